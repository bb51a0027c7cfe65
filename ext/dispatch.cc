// Run-time choice of the instruction set: the build never assumes the CPU it
// runs on (no -march=native), so one wheel serves every x86-64 and ARM host.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "accumulate_kernel.h"
#include "adam_kernel.h"

namespace jzo {
namespace {

enum Level : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Level detect() {
#if defined(JZO_HAVE_X86_KERNELS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return kAvx2;
#endif
  return kScalar;
}

const Level kBest = detect();

Level parse(const char* name, bool* ok) {
  *ok = true;
  if (std::strcmp(name, "avx512") == 0) return kAvx512;
  if (std::strcmp(name, "avx2") == 0) return kAvx2;
  if (std::strcmp(name, "scalar") == 0) return kScalar;
  *ok = false;
  return kScalar;
}

// JZO_SIMD caps the level for a whole process (tests, benchmarks).
Level initial() {
  const char* env = std::getenv("JZO_SIMD");
  bool ok = false;
  if (env) {
    const Level want = parse(env, &ok);
    if (ok && want <= kBest) return want;
  }
  return kBest;
}

std::atomic<int> g_level{initial()};

// quant8_gathers: -1 not chosen yet, 0 computed, 1 gathered.
int parse_codes(const char* name) {
  if (std::strcmp(name, "gather") == 0) return 1;
  if (std::strcmp(name, "computed") == 0) return 0;
  return -2;
}

int initial_codes() {
  const char* env = std::getenv("JZO_INT8_CODES");
  const int way = env ? parse_codes(env) : -1;
  return way >= 0 ? way : -1;
}

std::atomic<int> g_codes{initial_codes()};

// 32 MiB, not the level-3 cache's size: a VM reports its socket's (300 MiB on
// the GPU machines' Xeon, where prefetching gained 6% on arrays of 256 MiB).
std::atomic<int64_t> g_prefetch_above{int64_t{32} << 20};

}  // namespace

const char* simd_level() {
  switch (g_level.load(std::memory_order_relaxed)) {
    case kAvx512:
      return "avx512";
    case kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

bool set_simd_level(const char* name) {
  bool ok = false;
  const Level want = parse(name, &ok);
  if (!ok || want > kBest) return false;
  g_level.store(want, std::memory_order_relaxed);
  return true;
}

bool quant8_gathers() { return g_codes.load(std::memory_order_relaxed) == 1; }

const char* int8_codes() {
  switch (g_codes.load(std::memory_order_relaxed)) {
    case 1:
      return "gather";
    case 0:
      return "computed";
    default:
      return "unchosen";
  }
}

bool set_int8_codes(const char* way) {
  const int w = parse_codes(way);
  if (w < 0) return false;
  g_codes.store(w, std::memory_order_relaxed);
  return true;
}

int64_t prefetch_above() { return g_prefetch_above.load(std::memory_order_relaxed); }

void set_prefetch_above(int64_t bytes) { g_prefetch_above.store(bytes, std::memory_order_relaxed); }

void adam_range(const AdamBuffers& b, const AdamScalars& s, int64_t begin, int64_t end) {
  switch (g_level.load(std::memory_order_relaxed)) {
#if defined(JZO_HAVE_X86_KERNELS)
    case kAvx512:
      return isa::adam_range_avx512(b, s, begin, end);
    case kAvx2:
      return isa::adam_range_avx2(b, s, begin, end);
#endif
    default:
      return isa::adam_range_scalar(b, s, begin, end);
  }
}

AccumStats accumulate_range(const AccumBuffers& b, int64_t begin, int64_t end) {
  switch (g_level.load(std::memory_order_relaxed)) {
#if defined(JZO_HAVE_X86_KERNELS)
    case kAvx512:
      return isa::accumulate_range_avx512(b, begin, end);
    case kAvx2:
      return isa::accumulate_range_avx2(b, begin, end);
#endif
    default:
      return isa::accumulate_range_scalar(b, begin, end);
  }
}

}  // namespace jzo
