// A persistent pool of worker threads for the memory-bound host kernels.
#pragma once

#include <cstdint>
#include <functional>

namespace jzo {

// CPUs this process may run on (its affinity mask), at least 1.
int available_cpus();

// Threads used by parallel_for, the caller included. Default: available_cpus().
int num_threads();
void set_num_threads(int n);  // n >= 1; waits for running work to finish

// Calls fn(task) once for every task in [0, n_tasks), spread over at most
// `max_threads` threads (0: num_threads()); the calling thread works too.
// Returns when all tasks are done. Calls from several threads are serialized.
void parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn,
                  int max_threads = 0);

}  // namespace jzo
