// The e4m3 -> f16 conversion rate per SM (src/core/README.md: the core converts every page's K and V
// bytes): the hardware conversion (cvt.rn.f16x2.e4m3x2, SASS F2FP.F16.E4M3.UNPACK_B) against a bit
// trick of four integer instructions (value x 2^-8, exact for every non-NaN pair, checked here on all
// 65,536 byte pairs), and half of each.
//
//   cvt_bench
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <exception>

#include "common/cuda_check.h"

namespace {

__device__ __forceinline__ uint32_t convert_hardware(uint32_t w) {
  uint32_t r;
  asm volatile("{.reg .b16 l; mov.b32 {l, _}, %1; cvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(r) : "r"(w));
  return r;
}

// Bytes 0 and 1 of w to the low bytes of two halves, shifted into f16's exponent and mantissa fields
// (e4m3's bias 7 against f16's 15: the value times 2^-8, subnormals included); adding bit 14 to itself
// moves the sign from bit 14 to bit 15.
__device__ __forceinline__ uint32_t convert_bits(uint32_t w) {
  uint32_t t;
  asm volatile("prmt.b32 %0, %1, 0, 0x4140;" : "=r"(t) : "r"(w));
  const uint32_t x = t << 7;
  return x + (x & 0x40004000u);
}

enum Mode { kHardware, kBits, kHalfEach };

template <Mode kMode>
__global__ void rate_kernel(uint32_t* sink, long long* cycles, int iterations) {
  uint32_t v[8];
  for (int i = 0; i < 8; ++i) v[i] = threadIdx.x * 2654435761u + i;
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < iterations; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const bool bits = kMode == kBits || (kMode == kHalfEach && i % 2 == 1);
      v[i] ^= bits ? convert_bits(v[i]) : convert_hardware(v[i]);  // one xor per conversion keeps the chains
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  uint32_t acc = 0;
  for (int i = 0; i < 8; ++i) acc ^= v[i];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

__global__ void check_kernel(uint32_t* mismatches) {
  const uint32_t w = blockIdx.x * 256 + threadIdx.x;
  if ((w & 0x7F) == 0x7F || ((w >> 8) & 0x7F) == 0x7F) return;  // NaN encodings
  const uint32_t h = convert_hardware(w), b = convert_bits(w);
  const __half2 hh = *reinterpret_cast<const __half2*>(&h), bb = *reinterpret_cast<const __half2*>(&b);
  const float x0 = __low2float(hh), x1 = __high2float(hh);
  const float y0 = __low2float(bb) * 256.f, y1 = __high2float(bb) * 256.f;
  if (x0 != y0 || x1 != y1 || signbit(x0) != signbit(y0) || signbit(x1) != signbit(y1)) atomicAdd(mismatches, 1u);
}

}  // namespace

int main() {
  try {
    int sms = 0;
    MLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    uint32_t* sink;
    long long* cycles;
    uint32_t* mismatches;
    MLA_CUDA_CHECK(cudaMalloc(&sink, size_t(sms) * 1024 * 4));
    MLA_CUDA_CHECK(cudaMalloc(&cycles, size_t(sms) * 8));
    MLA_CUDA_CHECK(cudaMalloc(&mismatches, 4));
    constexpr int kIterations = 4096;
    std::printf("| conversion | threads / SM | e4m3 pairs per clock per SM |\n|---|---|---|\n");
    const char* names[] = {"cvt.rn.f16x2.e4m3x2 (F2FP)", "prmt + shift + and + add", "half each"};
    for (int mode = kHardware; mode <= kHalfEach; ++mode) {
      for (int threads : {256, 1024}) {
        if (mode == kHardware) rate_kernel<kHardware><<<sms, threads>>>(sink, cycles, kIterations);
        if (mode == kBits) rate_kernel<kBits><<<sms, threads>>>(sink, cycles, kIterations);
        if (mode == kHalfEach) rate_kernel<kHalfEach><<<sms, threads>>>(sink, cycles, kIterations);
        MLA_CUDA_CHECK(cudaGetLastError());
        long long c = 0;
        MLA_CUDA_CHECK(cudaMemcpy(&c, cycles, 8, cudaMemcpyDeviceToHost));
        std::printf("| %s | %d | %.1f |\n", names[mode], threads, double(threads) * kIterations * 8 / double(c));
      }
    }
    MLA_CUDA_CHECK(cudaMemset(mismatches, 0, 4));
    check_kernel<<<256, 256>>>(mismatches);
    MLA_CUDA_CHECK(cudaGetLastError());
    uint32_t bad = 0;
    MLA_CUDA_CHECK(cudaMemcpy(&bad, mismatches, 4, cudaMemcpyDeviceToHost));
    std::printf("\nbit trick x 2^8 against the hardware conversion, every non-NaN byte pair: %u mismatches\n", bad);
    for (void* p : {(void*)sink, (void*)cycles, (void*)mismatches}) MLA_CUDA_CHECK(cudaFree(p));
    return bad == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cvt_bench: %s\n", e.what());
    return 1;
  }
}
