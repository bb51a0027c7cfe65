// Times the AVX-512 kernel (as built by run.sh) on n = 2^E parameters:
// bf16 gradients, float32 weights updated in place with a bf16 copy, int8
// moments (Q8 = 1) or float32 ones (Q8 = 0), [0, n) split among T threads.
//   bench E Q8 REPS T  ->  Gparam/s, the median and best of REPS steps
//   bench E Q8 REPS T check  ->  whether REPS steps give the bits of the
//     scalar kernel (run.sh links the unpatched one) on the same state
// JZO_PREFETCH_ABOVE: the kernel's bound for prefetching (-1 never, 0 always).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
#include <sys/mman.h>
#include "adam_kernel.h"
#include "quant8.h"
using namespace jzo;
// Page-aligned and advised into huge pages, as the module's arrays are
// (kernels.aligned_empty over numpy, which advises MADV_HUGEPAGE): the
// kernel then streams the bfloat16 copy, as it does there.
template <typename T>
struct Buffer {
  T* p = nullptr;
  void assign(int64_t n, T value) {
    p = static_cast<T*>(aligned_alloc(4096, (n * sizeof(T) + 4095) / 4096 * 4096));
    madvise(p, n * sizeof(T), MADV_HUGEPAGE);
    std::fill(p, p + n, value);
  }
  T* data() { return p; }
  T& operator[](int64_t i) { return p[i]; }
};
// The kernel's way to int8 codes (adam_kernel.h), here from JZO_INT8_CODES
// (the dispatch that chooses it is not linked).
namespace jzo {
bool quant8_gathers() {
  static const bool gather = getenv("JZO_INT8_CODES") && strcmp(getenv("JZO_INT8_CODES"), "gather") == 0;
  return gather;
}
// The kernel's bound for prefetching (adam_kernel.h), the module's default
// unless JZO_PREFETCH_ABOVE says (-1: never; 0: always).
int64_t prefetch_above() {
  static const int64_t above = getenv("JZO_PREFETCH_ABOVE") ? atoll(getenv("JZO_PREFETCH_ABOVE")) : int64_t{32} << 20;
  return above;
}
}  // namespace jzo
struct State {
  Buffer<uint16_t> grad, lowp;
  Buffer<float> param, m32, v32, ms, vs;
  Buffer<uint8_t> m8, v8;
  AdamBuffers b;
};
// A denormal weight in every 1009th place and a large gradient in every
// 613th, so that the bfloat16 rounding and the int8 scales see both.
void make_state(State& st, int64_t n, bool q8) {
  st.grad.assign(n, 0); st.lowp.assign(n, 1); st.param.assign(n, 0);
  if (q8) { st.m8.assign(n, 0); st.v8.assign(n, 0); st.ms.assign(quant_blocks(n), 0); st.vs.assign(quant_blocks(n), 0); }
  else { st.m32.assign(n, 0); st.v32.assign(n, 0); }
  uint32_t r = 1;
  for (int64_t i = 0; i < n; ++i) {
    r = r * 1664525u + 1013904223u;
    float g = ((r >> 8) / 16777216.0f - 0.5f) * (i % 613 == 0 ? 1e3f : 1e-2f);
    uint32_t bits; memcpy(&bits, &g, 4); st.grad[i] = bits >> 16;
    st.param[i] = i % 1009 == 0 ? 1e-40f : 0.01f * (i % 97);
  }
  AdamBuffers& b = st.b;
  b.n = n; b.grad = st.grad.data(); b.grad_dtype = DType::kBF16;
  if (q8) { b.mu = st.m8.data(); b.nu = st.v8.data(); b.mu_dtype = b.nu_dtype = DType::kQ8; b.mu_scale = st.ms.data(); b.nu_scale = st.vs.data(); b.row = n; }
  else { b.mu = st.m32.data(); b.nu = st.v32.data(); }
  b.param = st.param.data(); b.update_param = true; b.lowp_out = st.lowp.data(); b.lowp_dtype = DType::kBF16;
}
int main(int argc, char** argv) {
  int64_t n = int64_t(1) << atoi(argv[1]);
  int q8 = atoi(argv[2]), reps = atoi(argv[3]), T = atoi(argv[4]);
  const bool check = argc > 5 && strcmp(argv[5], "check") == 0;
  State st;
  make_state(st, n, q8);
  const AdamBuffers& b = st.b;
  AdamScalars s{}; s.lr = 1e-3f; s.b1 = 0.9f; s.one_minus_b1 = 0.1f; s.b2 = 0.999f; s.one_minus_b2 = 0.001f; s.eps = 1e-8f; s.weight_decay = 0.01f; s.inv_bc1 = 1.5f; s.inv_bc2 = 2.0f; s.grad_scale = 1.0f;
  auto run = [&] {
    std::vector<std::thread> th;
    int64_t per = (n / T + 255) / 256 * 256;
    for (int t = 0; t < T; ++t) { int64_t lo = t * per, hi = std::min(n, lo + per); if (lo < hi) th.emplace_back([&, lo, hi] { isa::adam_range_avx512(b, s, lo, hi); }); }
    for (auto& x : th) x.join();
  };
  if (check) {
    State ref;
    make_state(ref, n, q8);
    for (int k = 0; k < reps; ++k) {
      run();
      isa::adam_range_scalar(ref.b, s, 0, n);
    }
    auto same = [&](const void* x, const void* y, int64_t bytes) { return memcmp(x, y, bytes) == 0; };
    const bool equal = same(st.param.data(), ref.param.data(), 4 * n) && same(st.lowp.data(), ref.lowp.data(), 2 * n) &&
        (q8 ? same(st.m8.data(), ref.m8.data(), n) && same(st.v8.data(), ref.v8.data(), n) &&
                  same(st.ms.data(), ref.ms.data(), 4 * quant_blocks(n)) && same(st.vs.data(), ref.vs.data(), 4 * quant_blocks(n))
            : same(st.m32.data(), ref.m32.data(), 4 * n) && same(st.v32.data(), ref.v32.data(), 4 * n));
    printf("%s\n", equal ? "bits equal to the scalar kernel's" : "BITS DIFFER from the scalar kernel's");
    return equal ? 0 : 1;
  }
  for (int w = 0; w < 2; ++w) run();
  std::vector<double> t;
  for (int k = 0; k < reps; ++k) { auto t0 = std::chrono::steady_clock::now(); run(); t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()); }
  std::sort(t.begin(), t.end());
  printf("%.3f Gparam/s (median of %d; best %.3f)\n", n / t[t.size() / 2] * 1e-9, reps, n / t[0] * 1e-9);
}
