// The query stage's GEMM path (large batches, DESIGN.md §4 query stage): the two projections run as
// cuBLAS GEMMs between two small kernels of ours (launch.cu):
//   1. gemm_norm_kernel      RMSNorm(q_a) -> qn bf16 [rows, 1536] (workspace); RMSNorm(kv_a) | k_pe ->
//                            the e4m3 cache row at the row's slot (after griddepcontrol.wait);
//   2. cuBLAS GEMM           q  = bf16(qn . q_b_proj^T) [rows, H*192], fp32 accumulate;
//   3. gemm_absorb_kernel    ql = q_nope[h] . W_UK_T[h] on wgmma (fp32), e4m3(ql / q_scale) and
//                            e4m3(q_rope / q_scale) into the query; triggers the dependents after its
//                            last store.
// The rounding points are the fused kernel's (and the spec's): qn, kvn and q in bf16, ql in fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/timeline.cuh"
#include "common/wgmma.cuh"
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

// ---- gemm_absorb_kernel: ql = q_nope . W_UK_T[h] on wgmma, e4m3 straight from the fp32 accumulators
// NOTE: our kernel rather than a cuBLAS batched GEMM: cuBLAS must write ql in fp32 (the spec rounds ql
// only once, to e4m3) and a quantize kernel read it back: 2 x 4 bytes an element through HBM, which
// made the GEMM path 0.87-0.92x the stock composition (bf16 ql) at 256 rows x H >= 64 on the H200.
// A CTA owns (head, row tile of 32, 64 or 128 rows: QueryPlan.absorb_row_tile, 128-column slice): the W_UK_T[h]
// slice (128 x 128) and the tile's q_nope in shared memory. Swap AB, as in the fused kernel's phase 5: M = the
// slice's columns, N = the tile's rows. Warpgroup wg takes the columns [64 wg, 64 wg + 64) by m64nNk16 wgmmas
// (N = the row tile): A = its columns of W from registers (ldmatrix.trans of the padded W tile, warp w's 16 columns
// [16w, 16w + 16): the mma.sync A fragment), B = the q tile from shared memory in the 128-byte swizzle (K-major,
// read by the tensor cores once a warpgroup).
// NOTE: on mma.sync every warp re-read the whole q tile through ldmatrix (160 KB of shared-memory reads a 64-row CTA
// against ~64 KB now); the timeline (H100, 2026-12-07) gave its math 1.3 µs a CTA alone on an SM, 2.3 µs at three.
inline constexpr int kAbsorbCols = 128;
inline constexpr int kAbsorbWarps = kAbsorbCols / 16;  // 8: two warpgroups of 64 columns
inline constexpr int kAbsorbThreads = kAbsorbWarps * 32;
inline constexpr int kAbsorbWStride = kAbsorbCols + 8;   // bf16; ldmatrix rows 16 bytes off per 128 B
inline constexpr int kAbsorbKBlock = 64;                 // bf16 a 128-byte swizzle row
inline constexpr int kAbsorbKBlocks = kNopeDim / kAbsorbKBlock;  // 2
inline constexpr int kAbsorbOutStride = kAbsorbCols + 16;  // bytes
inline constexpr size_t kAbsorbWBytes = size_t(kNopeDim) * kAbsorbWStride * 2;
static_assert(kKvLoraRank % kAbsorbCols == 0, "the latent columns must tile by the slice");

// The shared memory of a row tile: q first (the swizzle atoms need a 1024-byte aligned start, the dynamic window's
// base on sm_90), [k block 2][row][64] bf16; then W; then the staged e4m3 tile.
constexpr size_t absorb_q_bytes(int row_tile) { return size_t(row_tile) * kNopeDim * 2; }
constexpr size_t absorb_smem_bytes(int row_tile) {
  return absorb_q_bytes(row_tile) + kAbsorbWBytes + size_t(row_tile) * kAbsorbOutStride;
}
static_assert(absorb_q_bytes(32) % 1024 == 0, "W follows the swizzled q tile");

// D(64 x N) += A(64 x 16) . B(N x 16)^T: bf16, fp32 accumulate, A from registers, B from shared memory (K-major).
template <int N>
__device__ __forceinline__ void wgmma_bf16_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b);

template <>
__device__ __forceinline__ void wgmma_bf16_rs<32>(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_bf16_rs<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, "
      "%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_bf16_rs<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, "
      "%35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, "
      "%57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// CTAs an SM a row tile is built for (its launch bound): three as on mma.sync, two at 128 rows (64 accumulators).
constexpr int absorb_ctas_per_sm(int row_tile) { return row_tile == 128 ? 2 : 3; }

// Grid: (512 / 128 column slices, row tiles of kRowTile, H). Launched as a programmatic dependent of the q_b_proj
// GEMM: the weight slice streams in before griddepcontrol.wait, q after it. Slice 0 also quantizes
// the rope part of q. Triggers its dependents after its last store.
template <int kRowTile>
__global__ void __launch_bounds__(kAbsorbThreads, absorb_ctas_per_sm(kRowTile))
    gemm_absorb_kernel(const __grid_constant__ QueryParams p, const __nv_bfloat16* q) {
  static_assert(kRowTile == 32 || kRowTile == 64 || kRowTile == 128, "wgmma N: 32, 64 or 128 rows");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __nv_bfloat16* s_q = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* s_w = reinterpret_cast<__nv_bfloat16*>(smem_raw + absorb_q_bytes(kRowTile));
  uint8_t* s_out = smem_raw + absorb_q_bytes(kRowTile) + kAbsorbWBytes;
  const int col0 = blockIdx.x * kAbsorbCols, row0 = blockIdx.y * kRowTile, head = blockIdx.z;
  const int rows_here = min(kRowTile, p.num_rows - row0);
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
  // q_nope rows into [k block][row][64] with the 128-byte swizzle: chunk c of row r at 16 * (c ^ (r % 8)).
  constexpr int kQChunksPerRow = kNopeDim / 8;
  for (int i = threadIdx.x; i < kRowTile * kQChunksPerRow; i += kAbsorbThreads) {
    const int r = i / kQChunksPerRow, c = i % kQChunksPerRow;
    __nv_bfloat16* dst = s_q + (c / 8) * (kRowTile * kAbsorbKBlock) + r * kAbsorbKBlock + 8 * ((c % 8) ^ (r % 8));
    if (r < rows_here) {
      cp_async_16(dst, q + (int64_t(row0 + r) * p.num_heads + head) * kQkHeadDim + 8 * c);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);  // rows past the batch
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
  wgmma::fence_proxy_async();  // the q tile (cp.async and the zero rows' stores) is read by the async proxy
  __syncthreads();
  MLA_TIMELINE_MARK(p.timeline, kAbsorbMarkLoaded);

  // ql^T[16 columns of this warp, kRowTile rows], K = 128: one k block (four k16 steps) at a time, its A fragments loaded,
  // its wgmmas issued, then waited for. NOTE: all eight steps' fragments at once took 90 registers (2 CTAs an SM), or
  // 48 B of stack under the 3-CTA bound.
  const int mi = lane / 8, mj = lane % 8, g = lane / 4, t = lane % 4;
  constexpr int kStepsPerBlock = kAbsorbKBlock / 16;
  constexpr int kAcc = kRowTile / 2;
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  const uint32_t q_address = static_cast<uint32_t>(__cvta_generic_to_shared(s_q));
#pragma unroll
  for (int kb = 0; kb < kAbsorbKBlocks; ++kb) {
    uint32_t a[kStepsPerBlock][4];
#pragma unroll
    for (int s = 0; s < kStepsPerBlock; ++s) {
      const int k = (kb * kStepsPerBlock + s) * 16;
      ldmatrix_x4_trans(a[s], s_w + (k + mj + 8 * (mi / 2)) * kAbsorbWStride + warp * 16 + 8 * (mi % 2));
#pragma unroll
      for (int r = 0; r < 4; ++r) wgmma::fence_operand(a[s][r]);
    }
#pragma unroll
    for (int i = 0; i < kAcc; ++i) wgmma::fence_operand(acc[i]);
    wgmma::wgmma_fence();
#pragma unroll
    for (int s = 0; s < kStepsPerBlock; ++s) {
      // k block kb's 128-byte swizzle rows (8-row groups 1024 B apart), 32 bytes a k16 step.
      const uint32_t address = q_address + kb * (kRowTile * kAbsorbKBlock * 2) + s * 32;
      wgmma_bf16_rs<kRowTile>(acc, a[s], wgmma::gmma_desc(address, 8 * kAbsorbKBlock * 2, wgmma::kSwizzle128));
    }
    wgmma::wgmma_commit();
    wgmma::wgmma_wait<0>();  // the A registers are read before the next block's ldmatrix overwrites them
#pragma unroll
    for (int i = 0; i < kAcc; ++i) wgmma::fence_operand(acc[i]);
  }
  // D fragment: n8 tile j of the rows holds acc[4j .. 4j + 3], the mma.sync C layout (column g / g + 8, row 2t / 2t + 1).
#pragma unroll
  for (int j = 0; j < kRowTile / 8; ++j) {
    const float d[4] = {acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]};
    stage_e4m3_fragment(s_out, kAbsorbOutStride, j * 8, warp * 16, d, p.inv_q_scale, g, t);
  }
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
