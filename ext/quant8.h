// 8-bit block-wise dynamic quantization of the Adam moments (Dettmers et al.,
// "8-bit Optimizers via Block-wise Quantization", ICLR 2022).
//
// A moment array of n values is stored as n one-byte codes and one float32
// scale per block of kQuantBlock values: the block's largest magnitude
// (absmax). A value is scale * map.code[c].
//
// The maps are dynamic tree maps: a decade exponent and a linear fraction in
// [0.1, 1] whose bits grow with the exponent, so small values keep their
// relative precision and large ones get the most steps. Magnitude i >= 1
// lies in decade e = (position of i's top bit): value
// decade[e] * (0.9 * (i + 0.5) / 2^e - 0.8), the middle of step i - 2^e of
// 2^e equal steps over [0.1, 1]; magnitude 0 is 0 and the largest is 1 (the
// absmax itself). So a code decodes in a few vector operations, no lookup.
//   signed (mu):   code = sign << 7 | magnitude, 128 magnitudes in the
//                  7 decades 10^-6 .. 10^0 (1, 2, 4, ..., 64 values).
//   unsigned (nu): 256 magnitudes in the 8 decades 10^-7 .. 10^0; code 0
//                  decodes to half the first midpoint (the middle of what
//                  rounds to it), not 0: a second moment under 2.75e-8 of
//                  its block's largest, decoded as 0, would leave an element
//                  whose gradient stopped an update of m / eps, up to tens of
//                  times the learning rate where Adam's is at most about 1.
//
// Quantizing x >= 0 (a magnitude divided by the scale, at most 1) picks the
// nearest value: c = the number of midpoints between consecutive values that
// are < x (a tie goes to the lower value). It takes one table lookup: within
// the range of one bfloat16 pattern (the top 16 bits of x) lies at most one
// midpoint, so `index[top 16 bits - base]` holds the code at the range's start
// (high 16 bits) and 0xFFFF less the low 16 bits of that midpoint (0: none):
// adding x's low 16 bits carries into the code exactly where x is above the
// midpoint (quant8_exact). Every instruction set computes the same bits.
//
// The AVX-512 kernel can also find most codes without that lookup (on AMD's
// Zen 4 the vector gather took a third of the int8 pass; on Intel's Sapphire
// Rapids on all threads the gather is the faster: adam_kernel.h's
// quant8_gathers chooses per process): the midpoints
// between decades, and the last one (below 1), split [0, 1] into parts; in
// the part of decade e the midpoints are equally spaced, so the code is
// ceil(a x + b), capped at the part's top code. Each binary octave of x holds
// at most one part boundary: the part comes from x's exponent through two
// in-register tables and one comparison. Float32 rounding can move a code
// across a midpoint only where a x + b lies within kQuantUnsure of an integer:
// those values (1 in 4096 where a x + b is spread evenly) are redone by
// quant8_exact. tests/quant8_exhaustive.cc checks the kernel's codes on
// every float32 in [0, 1]; they stay exact down to a margin of 2^-16.
#pragma once

#include <cstdint>
#include <cstring>

namespace jzo {

// Values a scale covers; a thread's chunk (kAdamChunk) holds whole blocks.
constexpr int kQuantBlock = 256;

// Top-16-bit patterns the index covers: 0x3200 (2^-27, below half the
// smallest value, so everything under it is code 0) .. 0x3F80 (1.0f): 14 KB,
// which stays in the L1 cache beside the streamed arrays.
constexpr uint32_t kQuantIndexBase = 0x3200;
constexpr int kQuantIndexSize = 0x3F81 - kQuantIndexBase;

// Distance of a x + b from an integer below which a code is redone exactly.
constexpr float kQuantUnsure = 1.0f / 8192;

struct Quant8Map {
  float code[256];                   // dequantized value of each code
  uint32_t index[kQuantIndexSize];   // by top 16 bits - kQuantIndexBase: code << 16 |
                                     // 0xFFFF - low 16 bits of the midpoint in range (0: none)
  float mid[255];                    // midpoints between consecutive magnitudes, ascending
  int num_mid;                       // 127 signed, 255 unsigned
  float decade[16];                  // decade[e] = 10^(e + 1 - decades); 0 past the last
  int decades;                       // 7 signed, 8 unsigned
  bool is_signed;
  // The parts (above): by octave slot, the biased exponent & 31 of x in
  // [2^-27, 1] (below 2^-27 all is code 0, the slot of 2^-27):
  float octave_bound[32];            // the part boundary inside the octave, else +inf
  int32_t octave_part[32];           // the part of the octave's smallest value
  // By part: x's code is min(ceil(part_a x + part_b), part_top); part 0 is
  // code 0 (below the first midpoint), the last part code 255 or 127.
  float part_a[16];
  float part_b[16];
  int32_t part_top[16];
};

const Quant8Map& quant8_signed();    // the first moment's map
const Quant8Map& quant8_unsigned();  // the second moment's map

// The nearest code of y (quantizing by the index): the magnitude of y,
// clamped to 1 (NaN too), and for the signed map y's sign as the top bit.
inline uint8_t quant8_exact(float y, const Quant8Map& map) {
  uint32_t bits;
  std::memcpy(&bits, &y, 4);
  const uint32_t mag = bits & 0x7fffffffu;
  uint32_t top = (mag >> 16) < 0x3F80u ? mag >> 16 : 0x3F80u;
  top = top > kQuantIndexBase ? top - kQuantIndexBase : 0u;
  uint32_t k = (map.index[top] + (mag & 0xFFFFu)) >> 16;
  if (map.is_signed) k |= (bits >> 24) & 0x80u;
  return static_cast<uint8_t>(k);
}

// Blocks of an array of n values.
inline int64_t quant_blocks(int64_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

}  // namespace jzo
