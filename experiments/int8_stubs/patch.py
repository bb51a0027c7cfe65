"""python3 patch.py SRC-EXT DST-EXT STUB...: a copy of an ext folder whose
AVX-512 kernel has parts stubbed out (run.sh times them):
  NOGATHER  the quantizer's index gather (the kernel before 25d2560)
  NOQ       the whole quantizer (codes are the floats' low bytes)
  NODEQ     the decoding of codes (their integer values instead)
  NODIV     the division and square root (a multiply, an add)
  BF16CVT   the bfloat16 rounding in integers (VCVTNEPS2BF16 instead)
  NOLOWP    the bfloat16 copy of the weights (not written)
"""
import shutil, sys, re
src, dst, flags = sys.argv[1], sys.argv[2], set(sys.argv[3:])
shutil.rmtree(dst, ignore_errors=True); shutil.copytree(src, dst)
p = f"{dst}/adam_avx512.cc"; s = open(p).read()
if "NOGATHER" in flags:  # the gather's result is the index itself, shifted
  s = s.replace("_mm512_i32gather_epi32(top, reinterpret_cast<const int*>(map.index), 4)", "_mm512_slli_epi32(top, 12)")
if "NODIV" in flags:
  s = s.replace("return _mm512_div_ps(a, b);", "return _mm512_mul_ps(a, b);")
  s = s.replace("return _mm512_sqrt_ps(a);", "return _mm512_add_ps(a, a);")
if "NODEQ" in flags:
  s = s.replace("static JZO_INLINE F dequant8(const uint8_t* p, const jzo::Quant8Map& map) {",
    "static JZO_INLINE F dequant8(const uint8_t* p, const jzo::Quant8Map& map) {\n return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));")
if "NOQ" in flags:
  s = re.sub(r"(static JZO_INLINE (void|uint32_t) quant8\(uint8_t\* p, F y, const jzo::Quant8Map& map\) \{)",
    r"\1\n _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_castps_si512(y))); return 0;", s)
  s = s.replace("return 0;\n    const __m512i low16", "return;\n    const __m512i low16")
if "BF16CVT" in flags:
  s = s.replace("static JZO_INLINE __m256i to_bf16(F x) {", "static JZO_INLINE __m256i to_bf16(F x) {\n return (__m256i)_mm512_cvtneps_pbh(x);")
if "NOLOWP" in flags:
  s = s.replace("static JZO_INLINE void store_bf16(uint16_t* p, F x) {", "static JZO_INLINE void store_bf16(uint16_t* p, F x) {\n return;")
  s = s.replace("static JZO_INLINE void stream_bf16(uint16_t* p, F x) {", "static JZO_INLINE void stream_bf16(uint16_t* p, F x) {\n return;")
open(p, "w").write(s)
