// Body of the accumulation kernel over the vector type `V`, included after
// adam_kernel_impl.h (whose load/store it uses) by each per-ISA file.

#include "accumulate_kernel.h"

namespace {

// Vectors summed in float lanes before the lanes go into the double sum:
// bounds the float rounding of the sum of squares to 64 terms a lane.
constexpr int kFlushVectors = 64;

template <jzo::DType G, int L>
jzo::AccumStats accumulate_run(const jzo::AccumBuffers& b, int64_t begin, int64_t end) {
  jzo::AccumStats stats;
  const F zero = V::set1(0.0f);
  F sq = zero, nan_if_bad = zero;  // x * 0 is 0 for finite x, NaN otherwise
  int pending = 0;
  auto flush = [&] {
    alignas(64) float s[kW], z[kW];
    V::store_f32(s, sq);
    V::store_f32(z, nan_if_bad);
    for (int k = 0; k < kW; ++k) {
      stats.sumsq += s[k];
      stats.finite = stats.finite && z[k] == 0.0f;
    }
    sq = nan_if_bad = zero;
    pending = 0;
  };
  auto one = [&](const jzo::AccumBuffers& t, int64_t i) {
    F x = load<G>(t.grad, i);
    if (t.add) x = V::add(V::load_f32(t.acc + i), x);
    if (t.acc) V::store_f32(t.acc + i, x);
    if constexpr (L != kNoLowp) store<static_cast<jzo::DType>(L)>(t.lowp_out, i, x);
    sq = V::fmadd(x, x, sq);
    nan_if_bad = V::add(nan_if_bad, V::mul(x, zero));
    if (++pending == kFlushVectors) flush();
  };
  int64_t i = begin;
  for (; i + kW <= end; i += kW) one(b, i);
  if (i < end) {  // the last partial vector, through zero-padded scratch copies
    const int64_t k = end - i;
    alignas(64) float grad[kW] = {}, acc[kW] = {}, lowp[kW] = {};
    jzo::AccumBuffers t = b;
    t.grad = grad;
    t.acc = b.acc ? acc : nullptr;
    t.lowp_out = lowp;
    std::memcpy(grad, static_cast<const char*>(b.grad) + i * elem_size(b.grad_dtype),
                k * elem_size(b.grad_dtype));
    if (b.add) std::memcpy(acc, b.acc + i, k * 4);
    one(t, 0);
    if (b.acc) std::memcpy(b.acc + i, acc, k * 4);
    if constexpr (L != kNoLowp)
      std::memcpy(static_cast<char*>(b.lowp_out) + i * 2, lowp, k * 2);
  }
  flush();
  return stats;
}

template <jzo::DType G>
jzo::AccumStats accumulate_pick_lowp(const jzo::AccumBuffers& b, int64_t lo, int64_t hi) {
  if (!b.lowp_out) return accumulate_run<G, kNoLowp>(b, lo, hi);
  if (b.lowp_dtype == jzo::DType::kBF16)
    return accumulate_run<G, static_cast<int>(jzo::DType::kBF16)>(b, lo, hi);
  return accumulate_run<G, static_cast<int>(jzo::DType::kF16)>(b, lo, hi);
}

jzo::AccumStats accumulate_dispatch(const jzo::AccumBuffers& b, int64_t lo, int64_t hi) {
  switch (b.grad_dtype) {
    case jzo::DType::kBF16:
      return accumulate_pick_lowp<jzo::DType::kBF16>(b, lo, hi);
    case jzo::DType::kF16:
      return accumulate_pick_lowp<jzo::DType::kF16>(b, lo, hi);
    default:
      return accumulate_pick_lowp<jzo::DType::kF32>(b, lo, hi);
  }
}

}  // namespace
