#include "host_ops.h"

#include <algorithm>
#include <cstring>

#include "thread_pool.h"

namespace jzo {

void adam_parallel(const AdamBuffers& b, const AdamScalars& s, int max_threads) {
  const int64_t n_tasks = (b.n + kAdamChunk - 1) / kAdamChunk;
  if (n_tasks <= 1) return adam_range(b, s, 0, b.n);
  parallel_for(
      n_tasks,
      [&](int64_t t) { adam_range(b, s, t * kAdamChunk, std::min(b.n, (t + 1) * kAdamChunk)); },
      max_threads);
}

void parallel_copy(void* dst, const void* src, size_t bytes, int max_threads) {
  constexpr size_t kChunk = size_t{4} << 20;  // 4 MiB a task
  const int64_t n_tasks = static_cast<int64_t>((bytes + kChunk - 1) / kChunk);
  if (n_tasks <= 1) {
    if (bytes) std::memcpy(dst, src, bytes);
    return;
  }
  parallel_for(
      n_tasks,
      [&](int64_t t) {
        const size_t lo = static_cast<size_t>(t) * kChunk;
        std::memcpy(static_cast<char*>(dst) + lo, static_cast<const char*>(src) + lo,
                    std::min(kChunk, bytes - lo));
      },
      max_threads);
}

}  // namespace jzo
