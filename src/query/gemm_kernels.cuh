// The query stage's GEMM path (large batches, DESIGN.md §4 query stage): the two projections run as
// cuBLAS GEMMs between two small kernels of ours (launch.cu):
//   1. gemm_norm_kernel      RMSNorm(q_a) -> qn bf16 [rows, 1536] (workspace); RMSNorm(kv_a) | k_pe ->
//                            the e4m3 cache row at the row's slot (after griddepcontrol.wait);
//   2. cuBLAS GEMM           q  = bf16(qn . q_b_proj^T) [rows, H*192], fp32 accumulate;
//   3. gemm_absorb_kernel    ql = q_nope[h] . W_UK_T[h] on mma.sync (fp32), e4m3(ql / q_scale) and
//                            e4m3(q_rope / q_scale) into the query; triggers the dependents after its
//                            last store.
// The rounding points are the fused kernel's (and the spec's): qn, kvn and q in bf16, ql in fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/timeline.cuh"
#include "mla/dims.h"
#include "query/config.h"
#include "query/device_utils.cuh"
#include "query/params.h"

namespace mla::query {

inline constexpr int kGemmNormThreads = 256;  // one CTA a row: 6 bf16 of q_a and 2 of kv_a a thread

// Sums over the CTA (8 warps) of two values per thread, broadcast to every thread: one barrier for both.
__device__ __forceinline__ float2 block_sum2_256(float a, float b, float2* scratch) {
  a = warp_sum(a);
  b = warp_sum(b);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = make_float2(a, b);
  __syncthreads();
  float2 total = make_float2(0.f, 0.f);
#pragma unroll
  for (int w = 0; w < kGemmNormThreads / 32; ++w) {
    total.x += scratch[w].x;
    total.y += scratch[w].y;
  }
  return total;
}

// Grid: rows. Reads `projected` and `slots` only after griddepcontrol.wait (they may be the previous kernel's
// output); the norm weights before it. NOTE: every load of the row goes out at once after the wait, and both sums
// share one barrier: q_a, its sum, then q_a_norm, then the slot, kv_a, its sum and kv_a_norm, each after the last,
// were six round trips in series in front of the cuBLAS GEMM.
__global__ void __launch_bounds__(kGemmNormThreads) gemm_norm_kernel(const __grid_constant__ QueryParams p,
                                                                     __nv_bfloat16* qn) {
  __shared__ float2 scratch[kGemmNormThreads / 32];
  const int row = blockIdx.x;
  MLA_TIMELINE_MARK(p.timeline, kNormMarkStart);
  // q_a: columns 8t .. 8t+7 for t < 192 (threads 192..255 only norm kv_a); kv_a: 2t, 2t+1; k_pe: 2t, 2t+1 for t < 32.
  const int t = threadIdx.x;
  const bool has_q = t < kQLoraRank / 8;
  const uint4 wq = has_q ? *reinterpret_cast<const uint4*>(p.q_a_norm + 8 * t) : make_uint4(0u, 0u, 0u, 0u);
  const __nv_bfloat162 wkv = *reinterpret_cast<const __nv_bfloat162*>(p.kv_a_norm + 2 * t);
  grid_dependency_wait();
  MLA_TIMELINE_MARK(p.timeline, kNormMarkWaited);
  const __nv_bfloat16* x = p.projected + int64_t(row) * p.stride_projected_row;
  const int64_t slot = p.slots[row];
  const uint4 xq = has_q ? *reinterpret_cast<const uint4*>(x + kProjectedQaOffset + 8 * t) : make_uint4(0u, 0u, 0u, 0u);
  const __nv_bfloat162 kv = *reinterpret_cast<const __nv_bfloat162*>(x + kProjectedKvaOffset + 2 * t);
  const __nv_bfloat162 kpe = t < kRopeDim / 2 ? *reinterpret_cast<const __nv_bfloat162*>(x + kProjectedKpeOffset + 2 * t)
                                              : __nv_bfloat162{};
  float f[8];
  unpack8(xq, f);
  float ss_q = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) ss_q += f[e] * f[e];
  const float k0 = __low2float(kv), k1 = __high2float(kv);
  const float2 sums = block_sum2_256(ss_q, k0 * k0 + k1 * k1, scratch);
  MLA_TIMELINE_MARK(p.timeline, kNormMarkSummed);
  if (has_q) {
    const float inv_rms_q = rsqrtf(sums.x / float(kQLoraRank) + p.rms_eps);
    float w[8];
    unpack8(wq, w);
    uint4 out;
    out.x = pack_bf16x2(f[0] * inv_rms_q * w[0], f[1] * inv_rms_q * w[1]);
    out.y = pack_bf16x2(f[2] * inv_rms_q * w[2], f[3] * inv_rms_q * w[3]);
    out.z = pack_bf16x2(f[4] * inv_rms_q * w[4], f[5] * inv_rms_q * w[5]);
    out.w = pack_bf16x2(f[6] * inv_rms_q * w[6], f[7] * inv_rms_q * w[7]);
    *reinterpret_cast<uint4*>(qn + int64_t(row) * kQLoraRank + 8 * t) = out;
  }

  if (slot < 0 || slot / kPageSize >= p.num_cache_pages) {  // uniform over the CTA
    MLA_TIMELINE_MARK(p.timeline, kNormMarkEnd);
    return;
  }
  const float inv_rms_kv = rsqrtf(sums.y / float(kKvLoraRank) + p.rms_eps);
  // kvn = bf16(kv_a * inv_rms * w), then e4m3(kvn * inv_k_scale).
  const float y0 = __bfloat162float(__float2bfloat16_rn(k0 * inv_rms_kv * __low2float(wkv))) * p.inv_k_scale;
  const float y1 = __bfloat162float(__float2bfloat16_rn(k1 * inv_rms_kv * __high2float(wkv))) * p.inv_k_scale;
  uint8_t* dst = p.cache + (slot / kPageSize) * p.stride_cache_page + (slot % kPageSize) * kKeyDim;
  *reinterpret_cast<uint16_t*>(dst + 2 * t) = e4m3x2(y0, y1);
  if (t < kRopeDim / 2) {
    *reinterpret_cast<uint16_t*>(dst + kKvLoraRank + 2 * t) =
        e4m3x2(__low2float(kpe) * p.inv_k_scale, __high2float(kpe) * p.inv_k_scale);
  }
  MLA_TIMELINE_MARK(p.timeline, kNormMarkEnd);
}

// ---- gemm_absorb_kernel: ql = q_nope . W_UK_T[h] on mma.sync, e4m3 straight from the fp32 accumulators
// NOTE: our kernel rather than a cuBLAS batched GEMM: cuBLAS must write ql in fp32 (the spec rounds ql
// only once, to e4m3) and a quantize kernel read it back: 2 x 4 bytes an element through HBM, which
// made the GEMM path 0.87-0.92x the stock composition (bf16 ql) at 256 rows x H >= 64 on the H200.
// A CTA owns (head, 64-row tile, 128-column slice): the W_UK_T[h] slice (128 x 128) and the tile's
// q_nope in shared memory; warp w owns the 16 columns [16w, 16w + 16) for all 64 rows (M = columns
// through ldmatrix.trans, N = rows), the fused kernel's phase-5 fragment layout.
inline constexpr int kAbsorbRowTile = 64;
inline constexpr int kAbsorbCols = 128;
inline constexpr int kAbsorbWarps = kAbsorbCols / 16;  // 8
inline constexpr int kAbsorbThreads = kAbsorbWarps * 32;
inline constexpr int kAbsorbWStride = kAbsorbCols + 8;   // bf16; ldmatrix rows 16 bytes off per 128 B
inline constexpr int kAbsorbQStride = kNopeDim + 8;      // bf16
inline constexpr int kAbsorbOutStride = kAbsorbCols + 16;  // bytes
inline constexpr size_t kAbsorbWBytes = size_t(kNopeDim) * kAbsorbWStride * 2;
inline constexpr size_t kAbsorbQBytes = size_t(kAbsorbRowTile) * kAbsorbQStride * 2;
inline constexpr size_t kAbsorbSmemBytes = kAbsorbWBytes + kAbsorbQBytes + size_t(kAbsorbRowTile) * kAbsorbOutStride;
static_assert(kKvLoraRank % kAbsorbCols == 0, "the latent columns must tile by the slice");

// Grid: (512 / 128 column slices, row tiles, H). Launched as a programmatic dependent of the q_b_proj
// GEMM: the weight slice streams in before griddepcontrol.wait, q after it. Slice 0 also quantizes
// the rope part of q. Triggers its dependents after its last store.
__global__ void __launch_bounds__(kAbsorbThreads) gemm_absorb_kernel(const __grid_constant__ QueryParams p,
                                                                     const __nv_bfloat16* q) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  __nv_bfloat16* s_w = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* s_q = reinterpret_cast<__nv_bfloat16*>(smem_raw + kAbsorbWBytes);
  uint8_t* s_out = smem_raw + kAbsorbWBytes + kAbsorbQBytes;
  const int col0 = blockIdx.x * kAbsorbCols, row0 = blockIdx.y * kAbsorbRowTile, head = blockIdx.z;
  const int rows_here = min(kAbsorbRowTile, p.num_rows - row0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  MLA_TIMELINE_MARK(p.timeline, kAbsorbMarkStart);

  // W_UK_T[h][k][col0 .. col0 + 128): 128 rows of 16 16-byte chunks (independent of the producer).
  constexpr int kChunksPerRow = kAbsorbCols / 8;
  const __nv_bfloat16* w = p.w_uk_t + int64_t(head) * kNopeDim * kKvLoraRank + col0;
  for (int i = threadIdx.x; i < kNopeDim * kChunksPerRow; i += kAbsorbThreads) {
    const int k = i / kChunksPerRow, c = (i % kChunksPerRow) * 8;
    cp_async_16(s_w + k * kAbsorbWStride + c, w + int64_t(k) * kKvLoraRank + c);
  }
  grid_dependency_wait();  // q is the q_b_proj GEMM's output
  MLA_TIMELINE_MARK(p.timeline, kAbsorbMarkWaited);
  constexpr int kQChunksPerRow = kNopeDim / 8;
  for (int i = threadIdx.x; i < kAbsorbRowTile * kQChunksPerRow; i += kAbsorbThreads) {
    const int r = i / kQChunksPerRow, c = (i % kQChunksPerRow) * 8;
    if (r < rows_here) {
      cp_async_16(s_q + r * kAbsorbQStride + c, q + (int64_t(row0 + r) * p.num_heads + head) * kQkHeadDim + c);
    } else {
      *reinterpret_cast<uint4*>(s_q + r * kAbsorbQStride + c) = make_uint4(0, 0, 0, 0);  // rows past the batch
    }
  }
  if (blockIdx.x == 0) {
    // The rope part: e4m3(q_rope / q_scale), 8 features a thread.
    constexpr int kRopeVecs = kRopeDim / 8;
    for (int i = threadIdx.x; i < rows_here * kRopeVecs; i += kAbsorbThreads) {
      const int r = i / kRopeVecs, d = (i % kRopeVecs) * 8;
      const int64_t qrow = int64_t(row0 + r) * p.num_heads + head;
      float v[8];
      unpack8(*reinterpret_cast<const uint4*>(q + qrow * kQkHeadDim + kNopeDim + d), v);
      *reinterpret_cast<uint2*>(p.query + (int64_t(row0 + r) * p.num_heads_out + p.head_offset + head) * kKeyDim +
                                kKvLoraRank + d) = e4m3x8(v, p.inv_q_scale);
    }
  }
  cp_async_wait_all();
  __syncthreads();
  MLA_TIMELINE_MARK(p.timeline, kAbsorbMarkLoaded);

  // ql[rows, 16 columns of this warp], K = 128: A = W columns (ldmatrix.trans), B = q rows.
  constexpr int kNTiles = kAbsorbRowTile / 8;
  const int mi = lane / 8, mj = lane % 8, g = lane / 4, t = lane % 4;
  float acc[kNTiles][4] = {};
#pragma unroll
  for (int ks = 0; ks < kNopeDim / 16; ks += 2) {
    uint32_t a0[4], a1[4];
    ldmatrix_x4_trans(a0, s_w + (ks * 16 + mj + 8 * (mi / 2)) * kAbsorbWStride + warp * 16 + 8 * (mi % 2));
    ldmatrix_x4_trans(a1, s_w + ((ks + 1) * 16 + mj + 8 * (mi / 2)) * kAbsorbWStride + warp * 16 + 8 * (mi % 2));
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      uint32_t b[4];
      ldmatrix_x4(b, s_q + (nt * 8 + mj) * kAbsorbQStride + ks * 16 + 8 * mi);
      mma_bf16_16816(acc[nt], a0[0], a0[1], a0[2], a0[3], b[0], b[1]);
      mma_bf16_16816(acc[nt], a1[0], a1[1], a1[2], a1[3], b[2], b[3]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
    stage_e4m3_fragment(s_out, kAbsorbOutStride, nt * 8, warp * 16, acc[nt], p.inv_q_scale, g, t);
  __syncthreads();
  MLA_TIMELINE_MARK(p.timeline, kAbsorbMarkComputed);
  constexpr int kVecsPerRow = kAbsorbCols / 16;
  for (int i = threadIdx.x; i < rows_here * kVecsPerRow; i += kAbsorbThreads) {
    const int r = i / kVecsPerRow, v = i % kVecsPerRow;
    uint8_t* dst = p.query + (int64_t(row0 + r) * p.num_heads_out + p.head_offset + head) * kKeyDim + col0 + v * 16;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(s_out + r * kAbsorbOutStride + v * 16);
  }
  __syncthreads();  // every store of the CTA issued before the trigger
  MLA_TIMELINE_MARK(p.timeline, kAbsorbMarkEnd);
  trigger_dependents();
}

}  // namespace mla::query
