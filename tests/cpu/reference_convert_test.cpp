// The reference's scalar conversions: every e4m3 code, every rounding boundary cross-checked bit for
// bit against CUDA's host conversions, and bf16 round trips and ties.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "reference.h"

namespace mla::ref {
namespace {

bool is_e4m3_nan(uint8_t code) { return (code & 0x7f) == 0x7f; }

uint8_t cuda_e4m3(double x) {
  return static_cast<uint8_t>(__nv_cvt_double_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}
uint8_t cuda_e4m3(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// Both CUDA encoders and ours agree on x; NaN codes compare as "both NaN" (CUDA writes 0x7f for any).
void expect_matches_cuda(double x) {
  const uint8_t ours = e4m3_from_double(x);
  const uint8_t from_double = cuda_e4m3(x);
  if (is_e4m3_nan(from_double)) {
    EXPECT_TRUE(is_e4m3_nan(ours)) << "x = " << x;
    return;
  }
  EXPECT_EQ(ours, from_double) << "x = " << std::hexfloat << x;
  const float as_float = static_cast<float>(x);
  if (static_cast<double>(as_float) == x) {
    EXPECT_EQ(e4m3_from_double(as_float), cuda_e4m3(as_float)) << "x = " << std::hexfloat << x;
  }
}

TEST(RefE4m3, DecodesEveryCodeLikeCuda) {
  for (int code = 0; code < 256; ++code) {
    __nv_fp8_e4m3 fp8;
    fp8.__x = static_cast<__nv_fp8_storage_t>(code);
    const double cuda_value = static_cast<double>(static_cast<float>(fp8));
    const double value = e4m3_to_double(static_cast<uint8_t>(code));
    if (is_e4m3_nan(static_cast<uint8_t>(code))) {
      EXPECT_TRUE(std::isnan(value)) << code;
      EXPECT_TRUE(std::isnan(cuda_value)) << code;
    } else {
      EXPECT_EQ(value, cuda_value) << "code 0x" << std::hex << code;
      EXPECT_EQ(std::signbit(value), (code & 0x80) != 0) << code;
    }
  }
}

TEST(RefE4m3, KnownCodes) {
  EXPECT_EQ(e4m3_to_double(0x00), 0.0);
  EXPECT_TRUE(std::signbit(e4m3_to_double(0x80)));
  EXPECT_EQ(e4m3_to_double(0x01), std::ldexp(1.0, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_double(0x07), 7 * std::ldexp(1.0, -9));
  EXPECT_EQ(e4m3_to_double(0x08), std::ldexp(1.0, -6));  // smallest normal
  EXPECT_EQ(e4m3_to_double(0x38), 1.0);
  EXPECT_EQ(e4m3_to_double(0x39), 1.125);
  EXPECT_EQ(e4m3_to_double(0x7e), 448.0);
  EXPECT_EQ(e4m3_to_double(0xfe), -448.0);
  EXPECT_TRUE(std::isnan(e4m3_to_double(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_double(0xff)));
}

TEST(RefE4m3, EveryCodeReencodesToItself) {
  for (int code = 0; code < 256; ++code) {
    const uint8_t c = static_cast<uint8_t>(code);
    const uint8_t again = e4m3_from_double(e4m3_to_double(c));
    if (is_e4m3_nan(c)) {
      EXPECT_TRUE(is_e4m3_nan(again)) << code;
    } else {
      EXPECT_EQ(again, c) << "code 0x" << std::hex << code;
    }
  }
}

TEST(RefE4m3, MatchesCudaAtEveryMidpoint) {
  for (int code = 0; code < 0x7e; ++code) {
    const double low = e4m3_to_double(static_cast<uint8_t>(code));
    const double high = e4m3_to_double(static_cast<uint8_t>(code + 1));
    const double mid = (low + high) / 2;
    for (double sign : {1.0, -1.0}) {
      for (double x : {low, mid, high, std::nextafter(mid, 0.0), std::nextafter(mid, 1e9),
                       mid * (1 + 1e-9), mid * (1 - 1e-9)}) {
        expect_matches_cuda(sign * x);
      }
    }
  }
}

TEST(RefE4m3, MidpointTiesGoToEven) {
  EXPECT_EQ(e4m3_from_double(1.0625), 0x38);   // between 1 (0x38, even) and 1.125 (0x39)
  EXPECT_EQ(e4m3_from_double(1.1875), 0x3a);   // between 1.125 (0x39) and 1.25 (0x3a, even)
  EXPECT_EQ(e4m3_from_double(std::nextafter(1.0625, 2.0)), 0x39);
  EXPECT_EQ(e4m3_from_double(-1.1875), 0xba);
  EXPECT_EQ(e4m3_from_double(432.0), 0x7e);    // between 416 (0x7d) and 448 (0x7e, even)
  EXPECT_EQ(e4m3_from_double(15 * std::ldexp(1.0, -10)), 0x08);  // 7.5 subnormal steps: up to 2^-6
}

TEST(RefE4m3, SaturatesBeyond448) {
  const double inf = std::numeric_limits<double>::infinity();
  for (double x : {448.0, 449.0, 463.9, 464.0, 480.0, 1e6, 1e300, inf}) {
    EXPECT_EQ(e4m3_from_double(x), 0x7e) << x;
    EXPECT_EQ(e4m3_from_double(-x), 0xfe) << x;
    expect_matches_cuda(x);
    expect_matches_cuda(-x);
  }
}

TEST(RefE4m3, SubnormalsAndSignedZeros) {
  const double step = std::ldexp(1.0, -9);
  EXPECT_EQ(e4m3_from_double(0.0), 0x00);
  EXPECT_EQ(e4m3_from_double(-0.0), 0x80);
  EXPECT_EQ(e4m3_from_double(0.5 * step), 0x00);   // tie with 0: even
  EXPECT_EQ(e4m3_from_double(-0.5 * step), 0x80);  // underflow keeps the sign
  EXPECT_EQ(e4m3_from_double(0.50001 * step), 0x01);
  EXPECT_EQ(e4m3_from_double(1.5 * step), 0x02);   // tie between 1 and 2 steps: even
  EXPECT_EQ(e4m3_from_double(2.5 * step), 0x02);
  EXPECT_EQ(e4m3_from_double(1e-300), 0x00);
  for (double x : {0.0, -0.0, 0.25 * step, 0.5 * step, 0.75 * step, 1.5 * step, 6.5 * step, 7.5 * step,
                   1e-300, std::numeric_limits<double>::denorm_min()}) {
    expect_matches_cuda(x);
    expect_matches_cuda(-x);
  }
}

TEST(RefE4m3, NaNStaysNaNWithItsSign) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(e4m3_from_double(nan), 0x7f);
  EXPECT_EQ(e4m3_from_double(-nan), 0xff);
  EXPECT_TRUE(is_e4m3_nan(cuda_e4m3(nan)));
}

TEST(RefE4m3, RandomValuesMatchCuda) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> log_magnitude(-14.0, 10.0);
  for (int n = 0; n < 200000; ++n) {
    const double x = std::exp2(log_magnitude(rng)) * ((n & 1) ? -1.0 : 1.0);
    expect_matches_cuda(x);
    if (::testing::Test::HasFailure()) break;  // one counterexample is enough
  }
}

TEST(RefBf16, EveryPatternRoundTrips) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t b = static_cast<uint16_t>(bits);
    const double value = bf16_to_double(b);
    const float expected = std::bit_cast<float>(bits << 16);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(value)) << bits;
      EXPECT_TRUE(std::isnan(bf16_to_double(bf16_from_double(value)))) << bits;
    } else {
      EXPECT_EQ(value, static_cast<double>(expected)) << bits;
      EXPECT_EQ(bf16_from_double(value), b) << "bits 0x" << std::hex << bits;
    }
  }
}

TEST(RefBf16, TiesToEvenAndSingleRounding) {
  const double ulp = std::ldexp(1.0, -7);  // bf16 spacing in [1, 2)
  EXPECT_EQ(bf16_round(1 + ulp / 2), 1.0);                      // tie: down to even 1.0
  EXPECT_EQ(bf16_round(1 + 3 * ulp / 2), 1 + 2 * ulp);          // tie: up to even
  EXPECT_EQ(bf16_round(std::nextafter(1 + ulp / 2, 2.0)), 1 + ulp);
  // 1 + ulp/2 + 2^-40 rounds to the float tie 1 + ulp/2 first and then to 1.0 if converted through
  // float; rounding once goes up.
  EXPECT_EQ(bf16_round(1 + ulp / 2 + std::ldexp(1.0, -40)), 1 + ulp);
  EXPECT_EQ(bf16_from_double(-0.0), 0x8000);
  EXPECT_EQ(bf16_from_double(1e-50), 0x0000);  // below half the smallest subnormal (2^-133)
  EXPECT_EQ(bf16_from_double(std::ldexp(1.0, -133)), 0x0001);
  EXPECT_EQ(bf16_from_double(std::ldexp(3.0, -134)), 0x0002);  // subnormal tie between 1 and 2: even
}

TEST(RefBf16, OverflowInfinityAndNaN) {
  const double max = bf16_to_double(0x7f7f);
  EXPECT_EQ(bf16_from_double(max), 0x7f7f);
  EXPECT_EQ(bf16_from_double(std::nextafter(max + std::ldexp(1.0, 119), 0.0)), 0x7f7f);
  EXPECT_EQ(bf16_from_double(max + std::ldexp(1.0, 119)), 0x7f80);  // the tie rounds to even: infinity
  EXPECT_EQ(bf16_from_double(1e300), 0x7f80);
  EXPECT_EQ(bf16_from_double(-1e300), 0xff80);
  EXPECT_EQ(bf16_from_double(std::numeric_limits<double>::infinity()), 0x7f80);
  EXPECT_TRUE(std::isnan(bf16_to_double(bf16_from_double(std::nan("")))));
  EXPECT_EQ(bf16_from_double(-std::numeric_limits<double>::quiet_NaN()) & 0x8000, 0x8000);
}

TEST(RefBf16, MatchesCudaForFloats) {
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<uint32_t> bits;
  for (int n = 0; n < 200000; ++n) {
    const float x = std::bit_cast<float>(bits(rng));
    if (std::isnan(x)) continue;
    const __nv_bfloat16 cuda = __float2bfloat16_rn(x);
    EXPECT_EQ(bf16_from_double(x), std::bit_cast<uint16_t>(cuda)) << std::hexfloat << x;
    if (::testing::Test::HasFailure()) break;
  }
}

}  // namespace
}  // namespace mla::ref
