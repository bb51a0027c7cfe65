#include "quant8.h"

#include <cstring>
#include <stdexcept>
#include <vector>

namespace jzo {
namespace {

// The `count` magnitudes of a dynamic tree map, ascending: 0, then for each
// decade 10^(e - 6), e = 0 .. 5, `first << e` values at the middles of
// equal steps over [0.1, 1], and the rest in the decade 10^0, the largest of
// them replaced by 1.
std::vector<double> magnitudes(int first, int count) {
  std::vector<double> out = {0.0};
  for (int e = 0; e <= 6; ++e) {
    const int n = e < 6 ? first << e : count - static_cast<int>(out.size());
    double decade = 1.0;
    for (int k = e; k < 6; ++k) decade /= 10.0;
    for (int k = 0; k < n; ++k) out.push_back(decade * (0.1 + 0.9 * (k + 0.5) / n));
  }
  out.back() = 1.0;
  return out;
}

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

Quant8Map build(bool is_signed) {
  const std::vector<double> mag = is_signed ? magnitudes(1, 128) : magnitudes(2, 256);
  const int n = static_cast<int>(mag.size());  // 128 signed, 256 unsigned
  Quant8Map map{};
  map.is_signed = is_signed;
  for (int c = 0; c < 256; ++c) {
    const int k = is_signed ? c & 127 : c;
    const float value = static_cast<float>(mag[k]);
    map.code[c] = is_signed && c >= 128 ? -value : value;
  }
  std::vector<uint32_t> mid_bits(n - 1);
  map.num_mid = n - 1;
  for (int k = 0; k + 1 < n; ++k) {
    map.mid[k] = static_cast<float>((mag[k] + mag[k + 1]) / 2);
    mid_bits[k] = bits_of(map.mid[k]);
  }
  // For positive floats the bit patterns order as the values do.
  int below = 0;  // midpoints below the current range's start
  for (uint32_t top = 0; top < kQuantIndexSize; ++top) {
    const uint32_t start = top << 16, end = start + 0x10000;
    while (below < n - 1 && mid_bits[below] < start) ++below;
    uint32_t entry = static_cast<uint32_t>(below) << 16 | 0xFFFF;
    if (below < n - 1 && mid_bits[below] < end) {
      if (below + 1 < n - 1 && mid_bits[below + 1] < end)
        throw std::logic_error("quant8: two midpoints in one bfloat16 range");
      entry = static_cast<uint32_t>(below) << 16 | (mid_bits[below] & 0xFFFF);
    }
    map.index[top] = entry;
  }
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
