// The gradient accumulation kernel: plain pointers and sizes, no Python.
//
// One pass over memory per element i:
//   x = float(grad[i])                         (f32, bf16 or f16)
//   x = acc[i] + x                             when `add` (else the first micro-batch: a write)
//   acc[i] = x                                 when acc is given
//   lowp_out[i] = bf16/f16(x)                  when lowp_out is given
// and over the range the float32 sum of squares of x (in double across
// vectors) and whether every x is finite. With acc null and lowp_out given,
// the pass is a cast (float32 master weights to their bf16/fp16 copy).
// The sum of squares is summed in lanes of the vector width: its last bits
// depend on the instruction set, never on how [0, n) is split into chunks
// of a fixed size.
#pragma once

#include <cstdint>

#include "adam_kernel.h"

namespace jzo {

struct AccumBuffers {
  int64_t n = 0;                    // elements in every buffer
  const void* grad = nullptr;       // read
  DType grad_dtype = DType::kF32;   // f32, bf16 or f16
  float* acc = nullptr;             // f32 sum; read when add, written; may be null
  bool add = false;                 // acc += grad; else acc = grad
  void* lowp_out = nullptr;         // optional bf16/f16 copy of the result
  DType lowp_dtype = DType::kBF16;  // bf16 or f16
};

struct AccumStats {
  double sumsq = 0.0;  // sum of the results' squares (each square in float32)
  bool finite = true;  // every result is finite
};

// Runs elements [begin, end) with the SIMD level chosen at run time.
AccumStats accumulate_range(const AccumBuffers& b, int64_t begin, int64_t end);

namespace isa {
AccumStats accumulate_range_scalar(const AccumBuffers&, int64_t, int64_t);
AccumStats accumulate_range_avx2(const AccumBuffers&, int64_t, int64_t);
AccumStats accumulate_range_avx512(const AccumBuffers&, int64_t, int64_t);
}  // namespace isa

}  // namespace jzo
