// What one vector gather costs on this CPU, beside an in-register permute:
// the int8 moments' quantization does one gather (16 lanes at AVX-512, 8 at
// AVX2) from a 14 KB table per vector and moment (ext/quant8.h), and
// microcode that mitigates Gather Data Sampling makes gathers several times
// slower. One thread: dependent iterations (each index comes from the last
// result: the instruction's latency), and independent ones (indices stepping
// through the table, results summed: its throughput, as in the kernel).
//
//   g++ -O2 -mavx512f -mavx2 experiments/gather_cost.cc -o /tmp/gather_cost && /tmp/gather_cost
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

namespace {

constexpr int kTable = 3457;  // entries of the quantization's index (kQuantIndexSize)
constexpr long kIters = 20000000;

template <typename Step>
double ns_per_iteration(Step step) {
  step(kIters / 10);  // warm-up
  const auto start = std::chrono::steady_clock::now();
  const int sink = step(kIters);
  const double ns = std::chrono::duration<double, std::nano>(
      std::chrono::steady_clock::now() - start).count();
  std::printf("%s", sink == 12345 ? " " : "");  // keeps the loop's result alive
  return ns / kIters;
}

}  // namespace

int main() {
  alignas(64) static int32_t table[kTable];
  for (int i = 0; i < kTable; ++i) table[i] = (i * 7919) % kTable;
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i t0 = _mm512_load_si512(table), t1 = _mm512_load_si512(table + 16);

  const double gather512 = ns_per_iteration([&](long n) {
    __m512i idx = lanes;
    for (long i = 0; i < n; ++i) idx = _mm512_i32gather_epi32(idx, table, 4);
    return _mm512_reduce_add_epi32(idx);
  });
  const double gather256 = ns_per_iteration([&](long n) {
    __m256i idx = _mm512_castsi512_si256(lanes);
    for (long i = 0; i < n; ++i) idx = _mm256_i32gather_epi32(table, idx, 4);
    return _mm256_extract_epi32(idx, 0);
  });
  const double permute = ns_per_iteration([&](long n) {
    __m512i idx = lanes;
    for (long i = 0; i < n; ++i) idx = _mm512_permutex2var_epi32(t0, idx, t1);
    return _mm512_reduce_add_epi32(idx);
  });
  const double gather512_free = ns_per_iteration([&](long n) {
    __m512i sum = _mm512_setzero_si512(), idx = lanes;
    const __m512i step = _mm512_set1_epi32(16), wrap = _mm512_set1_epi32(kTable - 16);
    for (long i = 0; i < n; ++i) {
      sum = _mm512_add_epi32(sum, _mm512_i32gather_epi32(idx, table, 4));
      idx = _mm512_add_epi32(idx, step);
      idx = _mm512_mask_sub_epi32(idx, _mm512_cmpgt_epi32_mask(idx, wrap), idx, wrap);
    }
    return _mm512_reduce_add_epi32(sum);
  });
  const double permute_free = ns_per_iteration([&](long n) {
    __m512i sum = _mm512_setzero_si512(), idx = lanes;
    const __m512i step = _mm512_set1_epi32(3);
    for (long i = 0; i < n; ++i) {
      sum = _mm512_add_epi32(sum, _mm512_permutex2var_epi32(t0, idx, t1));
      idx = _mm512_add_epi32(idx, step);
    }
    return _mm512_reduce_add_epi32(sum);
  });
  std::printf("ns per op, one thread: dependent: gather zmm %.2f, gather ymm %.2f, "
              "permutex2var zmm %.2f; independent: gather zmm %.2f, permutex2var zmm %.2f\n",
              gather512, gather256, permute, gather512_free, permute_free);
  return 0;
}
