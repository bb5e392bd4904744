// How fast does an SM convert e4m3 to f16? The attention core converts every K and V byte of a page (the mma.sync
// kernel: 136 `cvt.rn.f16x2.e4m3x2` a thread and page, SASS F2FP.F16.E4M3.UNPACK_B; src/core/README.md next step 14).
// If that instruction runs at 16 results a clock an SM (the CUDA guide's "all other type conversions" on sm_90), one
// page's conversions take ~2200 SM clocks, ~1.25 µs of the ~1.5 µs in which a page's bytes arrive at the copy
// bandwidth's share of an SM. This times, on every SM at once, chains of
//   f2fp:  x = cvt.rn.f16x2.e4m3x2(low 16 bits of x)                     (one F2FP a result)
//   alu:   x = (prmt(x, 0, 0xa280) << 7) & 0xbf80bf80                      (core-v-alu.patch's
//          e4m3_signed_pair_to_f16x2_div256 after its PRMT: PRMT, IMAD.SHL, LOP3 a result, the e4m3 value / 256)
//   mixed: half the chains of each
// with 8 independent chains a thread at 16 and 32 warps an SM, and prints results a clock an SM (clock64 around the
// loop, the median CTA); then each with one chain in one warp an SM (its latency: clocks a step), and the same two
// for mma.sync.m16n8k16 f16 -> f32 (the split kernel's Q·K^T runs two 18-deep chains of it a warp and page: next
// step 10). Not run yet (2026-12-08: no device lent).
//   nvcc -arch=sm_90a -o cvt_rate_check cvt_rate_check.cu && ./cvt_rate_check
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check_main.h"

enum Mode { kF2fp, kAlu, kMixed, kHmma };

__device__ __forceinline__ uint32_t by_f2fp(uint32_t x) {
  uint32_t h2;
  asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(x)));
  return h2;
}

__device__ __forceinline__ uint32_t by_alu(uint32_t x) {
  uint32_t d;
  asm volatile("prmt.b32 %0, %1, 0, 0xa280;" : "=r"(d) : "r"(x));
  return (d << 7) & 0xbf80bf80u;
}

// One mma.sync.m16n8k16 f16 -> f32 step of an accumulator chain (A and B fixed).
__device__ __forceinline__ void by_hmma(float (&d)[4], uint32_t a) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %4, %4, %4}, {%4, %4}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a));
}

template <Mode kMode, int kChains>
__global__ void rate_kernel(uint32_t* sink, long long* cycles, int iters) {
  uint32_t x[kChains];
  float d[kChains][4];
#pragma unroll
  for (int j = 0; j < kChains; ++j) {
    x[j] = (threadIdx.x * 2654435761u) ^ (j * 40503u) ^ blockIdx.x;
    d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.0f;
  }
  const uint32_t one_half = 0x38003800u;  // f16x2 (0.5, 0.5): the MMA's A and B
  __syncthreads();
  const long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < kChains; ++j) {
      if constexpr (kMode == kHmma) {
        by_hmma(d[j], one_half);
      } else {
        const bool f2fp = kMode == kF2fp || (kMode == kMixed && j % 2 == 0);
        x[j] = f2fp ? by_f2fp(x[j]) : by_alu(x[j]);
      }
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  uint32_t all = 0;
#pragma unroll
  for (int j = 0; j < kChains; ++j) all ^= x[j] ^ __float_as_uint(d[j][0] + d[j][1] + d[j][2] + d[j][3]);
  if (all == 0x12345678u) sink[threadIdx.x] = all;  // keeps the chains alive
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

// Throughput (kChains 8, `threads` a CTA, one CTA an SM): results a clock an SM. Latency (kChains 1, one warp): clocks
// a step of the chain.
template <Mode kMode, int kChains>
int measure(const char* name, int sms, int threads, uint32_t* sink, long long* cycles) {
  constexpr int kIters = 4096;
  rate_kernel<kMode, kChains><<<sms, threads>>>(sink, cycles, 64);  // warm-up
  CHECK(cudaGetLastError());
  rate_kernel<kMode, kChains><<<sms, threads>>>(sink, cycles, kIters);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<long long> host(sms);
  CHECK(cudaMemcpy(host.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost));
  std::sort(host.begin(), host.end());
  const double median = static_cast<double>(host[sms / 2]);
  const char* unit = kMode == kHmma ? "mma.sync m16n8k16 (warp instructions)" : "f16x2 results (thread results)";
  if (kChains == 1) {
    std::printf("%-6s latency, 1 warp an SM: %5.1f clocks a dependent step\n", name, median / kIters);
  } else {
    const double results = static_cast<double>(kMode == kHmma ? threads / 32 : threads) * kIters * kChains;
    std::printf("%-6s %2d warps an SM: %6.2f %s a clock an SM (median CTA %.0f clocks)\n", name, threads / 32,
                results / median, unit, median);
  }
  return 0;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint32_t* sink;
  long long* cycles;
  CHECK(cudaMalloc(&sink, 1024 * sizeof(uint32_t)));
  CHECK(cudaMalloc(&cycles, sms * sizeof(long long)));
  for (const int threads : {512, 1024}) {  // one CTA an SM: 16 warps (the mma.sync core's two CTAs), 32 warps
    if (measure<kF2fp, 8>("f2fp", sms, threads, sink, cycles) != 0) return 1;
    if (measure<kAlu, 8>("alu", sms, threads, sink, cycles) != 0) return 1;
    if (measure<kMixed, 8>("mixed", sms, threads, sink, cycles) != 0) return 1;
    if (measure<kHmma, 8>("hmma", sms, threads, sink, cycles) != 0) return 1;
  }
  if (measure<kF2fp, 1>("f2fp", sms, 32, sink, cycles) != 0) return 1;
  if (measure<kAlu, 1>("alu", sms, 32, sink, cycles) != 0) return 1;
  if (measure<kHmma, 1>("hmma", sms, 32, sink, cycles) != 0) return 1;
  return 0;
}
