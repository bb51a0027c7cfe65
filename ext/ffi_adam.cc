// The Adam update as an XLA FFI custom call on the CPU backend, so that
// `jit`-compiled optax code runs the C++ kernel on XLA's own buffers. The
// moments are aliased input to output: with donated state the update is in
// place, without it XLA copies them first.
#include "ffi_adam.h"

#include <string>

#include "host_ops.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jzo {
namespace {

bool to_dtype(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32:
      *out = DType::kF32;
      return true;
    case ffi::DataType::BF16:
      *out = DType::kBF16;
      return true;
    case ffi::DataType::F16:
      *out = DType::kF16;
      return true;
    default:
      return false;
  }
}

ffi::Error AdamUpdateImpl(ffi::AnyBuffer grad, ffi::AnyBuffer mu, ffi::AnyBuffer nu,
                          ffi::Buffer<ffi::F32> param, ffi::Buffer<ffi::F32> scalars,
                          ffi::Result<ffi::Buffer<ffi::F32>> update,
                          ffi::Result<ffi::AnyBuffer> mu_out, ffi::Result<ffi::AnyBuffer> nu_out,
                          bool nesterov) {
  const int64_t n = static_cast<int64_t>(grad.element_count());
  if (mu.element_count() != grad.element_count() || nu.element_count() != grad.element_count() ||
      update->element_count() != grad.element_count())
    return ffi::Error::InvalidArgument("jzo_adam_update: grad, mu, nu and update sizes differ");
  if (param.element_count() != 0 && param.element_count() != grad.element_count())
    return ffi::Error::InvalidArgument("jzo_adam_update: param must be empty or match grad");
  if (scalars.element_count() != kNumAdamScalars)
    return ffi::Error::InvalidArgument("jzo_adam_update: expected " +
                                       std::to_string(kNumAdamScalars) + " scalars");
  AdamBuffers b;
  b.n = n;
  if (!to_dtype(grad.element_type(), &b.grad_dtype))
    return ffi::Error::InvalidArgument("jzo_adam_update: grad must be f32, bf16 or f16");
  if (!to_dtype(mu.element_type(), &b.mu_dtype) || b.mu_dtype == DType::kF16 ||
      mu_out->element_type() != mu.element_type())
    return ffi::Error::InvalidArgument("jzo_adam_update: mu must be f32 or bf16");
  if (!to_dtype(nu.element_type(), &b.nu_dtype) || b.nu_dtype == DType::kF16 ||
      nu_out->element_type() != nu.element_type())
    return ffi::Error::InvalidArgument("jzo_adam_update: nu must be f32 or bf16");
  if (mu_out->untyped_data() != mu.untyped_data() || nu_out->untyped_data() != nu.untyped_data())
    return ffi::Error::InvalidArgument("jzo_adam_update: mu and nu must alias their outputs");

  b.grad = grad.untyped_data();
  b.mu = mu_out->untyped_data();
  b.nu = nu_out->untyped_data();
  b.param = param.element_count() ? param.typed_data() : nullptr;
  b.update_out = update->typed_data();

  const float* c = scalars.typed_data();
  AdamScalars s{c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], nesterov};
  adam_parallel(b, s);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jzo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JzoAdamUpdateFfi, jzo::AdamUpdateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // grad, f32/bf16/f16
                                  .Arg<ffi::AnyBuffer>()         // mu, f32/bf16
                                  .Arg<ffi::AnyBuffer>()         // nu, f32/bf16
                                  .Arg<ffi::Buffer<ffi::F32>>()  // param, empty if no decay
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the 12 step scalars
                                  .Ret<ffi::Buffer<ffi::F32>>()  // update (-lr * ...)
                                  .Ret<ffi::AnyBuffer>()         // mu, aliased to input 1
                                  .Ret<ffi::AnyBuffer>()         // nu, aliased to input 2
                                  .Attr<bool>("nesterov"));
