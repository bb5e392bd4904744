// Tile constants and shared-memory plans of the query kernels. Host and device derive every size
// from these structs; nothing is recomputed by hand.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mla/dims.h"

namespace mla::query {

// ---- Kernel 1: norms + q_b_proj (split-K partials) --------------------------------------------
// A warp owns one tile of 16 output features (rows of q_b_proj) and streams it over the CTA's
// K slice in chunks of 32, straight from global memory into mma.sync A fragments.
inline constexpr int kProjWarps = 8;                   // warps per CTA = feature tiles per CTA
inline constexpr int kProjThreads = kProjWarps * 32;
inline constexpr int kFeatureTile = 16;                // mma M
inline constexpr int kKChunk = 32;                     // k per 16-byte load of each lane (2 mma k-steps)
inline constexpr int kNumKChunks = kQLoraRank / kKChunk;  // 48
inline constexpr int kProjPrefetch = 4;                // chunks in flight per warp
inline constexpr int kTilesPerHead = kQkHeadDim / kFeatureTile;  // 12
static_assert(kQkHeadDim % kFeatureTile == 0, "head rows must tile by 16");
static_assert(kQLoraRank % kKChunk == 0, "q_lora_rank must tile by 32");

// Row stride (elements) of the normed q_a slice in shared memory: ≡ 64 bytes mod 128 so that the
// 16-byte B-fragment loads of one quarter-warp (2 rows x 64 bytes) hit distinct banks.
constexpr int proj_smem_stride(int split_len) { return split_len + (split_len % 64 == 0 ? 32 : 0); }

struct ProjSmemPlan {
  int row_tile;   // rows per CTA (8 * n-tiles)
  int split_len;  // K slice
  constexpr size_t qn_bytes() const { return size_t(row_tile) * proj_smem_stride(split_len) * 2; }
  constexpr size_t inv_rms_bytes() const { return size_t(row_tile) * sizeof(float); }
  constexpr size_t bytes() const { return qn_bytes() + inv_rms_bytes(); }
};

// ---- Kernel 2: bf16(q) . W_UK_T[h] -> e4m3 query; rope part; cache row -------------------------
inline constexpr int kAbsorbWarps = 4;
inline constexpr int kAbsorbThreads = kAbsorbWarps * 32;
inline constexpr int kAbsorbMaxRows = 64;

struct AbsorbSmemPlan {
  int cols;  // latent columns of this CTA (multiple of 32)
  int rows;  // rows of this CTA (multiple of 8)
  constexpr int w_stride() const { return cols + 8; }        // bf16 elements; 16-byte skew: ldmatrix conflict-free
  constexpr int q_stride() const { return kNopeDim + 8; }    // bf16 elements
  constexpr int out_stride() const { return cols + 16; }     // bytes
  constexpr size_t w_bytes() const { return size_t(kNopeDim) * w_stride() * 2; }
  constexpr size_t q_bytes() const { return size_t(rows) * q_stride() * 2; }
  constexpr size_t out_bytes() const { return size_t(rows) * out_stride(); }
  constexpr size_t bytes() const { return w_bytes() + q_bytes() + out_bytes(); }
};

}  // namespace mla::query
