// The query stage's GEMM path (large batches, DESIGN.md §4 query stage): the two projections run as
// cuBLAS GEMMs between two small kernels of ours (launch.cu):
//   1. gemm_norm_kernel      RMSNorm(q_a) -> qn bf16 [rows, 1536] (workspace); RMSNorm(kv_a) | k_pe ->
//                            the e4m3 cache row at the row's slot (after griddepcontrol.wait);
//   2. cuBLAS GEMM           q  = bf16(qn . q_b_proj^T) [rows, H*192], fp32 accumulate;
//   3. cuBLAS batched GEMM   ql = q_nope[h] . W_UK_T[h] [rows, H, 512], fp32 out (not rounded to bf16);
//   4. gemm_quantize_kernel  e4m3(ql / q_scale) | e4m3(q_rope / q_scale) into the query; triggers the
//                            dependents after its last store.
// The rounding points are the fused kernel's (and the spec's): qn, kvn and q in bf16, ql in fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "mla/dims.h"
#include "query/device_utils.cuh"
#include "query/params.h"

namespace mla::query {

inline constexpr int kGemmNormThreads = 256;  // one CTA a row: 6 bf16 of q_a and 2 of kv_a a thread
inline constexpr int kGemmQuantThreads = 72;  // one CTA a (row, head): 8 query bytes a thread

// Sum over the CTA (8 warps) of one value per thread, broadcast to every thread.
__device__ __forceinline__ float block_sum_256(float v, float* scratch) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kGemmNormThreads / 32; ++w) total += scratch[w];
  return total;
}

// Grid: rows. Reads `projected` only after griddepcontrol.wait (it may be the previous kernel's output).
__global__ void __launch_bounds__(kGemmNormThreads) gemm_norm_kernel(const __grid_constant__ QueryParams p,
                                                                     __nv_bfloat16* qn) {
  __shared__ float scratch[2][kGemmNormThreads / 32];
  const int row = blockIdx.x;
  grid_dependency_wait();
  const __nv_bfloat16* x = p.projected + int64_t(row) * p.stride_projected_row;
  // q_a: columns 8t .. 8t+7 for t < 192 (threads 192..255 idle); kv_a: 2t, 2t+1.
  const int t = threadIdx.x;
  float f[8] = {};
  if (t < kQLoraRank / 8) unpack8(*reinterpret_cast<const uint4*>(x + kProjectedQaOffset + 8 * t), f);
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
  const float inv_rms_q = rsqrtf(block_sum_256(ss, scratch[0]) / float(kQLoraRank) + p.rms_eps);
  if (t < kQLoraRank / 8) {
    float w[8];
    unpack8(*reinterpret_cast<const uint4*>(p.q_a_norm + 8 * t), w);
    uint4 out;
    out.x = pack_bf16x2(f[0] * inv_rms_q * w[0], f[1] * inv_rms_q * w[1]);
    out.y = pack_bf16x2(f[2] * inv_rms_q * w[2], f[3] * inv_rms_q * w[3]);
    out.z = pack_bf16x2(f[4] * inv_rms_q * w[4], f[5] * inv_rms_q * w[5]);
    out.w = pack_bf16x2(f[6] * inv_rms_q * w[6], f[7] * inv_rms_q * w[7]);
    *reinterpret_cast<uint4*>(qn + int64_t(row) * kQLoraRank + 8 * t) = out;
  }

  const int64_t slot = p.slots[row];
  if (slot < 0 || slot / kPageSize >= p.num_cache_pages) return;  // uniform over the CTA
  const __nv_bfloat162 kv = *reinterpret_cast<const __nv_bfloat162*>(x + kProjectedKvaOffset + 2 * t);
  const float k0 = __low2float(kv), k1 = __high2float(kv);
  const float inv_rms_kv = rsqrtf(block_sum_256(k0 * k0 + k1 * k1, scratch[1]) / float(kKvLoraRank) + p.rms_eps);
  const __nv_bfloat162 wkv = *reinterpret_cast<const __nv_bfloat162*>(p.kv_a_norm + 2 * t);
  // kvn = bf16(kv_a * inv_rms * w), then e4m3(kvn * inv_k_scale).
  const float y0 = __bfloat162float(__float2bfloat16_rn(k0 * inv_rms_kv * __low2float(wkv))) * p.inv_k_scale;
  const float y1 = __bfloat162float(__float2bfloat16_rn(k1 * inv_rms_kv * __high2float(wkv))) * p.inv_k_scale;
  uint8_t* dst = p.cache + (slot / kPageSize) * p.stride_cache_page + (slot % kPageSize) * kKeyDim;
  *reinterpret_cast<uint16_t*>(dst + 2 * t) = e4m3x2(y0, y1);
  if (t < kRopeDim / 2) {
    const __nv_bfloat162 k = *reinterpret_cast<const __nv_bfloat162*>(x + kProjectedKpeOffset + 2 * t);
    *reinterpret_cast<uint16_t*>(dst + kKvLoraRank + 2 * t) =
        e4m3x2(__low2float(k) * p.inv_k_scale, __high2float(k) * p.inv_k_scale);
  }
}

// Grid: (rows, H). Launched in stream order after the cuBLAS GEMMs (no PDL wait needed); triggers
// its dependents after its last store.
__global__ void __launch_bounds__(kGemmQuantThreads) gemm_quantize_kernel(const __grid_constant__ QueryParams p,
                                                                          const __nv_bfloat16* q, const float* ql) {
  const int row = blockIdx.x, head = blockIdx.y, t = threadIdx.x;
  uint8_t* dst = p.query + (int64_t(row) * p.num_heads_out + p.head_offset + head) * kKeyDim + 8 * t;
  float v[8];
  if (t < kKvLoraRank / 8) {
    const float* src = ql + (int64_t(row) * p.num_heads + head) * kKvLoraRank + 8 * t;
    const float4 a = *reinterpret_cast<const float4*>(src), b = *reinterpret_cast<const float4*>(src + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const int d = kNopeDim + 8 * (t - kKvLoraRank / 8);
    unpack8(*reinterpret_cast<const uint4*>(q + (int64_t(row) * p.num_heads + head) * kQkHeadDim + d), v);
  }
  uint2 out;
  out.x = uint32_t(e4m3x2(v[0] * p.inv_q_scale, v[1] * p.inv_q_scale)) |
          (uint32_t(e4m3x2(v[2] * p.inv_q_scale, v[3] * p.inv_q_scale)) << 16);
  out.y = uint32_t(e4m3x2(v[4] * p.inv_q_scale, v[5] * p.inv_q_scale)) |
          (uint32_t(e4m3x2(v[6] * p.inv_q_scale, v[7] * p.inv_q_scale)) << 16);
  *reinterpret_cast<uint2*>(dst) = out;
  __syncthreads();  // every store of the CTA issued before the trigger
  trigger_dependents();
}

}  // namespace mla::query
