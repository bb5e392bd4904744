// Device helpers of the query kernel (kernel.cuh): PDL controls, streaming loads, mma.sync and
// ldmatrix wrappers, cp.async, bf16 / e4m3 packing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "query/config.h"
#include "query/params.h"

namespace mla::query {

__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void trigger_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Streaming 16-byte load: weights are read once, keep them out of L1.
__device__ __forceinline__ uint4 load_stream(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_ptr) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_ptr) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void cp_async_16(void* smem_ptr, const void* gmem_ptr) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(addr), "l"(gmem_ptr));
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Eight bf16 (one 16-byte vector) to floats.
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// e4m3 with saturation (DESIGN.md §4: saturate to +-448, NaN stays NaN), two at a time.
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// e4m3(v[i] * scale) for 8 values, byte i = element i (one 8-byte store of 8 consecutive features).
__device__ __forceinline__ uint2 e4m3x8(const float (&v)[8], float scale) {
  uint2 out;
  out.x = uint32_t(e4m3x2(v[0] * scale, v[1] * scale)) | (uint32_t(e4m3x2(v[2] * scale, v[3] * scale)) << 16);
  out.y = uint32_t(e4m3x2(v[4] * scale, v[5] * scale)) | (uint32_t(e4m3x2(v[6] * scale, v[7] * scale)) << 16);
  return out;
}

// The absorption's m16n8 C fragment (M = 16 latent columns from col0, N = 8 rows from row0; lane
// (g, t) holds d0 (column g, row 2t), d1 (g, 2t+1), d2 (g+8, 2t), d3 (g+8, 2t+1)) as e4m3(d * scale)
// bytes into a shared [row][stride] staging tile of the query bytes.
__device__ __forceinline__ void stage_e4m3_fragment(uint8_t* tile, int stride, int row0, int col0,
                                                    const float (&d)[4], float scale, int g, int t) {
  const uint16_t v01 = e4m3x2(d[0] * scale, d[1] * scale);
  const uint16_t v23 = e4m3x2(d[2] * scale, d[3] * scale);
  uint8_t* o = tile + (row0 + 2 * t) * stride + col0 + g;
  o[0] = uint8_t(v01 & 0xff);
  o[stride] = uint8_t(v01 >> 8);
  o[8] = uint8_t(v23 & 0xff);
  o[stride + 8] = uint8_t(v23 >> 8);
}

}  // namespace mla::query
