// Body of the Adam kernel, written once over a vector type `V` and compiled
// once per instruction set (adam_scalar.cc, adam_avx2.cc, adam_avx512.cc).
//
// Each including file defines `V` first: width kWidth, vector type F, and
// loads/stores for f32, bf16 and f16 plus add/mul/div/sqrt/fmadd/set1.
// Everything here has internal linkage, so the per-ISA copies never merge;
// for the same reason it calls no std:: templates, whose out-of-line copies
// the linker could share between translation units built for different CPUs.
//
// Bitwise determinism: every element goes through the same vector step; the
// last partial vector of a range is copied into a zero-padded scratch vector
// rather than run through a separate scalar loop. So results do not depend on
// how the caller splits [0, n) among threads. Nor on the instruction set, as
// long as the compiler fuses no multiply and add the code does not ask for:
// the kernels are built with -ffp-contract=off (GCC's default for C++ fuses).

#include <cstring>

#include "adam_kernel.h"
#include "quant8.h"

namespace {

using F = V::F;
constexpr int kW = V::kWidth;

template <jzo::DType D>
struct Storage;
template <>
struct Storage<jzo::DType::kF32> {
  using T = float;
};
template <>
struct Storage<jzo::DType::kBF16> {
  using T = uint16_t;
};
template <>
struct Storage<jzo::DType::kF16> {
  using T = uint16_t;
};

template <jzo::DType D>
JZO_INLINE F load(const void* base, int64_t i) {
  const auto* p = static_cast<const typename Storage<D>::T*>(base) + i;
  if constexpr (D == jzo::DType::kF32) return V::load_f32(p);
  if constexpr (D == jzo::DType::kBF16) return V::load_bf16(p);
  if constexpr (D == jzo::DType::kF16) return V::load_f16(p);
}

template <jzo::DType D>
JZO_INLINE void store(void* base, int64_t i, F x) {
  auto* p = static_cast<typename Storage<D>::T*>(base) + i;
  if constexpr (D == jzo::DType::kF32) V::store_f32(p, x);
  if constexpr (D == jzo::DType::kBF16) V::store_bf16(p, x);
  if constexpr (D == jzo::DType::kF16) V::store_f16(p, x);
}

// The low-precision copy is written once and read next by the DMA engine,
// not by this CPU: a non-temporal store skips reading each line first (2 of
// the 28 bytes an element would otherwise grow to 30). Needs an aligned address.
template <jzo::DType D>
JZO_INLINE void store_lowp(void* base, int64_t i, F x, bool stream) {
  auto* p = static_cast<uint16_t*>(base) + i;
  if (!stream) return store<D>(base, i, x);
  if constexpr (D == jzo::DType::kBF16) V::stream_bf16(p, x);
  if constexpr (D == jzo::DType::kF16) V::stream_f16(p, x);
}

struct Consts {
  F b1, omb1, b2, omb2, eps, eps_root, wd, inv_bc1, inv_bc2, inv_bc1_next, grad_scale, neg_lr;
  bool nesterov, read_param;
  bool stream_lowp = false;  // lowp_out is aligned for non-temporal stores
  explicit Consts(const jzo::AdamScalars& s, bool has_param)
      : b1(V::set1(s.b1)),
        omb1(V::set1(s.one_minus_b1)),
        b2(V::set1(s.b2)),
        omb2(V::set1(s.one_minus_b2)),
        eps(V::set1(s.eps)),
        eps_root(V::set1(s.eps_root)),
        wd(V::set1(s.weight_decay)),
        inv_bc1(V::set1(s.inv_bc1)),
        inv_bc2(V::set1(s.inv_bc2)),
        inv_bc1_next(V::set1(s.inv_bc1_next)),
        grad_scale(V::set1(s.grad_scale)),
        neg_lr(V::set1(-s.lr)),
        nesterov(s.nesterov),
        read_param(has_param && s.weight_decay != 0.0f) {}
};

// kNoLowp marks "no low-precision copy"; otherwise L is the copy's dtype.
constexpr int kNoLowp = -1;

// The update from the new moments (float32) and the gradient g (unscaled
// already), stored as the buffers ask: update_out, or param (and lowp_out).
template <int L>
JZO_INLINE void apply(const jzo::AdamBuffers& b, const Consts& c, int64_t i, F g, F m, F v) {
  const F m_hat = c.nesterov ? V::fmadd(c.b1, V::mul(m, c.inv_bc1_next),
                                        V::mul(c.omb1, V::mul(g, c.inv_bc1)))
                             : V::mul(m, c.inv_bc1);
  const F v_hat = V::mul(v, c.inv_bc2);
  F x = V::div(m_hat, V::add(V::sqrt(V::add(v_hat, c.eps_root)), c.eps));
  if (c.read_param) x = V::fmadd(c.wd, V::load_f32(b.param + i), x);
  const F u = V::mul(c.neg_lr, x);

  if (!b.update_param) {
    V::store_f32(b.update_out + i, u);
    return;
  }
  const F p = V::add(V::load_f32(b.param + i), u);
  V::store_f32(b.param + i, p);
  if constexpr (L != kNoLowp) store_lowp<static_cast<jzo::DType>(L)>(b.lowp_out, i, p, c.stream_lowp);
}

template <jzo::DType G>
JZO_INLINE F scaled_grad(const jzo::AdamBuffers& b, const Consts& c, int64_t i) {
  return V::mul(load<G>(b.grad, i), c.grad_scale);
}

template <jzo::DType G, jzo::DType M, jzo::DType N, int L>
JZO_INLINE void step(const jzo::AdamBuffers& b, const Consts& c, int64_t i) {
  const F g = scaled_grad<G>(b, c, i);
  const F m = V::fmadd(c.b1, load<M>(b.mu, i), V::mul(c.omb1, g));
  const F v = V::fmadd(c.b2, load<N>(b.nu, i), V::mul(c.omb2, V::mul(g, g)));
  store<M>(b.mu, i, m);
  store<N>(b.nu, i, v);
  if (!b.moments_only) apply<L>(b, c, i, g, m, v);
}

inline size_t elem_size(jzo::DType d) { return d == jzo::DType::kF32 ? 4 : 2; }

// Runs the last k < kW elements from index i through `step` on padded copies.
template <jzo::DType G, jzo::DType M, jzo::DType N, int L>
inline void tail(const jzo::AdamBuffers& b, Consts c, int64_t i, int64_t k) {
  c.stream_lowp = false;  // the scratch vector is read back right away
  alignas(64) float grad[kW] = {}, mu[kW] = {}, nu[kW] = {}, param[kW] = {},
                    update[kW] = {}, lowp[kW] = {};
  jzo::AdamBuffers t = b;
  t.grad = grad;
  t.mu = mu;
  t.nu = nu;
  t.param = b.param ? param : nullptr;
  t.update_out = b.update_out ? update : nullptr;
  t.lowp_out = b.lowp_out ? lowp : nullptr;
  auto in = [&](void* dst, const void* src, jzo::DType d) {
    std::memcpy(dst, static_cast<const char*>(src) + i * elem_size(d), k * elem_size(d));
  };
  auto out = [&](void* dst, const void* src, jzo::DType d) {
    std::memcpy(static_cast<char*>(dst) + i * elem_size(d), src, k * elem_size(d));
  };
  in(grad, b.grad, b.grad_dtype);
  in(mu, b.mu, b.mu_dtype);
  in(nu, b.nu, b.nu_dtype);
  if (b.param) in(param, b.param, jzo::DType::kF32);
  step<G, M, N, L>(t, c, 0);
  out(b.mu, mu, b.mu_dtype);
  out(b.nu, nu, b.nu_dtype);
  if (b.update_out && !b.update_param) out(b.update_out, update, jzo::DType::kF32);
  if (b.update_param) out(b.param, param, jzo::DType::kF32);
  if (b.lowp_out && b.update_param) out(b.lowp_out, lowp, b.lowp_dtype);
}

// The arrays' lines kAhead bytes past element i (the low-precision copy is
// streamed, not read): one call each 16 elements, a whole line of a float32
// array, half a line of a 16-bit one. Prefetches do not fault past an end.
constexpr int64_t kAhead = 256;
template <jzo::DType G, jzo::DType M, jzo::DType N>
JZO_INLINE void prefetch_ahead(const jzo::AdamBuffers& b, int64_t i) {
  __builtin_prefetch(static_cast<const char*>(b.grad) + i * sizeof(typename Storage<G>::T) + kAhead);
  __builtin_prefetch(static_cast<const char*>(b.mu) + i * sizeof(typename Storage<M>::T) + kAhead, 1);
  __builtin_prefetch(static_cast<const char*>(b.nu) + i * sizeof(typename Storage<N>::T) + kAhead, 1);
  if (b.param) __builtin_prefetch(reinterpret_cast<const char*>(b.param + i) + kAhead, 1);
}

// Whether the whole arrays hold more than jzo::prefetch_above() bytes, at
// `moment_bytes` an element for the two moments together.
template <jzo::DType G>
inline bool prefetches(const jzo::AdamBuffers& b, int64_t moment_bytes) {
  const int64_t bytes = b.n * (static_cast<int64_t>(sizeof(typename Storage<G>::T)) + moment_bytes +
                               (b.param ? 4 : 0));
  const int64_t above = jzo::prefetch_above();
  return above >= 0 && bytes > above;
}

template <jzo::DType G, jzo::DType M, jzo::DType N, int L>
void run(const jzo::AdamBuffers& buffers, const jzo::AdamScalars& s, int64_t begin,
         int64_t end) {
  // The loops read a local copy of the buffers: a vector store's intrinsic
  // (and a byte store) may alias anything in memory, so each pointer and flag
  // of `buffers` would be loaded again after every store.
  const jzo::AdamBuffers b = buffers;
  Consts c(s, b.param != nullptr);
  int64_t i = begin;
  // Peel a few elements so that the largest written array (param, else mu)
  // is vector-aligned: a vector that straddles two cache lines costs two
  // accesses, and numpy's large arrays start 16 bytes into a line.
  const void* anchor = b.update_param ? static_cast<const void*>(b.param) : b.mu;
  const size_t esize = b.update_param ? 4 : elem_size(b.mu_dtype);
  const size_t misalign = (reinterpret_cast<uintptr_t>(anchor) + i * esize) % (kW * esize);
  if (misalign && misalign % esize == 0) {
    const int64_t to_boundary = static_cast<int64_t>((kW * esize - misalign) / esize);
    const int64_t k = end - i < to_boundary ? end - i : to_boundary;
    tail<G, M, N, L>(b, c, i, k);
    i += k;
  }
  if constexpr (L != kNoLowp) {
    // Written over the gradient it was computed from, the line is in cache
    // already: a plain store costs no extra read there, a streamed one would
    // evict the half of the line not yet read.
    c.stream_lowp = V::kStreams && b.lowp_out != b.grad &&
                    (reinterpret_cast<uintptr_t>(b.lowp_out) + 2 * i) % (2 * kW) == 0;
  }
  constexpr int64_t kLine = 16;  // float32 elements a 64-byte line
  if (prefetches<G>(b, sizeof(typename Storage<M>::T) + sizeof(typename Storage<N>::T))) {
    for (; i + kLine <= end; i += kLine) {
      prefetch_ahead<G, M, N>(b, i);
      for (int j = 0; j < kLine; j += kW) step<G, M, N, L>(b, c, i + j);
    }
  }
  for (; i + kW <= end; i += kW) step<G, M, N, L>(b, c, i);
  if (c.stream_lowp) V::stream_fence();  // order the streamed stores before returning
  if (i < end) tail<G, M, N, L>(b, c, i, end - i);
}


// 8-bit moments (quant8.h), one block of kQuantBlock elements from `lo`:
// the new moments go to float32 scratch while the block's absmax is found,
// then each is quantized with the new scale and the update is formed from
// the unrounded moments. A block holding a non-finite moment gets a NaN
// scale (its codes are then meaningless), as a float32 moment would be NaN.
constexpr int kB = jzo::kQuantBlock;
static_assert(kB % kW == 0, "a block is whole vectors");

// mu's map is signed and nu's unsigned; V::dequant8 and V::quant8 take that
// as a template argument, so that the block's loops test no flag of the map.
struct Q8Maps {
  const jzo::Quant8Map& mu = jzo::quant8_signed();
  const jzo::Quant8Map& nu = jzo::quant8_unsigned();
};

// The scale of a block from its lanes' largest magnitudes (V::max_magnitude),
// and the factor that maps the block into [-1, 1].
JZO_INLINE void block_scale(F absmax, float* scale, float* inv) {
  alignas(64) uint32_t lanes[kW];
  V::store_f32(reinterpret_cast<float*>(lanes), absmax);
  uint32_t top = 0;
  for (int k = 0; k < kW; ++k) top = lanes[k] > top ? lanes[k] : top;
  if (top >= 0x7f800000u) {  // inf or NaN
    *scale = __builtin_nanf("");
    *inv = 0.0f;
    return;
  }
  std::memcpy(scale, &top, 4);
  *inv = top ? 1.0f / *scale : 0.0f;
}

// Element e's line of each array where e starts a line's worth of elements:
// called for each vector of a block with e in the next block, it asks for the
// next block's lines while this one computes.
template <jzo::DType G>
JZO_INLINE void prefetch_q8(const jzo::AdamBuffers& b, int64_t e) {
  constexpr int64_t kGrad = sizeof(typename Storage<G>::T);
  if (b.param && (e & 15) == 0) __builtin_prefetch(b.param + e, 1);
  if ((e & (64 / kGrad - 1)) == 0) __builtin_prefetch(static_cast<const char*>(b.grad) + e * kGrad);
  if ((e & 63) == 0) {
    __builtin_prefetch(static_cast<const uint8_t*>(b.mu) + e, 1);
    __builtin_prefetch(static_cast<const uint8_t*>(b.nu) + e, 1);
  }
}

// kGather: V::quant8's way to the codes, a template argument so that the
// loop holds one way's constants in registers.
template <jzo::DType G, int L, bool kGather>
JZO_INLINE void q8_block(const jzo::AdamBuffers& b, const Consts& c, const Q8Maps& maps, int64_t lo,
                         int64_t block, bool prefetch) {
  alignas(64) float m_new[kB], v_new[kB];
  auto* mu = static_cast<uint8_t*>(b.mu);
  auto* nu = static_cast<uint8_t*>(b.nu);
  const F mu_scale = V::set1(b.mu_scale[block]), nu_scale = V::set1(b.nu_scale[block]);
  const F zero = V::set1(0.0f);
  F m_max = zero, v_max = zero;
  for (int j = 0; j < kB; j += kW) {
    if (prefetch) prefetch_q8<G>(b, lo + kB + j);
    const F g = scaled_grad<G>(b, c, lo + j);
    const F m0 = V::mul(V::dequant8<true>(mu + lo + j, maps.mu), mu_scale);
    const F v0 = V::mul(V::dequant8<false>(nu + lo + j, maps.nu), nu_scale);
    const F m = V::fmadd(c.b1, m0, V::mul(c.omb1, g));
    const F v = V::fmadd(c.b2, v0, V::mul(c.omb2, V::mul(g, g)));
    V::store_f32(m_new + j, m);
    V::store_f32(v_new + j, v);
    m_max = V::max_magnitude(m_max, m);
    v_max = V::max_magnitude(v_max, v);
  }
  float m_inv, v_inv;
  block_scale(m_max, &b.mu_scale[block], &m_inv);
  block_scale(v_max, &b.nu_scale[block], &v_inv);
  const F m_to_code = V::set1(m_inv), v_to_code = V::set1(v_inv);
  // Lanes V::quant8 leaves to quant8_exact, by vector: redone after the
  // loop, so that its body has no branch.
  uint32_t redo_mu[kB / kW], redo_nu[kB / kW], any = 0;
  for (int j = 0; j < kB; j += kW) {
    const F m = V::load_f32(m_new + j), v = V::load_f32(v_new + j);
    redo_mu[j / kW] = V::quant8<true>(mu + lo + j, V::mul(m, m_to_code), maps.mu, kGather);
    redo_nu[j / kW] = V::quant8<false>(nu + lo + j, V::mul(v, v_to_code), maps.nu, kGather);
    any |= redo_mu[j / kW] | redo_nu[j / kW];
    if (!b.moments_only) apply<L>(b, c, lo + j, c.nesterov ? scaled_grad<G>(b, c, lo + j) : zero, m, v);
  }
  if (__builtin_expect(any != 0, 0)) {
    for (int w = 0; w < kB / kW; ++w) {
      for (uint32_t r = redo_mu[w]; r; r &= r - 1) {
        const int l = w * kW + __builtin_ctz(r);
        mu[lo + l] = jzo::quant8_exact(m_new[l] * m_inv, maps.mu);
      }
      for (uint32_t r = redo_nu[w]; r; r &= r - 1) {
        const int l = w * kW + __builtin_ctz(r);
        nu[lo + l] = jzo::quant8_exact(v_new[l] * v_inv, maps.nu);
      }
    }
  }
}

// A last block shorter than kB, run on zero-padded copies (zeros leave the
// absmax as it is).
template <jzo::DType G, int L, bool kGather>
inline void q8_partial(const jzo::AdamBuffers& b, Consts c, const Q8Maps& maps, int64_t lo,
                       int64_t k, int64_t block) {
  c.stream_lowp = false;
  alignas(64) float grad[kB] = {}, param[kB] = {}, update[kB] = {}, lowp[kB] = {};
  alignas(64) uint8_t mu[kB] = {}, nu[kB] = {};
  float mu_scale = b.mu_scale[block], nu_scale = b.nu_scale[block];
  jzo::AdamBuffers t = b;
  t.grad = grad;
  t.mu = mu;
  t.nu = nu;
  t.mu_scale = &mu_scale;
  t.nu_scale = &nu_scale;
  t.param = b.param ? param : nullptr;
  t.update_out = b.update_out ? update : nullptr;
  t.lowp_out = b.lowp_out ? lowp : nullptr;
  const size_t gsize = elem_size(b.grad_dtype);
  std::memcpy(grad, static_cast<const char*>(b.grad) + lo * gsize, k * gsize);
  std::memcpy(mu, static_cast<const uint8_t*>(b.mu) + lo, k);
  std::memcpy(nu, static_cast<const uint8_t*>(b.nu) + lo, k);
  if (b.param) std::memcpy(param, b.param + lo, k * 4);
  q8_block<G, L, kGather>(t, c, maps, 0, 0, false);
  std::memcpy(static_cast<uint8_t*>(b.mu) + lo, mu, k);
  std::memcpy(static_cast<uint8_t*>(b.nu) + lo, nu, k);
  b.mu_scale[block] = mu_scale;
  b.nu_scale[block] = nu_scale;
  if (b.moments_only) return;
  if (!b.update_param) return (void)std::memcpy(b.update_out + lo, update, k * 4);
  std::memcpy(b.param + lo, param, k * 4);
  if (b.lowp_out) std::memcpy(static_cast<uint16_t*>(b.lowp_out) + lo, lowp, k * 2);
}

template <jzo::DType G, int L, bool kGather>
void run_q8_blocks(const jzo::AdamBuffers& buffers, const jzo::AdamScalars& s, int64_t begin,
                   int64_t end) {
  const jzo::AdamBuffers b = buffers;  // a local copy, as in run
  Consts c(s, b.param != nullptr);
  const Q8Maps maps;
  if constexpr (L != kNoLowp) {
    c.stream_lowp = V::kStreams && b.lowp_out != b.grad && b.row % kW == 0 &&
                    (reinterpret_cast<uintptr_t>(b.lowp_out) + 2 * begin) % (2 * kW) == 0;
  }
  const bool prefetch = prefetches<G>(b, 2);
  // Blocks run along each row (the last axis): a row's last block may be short.
  const int64_t per_row = jzo::quant_blocks(b.row);
  for (int64_t lo = begin; lo < end;) {
    const int64_t r = lo / b.row, offset = lo - r * b.row;
    const int64_t block = r * per_row + offset / kB;
    int64_t k = (r + 1) * b.row - lo < end - lo ? (r + 1) * b.row - lo : end - lo;
    k = k < kB ? k : kB;
    if (k == kB) {
      q8_block<G, L, kGather>(b, c, maps, lo, block, prefetch);
    } else {
      q8_partial<G, L, kGather>(b, c, maps, lo, k, block);
    }
    lo += k;
  }
  if (c.stream_lowp) V::stream_fence();
}

template <jzo::DType G, int L>
void run_q8(const jzo::AdamBuffers& b, const jzo::AdamScalars& s, int64_t begin, int64_t end) {
  if constexpr (V::kCodesTwoWays) {
    if (jzo::quant8_gathers()) return run_q8_blocks<G, L, true>(b, s, begin, end);
  }
  run_q8_blocks<G, L, false>(b, s, begin, end);  // the one way of AVX2 and scalar
}

// Turns the run-time dtypes into one of the compiled instantiations (36 with float moments, 9 with q8,
// twice where V::kCodesTwoWays).
template <jzo::DType G, jzo::DType M, jzo::DType N>
void pick_lowp(const jzo::AdamBuffers& b, const jzo::AdamScalars& s, int64_t lo, int64_t hi) {
  if (!b.lowp_out || !b.update_param) return run<G, M, N, kNoLowp>(b, s, lo, hi);
  if (b.lowp_dtype == jzo::DType::kBF16)
    return run<G, M, N, static_cast<int>(jzo::DType::kBF16)>(b, s, lo, hi);
  return run<G, M, N, static_cast<int>(jzo::DType::kF16)>(b, s, lo, hi);
}

template <jzo::DType G, jzo::DType M>
void pick_nu(const jzo::AdamBuffers& b, const jzo::AdamScalars& s, int64_t lo, int64_t hi) {
  if (b.nu_dtype == jzo::DType::kBF16) return pick_lowp<G, M, jzo::DType::kBF16>(b, s, lo, hi);
  return pick_lowp<G, M, jzo::DType::kF32>(b, s, lo, hi);
}

template <jzo::DType G>
void pick_mu(const jzo::AdamBuffers& b, const jzo::AdamScalars& s, int64_t lo, int64_t hi) {
  if (b.mu_dtype == jzo::DType::kQ8) {  // nu is q8 too (checked at the boundary)
    if (!b.lowp_out || !b.update_param) return run_q8<G, kNoLowp>(b, s, lo, hi);
    if (b.lowp_dtype == jzo::DType::kBF16)
      return run_q8<G, static_cast<int>(jzo::DType::kBF16)>(b, s, lo, hi);
    return run_q8<G, static_cast<int>(jzo::DType::kF16)>(b, s, lo, hi);
  }
  if (b.mu_dtype == jzo::DType::kBF16) return pick_nu<G, jzo::DType::kBF16>(b, s, lo, hi);
  return pick_nu<G, jzo::DType::kF32>(b, s, lo, hi);
}

void dispatch(const jzo::AdamBuffers& b, const jzo::AdamScalars& s, int64_t lo, int64_t hi) {
  switch (b.grad_dtype) {
    case jzo::DType::kBF16:
      return pick_mu<jzo::DType::kBF16>(b, s, lo, hi);
    case jzo::DType::kF16:
      return pick_mu<jzo::DType::kF16>(b, s, lo, hi);
    default:
      return pick_mu<jzo::DType::kF32>(b, s, lo, hi);
  }
}

}  // namespace
