// Portable Adam and accumulation kernels: one element at a time, for CPUs
// without AVX2 and for non-x86 builds. Same operation sequence as the SIMD versions
// (fused multiply-add included), so it gives the same bits.
#include <cstdint>
#include <cstring>

#include "adam_kernel.h"
#include "quant8.h"

namespace {
struct V {
  static constexpr int kWidth = 1;
  using F = float;
  static JZO_INLINE F load_f32(const float* p) { return *p; }
  static JZO_INLINE void store_f32(float* p, F x) { *p = x; }
  static JZO_INLINE F load_bf16(const uint16_t* p) {
    const uint32_t bits = static_cast<uint32_t>(*p) << 16;
    F x;
    std::memcpy(&x, &bits, 4);
    return x;
  }
  // Round to nearest even; NaN stays a quiet NaN of the same sign.
  static JZO_INLINE void store_bf16(uint16_t* p, F x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if (x != x) {
      *p = static_cast<uint16_t>((bits >> 16) | 0x40);
      return;
    }
    *p = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
  }
  // _Float16 conversions are IEEE round-to-nearest-even (GCC, Clang).
  static JZO_INLINE F load_f16(const uint16_t* p) {
    _Float16 h;
    std::memcpy(&h, p, 2);
    return static_cast<F>(h);
  }
  static JZO_INLINE void store_f16(uint16_t* p, F x) {
    const _Float16 h = static_cast<_Float16>(x);
    std::memcpy(p, &h, 2);
  }
  // No streaming stores here: the "stream" versions are plain stores.
  static constexpr bool kStreams = false;
  static constexpr bool kCodesTwoWays = false;  // quant8 always uses the index
  static JZO_INLINE void stream_bf16(uint16_t* p, F x) { store_bf16(p, x); }
  static JZO_INLINE void stream_f16(uint16_t* p, F x) { store_f16(p, x); }
  static JZO_INLINE void stream_fence() {}
  static JZO_INLINE F set1(float x) { return x; }
  static JZO_INLINE F add(F a, F b) { return a + b; }
  static JZO_INLINE F mul(F a, F b) { return a * b; }
  static JZO_INLINE F div(F a, F b) { return a / b; }
  static JZO_INLINE F sqrt(F a) { return __builtin_sqrtf(a); }
  static JZO_INLINE F fmadd(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
  // The larger magnitude, compared as bit patterns: NaN > inf > finite.
  static JZO_INLINE F max_magnitude(F acc, F x) {
    uint32_t a, b;
    std::memcpy(&a, &acc, 4);
    std::memcpy(&b, &x, 4);
    b &= 0x7fffffffu;
    const uint32_t top = a > b ? a : b;
    F out;
    std::memcpy(&out, &top, 4);
    return out;
  }
  // 8-bit moments (quant8.h): a code's value, by the map's arithmetic, and
  // the nearest code of y.
  template <bool kSigned>
  static JZO_INLINE F dequant8(const uint8_t* p, const jzo::Quant8Map& map) {
    const uint32_t c = *p, i = kSigned ? c & 127u : c;
    const uint32_t top = kSigned ? 127u : 255u;
    float r = static_cast<float>(2 * i + 1);
    uint32_t bits;
    std::memcpy(&bits, &r, 4);
    const uint32_t exponent = bits >> 23;  // 127 for i = 0, else 128 + decade
    bits = (bits & 0x7fffffu) | 0x3f800000u;
    std::memcpy(&r, &bits, 4);
    F value = i == 0 ? map.code[0] : map.decade[exponent & 15] * __builtin_fmaf(0.9f, r, -0.8f);
    if (i == top) value = 1.0f;
    if constexpr (kSigned) value = c & 128u ? -value : value;
    return value;
  }
  template <bool kSigned>
  static JZO_INLINE uint32_t quant8(uint8_t* p, F y, const jzo::Quant8Map& map,
                                    bool /*gather: always by the index*/) {
    *p = jzo::quant8_exact(y, map);
    return 0;
  }
};
}  // namespace

#include "adam_kernel_impl.h"
#include "accumulate_impl.h"

void jzo::isa::adam_range_scalar(const AdamBuffers& b, const AdamScalars& s,
                                 int64_t begin, int64_t end) {
  dispatch(b, s, begin, end);
}

jzo::AccumStats jzo::isa::accumulate_range_scalar(const AccumBuffers& b, int64_t begin,
                                                  int64_t end) {
  return accumulate_dispatch(b, begin, end);
}
