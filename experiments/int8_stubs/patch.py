"""python3 patch.py SRC-EXT DST-EXT STUB...: a copy of an ext folder whose
AVX-512 kernel has parts stubbed out (run.sh times them):
  NOGATHER  the quantizer's index gather (the kernel before 25d2560; today's gather way)
  NOQ       the whole quantizer (codes are the floats' low bytes)
  NODEQ     the decoding of codes (their integer values instead)
  NODIV     the division and square root (a multiply, an add)
  BF16CVT   the bfloat16 rounding in integers (VCVTNEPS2BF16 instead)
  NOLOWP    the bfloat16 copy of the weights (not written)
"""
import re
import shutil
import sys

src, dst, flags = sys.argv[1], sys.argv[2], set(sys.argv[3:])
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, dst)
path = f"{dst}/adam_avx512.cc"
text = open(path).read()


def stub(old: str, new) -> None:
  """Replaces the text old in the kernel, which must hold it (a stub that no
  longer matches the source would time the whole kernel); old may be a
  compiled pattern, new then a function of the match."""
  global text
  pattern = old if isinstance(old, re.Pattern) else re.compile(re.escape(old))
  text, n = pattern.subn(new if callable(new) else lambda m: new, text)
  if not n:
    sys.exit(f"patch.py: {pattern.pattern!r} is not in {path}")


if "NOGATHER" in flags:  # the gather's result is the index itself, shifted
  stub("_mm512_i32gather_epi32(top, reinterpret_cast<const int*>(map.index), 4)", "_mm512_slli_epi32(top, 12)")
if "NODIV" in flags:
  stub("return _mm512_div_ps(a, b);", "return _mm512_mul_ps(a, b);")
  stub("return _mm512_sqrt_ps(a);", "return _mm512_add_ps(a, a);")
if "NODEQ" in flags:
  stub("static JZO_INLINE F dequant8(const uint8_t* p, const jzo::Quant8Map& map) {",
    "static JZO_INLINE F dequant8(const uint8_t* p, const jzo::Quant8Map& map) {\n return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));")
if "NOQ" in flags:  # the codes are the floats' low bytes (void: the kernel before 25d2560)
  stub(re.compile(r"static JZO_INLINE (void|uint32_t) quant8\(uint8_t\* p, F y, "
                  r"const jzo::Quant8Map& map(, bool gather)?\) \{"),
       lambda m: m.group(0) + "\n _mm_storeu_si128(reinterpret_cast<__m128i*>(p), "
       "_mm512_cvtepi32_epi8(_mm512_castps_si512(y))); return" +
       (" 0;" if m.group(1) == "uint32_t" else ";"))
if "BF16CVT" in flags:
  stub("static JZO_INLINE __m256i to_bf16(F x) {", "static JZO_INLINE __m256i to_bf16(F x) {\n return (__m256i)_mm512_cvtneps_pbh(x);")
if "NOLOWP" in flags:
  stub("static JZO_INLINE void store_bf16(uint16_t* p, F x) {", "static JZO_INLINE void store_bf16(uint16_t* p, F x) {\n return;")
  stub("static JZO_INLINE void stream_bf16(uint16_t* p, F x) {", "static JZO_INLINE void stream_bf16(uint16_t* p, F x) {\n return;")
open(path, "w").write(text)
