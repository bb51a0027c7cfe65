#include "host_ops.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>  // SSE2, part of every x86-64: no run-time check needed
#endif

#include "quant8.h"
#include "thread_pool.h"

namespace jzo {
namespace {

// memcpy with non-temporal stores: the destination is written without first
// being read into the cache, so a large copy moves only the bytes it copies
// (and does not evict the cache for data nobody will read soon).
void stream_copy(char* dst, const char* src, size_t bytes) {
#if defined(__x86_64__) || defined(_M_X64)
  const size_t head = std::min(bytes, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, bytes - i);
  _mm_sfence();  // streamed stores are weakly ordered: publish them before returning
#else
  std::memcpy(dst, src, bytes);
#endif
}

// Elements per task of an Adam step over n elements: kAdamChunk, or for a
// smaller array an even share per thread, so that 2^16 elements run on two
// threads too (the spinning pool starts a task in about a microsecond). A
// whole number of quantization blocks; at least kMinAdamChunk.
int64_t adam_chunk(int64_t n, int max_threads) {
  const int64_t threads = max_threads > 0 ? std::min(max_threads, num_threads()) : num_threads();
  const int64_t share = (n + threads - 1) / threads;
  const int64_t blocks = (share + kQuantBlock - 1) / kQuantBlock * kQuantBlock;
  return std::min(kAdamChunk, std::max(kMinAdamChunk, blocks));
}

// Times the two ways to int8 codes (adam_kernel.h: quant8_gathers) on all
// the pool's threads at once, as steps run by default, and keeps the faster;
// not on the first int8 call's thread cap, whose choice on one thread would
// then hold for the engine's update on all of them. Each thread updates its
// own 2^16 parameters in its caches (bf16 gradients, int8 moments, float32
// weights and their bf16 copy), where, as in a step, the int8 pass is bound
// by its arithmetic; best of 5 passes each, a few ms.
void choose_int8_codes() {
  static std::mutex choosing;
  const std::lock_guard<std::mutex> lock(choosing);
  if (std::strcmp(int8_codes(), "unchosen") != 0) return;  // another thread chose
  if (std::strcmp(simd_level(), "avx512") != 0) {  // the others always use the index
    set_int8_codes("gather");
    return;
  }
  const int threads = num_threads();
  constexpr int64_t kPer = int64_t{1} << 16;
  const int64_t n = kPer * threads;
  std::vector<uint16_t> grad(n), lowp(n);
  std::vector<float> param(n, 0.01f), mu_scale(quant_blocks(n)), nu_scale(quant_blocks(n));
  std::vector<uint8_t> mu(n), nu(n);
  uint32_t r = 1;
  for (uint16_t& g : grad) {  // bf16 values spread over (-0.01, 0.01)
    r = r * 1664525u + 1013904223u;
    const float x = (static_cast<float>(r >> 8) / 16777216.0f - 0.5f) * 0.02f;
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    g = static_cast<uint16_t>(bits >> 16);
  }
  AdamBuffers b;
  b.n = n;
  b.grad = grad.data();
  b.grad_dtype = DType::kBF16;
  b.mu = mu.data();
  b.nu = nu.data();
  b.mu_dtype = b.nu_dtype = DType::kQ8;
  b.mu_scale = mu_scale.data();
  b.nu_scale = nu_scale.data();
  b.row = n;
  b.param = param.data();
  b.update_param = true;
  b.lowp_out = lowp.data();
  AdamScalars s{};
  s.lr = 1e-3f, s.b1 = 0.9f, s.one_minus_b1 = 0.1f, s.b2 = 0.999f, s.one_minus_b2 = 0.001f;
  s.eps = 1e-8f, s.weight_decay = 0.01f, s.inv_bc1 = s.inv_bc2 = s.grad_scale = 1.0f;
  double best[2] = {1e30, 1e30};
  for (int round = 0; round < 6; ++round) {
    for (const int way : {0, 1}) {
      set_int8_codes(way ? "gather" : "computed");
      const auto start = std::chrono::steady_clock::now();
      parallel_for(threads, [&](int64_t t) { adam_range(b, s, t * kPer, (t + 1) * kPer); },
                   threads);
      const double took =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (round > 0) best[way] = std::min(best[way], took);  // round 0 warms up
    }
  }
  set_int8_codes(best[1] < best[0] ? "gather" : "computed");
}

}  // namespace

void adam_parallel(const AdamBuffers& b, const AdamScalars& s, int max_threads) {
  const int64_t chunk = adam_chunk(b.n, max_threads);
  if (b.mu_dtype == DType::kQ8) {
    if (std::strcmp(int8_codes(), "unchosen") == 0) choose_int8_codes();
    // Tasks of whole blocks: a block's scale comes from all of it.
    const int64_t per_row = quant_blocks(b.row), rows = b.row ? b.n / b.row : 0;
    const int64_t blocks = rows * per_row, per_task = chunk / kQuantBlock;
    auto start = [&](int64_t block) {  // element where a block starts (b.n past the last)
      return block >= blocks ? b.n : block / per_row * b.row + block % per_row * kQuantBlock;
    };
    parallel_for(
        (blocks + per_task - 1) / per_task,
        [&](int64_t t) { adam_range(b, s, start(t * per_task), start((t + 1) * per_task)); },
        max_threads);
    return;
  }
  const int64_t n_tasks = (b.n + chunk - 1) / chunk;
  if (n_tasks <= 1) return adam_range(b, s, 0, b.n);
  parallel_for(
      n_tasks, [&](int64_t t) { adam_range(b, s, t * chunk, std::min(b.n, (t + 1) * chunk)); },
      max_threads);
}

AccumStats accumulate_parallel(const AccumBuffers& b, int max_threads) {
  const int64_t n_tasks = (b.n + kAdamChunk - 1) / kAdamChunk;
  if (n_tasks <= 1) return accumulate_range(b, 0, b.n);
  std::vector<AccumStats> parts(static_cast<size_t>(n_tasks));
  parallel_for(
      n_tasks,
      [&](int64_t t) {
        parts[t] = accumulate_range(b, t * kAdamChunk, std::min(b.n, (t + 1) * kAdamChunk));
      },
      max_threads);
  AccumStats all;
  for (const AccumStats& p : parts) {
    all.sumsq += p.sumsq;
    all.finite = all.finite && p.finite;
  }
  return all;
}

void parallel_copy(void* dst, const void* src, size_t bytes, int max_threads) {
  constexpr size_t kChunk = size_t{4} << 20;  // 4 MiB a task
  const int64_t n_tasks = static_cast<int64_t>((bytes + kChunk - 1) / kChunk);
  if (n_tasks <= 1) {
    if (bytes) std::memcpy(dst, src, bytes);  // small: cached stores are faster
    return;
  }
  parallel_for(
      n_tasks,
      [&](int64_t t) {
        const size_t lo = static_cast<size_t>(t) * kChunk;
        stream_copy(static_cast<char*>(dst) + lo, static_cast<const char*>(src) + lo,
                    std::min(kChunk, bytes - lo));
      },
      max_threads);
}

}  // namespace jzo
