// XLA FFI handlers for the CPU Adam step inside jit (see ffi_adam.cc).
#pragma once

#include "xla/ffi/api/api.h"

namespace jzo {

// Number of float32 scalars the handlers read, in this order:
// lr, b1, 1-b1, b2, 1-b2, eps, eps_root, weight_decay, 1/bc1, 1/bc2, 1/bc1_next,
// grad_scale, with bc = 1 - b**t.
constexpr int kNumAdamScalars = 12;

}  // namespace jzo

// Handler symbols registered with jax.ffi.register_ffi_target (C linkage).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JzoAdamUpdateFfi);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JzoAdamMomentsFfi);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JzoAdamStepFfi);
