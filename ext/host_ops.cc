#include "host_ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
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

}  // namespace

void adam_parallel(const AdamBuffers& b, const AdamScalars& s, int max_threads) {
  const int64_t chunk = adam_chunk(b.n, max_threads);
  if (b.mu_dtype == DType::kQ8) {
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
