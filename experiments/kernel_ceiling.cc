// The fp32 Adam kernel against the memory's ceiling for its traffic: the
// AVX-512 kernel (or the AVX2 one, built without AVX-512 flags; float32
// gradients, moments and weights, updated in place: 16 bytes read and 12
// written a parameter) and a loop that moves the same bytes with almost no
// arithmetic, taking turns in one process on T threads, tasks of 2^16
// parameters handed out as the module's pool does; and the kernel again on
// T contiguous parts, one a thread (as OpenMP's static schedule splits
// torch's); and the kernel asking for its lines ahead (prefetch_above 0),
// with the median over rounds of its speed over the plain kernel's. If the
// kernel runs as fast as the loop, it is bound by memory, and no fused AdamW
// that moves these 28 bytes can be faster on this host.
//
// Built and run from the repository's root (gpu_runs.sh's part kernel-ceiling):
//   FLAGS="-O3 -std=c++17 -ffp-contract=off -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mavx2 -mfma -mf16c"
//   g++ $FLAGS -Iext -c ext/adam_avx512.cc -o /tmp/k.o
//   g++ $FLAGS -Iext experiments/kernel_ceiling.cc ext/quant8.cc /tmp/k.o -o /tmp/kc -lpthread
//   /tmp/kc E ROUNDS T   ->  each one's median Gparam/s over rounds 2..ROUNDS (round 1 warms up)
// On an AVX2 host: FLAGS="-O3 -std=c++17 -ffp-contract=off -mavx2 -mfma -mf16c" and ext/adam_avx2.cc.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "adam_kernel.h"

// The kernel's way to int8 codes (adam_kernel.h): the dispatch that chooses
// it is not linked, and this float32 pass never asks.
bool jzo::quant8_gathers() { return false; }

// The module's bound for prefetching (dispatch.cc is not linked): -1 never,
// 0 always; each row sets it.
int64_t g_prefetch_above = -1;
int64_t jzo::prefetch_above() { return g_prefetch_above; }

namespace {

// n floats on 2 MiB pages where the kernel allows (numpy asks for them too).
float* zeros(int64_t n) {
  const size_t bytes = ((n * 4 + (1 << 21) - 1) >> 21) << 21;
  void* p = std::aligned_alloc(1 << 21, bytes);
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 0, bytes);
  return static_cast<float*>(p);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) return std::fprintf(stderr, "usage: %s E ROUNDS THREADS\n", argv[0]), 2;
  const int64_t n = int64_t{1} << std::atoi(argv[1]);
  const int rounds = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  float *param = zeros(n), *grad = zeros(n), *mu = zeros(n), *nu = zeros(n);
  for (int64_t i = 0; i < n; ++i) {
    grad[i] = 1e-3f * static_cast<float>(i * 7919 % 1000 - 500);
    param[i] = 0.01f * static_cast<float>(i % 97);
  }
  jzo::AdamBuffers b;
  b.n = n;
  b.grad = grad;
  b.grad_dtype = jzo::DType::kF32;
  b.mu = mu;
  b.nu = nu;
  b.param = param;
  b.update_param = true;
  jzo::AdamScalars s{};
  s.lr = 1e-3f, s.b1 = 0.9f, s.one_minus_b1 = 0.1f, s.b2 = 0.999f, s.one_minus_b2 = 0.001f;
  s.eps = 1e-8f, s.weight_decay = 0.01f, s.inv_bc1 = 1.5f, s.inv_bc2 = 2.0f, s.grad_scale = 1.0f;

  constexpr int64_t kChunk = int64_t{1} << 16;
  auto in_tasks = [&](auto body) {
    std::atomic<int64_t> next{0};
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&] {
        for (int64_t c; (c = next++) * kChunk < n;) body(c * kChunk, std::min(n, (c + 1) * kChunk));
      });
    for (auto& t : pool) t.join();
  };
#ifdef __AVX512F__
  auto kernel = [&](int64_t lo, int64_t hi) { jzo::isa::adam_range_avx512(b, s, lo, hi); };
#else
  auto kernel = [&](int64_t lo, int64_t hi) { jzo::isa::adam_range_avx2(b, s, lo, hi); };
#endif
  auto in_parts = [&](auto body) {  // thread t: [n t / T, n (t + 1) / T), a task at a time
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
        for (int64_t c = lo; c < hi; c += kChunk) body(c, std::min(hi, c + kChunk));
      });
    for (auto& t : pool) t.join();
  };
  // Vectorized as wide as the kernel (the file is built with its flags;
  // restrict: the arrays do not overlap).
  auto same_bytes = [&](int64_t lo, int64_t hi) {
    const float* __restrict g = grad;
    float* __restrict m = mu;
    float* __restrict v = nu;
    float* __restrict p = param;
    for (int64_t i = lo; i < hi; ++i) {
      m[i] = 0.9f * m[i] + g[i];
      v[i] = 0.999f * v[i] + g[i] * g[i];
      p[i] += 1e-9f * g[i];
    }
  };

  const char* names[] = {"kernel", "same bytes, no Adam", "kernel, contiguous parts",
                         "kernel, prefetching"};
  std::vector<double> seconds[4];
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < 4; ++k) {
      g_prefetch_above = k == 3 ? 0 : -1;
      const auto start = std::chrono::steady_clock::now();
      k == 0 ? in_tasks(kernel) : k == 1 ? in_tasks(same_bytes) : k == 2 ? in_parts(kernel) : in_tasks(kernel);
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (r > 0) seconds[k].push_back(took);  // round 0 warms up
    }
  }
  std::vector<double> gain;  // prefetching over plain, round by round
  for (size_t r = 0; r < seconds[0].size(); ++r) gain.push_back(seconds[0][r] / seconds[3][r]);
  std::sort(gain.begin(), gain.end());
  for (int k = 0; k < 4; ++k) {
    std::sort(seconds[k].begin(), seconds[k].end());
    const double median = seconds[k][seconds[k].size() / 2];
    std::printf("%-20s 2^%s, %d threads: %.3f Gparam/s (%.1f GB/s at 28 B a parameter)\n",
                names[k], argv[1], threads, n / median * 1e-9, n * 28 / median * 1e-9);
  }
  std::printf("prefetching / plain, round by round: median %.3f (quartiles %.3f, %.3f)\n",
              gain[gain.size() / 2], gain[gain.size() / 4], gain[3 * gain.size() / 4]);
}
