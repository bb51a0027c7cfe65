"""python3 patch.py SRC-EXT DST-EXT STUB...: a copy of an ext folder whose
AVX-512 kernel has parts stubbed out (run.sh times them):
  NOGATHER  the quantizer's index gather (the kernel before 25d2560; today's gather way)
  NOQ       the whole quantizer (codes are the floats' low bytes)
  NODEQ     the decoding of codes (their integer values instead)
  NODIV     the division and square root (a multiply, an add)
  BF16CVT   the bfloat16 rounding in integers (VCVTNEPS2BF16 instead)
  NOLOWP    the bfloat16 copy of the weights (not written)
Variants that compute the same bits another way:
  NOSTREAM  the int8 pass's bfloat16 copy by plain stores, not streamed
  LINE      the int8 pass's bfloat16 copy streamed a whole 64-byte line at a time
  APPLY1    the int8 pass forms the update in its first loop, beside the moments
"""
import re
import shutil
import sys

src, dst, flags = sys.argv[1], sys.argv[2], set(sys.argv[3:])
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, dst)
path = f"{dst}/adam_avx512.cc"
text = open(path).read()
impl_path = f"{dst}/adam_kernel_impl.h"
impl = open(impl_path).read()


def stub(old: str, new, in_impl: bool = False) -> None:
  """Replaces the text old in the kernel (adam_avx512.cc, or with in_impl
  adam_kernel_impl.h), which must hold it (a stub that no longer matches
  the source would time the whole kernel); old may be a compiled pattern,
  new then a function of the match."""
  global text, impl
  pattern = old if isinstance(old, re.Pattern) else re.compile(re.escape(old))
  replace = new if callable(new) else lambda m: new
  if in_impl:
    impl, n = pattern.subn(replace, impl)
  else:
    text, n = pattern.subn(replace, text)
  if not n:
    sys.exit(f"patch.py: {pattern.pattern!r} is not in {impl_path if in_impl else path}")


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
if "NOSTREAM" in flags:
  stub("    c.stream_lowp = V::kStreams && b.lowp_out != b.grad && b.row % kW == 0 &&",
       "    c.stream_lowp = false && b.lowp_out != b.grad && b.row % kW == 0 &&", in_impl=True)
if "LINE" in flags:
  stub("  static JZO_INLINE void stream_fence()",
       "  static JZO_INLINE void stream_bf16_line(uint16_t* p, F a, F b) {\n"
       "    _mm512_stream_si512(reinterpret_cast<__m512i*>(p),\n"
       "                        _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(a)), to_bf16(b), 1));\n"
       "  }\n  static JZO_INLINE void stream_fence()")
  stub("  bool stream_lowp = false;", "  bool stream_lowp = false;\n  bool stream_line = false;", in_impl=True)
  stub("JZO_INLINE void apply(", "JZO_INLINE F apply(", in_impl=True)
  stub("    return;\n  }\n  const F p = V::add", "    return u;\n  }\n  const F p = V::add", in_impl=True)
  stub("  if constexpr (L != kNoLowp) store_lowp<static_cast<jzo::DType>(L)>(b.lowp_out, i, p, c.stream_lowp);\n}",
       "  if constexpr (L != kNoLowp) if (!c.stream_line) store_lowp<static_cast<jzo::DType>(L)>(b.lowp_out, i, p, c.stream_lowp);\n  return p;\n}",
       in_impl=True)
  stub("  c.stream_lowp = false;\n  alignas(64) float grad[kB]",
       "  c.stream_lowp = false;\n  c.stream_line = false;\n  alignas(64) float grad[kB]", in_impl=True)
  stub("        (reinterpret_cast<uintptr_t>(b.lowp_out) + 2 * begin) % (2 * kW) == 0;\n  }\n",
       "        (reinterpret_cast<uintptr_t>(b.lowp_out) + 2 * begin) % (2 * kW) == 0;\n"
       "    c.stream_line = c.stream_lowp && L == static_cast<int>(jzo::DType::kBF16) && b.row % 32 == 0 &&\n"
       "        (reinterpret_cast<uintptr_t>(b.lowp_out) + 2 * begin) % 64 == 0;\n  }\n", in_impl=True)
  stub("""  for (int j = 0; j < kB; j += kW) {
    const F m = V::load_f32(m_new + j), v = V::load_f32(v_new + j);
    redo_mu[j / kW] = V::quant8<true>(mu + lo + j, V::mul(m, m_to_code), maps.mu, kGather);
    redo_nu[j / kW] = V::quant8<false>(nu + lo + j, V::mul(v, v_to_code), maps.nu, kGather);
    any |= redo_mu[j / kW] | redo_nu[j / kW];
    if (!b.moments_only) apply<L>(b, c, lo + j, c.nesterov ? scaled_grad<G>(b, c, lo + j) : zero, m, v);
  }""", """  for (int j0 = 0; j0 < kB; j0 += 2 * kW) {
    F p2[2];
    for (int h = 0; h < 2; ++h) {
      const int j = j0 + h * kW;
      const F m = V::load_f32(m_new + j), v = V::load_f32(v_new + j);
      redo_mu[j / kW] = V::quant8<true>(mu + lo + j, V::mul(m, m_to_code), maps.mu, kGather);
      redo_nu[j / kW] = V::quant8<false>(nu + lo + j, V::mul(v, v_to_code), maps.nu, kGather);
      any |= redo_mu[j / kW] | redo_nu[j / kW];
      if (!b.moments_only) p2[h] = apply<L>(b, c, lo + j, c.nesterov ? scaled_grad<G>(b, c, lo + j) : zero, m, v);
    }
    if (c.stream_line) V::stream_bf16_line(static_cast<uint16_t*>(b.lowp_out) + lo + j0, p2[0], p2[1]);
  }""", in_impl=True)
if "APPLY1" in flags:
  stub("    v_max = V::max_magnitude(v_max, v);\n  }",
       "    v_max = V::max_magnitude(v_max, v);\n    if (!b.moments_only) apply<L>(b, c, lo + j, g, m, v);\n  }",
       in_impl=True)
  stub("    if (!b.moments_only) apply<L>(b, c, lo + j, c.nesterov ? scaled_grad<G>(b, c, lo + j) : zero, m, v);\n",
       "", in_impl=True)
open(path, "w").write(text)
open(impl_path, "w").write(impl)
