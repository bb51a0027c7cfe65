#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
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

// A bounded busy wait (about kSpinMicros) before sleeping on a condition
// variable: on a VM a sleeping thread takes tens of microseconds to wake,
// as long as a whole step of 2^18 parameters, so a pool whose workers slept
// between steps ran such steps on one thread. Workers spin after each run
// (back-to-back steps start at once); the caller spins on their last tasks.
class Spinner {
 public:
  // True while the caller should keep spinning (about kSpinMicros in all).
  bool spin() {
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
    if (++count_ % 64) return true;
    const auto now = std::chrono::steady_clock::now();
    if (count_ == 64) start_ = now;
    return now - start_ < std::chrono::microseconds(kSpinMicros);
  }

 private:
  static constexpr int kSpinMicros = 100;
  uint64_t count_ = 0;
  std::chrono::steady_clock::time_point start_;
};

// Workers join a run while it is open; the caller closes it once no task is
// left to claim and waits only for the workers that joined. So a worker that
// was not scheduled in time (a busy host) costs nothing: the caller runs its
// tasks instead of waiting for it to wake up.
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

  // Runs fn on tasks [0, n_tasks) with up to `helpers` workers plus the caller.
  void run(int64_t n_tasks, int helpers, const std::function<void(int64_t)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_tasks_ = n_tasks;
      next_.store(0);
      helpers_ = helpers;
      open_ = true;
      generation_.fetch_add(1);
    }
    start_.notify_all();  // no system call unless a worker sleeps
    work();
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = false;
    }
    for (Spinner s; inside_.load() != 0 && s.spin();) {
    }
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return inside_.load() == 0; });
    fn_ = nullptr;
  }

 private:
  void work() {
    for (int64_t t = next_.fetch_add(1); t < n_tasks_; t = next_.fetch_add(1)) (*fn_)(t);
  }
  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      for (Spinner s; generation_.load() == seen && s.spin();) {
      }
      {
        std::unique_lock<std::mutex> lock(mu_);
        start_.wait(lock, [&] { return stop_ || generation_.load() != seen; });
        if (stop_) return;
        seen = generation_.load();
        if (!open_ || id >= helpers_) continue;  // over already, or not needed
        inside_.fetch_add(1);
      }
      work();
      if (inside_.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(mu_);  // the caller may be between its check and wait
        done_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_, done_;
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
  bool open_ = false;  // workers may still join this run
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  int helpers_ = 0;
  std::atomic<int> inside_{0};  // workers in this run
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
