// XLA FFI handlers for the CPU Adam step inside jit (see ffi_adam.cc).
#pragma once

#include "xla/ffi/api/api.h"

// Each handler reads the step's scalars as float32[kNumAdamScalars] laid out
// as JZO_ADAM_SCALARS lists them (adam_kernel.h).
// Handler symbols registered with jax.ffi.register_ffi_target (C linkage).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JzoAdamUpdateFfi);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JzoAdamMomentsFfi);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JzoAdamStepFfi);
