// Tile constants and the shared-memory plan of the FP8 attention core (one source of truth for sizes).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_fp16.h>

#include "common/timeline.h"
#include "mla/dims.h"

namespace mla::core {

// ---- Tiles -----------------------------------------------------------------------------------------
// One CTA = one (request, split, M-tile) where the M side folds a request's q rows with its heads:
// M index mi = i * H + h (so a request's M rows are contiguous in the query, latent and LSE).
inline constexpr int kBlockM = 16;                 // rows of one M-tile (one mma.sync m16)
// NOTE: 8 warps, not 4: with one warp per scheduler every dependent MMA / shared load / MUFU
// latency is exposed (measured: 4 warps x 1-2 CTAs/SM ran at 27-42 % of copy bandwidth).
inline constexpr int kNumWarps = 8;                // QK: warp w owns tokens [16(w%4), +16) x k half w/4;
                                                   // PV: warp w owns latent dims [64w, 64w+64)
inline constexpr int kNumThreads = kNumWarps * 32;
// NOTE: Q·K^T splits the 576-long reduction in two halves (warps 0-3 and 4-7, partial sums added
// through shared memory) so that each warp's query fragments feed two n8 token tiles: the query tile
// is read from shared memory once per 16 tokens instead of once per 8 (27 instead of 45 ldmatrix.x4 a
// warp and page; measured 144.3 -> 127.3 µs at 128x4k x16, src/core/README.md).
inline constexpr int kQkTokenGroups = 4;                           // warps per k half
inline constexpr int kQkTokensPerWarp = kPageSize / kQkTokenGroups;  // 16: two n8 tiles
inline constexpr int kQkKHalves = kNumWarps / kQkTokenGroups;        // 2
inline constexpr int kQkStepsPerWarp = kKeyDim / 16 / kQkKHalves;    // 18 k16 steps
inline constexpr int kDimsPerWarp = kKvLoraRank / kNumWarps;      // 64
inline constexpr int kPageBytes = kPageSize * kKeyDim;            // 36864 bytes that one page moves

// Online softmax of version 1 (kernel.cuh, 3c): P = exp2(x - m) against the running max m of the
// pages before while no logit of the page exceeds m by more than this (P <= 2^8 in fp16, whose range
// ends at 2^16); past it the CTA raises m exactly (one more barrier, P recomputed, sums rescaled).
inline constexpr float kLazyMaxSlack = 8.0f;

// NOTE: a cached token row (576 B) lands in shared memory padded to 592 B (148 words = 20 mod 32).
// That makes the 8-row ldmatrix of K (Q·K^T) and the 8-row ldmatrix.trans of V (P·V) conflict-free.
inline constexpr int kKvRowBytes = kKeyDim + 16;
// P tile: 16 rows x 64 tokens of fp16, rows padded to 72 halves (36 words = 4 mod 32): the A-fragment
// loads (row g, word c) and the stores hit 32 distinct banks.
inline constexpr int kPRowHalves = kPageSize + 8;
// f16 query tile: 16 rows x 576 halves, rows padded to 584 halves (292 words = 4 mod 32): the
// ldmatrix rows of one 8x8 matrix hit 32 distinct banks.
inline constexpr int kQRowHalves = kKeyDim + 8;

static_assert(kQkTokensPerWarp == 16 && kQkKHalves == 2 && kQkStepsPerWarp % 2 == 0,
              "QK: two n8 token tiles per warp, two k halves of whole k16-step pairs");
static_assert(kKvLoraRank == kNumWarps * kDimsPerWarp && kDimsPerWarp % 32 == 0,
              "PV: each warp owns whole 32-dim chunks of the latent");
static_assert(kKeyDim % 64 == 0, "QK loads K with ldmatrix.x4 over 64-byte column blocks");
static_assert(kKvRowBytes % 16 == 0 && kKeyDim % 16 == 0, "bulk copies need 16-byte sizes and addresses");

// ---- Shared memory ---------------------------------------------------------------------------------
template <int kStages>
struct SharedMemoryPlan {
  alignas(128) uint8_t kv[kStages][kPageSize][kKvRowBytes];  // K/V page ring (V = K[:, 0:512])
  alignas(16) __half p[kBlockM][kPRowHalves];                // P of the current page (fp16)
  alignas(16) __half q[kBlockM][kQRowHalves];                // the query tile, f16 (k permuted: kernel.cuh)
  alignas(16) float4 s_part[kQkTokenGroups][2][32];          // QK partial sums of the second k half
  float row_max[kQkTokenGroups][kBlockM];                    // per-token-group page row max (base-2 logits)
  float row_sum[kQkTokenGroups][kBlockM];                    // per-token-group softmax sums at the end
  alignas(8) uint64_t full[kStages];                         // mbarrier per stage: page landed
};

// ---- wgmma (the helpers: wgmma.cuh) -------------------------------------------------------------------
// One CTA = two warpgroups over one (request, split, N-tile) where the N side holds kTileN of the request's folded M
// rows ("swap AB": the 64 tokens of a page are the wgmma M side, so H·q = 16 wastes nothing). Warpgroup w computes
// O^T for latent dims [256w, 256w + 256) over all kTileN rows.
inline constexpr int kWgThreads = 256;
inline constexpr int kWgDims = kKvLoraRank / 2;      // latent dims per warpgroup
inline constexpr int kSw64Bytes = 64;                // K-major 64-byte swizzle: one column block's row
inline constexpr int kKeyBlocks = kKeyDim / kSw64Bytes;  // 9 column blocks of a token row
inline constexpr int kPageBlockBytes = kPageSize * kSw64Bytes;  // 4096: one column block of a page
static_assert(kKeyDim % kSw64Bytes == 0, "a token row splits into whole 64-byte swizzle blocks");
static_assert(kPageSize * 2 == 128, "P^T rows (64 fp16 tokens) are exactly one 128-byte swizzle row");
static_assert(kKvLoraRank == 2 * kWgDims && kWgDims == 4 * 64, "each warpgroup owns four m64 dim tiles");

// Page: FP8 [column block 9][token 64][64 B], 16-byte chunk c of token r stored at chunk
// c ^ ((r >> 1) & 3) (a 64-byte swizzle: keeps the ldmatrix of K and the V loads conflict-free).
// Query tile: f16 [k block 9][row kTileN][64 halves], K-major with the wgmma 128-byte swizzle (chunk c of
// row r at c ^ (r & 7)), its k order permuted within each 16-element step to match the K fragments
// (wgmma.cuh). P^T: [row kTileN][64 tokens] fp16, the same 128-byte swizzle.
inline constexpr int kSw128Halves = 64;  // f16 elements of one 128-byte swizzle row

// ---- Ping-pong wgmma kernel (kernel_wgmma_pp.cuh) -----------------------------------------------------
// Two warpgroups over one (request, split, N-tile) taking the pages in turns: warpgroup k % 2 runs page k's
// Q·K^T and softmax, both run its P·V for their 256 latent dims.
template <int kTileN, int kStages>
struct WgmmaPpSharedMemoryPlan {
  alignas(1024) uint8_t kv[kStages][kPageBytes];                  // page ring, the 64-byte-swizzle layout above
  alignas(1024) __half q[kKeyDim / kSw128Halves][kTileN][kSw128Halves];
  alignas(1024) __half p[2][kTileN][kPageSize];                   // P^T of page k in buffer k % 2 (its owner's)
  float alpha[2][kTileN];                                         // per-row rescale of that P^T's page
  uint32_t raised[2];                                             // nonzero: the page raised a running max
  float m_cur[kTileN];                                            // running max (base 2) after the last softmax
  float red[2][4][kTileN];                                        // [warpgroup][warp][row]: page row max exchange
  float sum_red[2][4][kTileN];                                    // [warpgroup][warp][row]: final softmax sums
  float row_sum[kTileN];                                          // softmax sums of the tile's rows
  alignas(8) uint64_t full[kStages];                              // page landed (256 thread arrivals)
  uint64_t p_full[2];                                             // P^T written (its owner's 128 arrivals)
  static_assert(kTileN % 16 == 0 && kTileN <= 64, "kTileN: 16, 32, 48 or 64");
};

// How the split kernel's CTA slots are dealt (CorePlan): num_splits each (uniform), or the batch's pages flattened over
// the CTAs across request boundaries (flat, split_rule.h flat_cta_range). The combine takes the same mode.
// Flat-merged: flat slots whose partials the split kernel merges itself (CorePlan::merge_in_split; no combine). Its
// own instantiation, so that the flat kernels the combine follows carry none of the merge's code (which cost them 1-3 %
// by register allocation alone at 48/64-row tiles: H100, 2026-12-05, bench/results/core.md ~23:13).
// NOTE: 1 was the balanced deal (by pages, one slot a request at least), removed 2026-12-06 with the lockstep wgmma
// kernel, its only user; the other values stay, as they name the kernels' instantiations (kSlots in the symbols).
inline constexpr int kSlotsUniform = 0;
inline constexpr int kSlotsFlat = 2;
inline constexpr int kSlotsFlatMerged = 3;
constexpr bool is_flat(int slots) { return slots == kSlotsFlat || slots == kSlotsFlatMerged; }

// Splits: whole pages per split, at most this many (bounds the combine's work per entry).
inline constexpr int kMaxSplits = 1024;
// Combine kernel: a group of warps_per_entry warps per (entry, 128-dim chunk) takes the request's nonempty
// splits round-robin, each warp with kCombineLoadsInFlight latent rows in flight; a CTA holds
// max(warps_per_entry, kCombineMinWarps) warps (launch.cu picks warps_per_entry from the split count).
inline constexpr int kCombineMaxWarps = 16;
inline constexpr int kCombineMinWarps = 4;
inline constexpr int kCombineDims = 128;
inline constexpr int kCombineLoadsInFlight = 8;

// Timeline marks (MLA_TIMELINE builds, `core_bench --timeline`): each is recorded by thread 0 of a CTA when the
// phase it names is complete in that CTA. A CTA without pages records every mark at its exit.
enum CoreMark : int {
  kCoreMarkStart,      // kernel entry
  kCoreMarkWaited,     // griddepcontrol.wait returned (its metadata was read before it)
  kCoreMarkQuery,      // the first segment's query tile is in shared memory (its loads go out before the first page's)
  kCoreMarkFirstPage,  // the first page has landed
  kCoreMarkPages,      // the last segment's page loop is done
  kCoreMarkEnd,        // the last stores are issued: dependents are triggered next
  kNumCoreMarks
};
inline constexpr const char* kCoreMarkNames[kNumCoreMarks] = {"start", "waited", "query", "first page", "pages", "end"};
enum CombineMark : int {
  kCombineMarkStart,     // kernel entry
  kCombineMarkMetadata,  // the work before the PDL wait: the request's length (the uniform deal bounds its first loads
                         // by the nonempty splits, so it waits for it here) and the value weights' L2 prefetch request
  kCombineMarkWaited,    // griddepcontrol.wait returned
  kCombineMarkEnd,       // the merged rows are stored: dependents are triggered next
  kNumCombineMarks
};
inline constexpr const char* kCombineMarkNames[kNumCombineMarks] = {"start", "metadata", "waited", "end"};
static_assert(kNumCoreMarks <= timeline::kMaxMarks && kNumCombineMarks <= timeline::kMaxMarks,
              "the timeline holds timeline::kMaxMarks marks a CTA");

}  // namespace mla::core
