// The fused Adam(W) kernel: plain pointers and sizes, no Python, no XLA.
//
// One pass over memory per element i:
//   g      = float(grad[i]) * grad_scale               (unscale: loss scale, clip)
//   m      = b1 * m + (1 - b1) * g
//   v      = b2 * v + (1 - b2) * g * g
//   m_hat  = m * inv_bc1        (nesterov: b1 * m * inv_bc1_next + (1 - b1) * g * inv_bc1)
//   v_hat  = v * inv_bc2
//   x      = m_hat / (sqrt(v_hat + eps_root) + eps) + weight_decay * param
//   update = -lr * x
// then either param += update in place, or update is written to update_out,
// or (moments_only) the pass ends after m and v are stored; the new param may
// also be written as bf16/fp16 into lowp_out.
// All arithmetic is float32 whatever the storage types. The bias corrections
// are multiplied as reciprocals, leaving one division and one square root per
// element: on hosts whose divider is shared by two hyperthreads, three
// divisions would make the kernel compute-bound.
#pragma once

#include <cstdint>

// Forces inlining of the per-vector helpers of the kernels (each ISA's `V`,
// the steps in adam_kernel_impl.h). nanobind builds the module with -Os,
// which leaves even a two-instruction load out of line and passes vectors
// through the stack: the kernels ran 20-30% slower that way.
#define JZO_INLINE inline __attribute__((always_inline))

namespace jzo {

// Storage types of the arrays, by the codes Python passes (jzo.native.DTYPE_CODES).
// kQ8: 8-bit codes with a float32 scale per block (quant8.h), moments only.
#define JZO_DTYPES(X) \
  X(kF32, 0, "float32") X(kBF16, 1, "bfloat16") X(kF16, 2, "float16") X(kQ8, 3, "int8")

enum class DType : int {
#define JZO_DTYPE_ENUM(name, code, text) name = code,
  JZO_DTYPES(JZO_DTYPE_ENUM)
#undef JZO_DTYPE_ENUM
};

// The float32 scalars of one step, already reduced to float32 (bias
// corrections included) so that every code path sees the same rounded
// values. This list is their one definition: the struct, the order of the
// float32[kNumAdamScalars] array every caller passes (Python reads the names
// from jzo.native.ADAM_SCALARS) and its reading all come from it.
//   inv_bc1 = 1 / (1 - b1**t), inv_bc2 = 1 / (1 - b2**t),
//   inv_bc1_next = 1 / (1 - b1**(t + 1)) (nesterov only).
#define JZO_ADAM_SCALARS(X)                                                              \
  X(lr) X(b1) X(one_minus_b1) X(b2) X(one_minus_b2) X(eps) X(eps_root) X(weight_decay) \
  X(inv_bc1) X(inv_bc2) X(inv_bc1_next) X(grad_scale)

struct AdamScalars {
#define JZO_SCALAR_FIELD(name) float name;
  JZO_ADAM_SCALARS(JZO_SCALAR_FIELD)
#undef JZO_SCALAR_FIELD
  bool nesterov;
};

#define JZO_COUNT_ONE(name) +1
constexpr int kNumAdamScalars = 0 JZO_ADAM_SCALARS(JZO_COUNT_ONE);
#undef JZO_COUNT_ONE

// The scalars from c[0 .. kNumAdamScalars), in the list's order.
inline AdamScalars adam_scalars_from(const float* c, bool nesterov) {
  AdamScalars s{};
  int i = 0;
#define JZO_READ_SCALAR(name) s.name = c[i++];
  JZO_ADAM_SCALARS(JZO_READ_SCALAR)
#undef JZO_READ_SCALAR
  s.nesterov = nesterov;
  return s;
}

struct AdamBuffers {
  int64_t n = 0;                     // elements in every buffer
  const void* grad = nullptr;        // read
  DType grad_dtype = DType::kF32;    // f32, bf16 or f16
  void* mu = nullptr;                // read and written
  DType mu_dtype = DType::kF32;      // f32, bf16 or q8 (then nu is q8 too)
  void* nu = nullptr;                // read and written
  DType nu_dtype = DType::kF32;      // f32, bf16 or q8 (then mu is q8 too)
  float* mu_scale = nullptr;         // q8: quant_blocks(n) scales of mu, read and written
  float* nu_scale = nullptr;         // q8: the same for nu
  int64_t row = 0;                   // q8: elements per row (the last axis); blocks restart
                                     // at each row, quant_blocks(row) scales a row
  float* param = nullptr;            // f32; read for weight decay, written if update_param
  bool update_param = false;         // param += update in place
  float* update_out = nullptr;       // f32 update, when not applied in place
  bool moments_only = false;         // write m and v only: the caller forms the update
  void* lowp_out = nullptr;          // optional low-precision copy of the new param; may be grad
  DType lowp_dtype = DType::kBF16;   // bf16 or f16
};

// Runs elements [begin, end) with the SIMD level chosen at run time.
// Results do not depend on how [0, n) is split into ranges; with q8 moments
// the ranges must hold whole blocks (begin at a block's start).
void adam_range(const AdamBuffers& b, const AdamScalars& s, int64_t begin,
                int64_t end);

// Name of the instruction set adam_range uses: "avx512", "avx2" or "scalar".
const char* simd_level();

// Restricts the dispatch to at most `level` (for tests and benchmarks);
// returns false if the CPU lacks it or the name is unknown.
bool set_simd_level(const char* level);

// How the AVX-512 kernel finds the int8 codes it writes (quant8.h): by a
// gather from the index, or computed from the map's parts. The codes are the
// same; the speed is not: the gather is slow on AMD's Zen 4, while on the
// GPU machines' Xeons the computed codes were mostly the slower on all
// threads (not on one: two hyperthreads share the vector units, which the
// gather leaves freer), so the choice is timed, not fixed. Unless set
// (JZO_INT8_CODES or set_int8_codes), the first int8 step times both on all
// its threads (host_ops.h) and keeps the faster.
bool quant8_gathers();
// "gather", "computed", or "unchosen" before that first step.
const char* int8_codes();
// Sets the way ("gather" or "computed"); false if the name is unknown.
bool set_int8_codes(const char* way);

// The kernel asks for its arrays' lines a little ahead of its loop (the
// int8 pass: the next block's) when they hold more bytes than this (all of
// them together, n times the bytes of an element of each; default 32 MiB).
// From memory that ran the float-moment pass 1-10% faster on the 2-core EPYC
// and 4-6% on the 16-core Xeon; from the EPYC's cache, 5-9% slower (the
// extra instructions).
int64_t prefetch_above();
// Sets that bound, in bytes (tests and benchmarks: 0 always prefetches, -1 never).
void set_prefetch_above(int64_t bytes);

namespace isa {
// One entry point per instruction set, each compiled in its own translation
// unit with its own target flags.
void adam_range_scalar(const AdamBuffers&, const AdamScalars&, int64_t, int64_t);
void adam_range_avx2(const AdamBuffers&, const AdamScalars&, int64_t, int64_t);
void adam_range_avx512(const AdamBuffers&, const AdamScalars&, int64_t, int64_t);
}  // namespace isa

}  // namespace jzo
