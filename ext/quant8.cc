#include "quant8.h"

#include <cstring>
#include <stdexcept>
#include <vector>

namespace jzo {
namespace {

// The magnitudes of a dynamic tree map with `decades` decades, ascending:
// 0, then magnitude i in 1 .. 2^decades - 1 is the middle of step i - 2^e of
// 2^e equal steps over [0.1, 1] in the decade 10^(e + 1 - decades), e the
// position of i's top bit; the largest is replaced by 1. They are computed
// as dequant8 computes them (float32, one fused multiply-add), so the table
// and the arithmetic agree to the bit.
std::vector<float> magnitudes(int decades, const float* decade) {
  std::vector<float> out = {0.0f};
  for (int i = 1; i < (1 << decades); ++i) {
    const float r = static_cast<float>(2 * i + 1);  // (i + 0.5) * 2, exact
    int e = 0;
    while ((2 << e) <= i) ++e;
    const float in_decade = r / static_cast<float>(2 << e);  // (i + 0.5) / 2^e, in [1, 2)
    out.push_back(decade[e] * __builtin_fmaf(0.9f, in_decade, -0.8f));
  }
  out.back() = 1.0f;
  return out;
}

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// The parts of [0, 1] (quant8.h) for a map of n magnitudes: bounded by the
// midpoints below decade 0's value, between decades and below 1.
void build_parts(Quant8Map& map, int n) {
  std::vector<float> bounds = {map.mid[0]};
  for (int e = 1; e < map.decades; ++e) bounds.push_back(map.mid[(1 << e) - 1]);
  bounds.push_back(map.mid[n - 2]);
  const int parts = static_cast<int>(bounds.size()) + 1;
  for (int part = 0; part < 16; ++part) {  // code 0, then (if used) decade 0's one code
    map.part_a[part] = 0.0f;
    map.part_b[part] = part == 1 ? 0.5f : -0.5f;
    map.part_top[part] = part == 1 ? 1 : 0;
  }
  for (int e = 1; e < map.decades; ++e) {  // decade e: code 2^e + j over (j, j + 1] in steps
    const double steps = 1 << e;
    map.part_a[e + 1] = static_cast<float>(steps / (0.9 * map.decade[e]));
    map.part_b[e + 1] = static_cast<float>(steps - 1 - steps / 9);
    map.part_top[e + 1] = e + 1 == map.decades ? n - 2 : (2 << e) - 1;
  }
  map.part_b[parts - 1] = static_cast<float>(n - 1) - 0.5f;  // 1 itself
  map.part_top[parts - 1] = n - 1;
  const uint32_t lowest = kQuantIndexBase >> 7;  // biased exponent of 2^-27
  for (uint32_t exponent = lowest; exponent <= 127; ++exponent) {
    const uint32_t start = exponent << 23, end = (exponent + 1) << 23;
    int below = 0, inside = 0;
    float bound = __builtin_inff();
    for (const float b : bounds) {
      if (bits_of(b) < start) ++below;
      else if (bits_of(b) < end) ++inside, bound = b;
    }
    if (inside > 1) throw std::logic_error("quant8: two part boundaries in one octave");
    map.octave_bound[exponent & 31] = bound;
    map.octave_part[exponent & 31] = below;
  }
}

Quant8Map build(bool is_signed) {
  Quant8Map map{};
  map.is_signed = is_signed;
  map.decades = is_signed ? 7 : 8;
  for (int e = 0; e < map.decades; ++e) {
    double d = 1.0;
    for (int k = e + 1; k < map.decades; ++k) d /= 10.0;
    map.decade[e] = static_cast<float>(d);
  }
  const std::vector<float> mag = magnitudes(map.decades, map.decade);
  const int n = static_cast<int>(mag.size());  // 128 signed, 256 unsigned
  for (int c = 0; c < 256; ++c) {
    const float value = mag[is_signed ? c & 127 : c];
    map.code[c] = is_signed && c >= 128 ? -value : value;
  }
  std::vector<uint32_t> mid_bits(n - 1);
  map.num_mid = n - 1;
  for (int k = 0; k + 1 < n; ++k) {
    map.mid[k] = static_cast<float>((double{mag[k]} + mag[k + 1]) / 2);
    mid_bits[k] = bits_of(map.mid[k]);
  }
  // The second moment's code 0 stands for the middle of what it rounds
  // (0 up to the first midpoint): decoded as 0, an element whose gradient
  // stopped would divide its first moment by eps alone.
  if (!is_signed) map.code[0] = map.mid[0] / 2;
  // For positive floats the bit patterns order as the values do.
  int below = 0;  // midpoints below the current range's start
  if (mid_bits[0] < kQuantIndexBase << 16)
    throw std::logic_error("quant8: the index starts above the first midpoint");
  for (uint32_t top = kQuantIndexBase; top < kQuantIndexBase + kQuantIndexSize; ++top) {
    const uint32_t start = top << 16, end = start + 0x10000;
    while (below < n - 1 && mid_bits[below] < start) ++below;
    uint32_t entry = static_cast<uint32_t>(below) << 16;
    if (below < n - 1 && mid_bits[below] < end) {
      if (below + 1 < n - 1 && mid_bits[below + 1] < end)
        throw std::logic_error("quant8: two midpoints in one bfloat16 range");
      entry |= 0xFFFF - (mid_bits[below] & 0xFFFF);
    }
    map.index[top - kQuantIndexBase] = entry;
  }
  build_parts(map, n);
  return map;
}

}  // namespace

const Quant8Map& quant8_signed() {
  static const Quant8Map map = build(true);
  return map;
}

const Quant8Map& quant8_unsigned() {
  static const Quant8Map map = build(false);
  return map;
}

}  // namespace jzo
