// 8-bit block-wise dynamic quantization of the Adam moments (Dettmers et al.,
// "8-bit Optimizers via Block-wise Quantization", ICLR 2022).
//
// A moment array of n values is stored as n one-byte codes and one float32
// scale per block of kQuantBlock values: the block's largest magnitude
// (absmax). A value is scale * map.code[c].
//
// The maps are dynamic tree maps: a decade exponent (10^-6 .. 10^0) and a
// linear fraction in [0.1, 1] whose bits grow with the exponent, so small
// values keep their relative precision and large ones get the most steps.
//   signed (mu):   code = sign << 7 | magnitude, 128 magnitudes:
//                  0, then 1, 2, 4, ..., 64 fractions in the decades
//                  10^-6 .. 10^0; the largest is 1 (the absmax itself).
//   unsigned (nu): 256 values: 0, then 2, 4, ..., 64 fractions in the
//                  decades 10^-6 .. 10^-1 and 129 in 10^0; the largest is 1.
//
// Quantizing x >= 0 (a magnitude divided by the scale, at most 1) picks the
// nearest value: c = the number of midpoints between consecutive values that
// are < x (a tie goes to the lower value). It takes one table lookup: within
// the range of one bfloat16 pattern (the top 16 bits of x) lies at most one
// midpoint, so `index[top 16 bits]` holds the code at the range's start and
// the low 16 bits of that midpoint (0xFFFF: none), and x's low 16 bits
// decide. Every instruction set computes the same bits.
#pragma once

#include <cstdint>

namespace jzo {

// Values a scale covers; a thread's chunk (kAdamChunk) holds whole blocks.
constexpr int kQuantBlock = 256;

// Top-16-bit patterns of the floats in [0, 1]: 0x0000 .. 0x3F80 (1.0f).
constexpr int kQuantIndexSize = 0x3F81;

struct Quant8Map {
  float code[256];                   // dequantized value of each code
  uint32_t index[kQuantIndexSize];   // code << 16 | low 16 bits of the midpoint in range
  float mid[255];                    // midpoints between consecutive magnitudes, ascending
  int num_mid;                       // 127 signed, 255 unsigned
  bool is_signed;
};

const Quant8Map& quant8_signed();    // the first moment's map
const Quant8Map& quant8_unsigned();  // the second moment's map

// Blocks of an array of n values.
inline int64_t quant_blocks(int64_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

}  // namespace jzo
