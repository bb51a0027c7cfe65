// AVX2 + FMA + F16C Adam and accumulation kernels, 8 floats a vector. Compiled with
// -mavx2 -mfma -mf16c and only called after a CPUID check.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "adam_kernel.h"
#include "quant8.h"

namespace {
struct V {
  static constexpr int kWidth = 8;
  using F = __m256;
  static JZO_INLINE F load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static JZO_INLINE void store_f32(float* p, F x) { _mm256_storeu_ps(p, x); }
  static JZO_INLINE F load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // Round to nearest even in integer arithmetic, as the scalar version does.
  static JZO_INLINE __m128i to_bf16(F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(bits, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    // Values fit 16 bits, so the saturating pack is exact; then gather the
    // two 64-bit halves that hold the 8 results.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(packed);
  }
  static JZO_INLINE __m128i to_f16(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static JZO_INLINE void store_bf16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x));
  }
  static JZO_INLINE F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static JZO_INLINE void store_f16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_f16(x));
  }
  static constexpr bool kStreams = true;  // 16-byte aligned p only
  static constexpr bool kCodesTwoWays = false;  // quant8 always gathers
  static JZO_INLINE void stream_bf16(uint16_t* p, F x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(x));
  }
  static JZO_INLINE void stream_f16(uint16_t* p, F x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_f16(x));
  }
  static JZO_INLINE void stream_fence() { _mm_sfence(); }
  static JZO_INLINE F set1(float x) { return _mm256_set1_ps(x); }
  static JZO_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  static JZO_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static JZO_INLINE F div(F a, F b) { return _mm256_div_ps(a, b); }
  static JZO_INLINE F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static JZO_INLINE F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // The larger magnitude lane by lane, compared as bit patterns: NaN > inf > finite.
  static JZO_INLINE F max_magnitude(F acc, F x) {
    const __m256i mag = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff));
    return _mm256_castsi256_ps(_mm256_max_epu32(_mm256_castps_si256(acc), mag));
  }
  // 8-bit moments (quant8.h), as the scalar version.
  template <bool kSigned>
  static JZO_INLINE F dequant8(const uint8_t* p, const jzo::Quant8Map& map) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i i = kSigned ? _mm256_and_si256(c, _mm256_set1_epi32(127)) : c;
    const __m256i bits = _mm256_castps_si256(
        _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(i, 1), _mm256_set1_epi32(1))));
    // The decade from the exponent's low 3 bits (permutevar8x32 reads those).
    const F decade = _mm256_permutevar8x32_ps(_mm256_loadu_ps(map.decade), _mm256_srli_epi32(bits, 23));
    const F in_decade = _mm256_castsi256_ps(_mm256_or_si256(
        _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffff)), _mm256_set1_epi32(0x3f800000)));
    F value = _mm256_mul_ps(decade, _mm256_fmadd_ps(_mm256_set1_ps(0.9f), in_decade,
                                                    _mm256_set1_ps(-0.8f)));
    const F is_zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(i, _mm256_setzero_si256()));
    value = _mm256_blendv_ps(value, _mm256_set1_ps(map.code[0]), is_zero);
    const __m256i top = _mm256_cmpeq_epi32(i, _mm256_set1_epi32(kSigned ? 127 : 255));
    value = _mm256_blendv_ps(value, _mm256_set1_ps(1.0f), _mm256_castsi256_ps(top));
    if constexpr (kSigned)
      value = _mm256_xor_ps(value, _mm256_castsi256_ps(_mm256_slli_epi32(
                                       _mm256_and_si256(c, _mm256_set1_epi32(128)), 24)));
    return value;
  }
  // Writes the codes of y's 8 lanes by the index's gather (always); returns 0:
  // none to redo.
  template <bool kSigned>
  static JZO_INLINE uint32_t quant8(uint8_t* p, F y, const jzo::Quant8Map& map,
                                    bool /*gather*/) {
    const __m256i bits = _mm256_castps_si256(y);
    // The top 16 bits of |y|, less the index's base (saturating in 16-bit
    // lanes: each 32-bit lane's high half is 0 in both), capped at 1.0f's.
    const __m256i top = _mm256_min_epu32(
        _mm256_subs_epu16(_mm256_srli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), 16),
                          _mm256_set1_epi32(jzo::kQuantIndexBase)),
        _mm256_set1_epi32(0x3F80 - jzo::kQuantIndexBase));
    const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(map.index), top, 4);
    __m256i k = _mm256_srli_epi32(
        _mm256_add_epi32(e, _mm256_and_si256(bits, _mm256_set1_epi32(0xFFFF))), 16);
    if constexpr (kSigned)
      k = _mm256_or_si256(k, _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80)));
    // Codes fit a byte, so the saturating packs are exact; each 128-bit
    // lane then holds its four codes in its lowest 32 bits.
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(k, k), k);
    const uint64_t lo = static_cast<uint32_t>(_mm256_extract_epi32(bytes, 0));
    const uint64_t hi = static_cast<uint32_t>(_mm256_extract_epi32(bytes, 4));
    const uint64_t out = lo | hi << 32;
    std::memcpy(p, &out, 8);
    return 0;
  }
};
}  // namespace

#include "adam_kernel_impl.h"
#include "accumulate_impl.h"

void jzo::isa::adam_range_avx2(const AdamBuffers& b, const AdamScalars& s,
                               int64_t begin, int64_t end) {
  dispatch(b, s, begin, end);
}

jzo::AccumStats jzo::isa::accumulate_range_avx2(const AccumBuffers& b, int64_t begin,
                                                int64_t end) {
  return accumulate_dispatch(b, begin, end);
}
