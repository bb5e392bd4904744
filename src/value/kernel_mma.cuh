// The tensor-core value kernel (large batches, no DCP merge):
//   out[r, h*128 + c] = bf16((latent[r, h] . W_UV[h][:, c]) * sigmoid(gate[r, h*128 + c]))
// per head a [rows x 512] . [512 x 128] GEMM on mma.sync m16n8k16 (bf16 operands, fp32 accumulate),
// a CTA per (64-row tile, head) and all 128 columns, or per (tile, head, 32-column split),
// the gate and the zero rows in the epilogue with the CUDA-core kernel's numerics (kernel.cuh):
// v / (1 + expf(-gate)) in fp32, bf16 round-to-nearest, exactly +0 for empty and padded rows.
//
// NOTE: no DCP merge here. The merged latent is fp32 and DESIGN.md §4 (DCP) does not round it to bf16
// before W_UV; this kernel's A operand is bf16, so num_partials > 1 always runs the CUDA-core kernel
// (plan_value / launch_value enforce it).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mla/dims.h"
#include "query/device_utils.cuh"  // mma_bf16_16816, ldmatrix_x4, ldmatrix_x4_trans (GPU-tested wrappers)
#include "value/config.h"
#include "value/kernel.cuh"  // is_zero_row
#include "value/params.h"

namespace mla::value {

// 16-byte cp.async (L2 only: every byte is used once per CTA); with valid = false it reads nothing and
// writes 16 zero bytes (the zero-fill form, src-size 0): rows past the batch.
__device__ __forceinline__ void cp_async_16_or_zero(void* smem_ptr, const void* gmem_ptr, bool valid) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  const uint32_t src_bytes = valid ? 16u : 0u;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(addr), "l"(gmem_ptr), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// K chunk `chunk` of the CTA's kCols columns of W_UV[h] ([512][128] row-major, `w_cols` at the first
// column) into a [64 k][kCols] stage: kCols / 8 16-byte vectors a k row.
template <int kCols>
__device__ __forceinline__ void load_w_chunk(MmaSharedPlan<kCols>& smem, int stage, const __nv_bfloat16* w_cols,
                                             int chunk) {
  constexpr int kVecsPerRow = kCols / 8;
  static_assert((kMmaChunkK * kVecsPerRow) % kMmaThreads == 0, "whole vectors per thread");
#pragma unroll
  for (int j = 0; j < kMmaChunkK * kVecsPerRow / kMmaThreads; ++j) {
    const int i = threadIdx.x + j * kMmaThreads;
    const int k = i / kVecsPerRow, c = (i % kVecsPerRow) * 8;
    cp_async_16_or_zero(&smem.w[stage][k][c], w_cols + (chunk * kMmaChunkK + k) * kVHeadDim + c, true);
  }
}

// A [64 rows][8·kVecsPerRow] bf16 tile by cp.async: tile row r is row `row_begin + r` of the matrix at
// `base` (`stride` elements a row) into dst(r, c) (c = first element of the 16-byte vector); rows past
// `rows` are zero-filled without reading memory.
template <int kVecsPerRow, class Dst>
__device__ __forceinline__ void load_row_tile(const __nv_bfloat16* base, int64_t stride, int rows, int row_begin,
                                              Dst dst) {
  static_assert((kMmaRowTile * kVecsPerRow) % kMmaThreads == 0, "whole vectors per thread");
#pragma unroll
  for (int j = 0; j < kMmaRowTile * kVecsPerRow / kMmaThreads; ++j) {
    const int i = threadIdx.x + j * kMmaThreads;
    const int r = i / kVecsPerRow, c = (i % kVecsPerRow) * 8;
    const int row = row_begin + r;
    const bool valid = row < rows;
    cp_async_16_or_zero(dst(r, c), valid ? base + row * stride + c : base, valid);
  }
}

// K chunk `chunk` of the tile's latent rows ([64 rows][64 k], 8 vectors a row).
template <int kCols>
__device__ __forceinline__ void load_latent_chunk(MmaSharedPlan<kCols>& smem, int stage, const ValueParams& p,
                                                  int row_begin, int head, int chunk) {
  load_row_tile<kMmaChunkK / 8>(p.latent + head * kKvLoraRank + chunk * kMmaChunkK, p.stride_latent_row, p.rows,
                                row_begin, [&](int r, int c) { return &smem.latent[stage][r][c]; });
}

// The tile's gate logits [64 rows][kCols columns from column col_begin of the head].
template <int kCols>
__device__ __forceinline__ void load_gate(MmaSharedPlan<kCols>& smem, const ValueParams& p, int row_begin, int head,
                                          int col_begin) {
  load_row_tile<kCols / 8>(p.projected + kProjectedGateOffset + head * kVHeadDim + col_begin, p.stride_projected_row,
                           p.rows, row_begin, [&](int r, int c) { return &smem.gate_out[r][c]; });
}

// Grid: (row tiles of 64, heads, kVHeadDim / kCols column splits); kMmaThreads threads;
// sizeof(MmaSharedPlan<kCols>) dynamic shared memory. Requires (launch_value checks): latent, w_uv,
// projected 16-byte aligned, stride_latent_row and stride_projected_row multiples of 8. `out` may have
// any bf16 alignment (16-byte stores when aligned).
template <int kCols>
__global__ void __launch_bounds__(kMmaThreads, kMmaMinCtasPerSm) value_mma_kernel(const __grid_constant__ ValueParams p) {
  using Tile = MmaTile<kCols>;
  constexpr int kMTiles = Tile::kMTiles, kNTiles = Tile::kNTiles;
  // ---- 1. Grid mapping: CTA = (64-row tile, head, column split), kCols columns of the head. Warp
  // (wm, wn) owns rows [kWarpRows wm, +kWarpRows) x columns [kWarpCols wn, +kWarpCols) of the tile.
  const int row_begin = blockIdx.x * kMmaRowTile;
  const int head = blockIdx.y;
  const int col_begin = blockIdx.z * kCols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row = (warp / Tile::kWarpsN) * Tile::kWarpRows;
  const int warp_col = (warp % Tile::kWarpsN) * Tile::kWarpCols;

  extern __shared__ __align__(16) uint8_t smem_raw[];
  MmaSharedPlan<kCols>& smem = *reinterpret_cast<MmaSharedPlan<kCols>*>(smem_raw);
  MLA_TIMELINE_MARK(p.timeline, kValueMarkStart);
  const __nv_bfloat16* w_cols = p.w_uv + static_cast<int64_t>(head) * kKvLoraRank * kVHeadDim + col_begin;

  // ---- 2. Prologue. The weights do not depend on the previous kernel: the W_UV chunks of the first
  // kMmaStages - 1 stages stream in before the PDL wait, overlapping the producer's tail. The latent
  // (the core's output) and the gate (read only after the wait, like every step input) follow it.
  // cp.async groups: group s = {latent chunk s} (group 0 also holds the early W_UV chunks and the
  // gate tile); the main loop commits exactly one group per chunk, so chunk c is group c.
#pragma unroll
  for (int s = 0; s < kMmaStages - 1; ++s) load_w_chunk(smem, s, w_cols, s);
  cudaGridDependencySynchronize();
  MLA_TIMELINE_MARK(p.timeline, kValueMarkWaited);
  load_gate(smem, p, row_begin, head, col_begin);
#pragma unroll
  for (int s = 0; s < kMmaStages - 1; ++s) {
    load_latent_chunk(smem, s, p, row_begin, head, s);
    cp_async_commit();
  }

  // Zero rows of this thread's accumulator rows (fragment row g and g + 8 of each m16 tile), read now
  // so that the lengths' latency hides under the main loop. Rows past p.rows are never stored.
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: group and thread in group
  bool zero_row[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row_begin + warp_row + mt * 16 + half * 8 + g;
      zero_row[mt][half] = row >= p.rows || is_zero_row(p, row);
    }
  }

  // ---- 3. Main loop over the 8 K chunks. ldmatrix lane addressing (PTX ISA, ldmatrix / mma.m16n8k16):
  // lane l supplies row l % 8 of 8x8 matrix l / 8.
  //   A (latent [row][k], non-transposed): matrices (rows +0, k +0), (rows +8, k +0), (rows +0, k +8),
  //     (rows +8, k +8) = a0..a3 of the m16k16 fragment (a0: row g, k 2t..2t+1; a1: row g+8; a2: k+8).
  //   B (W_UV [k][column], .trans): matrices (k +0, n +0), (k +8, n +0), (k +0, n +8), (k +8, n +8) =
  //     b0, b1 of n8 tile 0 and b0, b1 of n8 tile 1 (b0: k 2t..2t+1, column g; b1: k+8).
  // Both: row offset (lane % 8) + 8 * ((lane / 8) % 2), column offset 8 * (lane / 16).
  const int ld_row = lane % 8 + 8 * ((lane / 8) % 2);
  const int ld_col = 8 * (lane / 16);
  float acc[kMTiles][kNTiles][4] = {};
  for (int chunk = 0; chunk < kMmaNumChunks; ++chunk) {
    cp_async_wait<kMmaStages - 2>();  // this thread's copies of chunk `chunk` have landed ...
    __syncthreads();                  // ... and every thread's; every warp is done with chunk - 1's stage
    // Refill the stage chunk - 1 used with chunk + kMmaStages - 1 (an empty group past the end keeps
    // the group count, hence the wait above, uniform).
    const int next = chunk + kMmaStages - 1;
    if (next < kMmaNumChunks) {
      load_w_chunk(smem, next % kMmaStages, w_cols, next);
      load_latent_chunk(smem, next % kMmaStages, p, row_begin, head, next);
    }
    cp_async_commit();

    const int stage = chunk % kMmaStages;
#pragma unroll
    for (int ks = 0; ks < kMmaChunkK; ks += 16) {
      uint32_t a[kMTiles][4], b[kNTiles / 2][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        query::ldmatrix_x4(a[mt], &smem.latent[stage][warp_row + mt * 16 + ld_row][ks + ld_col]);
      }
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        query::ldmatrix_x4_trans(b[np], &smem.w[stage][ks + ld_row][warp_col + np * 16 + ld_col]);
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          query::mma_bf16_16816(acc[mt][nt], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[nt / 2][2 * (nt % 2)],
                                b[nt / 2][2 * (nt % 2) + 1]);
        }
      }
    }
  }
  cp_async_wait<0>();  // only empty groups remain; the gate tile came with group 0
  __syncthreads();

  // ---- 4. Gate in place: each accumulator pair (c0, c1) / (c2, c3) is (row g / g + 8, columns 2t,
  // 2t + 1) of its m16n8 tile; its gate logits sit at the same place of gate_out, which the same thread
  // overwrites with the bf16 result. NOTE: the CUDA-core kernel's numerics exactly:
  // v / (1 + expf(-gate)) in fp32, round to nearest; zero rows 0.0f -> bf16 +0.
  // Bank check: word (row * S + column / 2) % 32 with S = kOutStride / 2 = 68 (kCols 128) or 20 (32):
  // (4 g + t + const) or (20 g + t + const) % 32, distinct over the warp either way.
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int local_row = warp_row + mt * 16 + half * 8 + g;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        auto* cell = reinterpret_cast<__nv_bfloat162*>(&smem.gate_out[local_row][warp_col + nt * 8 + 2 * t]);
        float r0 = 0.0f, r1 = 0.0f;
        if (!zero_row[mt][half]) {
          const float2 gate = __bfloat1622float2(*cell);
          r0 = acc[mt][nt][2 * half] / (1.0f + expf(-gate.x));
          r1 = acc[mt][nt][2 * half + 1] / (1.0f + expf(-gate.y));
        }
        *cell = __floats2bfloat162_rn(r0, r1);
      }
    }
  }
  __syncthreads();

  // ---- 5. Store the tile's rows < p.rows: 16 bytes a thread (a row's kCols columns per kCols / 8
  // lanes) where `out` is 16-byte aligned (rows are H * 256 bytes apart and column splits 64 bytes, so
  // then every row is), else bf16 by bf16.
  const int64_t stride_out_row = static_cast<int64_t>(p.num_heads) * kVHeadDim;
  __nv_bfloat16* out_head = p.out + static_cast<int64_t>(row_begin) * stride_out_row + head * kVHeadDim + col_begin;
  const int rows_here = min(kMmaRowTile, p.rows - row_begin);
  constexpr int kVecsPerRow = kCols / 8;
  if ((reinterpret_cast<uintptr_t>(p.out) & 15u) == 0) {
    for (int i = threadIdx.x; i < rows_here * kVecsPerRow; i += kMmaThreads) {
      const int r = i / kVecsPerRow, c = (i % kVecsPerRow) * 8;
      *reinterpret_cast<uint4*>(out_head + r * stride_out_row + c) =
          *reinterpret_cast<const uint4*>(&smem.gate_out[r][c]);
    }
  } else {
    for (int i = threadIdx.x; i < rows_here * kCols; i += kMmaThreads) {
      const int r = i / kCols, c = i % kCols;
      out_head[r * stride_out_row + c] = smem.gate_out[r][c];
    }
  }

  // ---- 6. Only after this thread's last store may the next kernel start reading.
  MLA_TIMELINE_MARK(p.timeline, kValueMarkEnd);  // thread 0's
  cudaTriggerProgrammaticLaunchCompletion();
}

}  // namespace mla::value
