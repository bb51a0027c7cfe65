// Times the AVX-512 kernel (as built by run.sh) on n = 2^E parameters:
// bf16 gradients, float32 weights updated in place with a bf16 copy, int8
// moments (Q8 = 1) or float32 ones (Q8 = 0), [0, n) split among T threads.
//   bench E Q8 REPS T  ->  Gparam/s, the median and best of REPS steps
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
#include "adam_kernel.h"
#include "quant8.h"
using namespace jzo;
// The kernel's way to int8 codes (adam_kernel.h), here from JZO_INT8_CODES
// (the dispatch that chooses it is not linked).
namespace jzo {
bool quant8_gathers() {
  static const bool gather = getenv("JZO_INT8_CODES") && strcmp(getenv("JZO_INT8_CODES"), "gather") == 0;
  return gather;
}
}  // namespace jzo
int main(int argc, char** argv) {
  int64_t n = int64_t(1) << atoi(argv[1]);
  int q8 = atoi(argv[2]), reps = atoi(argv[3]), T = atoi(argv[4]);
  std::vector<uint16_t> grad(n), lowp(n);
  std::vector<float> param(n), m32, v32;
  std::vector<uint8_t> m8, v8;
  std::vector<float> ms, vs;
  if (q8) { m8.assign(n, 0); v8.assign(n, 0); ms.assign(quant_blocks(n), 0); vs.assign(quant_blocks(n), 0); }
  else { m32.assign(n, 0); v32.assign(n, 0); }
  uint32_t r = 1;
  for (int64_t i = 0; i < n; ++i) { r = r * 1664525u + 1013904223u; float g = ((r >> 8) / 16777216.0f - 0.5f) * 1e-2f; uint32_t b; memcpy(&b, &g, 4); grad[i] = b >> 16; param[i] = 0.01f * (i % 97); }
  AdamBuffers b; b.n = n; b.grad = grad.data(); b.grad_dtype = DType::kBF16;
  if (q8) { b.mu = m8.data(); b.nu = v8.data(); b.mu_dtype = b.nu_dtype = DType::kQ8; b.mu_scale = ms.data(); b.nu_scale = vs.data(); b.row = n; }
  else { b.mu = m32.data(); b.nu = v32.data(); }
  b.param = param.data(); b.update_param = true; b.lowp_out = lowp.data(); b.lowp_dtype = DType::kBF16;
  AdamScalars s{}; s.lr = 1e-3f; s.b1 = 0.9f; s.one_minus_b1 = 0.1f; s.b2 = 0.999f; s.one_minus_b2 = 0.001f; s.eps = 1e-8f; s.weight_decay = 0.01f; s.inv_bc1 = 1.5f; s.inv_bc2 = 2.0f; s.grad_scale = 1.0f;
  auto run = [&] {
    std::vector<std::thread> th;
    int64_t per = (n / T + 255) / 256 * 256;
    for (int t = 0; t < T; ++t) { int64_t lo = t * per, hi = std::min(n, lo + per); if (lo < hi) th.emplace_back([&, lo, hi] { isa::adam_range_avx512(b, s, lo, hi); }); }
    for (auto& x : th) x.join();
  };
  for (int w = 0; w < 2; ++w) run();
  std::vector<double> t;
  for (int k = 0; k < reps; ++k) { auto t0 = std::chrono::steady_clock::now(); run(); t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()); }
  std::sort(t.begin(), t.end());
  printf("%.3f Gparam/s (median of %d; best %.3f)\n", n / t[t.size() / 2] * 1e-9, reps, n / t[0] * 1e-9);
}
