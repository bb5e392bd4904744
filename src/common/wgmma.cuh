// Generic sm_90a warpgroup-MMA (wgmma) PTX helpers shared by the kernel families that use wgmma (the attention
// core's ping-pong kernel, the query stage's GEMM-path absorb kernel): the shared-memory matrix descriptor, the
// fence / commit / wait of a warpgroup's async MMAs, the generic-to-async proxy fence and operand pins. The
// shape- and type-specific wgmma instructions live with the kernels that issue them.
#pragma once

#include <cstdint>

namespace mla::wgmma {

// Shared-memory matrix descriptor (PTX "matrix-descriptor"): start address, leading byte offset 1
// (unused by the swizzled K-major layouts), stride byte offset = bytes between 8-row groups, layout
// 1 = 128-byte swizzle. The base-offset field stays 0: every swizzle atom is aligned to its
// repeat (1024 B), and a k-step inside an atom only moves the start address.
inline constexpr uint32_t kSwizzle128 = 1;
__device__ __forceinline__ uint64_t gmma_desc(uint32_t smem_address, uint32_t stride_bytes, uint32_t layout) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (static_cast<uint64_t>(layout) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Orders generic-proxy shared accesses (st.shared, cp.async) before the async proxy's (wgmma reads, bulk copies).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Pins a register's accesses in program order against the wgmma fence / wait (the compiler must not
// move an accumulator or A-fragment write across them).
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// Waits until at most N committed wgmma groups of this warpgroup are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

}  // namespace mla::wgmma
