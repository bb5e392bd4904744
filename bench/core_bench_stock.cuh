// The stock composition the attention core is measured against (DESIGN.md §6): the way an engine
// without a fused FP8 MLA decode kernel runs it, one request per batch entry of cuBLAS:
//   1. gather_kv:   the paged e4m3 cache -> contiguous bf16 K [batch, max_len, 576] (times k_scale,
//                   zero past each length) and the e4m3 query -> bf16 [rows, H, 576]
//   2. cuBLAS:      S [batch, q*H, max_len] = Q . K^T (fp32 out, fp32 compute), strided batched
//   3. softmax:     P = softmax(scale * S) over each row's visible tokens (bf16), LSE (natural log)
//   4. cuBLAS:      latent [batch, q*H, 512] = P . V, V = K[:, :512] (bf16 out, fp32 compute)
// Bottom-right causal as in the core: query row i of q sees the first length - q + 1 + i tokens.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>

#include "common/cublas_check.h"
#include "common/cuda_check.h"
#include "mla/dims.h"

namespace mla::bench {

__device__ __forceinline__ void e4m3x8_to_bf16x8(uint2 bytes, float scale, __nv_bfloat16 (&out)[8]) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&bytes);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    __nv_fp8_e4m3 v;
    v.__x = b[e];
    out[e] = __float2bfloat16_rn(float(v) * scale);
  }
}

// Grid (blocks, batch): request b's K rows [0, max_len) in 8-byte groups (72 a token).
__global__ void stock_gather_kv_kernel(const uint8_t* cache, int64_t page_bytes, const int32_t* block_table,
                                       int pages_per_request, const int32_t* lengths, int max_len, float k_scale,
                                       __nv_bfloat16* kv) {
  const int b = blockIdx.y, length = lengths[b];
  constexpr int kGroups = kKeyDim / 8;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < int64_t{max_len} * kGroups;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int t = int(e / kGroups), group = int(e % kGroups);
    __nv_bfloat16 v[8];
    if (t < length) {
      const int page = block_table[int64_t{b} * pages_per_request + t / kPageSize];
      const uint8_t* src = cache + page * page_bytes + (t % kPageSize) * kKeyDim + group * 8;
      e4m3x8_to_bf16x8(*reinterpret_cast<const uint2*>(src), k_scale, v);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __float2bfloat16_rn(0.f);
    }
    *reinterpret_cast<uint4*>(kv + (int64_t{b} * max_len + t) * kKeyDim + group * 8) = *reinterpret_cast<uint4*>(v);
  }
}

__global__ void stock_query_to_bf16_kernel(const uint8_t* query, int64_t groups, __nv_bfloat16* out) {
  for (int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; g < groups; g += int64_t{gridDim.x} * blockDim.x) {
    __nv_bfloat16 v[8];
    e4m3x8_to_bf16x8(*reinterpret_cast<const uint2*>(query + g * 8), 1.f, v);
    *reinterpret_cast<uint4*>(out + g * 8) = *reinterpret_cast<uint4*>(v);
  }
}

// Grid (q*H, batch), 256 threads: one row of S.
__global__ void stock_softmax_kernel(const float* scores, const int32_t* lengths, int max_len, int q, int heads,
                                     float scale, __nv_bfloat16* probs, float* lse) {
  const int r = blockIdx.x, b = blockIdx.y;
  const int visible = max(0, lengths[b] - q + 1 + r / heads);
  const float* s = scores + (int64_t{b} * gridDim.x + r) * max_len;
  __nv_bfloat16* p = probs + (int64_t{b} * gridDim.x + r) * max_len;
  __shared__ float reduce[8];
  auto block_reduce = [&](float v, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, v, o);
      v = is_max ? fmaxf(v, other) : v + other;
    }
    __syncthreads();
    if (threadIdx.x % 32 == 0) reduce[threadIdx.x / 32] = v;
    __syncthreads();
    v = reduce[0];
    for (int w = 1; w < int(blockDim.x / 32); ++w) v = is_max ? fmaxf(v, reduce[w]) : v + reduce[w];
    return v;
  };
  float m = -INFINITY;
  for (int t = threadIdx.x; t < visible; t += blockDim.x) m = fmaxf(m, s[t] * scale);
  m = block_reduce(m, true);
  float sum = 0.f;
  for (int t = threadIdx.x; t < visible; t += blockDim.x) sum += __expf(s[t] * scale - m);
  sum = block_reduce(sum, false);
  for (int t = threadIdx.x; t < max_len; t += blockDim.x)
    p[t] = __float2bfloat16_rn(t < visible ? __expf(s[t] * scale - m) / sum : 0.f);
  if (threadIdx.x == 0) lse[int64_t{b} * gridDim.x + r] = visible > 0 ? m + logf(sum) : -INFINITY;
}

// The buffers of one shape and the four steps; run() only launches (graph-capturable).
struct StockCore {
  int batch = 0, q = 0, heads = 0, max_len = 0, pages_per_request = 0;
  int64_t page_bytes = 0;
  __nv_bfloat16 *kv = nullptr, *query = nullptr, *probs = nullptr, *latent = nullptr;
  float *scores = nullptr, *lse = nullptr;

  StockCore(int batch_, int q_, int heads_, int max_len_, int pages_per_request_, int64_t page_bytes_)
      : batch(batch_), q(q_), heads(heads_), max_len(max_len_), pages_per_request(pages_per_request_),
        page_bytes(page_bytes_) {
    const int64_t rows = int64_t{batch} * q * heads;
    MLA_CUDA_CHECK(cudaMalloc(&kv, int64_t{batch} * max_len * kKeyDim * 2));
    MLA_CUDA_CHECK(cudaMalloc(&query, rows * kKeyDim * 2));
    MLA_CUDA_CHECK(cudaMalloc(&scores, rows * max_len * 4));
    MLA_CUDA_CHECK(cudaMalloc(&probs, rows * max_len * 2));
    MLA_CUDA_CHECK(cudaMalloc(&latent, rows * kKvLoraRank * 2));
    MLA_CUDA_CHECK(cudaMalloc(&lse, rows * 4));
  }
  ~StockCore() {  // a destructor cannot report; the benchmark exits right after a failure anyway
    for (void* p : {(void*)kv, (void*)query, (void*)scores, (void*)probs, (void*)latent, (void*)lse}) cudaFree(p);
  }
  StockCore(const StockCore&) = delete;
  StockCore& operator=(const StockCore&) = delete;

  // Device bytes the intermediates take (so a caller can skip shapes that do not fit).
  static int64_t bytes(int batch, int q, int heads, int max_len) {
    const int64_t rows = int64_t{batch} * q * heads;
    return int64_t{batch} * max_len * kKeyDim * 2 + rows * kKeyDim * 2 + rows * max_len * 6 + rows * kKvLoraRank * 2 +
           rows * 4;
  }

  // softmax_scale multiplies Q·K^T of the e4m3 query and the k_scale-scaled cache (bf16); the latent is
  // P·V of the scaled cache, so it comes out scaled as the core's does.
  void run(cublasHandle_t cublas, cudaStream_t stream, const uint8_t* cache, const int32_t* block_table,
           const int32_t* lengths, const uint8_t* query_fp8, float softmax_scale, float k_scale = 1.0f) {
    const int rows_per_request = q * heads;
    stock_gather_kv_kernel<<<dim3(256, batch), 256, 0, stream>>>(cache, page_bytes, block_table, pages_per_request,
                                                                 lengths, max_len, k_scale, kv);
    MLA_CUDA_CHECK_LAUNCH();
    stock_query_to_bf16_kernel<<<256, 256, 0, stream>>>(query_fp8, int64_t{batch} * rows_per_request * kKeyDim / 8,
                                                        query);
    MLA_CUDA_CHECK_LAUNCH();
    const float one = 1.f, zero = 0.f;
    // Column-major: S^T (max_len x q*H) = K (rows of 576, transposed) x Q^T.
    MLA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        cublas, CUBLAS_OP_T, CUBLAS_OP_N, max_len, rows_per_request, kKeyDim, &one, kv, CUDA_R_16BF, kKeyDim,
        int64_t{max_len} * kKeyDim, query, CUDA_R_16BF, kKeyDim, int64_t{rows_per_request} * kKeyDim, &zero, scores,
        CUDA_R_32F, max_len, int64_t{rows_per_request} * max_len, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    stock_softmax_kernel<<<dim3(rows_per_request, batch), 256, 0, stream>>>(scores, lengths, max_len, q, heads,
                                                                           softmax_scale, probs, lse);
    MLA_CUDA_CHECK_LAUNCH();
    // latent^T (512 x q*H) = V^T (the first 512 of each 576-wide K row) x P^T.
    MLA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        cublas, CUBLAS_OP_N, CUBLAS_OP_N, kKvLoraRank, rows_per_request, max_len, &one, kv, CUDA_R_16BF, kKeyDim,
        int64_t{max_len} * kKeyDim, probs, CUDA_R_16BF, max_len, int64_t{rows_per_request} * max_len, &zero, latent,
        CUDA_R_16BF, kKvLoraRank, int64_t{rows_per_request} * kKvLoraRank, batch, CUBLAS_COMPUTE_32F,
        CUBLAS_GEMM_DEFAULT));
  }
};

}  // namespace mla::bench
