// Multi-threaded host operations built on the kernel and the pool.
#pragma once

#include <cstddef>
#include <cstdint>

#include "accumulate_kernel.h"
#include "adam_kernel.h"

namespace jzo {

// Elements per task: large enough to amortize the dispatch (about 1.8 MB of
// traffic at 28 bytes an element), small enough to balance 16+ threads on a
// few million elements. A multiple of every vector width.
constexpr int64_t kAdamChunk = int64_t{1} << 16;
// The smallest task an Adam step is split into (a smaller array runs on one
// thread): about 3 microseconds of work.
constexpr int64_t kMinAdamChunk = int64_t{1} << 13;

// The Adam kernel over all b.n elements on up to max_threads threads
// (0: the pool's size). Bitwise identical for any thread count.
void adam_parallel(const AdamBuffers& b, const AdamScalars& s, int max_threads = 0);

// The accumulation kernel over all b.n elements on up to max_threads threads,
// in chunks of kAdamChunk whose statistics are combined in chunk order: the
// result is bitwise the same for any thread count.
AccumStats accumulate_parallel(const AccumBuffers& b, int max_threads = 0);

// memcpy of `bytes` bytes split over up to max_threads threads; copies over
// 4 MiB use non-temporal stores.
void parallel_copy(void* dst, const void* src, size_t bytes, int max_threads = 0);

}  // namespace jzo
