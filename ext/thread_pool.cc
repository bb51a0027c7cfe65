#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

namespace jzo {
namespace {

class ThreadPool {
 public:
  explicit ThreadPool(int n_workers) {
    for (int id = 0; id < n_workers; ++id) workers_.emplace_back([this, id] { loop(id); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    start_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int workers() const { return static_cast<int>(workers_.size()); }

  // Runs fn on tasks [0, n_tasks) with `helpers` workers plus the caller.
  void run(int64_t n_tasks, int helpers, const std::function<void(int64_t)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_tasks_ = n_tasks;
      next_.store(0);
      helpers_ = helpers;
      pending_ = helpers;
      ++generation_;
    }
    start_.notify_all();
    work();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void work() {
    for (int64_t t = next_.fetch_add(1); t < n_tasks_; t = next_.fetch_add(1)) (*fn_)(t);
  }
  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (id >= helpers_) continue;  // not needed this round
      }
      work();
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_, done_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  int helpers_ = 0, pending_ = 0;
  std::atomic<int64_t> next_{0};
};

std::mutex g_run_mu;  // one parallel_for at a time; guards the two below
int g_threads = 0;    // 0: not chosen yet
std::unique_ptr<ThreadPool> g_pool;

ThreadPool& pool_locked() {
  if (g_threads == 0) g_threads = available_cpus();
  if (!g_pool || g_pool->workers() != g_threads - 1)
    g_pool = std::make_unique<ThreadPool>(g_threads - 1);
  return *g_pool;
}

}  // namespace

int available_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

int num_threads() {
  std::lock_guard<std::mutex> lock(g_run_mu);
  return g_threads == 0 ? available_cpus() : g_threads;
}

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lock(g_run_mu);
  g_threads = std::max(1, n);
}

void parallel_for(int64_t n_tasks, const std::function<void(int64_t)>& fn, int max_threads) {
  if (n_tasks <= 0) return;
  std::lock_guard<std::mutex> lock(g_run_mu);
  ThreadPool& pool = pool_locked();
  int threads = max_threads > 0 ? std::min(max_threads, g_threads) : g_threads;
  threads = static_cast<int>(std::min<int64_t>(threads, n_tasks));
  if (threads <= 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t);
    return;
  }
  pool.run(n_tasks, threads - 1, fn);
}

}  // namespace jzo
