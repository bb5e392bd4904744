// The core's e4m3 byte helpers (core/fp8_bits.h), without a GPU: every byte value in every position of a word.
#include <gtest/gtest.h>

#include <cstdint>

#include "core/fp8_bits.h"

namespace mla::core {
namespace {

TEST(E4m3NanToZero, ZeroesExactlyTheNanBytes) {
  for (int position = 0; position < 4; ++position) {
    for (uint32_t byte = 0; byte < 256; ++byte) {
      // The byte under test among neighbours that are NaN and not: no carry or mask may reach them.
      for (const uint32_t others : {0x00000000u, 0x7f7f7f7fu, 0xffffffffu, 0x7e80fe01u}) {
        const uint32_t shift = 8 * position;
        const uint32_t w = (others & ~(0xffu << shift)) | (byte << shift);
        uint32_t expected = 0;
        for (int b = 0; b < 4; ++b) {
          const uint32_t x = (w >> (8 * b)) & 0xffu;
          if ((x & 0x7fu) != 0x7fu) expected |= x << (8 * b);  // 0x7f and 0xff are e4m3's NaNs
        }
        ASSERT_EQ(e4m3_nan_to_zero(w), expected) << std::hex << "word 0x" << w;
      }
    }
  }
}

}  // namespace
}  // namespace mla::core
