// AVX2 + FMA + F16C Adam and accumulation kernels, 8 floats a vector. Compiled with
// -mavx2 -mfma -mf16c and only called after a CPUID check.
#include <immintrin.h>

#include <cstdint>

namespace {
struct V {
  static constexpr int kWidth = 8;
  using F = __m256;
  static F load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // Round to nearest even in integer arithmetic, as the scalar version does.
  static __m128i to_bf16(F x) {
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
  static __m128i to_f16(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static void store_bf16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x));
  }
  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_f16(x));
  }
  static constexpr bool kStreams = true;  // 16-byte aligned p only
  static void stream_bf16(uint16_t* p, F x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(x));
  }
  static void stream_f16(uint16_t* p, F x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_f16(x));
  }
  static void stream_fence() { _mm_sfence(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
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
