// Scalar conversions of the reference: OCP e4m3fn and bfloat16, both round-to-nearest-even.
//
// Both encoders first round the double to the target's grid in double (one rounding, so no double
// rounding through float) and then read the bits of the exactly representable result.
#include <bit>
#include <cmath>
#include <cstdint>

#include "reference.h"

namespace mla::ref {
namespace {

constexpr int kE4m3MinNormalExponent = -6;  // 2^-6: smallest normal e4m3
constexpr int kE4m3MantissaBits = 3;
constexpr int kE4m3ExponentBias = 7;
constexpr uint8_t kE4m3NaN = 0x7f;          // e4m3fn has no infinity; S.1111.111 is NaN
constexpr uint8_t kE4m3MaxCode = 0x7e;      // 448 = 1.75 * 2^8

constexpr int kBf16MinNormalExponent = -126;
constexpr int kBf16MantissaBits = 7;
constexpr uint16_t kBf16QuietNaN = 0x7fc0;
constexpr uint16_t kBf16Infinity = 0x7f80;
constexpr double kBf16Max = 0x1.fep127;  // (2 - 2^-7) * 2^127

// Rounds |x| (finite, > 0) to the binary grid with `mantissa_bits` fraction bits and the given
// smallest normal exponent (below it the grid spacing stays that of the subnormals). nearbyint uses
// the default round-to-nearest-even mode.
double round_to_grid(double magnitude, int mantissa_bits, int min_normal_exponent) {
  int exponent = std::ilogb(magnitude);
  if (exponent < min_normal_exponent) exponent = min_normal_exponent;
  const int ulp_exponent = exponent - mantissa_bits;
  return std::ldexp(std::nearbyint(std::ldexp(magnitude, -ulp_exponent)), ulp_exponent);
}

}  // namespace

uint8_t e4m3_from_double(double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return sign | kE4m3NaN;
  const double magnitude = std::fabs(x);
  if (magnitude == 0) return sign;
  // Saturating: everything that rounds above 448 (infinity included) becomes 448.
  if (magnitude >= kE4m3Max) return sign | kE4m3MaxCode;
  const double rounded = round_to_grid(magnitude, kE4m3MantissaBits, kE4m3MinNormalExponent);
  if (rounded == 0) return sign;
  if (rounded >= kE4m3Max) return sign | kE4m3MaxCode;
  const int exponent = std::ilogb(rounded);
  if (exponent < kE4m3MinNormalExponent) {  // subnormal: 0.mmm * 2^-6
    const int mantissa = static_cast<int>(std::ldexp(rounded, -kE4m3MinNormalExponent + kE4m3MantissaBits));
    return sign | static_cast<uint8_t>(mantissa);
  }
  const int mantissa =
      static_cast<int>(std::ldexp(rounded, kE4m3MantissaBits - exponent)) - (1 << kE4m3MantissaBits);
  return sign | static_cast<uint8_t>(((exponent + kE4m3ExponentBias) << kE4m3MantissaBits) | mantissa);
}

double e4m3_to_double(uint8_t code) {
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  const int exponent_field = (code >> kE4m3MantissaBits) & 0xf;
  const int mantissa = code & 0x7;
  if ((code & 0x7f) == kE4m3NaN) return std::nan("");
  if (exponent_field == 0) {
    return sign * std::ldexp(mantissa, kE4m3MinNormalExponent - kE4m3MantissaBits);
  }
  return sign * std::ldexp((1 << kE4m3MantissaBits) + mantissa,
                           exponent_field - kE4m3ExponentBias - kE4m3MantissaBits);
}

uint16_t bf16_from_double(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0x0000;
  if (std::isnan(x)) return sign | kBf16QuietNaN;
  if (std::isinf(x) || x == 0) {
    return static_cast<uint16_t>(std::bit_cast<uint32_t>(static_cast<float>(x)) >> 16);
  }
  const double rounded = round_to_grid(std::fabs(x), kBf16MantissaBits, kBf16MinNormalExponent);
  // RNE overflows to infinity past the largest bf16; checked here because a double beyond float's
  // range must not reach the cast below.
  if (rounded > kBf16Max) return sign | kBf16Infinity;
  // The rounded value has at most 8 significant bits and lies in float's range: the cast is exact.
  const float as_float = static_cast<float>(std::copysign(rounded, x));
  return static_cast<uint16_t>(std::bit_cast<uint32_t>(as_float) >> 16);
}

}  // namespace mla::ref
