// The stock composition the fused query stage is measured against (DESIGN.md §6): separate kernels
// the way an engine without a fused kernel runs the query stage.
//   1. rms_norm_kernel: qn [rows, 1536], kvn [rows, 512] (bf16)
//   2. cuBLAS GEMM:     q  [rows, H*192] = qn . q_b_proj^T (bf16 out, fp32 compute)
//   3. cuBLAS batched:  ql [rows, H, 512] = q_nope[h] . W_UK_T[h] (bf16 out, fp32 compute)
//   4. quantize_kernel: e4m3 query [rows, H, 576] and the e4m3 cache rows
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace mla::bench {

__global__ void stock_rms_norm_kernel(const __nv_bfloat16* projected, int64_t pitch, const __nv_bfloat16* q_a_norm,
                                      const __nv_bfloat16* kv_a_norm, float eps, __nv_bfloat16* qn,
                                      __nv_bfloat16* kvn) {
  const int row = blockIdx.x;
  const __nv_bfloat16* x = projected + row * pitch;
  __shared__ float partial[2][8];
  float ss_q = 0.f, ss_kv = 0.f;
  for (int k = threadIdx.x; k < 2048; k += blockDim.x) {
    const float v = __bfloat162float(x[k]);
    if (k < 1536) ss_q += v * v; else ss_kv += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) {
    ss_q += __shfl_xor_sync(0xffffffffu, ss_q, o);
    ss_kv += __shfl_xor_sync(0xffffffffu, ss_kv, o);
  }
  if (threadIdx.x % 32 == 0) { partial[0][threadIdx.x / 32] = ss_q; partial[1][threadIdx.x / 32] = ss_kv; }
  __syncthreads();
  float tq = 0.f, tkv = 0.f;
  for (int i = 0; i < int(blockDim.x / 32); ++i) { tq += partial[0][i]; tkv += partial[1][i]; }
  const float inv_q = rsqrtf(tq / 1536.f + eps), inv_kv = rsqrtf(tkv / 512.f + eps);
  for (int k = threadIdx.x; k < 2048; k += blockDim.x) {
    const float v = __bfloat162float(x[k]);
    if (k < 1536) qn[row * 1536 + k] = __float2bfloat16_rn(v * inv_q * __bfloat162float(q_a_norm[k]));
    else kvn[row * 512 + k - 1536] = __float2bfloat16_rn(v * inv_kv * __bfloat162float(kv_a_norm[k - 1536]));
  }
}

// One block per (row, head): 576 bytes of query; block (row, 0) also writes the cache row.
__global__ void stock_quantize_kernel(const __nv_bfloat16* q, const __nv_bfloat16* ql, const __nv_bfloat16* kvn,
                                      const __nv_bfloat16* projected, int64_t pitch, const int64_t* slots,
                                      int num_heads, float inv_q_scale, float inv_k_scale, uint8_t* query,
                                      uint8_t* cache, int64_t stride_cache_page) {
  const int row = blockIdx.x, head = blockIdx.y;
  uint8_t* out = query + (int64_t(row) * num_heads + head) * 576;
  for (int d = threadIdx.x; d < 576; d += blockDim.x) {
    const float v = d < 512 ? __bfloat162float(ql[(int64_t(row) * num_heads + head) * 512 + d])
                            : __bfloat162float(q[int64_t(row) * num_heads * 192 + head * 192 + 128 + d - 512]);
    out[d] = __nv_cvt_float_to_fp8(v * inv_q_scale, __NV_SATFINITE, __NV_E4M3);
  }
  if (head == 0 && slots[row] >= 0) {
    const int64_t slot = slots[row];
    uint8_t* dst = cache + (slot / 64) * stride_cache_page + (slot % 64) * 576;
    for (int d = threadIdx.x; d < 576; d += blockDim.x) {
      const float v = d < 512 ? __bfloat162float(kvn[row * 512 + d]) : __bfloat162float(projected[row * pitch + 2048 + d - 512]);
      dst[d] = __nv_cvt_float_to_fp8(v * inv_k_scale, __NV_SATFINITE, __NV_E4M3);
    }
  }
}

}  // namespace mla::bench
