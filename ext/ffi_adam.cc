// The Adam step as XLA FFI custom calls on the CPU backend, so that
// `jit`-compiled code runs the C++ kernel on XLA's own buffers. Every output
// that replaces an input (moments, and params for the in-place step) is
// aliased to it: with donated buffers the pass is in place, without donation
// XLA copies them first.
//
// Three handlers, one per contract:
//   jzo_adam_update:  g, m, v, p -> update, m, v      (optax's update_fn)
//   jzo_adam_moments: g, m, v -> m, v                 (XLA forms the update,
//                     fused with optax.apply_updates: 36 bytes a parameter
//                     instead of the 40 of a written-out update plus its add)
//   jzo_adam_step:    g, m, v, p -> p, m, v           (jzo.adamw_step, 28 bytes)
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

ffi::Error invalid(const char* target, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + what);
}

// Checks grad and the moments (aliased in place) and points `b` at them.
ffi::Error bind_moments(const char* target, ffi::AnyBuffer grad, ffi::AnyBuffer mu,
                        ffi::AnyBuffer nu, ffi::Result<ffi::AnyBuffer> mu_out,
                        ffi::Result<ffi::AnyBuffer> nu_out, AdamBuffers* b) {
  b->n = static_cast<int64_t>(grad.element_count());
  if (mu.element_count() != grad.element_count() || nu.element_count() != grad.element_count())
    return invalid(target, "grad, mu and nu sizes differ");
  if (!to_dtype(grad.element_type(), &b->grad_dtype))
    return invalid(target, "grad must be f32, bf16 or f16");
  if (!to_dtype(mu.element_type(), &b->mu_dtype) || b->mu_dtype == DType::kF16 ||
      mu_out->element_type() != mu.element_type())
    return invalid(target, "mu must be f32 or bf16");
  if (!to_dtype(nu.element_type(), &b->nu_dtype) || b->nu_dtype == DType::kF16 ||
      nu_out->element_type() != nu.element_type())
    return invalid(target, "nu must be f32 or bf16");
  if (mu_out->untyped_data() != mu.untyped_data() || nu_out->untyped_data() != nu.untyped_data())
    return invalid(target, "mu and nu must alias their outputs");
  b->grad = grad.untyped_data();
  b->mu = mu_out->untyped_data();
  b->nu = nu_out->untyped_data();
  return ffi::Error::Success();
}

ffi::Error read_scalars(const char* target, ffi::Buffer<ffi::F32> scalars, bool nesterov,
                        AdamScalars* s) {
  if (scalars.element_count() != kNumAdamScalars)
    return invalid(target, "expected " + std::to_string(kNumAdamScalars) + " scalars");
  *s = adam_scalars_from(scalars.typed_data(), nesterov);
  return ffi::Error::Success();
}

constexpr char kUpdate[] = "jzo_adam_update";
constexpr char kMoments[] = "jzo_adam_moments";
constexpr char kStep[] = "jzo_adam_step";

ffi::Error AdamUpdateImpl(ffi::AnyBuffer grad, ffi::AnyBuffer mu, ffi::AnyBuffer nu,
                          ffi::Buffer<ffi::F32> param, ffi::Buffer<ffi::F32> scalars,
                          ffi::Result<ffi::Buffer<ffi::F32>> update,
                          ffi::Result<ffi::AnyBuffer> mu_out, ffi::Result<ffi::AnyBuffer> nu_out,
                          bool nesterov) {
  AdamBuffers b;
  AdamScalars s;
  if (auto e = bind_moments(kUpdate, grad, mu, nu, mu_out, nu_out, &b); e.failure()) return e;
  if (auto e = read_scalars(kUpdate, scalars, nesterov, &s); e.failure()) return e;
  if (update->element_count() != grad.element_count())
    return invalid(kUpdate, "update and grad sizes differ");
  if (param.element_count() != 0 && param.element_count() != grad.element_count())
    return invalid(kUpdate, "param must be empty or match grad");
  b.param = param.element_count() ? param.typed_data() : nullptr;
  b.update_out = update->typed_data();
  adam_parallel(b, s);
  return ffi::Error::Success();
}

ffi::Error AdamMomentsImpl(ffi::AnyBuffer grad, ffi::AnyBuffer mu, ffi::AnyBuffer nu,
                           ffi::Buffer<ffi::F32> scalars, ffi::Result<ffi::AnyBuffer> mu_out,
                           ffi::Result<ffi::AnyBuffer> nu_out) {
  AdamBuffers b;
  AdamScalars s;
  if (auto e = bind_moments(kMoments, grad, mu, nu, mu_out, nu_out, &b); e.failure()) return e;
  if (auto e = read_scalars(kMoments, scalars, false, &s); e.failure()) return e;
  b.moments_only = true;
  adam_parallel(b, s);
  return ffi::Error::Success();
}

ffi::Error AdamStepImpl(ffi::AnyBuffer grad, ffi::AnyBuffer mu, ffi::AnyBuffer nu,
                        ffi::Buffer<ffi::F32> param, ffi::Buffer<ffi::F32> scalars,
                        ffi::Result<ffi::Buffer<ffi::F32>> param_out,
                        ffi::Result<ffi::AnyBuffer> mu_out, ffi::Result<ffi::AnyBuffer> nu_out,
                        bool nesterov) {
  AdamBuffers b;
  AdamScalars s;
  if (auto e = bind_moments(kStep, grad, mu, nu, mu_out, nu_out, &b); e.failure()) return e;
  if (auto e = read_scalars(kStep, scalars, nesterov, &s); e.failure()) return e;
  if (param.element_count() != grad.element_count())
    return invalid(kStep, "param and grad sizes differ");
  if (param_out->typed_data() != param.typed_data())
    return invalid(kStep, "param must alias its output");
  b.param = param_out->typed_data();
  b.update_param = true;
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
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the step's scalars (JZO_ADAM_SCALARS)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // update (-lr * ...)
                                  .Ret<ffi::AnyBuffer>()         // mu, aliased to input 1
                                  .Ret<ffi::AnyBuffer>()         // nu, aliased to input 2
                                  .Attr<bool>("nesterov"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JzoAdamMomentsFfi, jzo::AdamMomentsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // grad, f32/bf16/f16
                                  .Arg<ffi::AnyBuffer>()         // mu, f32/bf16
                                  .Arg<ffi::AnyBuffer>()         // nu, f32/bf16
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the step's scalars (JZO_ADAM_SCALARS)
                                  .Ret<ffi::AnyBuffer>()         // mu, aliased to input 1
                                  .Ret<ffi::AnyBuffer>());       // nu, aliased to input 2

XLA_FFI_DEFINE_HANDLER_SYMBOL(JzoAdamStepFfi, jzo::AdamStepImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // grad, f32/bf16/f16
                                  .Arg<ffi::AnyBuffer>()         // mu, f32/bf16
                                  .Arg<ffi::AnyBuffer>()         // nu, f32/bf16
                                  .Arg<ffi::Buffer<ffi::F32>>()  // param, f32 master weights
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the step's scalars (JZO_ADAM_SCALARS)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // param, aliased to input 3
                                  .Ret<ffi::AnyBuffer>()         // mu, aliased to input 1
                                  .Ret<ffi::AnyBuffer>()         // nu, aliased to input 2
                                  .Attr<bool>("nesterov"));
