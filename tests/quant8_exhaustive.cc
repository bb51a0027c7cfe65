// The AVX-512 kernel's quantizer, both ways (ext/quant8.h: codes computed by
// parts, lanes too close to a midpoint redone by the index; or gathered from
// the index) against the index alone on every float32 in [0, 1], both maps;
// and how many lanes the computed way redoes.
// Exits non-zero if a code differs. test_quant8.py builds and runs it;
// by hand:
//   g++ -O2 -std=c++17 -ffp-contract=off -Iext -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c \
//     tests/quant8_exhaustive.cc ext/quant8.cc -o /tmp/quant8_exhaustive && /tmp/quant8_exhaustive
#include "../ext/adam_avx512.cc"  // the kernel's V, as it is compiled there

#include <cstdio>
#include <cstring>
#include <initializer_list>

// The kernel's dispatch is not linked: each way is passed to V::quant8 here.
bool jzo::quant8_gathers() { return false; }
int64_t jzo::prefetch_above() { return -1; }  // linked for the kernel's passes, which this never runs

int main() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) {
    std::puts("this CPU has no AVX-512");
    return 1;
  }
  int failed = 0;
  for (const bool gather : {false, true})
  for (const bool is_signed : {true, false}) {
    const jzo::Quant8Map& map = is_signed ? jzo::quant8_signed() : jzo::quant8_unsigned();
    long wrong = 0, redone = 0, total = 0;
    alignas(64) uint32_t bits[16];
    alignas(16) uint8_t codes[16];
    for (uint64_t start = 0; start <= 0x3f800000u; start += 16) {
      for (int k = 0; k < 16; ++k) bits[k] = static_cast<uint32_t>(start + k);
      float values[16];
      std::memcpy(values, bits, sizeof values);
      const F y = _mm512_load_ps(values);
      const uint32_t redo = is_signed ? V::quant8<true>(codes, y, map, gather)
                                      : V::quant8<false>(codes, y, map, gather);
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
    std::printf("%s map, %s: %ld values in [0, 1], %ld codes differ, %ld redone (%.4f%%)\n",
                is_signed ? "signed" : "unsigned", gather ? "gathered" : "computed", total,
                wrong, redone, 100.0 * redone / total);
    failed += wrong != 0;
  }
  return failed;
}
