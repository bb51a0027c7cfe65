// The AVX-512 kernel's two quantizers (ext/quant8.h: codes computed by
// parts, lanes too close to a midpoint redone by the index; and the index's
// vector gather) against the index alone on every float32 in [0, 1], both
// maps; and how many lanes the parts redo. Exits non-zero if a code differs.
// test_quant8.py builds and runs it; by hand:
//   g++ -O2 -std=c++17 -Iext -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx2 -mfma -mf16c \
//     tests/quant8_exhaustive.cc ext/quant8.cc -o /tmp/quant8_exhaustive && /tmp/quant8_exhaustive
#include "../ext/adam_avx512.cc"  // the kernel's V, as it is compiled there

// What dispatch.cc defines for the module (the quantizers are called directly here).
const bool jzo::isa::g_avx512_bf16 = false;
int jzo::isa::g_quant8_gather = 0;
int jzo::isa::choose_quant8_gather() { return 0; }

#include <cstdio>
#include <cstring>

int main() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) {
    std::puts("this CPU has no AVX-512");
    return 1;
  }
  int failed = 0;
  for (int run = 0; run < 4; ++run) {
    const bool gather = run >= 2, is_signed = run % 2 == 0;
    const jzo::Quant8Map& map = is_signed ? jzo::quant8_signed() : jzo::quant8_unsigned();
    long wrong = 0, redone = 0, total = 0;
    alignas(64) uint32_t bits[16];
    alignas(16) uint8_t codes[16];
    for (uint64_t start = 0; start <= 0x3f800000u; start += 16) {
      for (int k = 0; k < 16; ++k) bits[k] = static_cast<uint32_t>(start + k);
      float values[16];
      std::memcpy(values, bits, sizeof values);
      uint32_t redo = 0;
      if (gather)
        V::quant8_gather(codes, _mm512_load_ps(values), map);
      else
        redo = V::quant8_by_parts(codes, _mm512_load_ps(values), map);
      for (int k = 0; k < 16 && start + k <= 0x3f800000u; ++k, ++total) {
        if (redo >> k & 1) {
          ++redone;
          continue;
        }
        if (codes[k] != jzo::quant8_exact(values[k], map)) {
          if (wrong++ < 5)
            std::printf("  %.9g: %d, the index %d\n", values[k], codes[k],
                        jzo::quant8_exact(values[k], map));
        }
      }
    }
    std::printf("%s, %s map: %ld values in [0, 1], %ld codes differ, %ld redone (%.4f%%)\n",
                gather ? "gather" : "parts", is_signed ? "signed" : "unsigned", total, wrong,
                redone, 100.0 * redone / total);
    failed += wrong != 0;
  }
  return failed;
}
