// AVX-512 (F, BW, VL) Adam and accumulation kernels, 16 floats a vector.
// Compiled with AVX-512 target flags and only called after a CPUID check.
#include <immintrin.h>

#include <cstdint>

#include "adam_kernel.h"
#include "quant8.h"

namespace {
struct V {
  static constexpr int kWidth = 16;
  using F = __m512;
  static JZO_INLINE F load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static JZO_INLINE void store_f32(float* p, F x) { _mm512_storeu_ps(p, x); }
  static JZO_INLINE F load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // Round to nearest even in integer arithmetic rather than VCVTNEPS2BF16,
  // which flushes denormals: the scalar and AVX2 versions give the same bits.
  static JZO_INLINE __m256i to_bf16(F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(bits, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
  }
  static JZO_INLINE __m256i to_f16(F x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static JZO_INLINE void store_bf16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
  }
  static JZO_INLINE F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static JZO_INLINE void store_f16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_f16(x));
  }
  static constexpr bool kStreams = true;  // 32-byte aligned p only
  static constexpr bool kCodesTwoWays = true;  // quant8 gathers or computes
  static JZO_INLINE void stream_bf16(uint16_t* p, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
  }
  static JZO_INLINE void stream_f16(uint16_t* p, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_f16(x));
  }
  static JZO_INLINE void stream_fence() { _mm_sfence(); }
  static JZO_INLINE F set1(float x) { return _mm512_set1_ps(x); }
  static JZO_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static JZO_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static JZO_INLINE F div(F a, F b) { return _mm512_div_ps(a, b); }
  static JZO_INLINE F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static JZO_INLINE F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // The larger magnitude lane by lane, compared as bit patterns: NaN > inf > finite.
  static JZO_INLINE F max_magnitude(F acc, F x) {
    const __m512i mag = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
    return _mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(acc), mag));
  }
  // 8-bit moments (quant8.h), as the scalar version.
  template <bool kSigned>
  static JZO_INLINE F dequant8(const uint8_t* p, const jzo::Quant8Map& map) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i i = kSigned ? _mm512_and_si512(c, _mm512_set1_epi32(127)) : c;
    const __m512i bits = _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(i, 1), _mm512_set1_epi32(1))));
    // The decade from the exponent's low 4 bits: 15 (a zero entry) for i = 0,
    // whose value is then the map's code 0 (nonzero for nu's map).
    const F decade = _mm512_permutexvar_ps(_mm512_srli_epi32(bits, 23), _mm512_loadu_ps(map.decade));
    const F in_decade = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffff)), _mm512_set1_epi32(0x3f800000)));
    F value = _mm512_mul_ps(decade, _mm512_fmadd_ps(_mm512_set1_ps(0.9f), in_decade,
                                                    _mm512_set1_ps(-0.8f)));
    if constexpr (!kSigned)
      value = _mm512_mask_mov_ps(value, _mm512_cmpeq_epi32_mask(i, _mm512_setzero_si512()),
                                 _mm512_set1_ps(map.code[0]));
    const __mmask16 top = _mm512_cmpeq_epi32_mask(i, _mm512_set1_epi32(kSigned ? 127 : 255));
    value = _mm512_mask_mov_ps(value, top, _mm512_set1_ps(1.0f));
    if constexpr (kSigned)
      value = _mm512_castsi512_ps(_mm512_xor_si512(
          _mm512_castps_si512(value),
          _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(128)), 24)));
    return value;
  }
  // Writes the codes of y's 16 lanes, by the index's gather (exact: returns
  // 0) or by the map's parts (quant8.h; returns the lanes to redo with
  // quant8_exact): the same codes, at a speed that depends on the CPU.
  template <bool kSigned>
  static JZO_INLINE uint32_t quant8(uint8_t* p, F y, const jzo::Quant8Map& map, bool gather) {
    const __m512i bits = _mm512_castps_si512(y);
    if (gather) {
      // As the AVX2 version: the top 16 bits of |y| less the base, capped.
      const __m512i top = _mm512_min_epu32(
          _mm512_subs_epu16(_mm512_srli_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), 16),
                            _mm512_set1_epi32(jzo::kQuantIndexBase)),
          _mm512_set1_epi32(0x3F80 - jzo::kQuantIndexBase));
      const __m512i e = _mm512_i32gather_epi32(top, reinterpret_cast<const int*>(map.index), 4);
      __m512i k = _mm512_srli_epi32(
          _mm512_add_epi32(e, _mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF))), 16);
      if constexpr (kSigned)  // k | (the sign bit, moved to 0x80)
        k = _mm512_ternarylogic_epi32(k, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xF8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(k));
      return 0;
    }
    // |y|, at most 1 (NaN too); its octave slot (the exponent's low 5 bits,
    // all below 2^-27 in 2^-27's).
    const __m512i mag = _mm512_min_epu32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                         _mm512_set1_epi32(0x3f800000));
    const F x = _mm512_castsi512_ps(mag);
    const __m512i slot = _mm512_srli_epi32(
        _mm512_max_epu32(mag, _mm512_set1_epi32(jzo::kQuantIndexBase << 16)), 23);
    const F bound = _mm512_permutex2var_ps(_mm512_loadu_ps(map.octave_bound), slot,
                                           _mm512_loadu_ps(map.octave_bound + 16));
    __m512i part = _mm512_permutex2var_epi32(_mm512_loadu_si512(map.octave_part), slot,
                                             _mm512_loadu_si512(map.octave_part + 16));
    part = _mm512_mask_add_epi32(part, _mm512_cmp_ps_mask(x, bound, _CMP_GT_OQ), part,
                                 _mm512_set1_epi32(1));
    const F t = _mm512_fmadd_ps(x, _mm512_permutexvar_ps(part, _mm512_loadu_ps(map.part_a)),
                                _mm512_permutexvar_ps(part, _mm512_loadu_ps(map.part_b)));
    const F nearest = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 unsure = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(t, nearest)),
                                                _mm512_set1_ps(jzo::kQuantUnsure), _CMP_LT_OQ);
    __m512i k = _mm512_min_epi32(_mm512_cvt_roundps_epi32(t, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC),
                                 _mm512_permutexvar_epi32(part, _mm512_loadu_si512(map.part_top)));
    if constexpr (kSigned)
      k = _mm512_or_si512(k, _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(k));
    return unsure;
  }
};
}  // namespace

#include "adam_kernel_impl.h"
#include "accumulate_impl.h"

void jzo::isa::adam_range_avx512(const AdamBuffers& b, const AdamScalars& s,
                                 int64_t begin, int64_t end) {
  dispatch(b, s, begin, end);
}

jzo::AccumStats jzo::isa::accumulate_range_avx512(const AccumBuffers& b, int64_t begin,
                                                  int64_t end) {
  return accumulate_dispatch(b, begin, end);
}
