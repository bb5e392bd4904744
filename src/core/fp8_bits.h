// Bit-level helpers on packed e4m3 bytes, shared by the core's kernels (kernel.cuh) and checked on the CPU over every
// byte value (tests/cpu/core_fp8_bits_test.cpp).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MLA_CORE_FP8_BITS_FN __host__ __device__ __forceinline__
#else
#define MLA_CORE_FP8_BITS_FN inline
#endif

namespace mla::core {

// Each e4m3 NaN byte (0x7f, 0xff) of a word set to 0, every other byte unchanged.
MLA_CORE_FP8_BITS_FN uint32_t e4m3_nan_to_zero(uint32_t w) {
  const uint32_t nan = ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;  // bit 7 of each byte whose low 7 bits are 1
  return w & ~((nan >> 7) * 0xffu);
}

}  // namespace mla::core
