// Tile constants and the shared-memory plan of the query kernel. Host and device derive every size
// from these structs; nothing is recomputed by hand.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/timeline.h"
#include "mla/dims.h"

namespace mla::query {

// ---- q_b_proj tiling ---------------------------------------------------------------------------
// A warp owns one tile of 16 output features (rows of q_b_proj) and streams it over the CTA's K slice
// in chunks of 32, straight from global memory into mma.sync A fragments.
inline constexpr int kFeatureTile = 16;                          // mma M
inline constexpr int kKChunk = 32;                               // k per 16-byte load of each lane (2 mma k-steps)
inline constexpr int kTilesPerHead = kQkHeadDim / kFeatureTile;  // 12
inline constexpr int kRopeTilesPerHead = kRopeDim / kFeatureTile;  // 4: the last tiles of a head
// The plan (launch.cu, plan_fused): from this many heads at 8-row tiles, one CTA a head (C = 1, with rope CTAs) instead
// of clusters of two (measured: H 48-66 faster, H 40 slower).
inline constexpr int kMinHeadsOneCtaAHead = 48;
// The plan (launch.cu, fused_planned): at 17-32 rows, from this many heads (up to one wave of pairs) one 32-row tile of
// clusters of two instead of the GEMM path (measured: H 48-64 faster, H 40 faster only up to 24 rows, H 12-32 slower).
inline constexpr int kMinHeadsFusedPairs = 48;
static_assert(kQkHeadDim % kFeatureTile == 0, "head rows must tile by 16");
static_assert(kQLoraRank % kKChunk == 0, "q_lora_rank must tile by 32");

// Row stride (elements) of the normed q_a slice in shared memory: ≡ 64 bytes mod 128 so that the
// 16-byte B-fragment loads of one quarter-warp (2 rows x 64 bytes) hit distinct banks.
constexpr int proj_smem_stride(int split_len) { return split_len + (split_len % 64 == 0 ? 32 : 0); }

// ---- Fused kernel: one cluster of C CTAs per (head, row tile) -----------------------------------
// CTA r of a cluster owns the K slice [r*1536/C, (r+1)*1536/C) of the head's q_b_proj rows (one
// 16-feature tile per warp: 12 warps = the head's 192 features) and the 16-column tiles
// [r*32/C, (r+1)*32/C) of the absorption's 512 latent columns (C = 3 and 6 deal them 10-11 and 5-6 a
// rank); the C partial q tiles are summed through distributed shared memory, so a head's q never
// leaves the cluster.
inline constexpr int kFusedWarps = kTilesPerHead;  // 12
inline constexpr int kFusedThreads = kFusedWarps * 32;
inline constexpr int kFusedPrefetch = 8;            // 32-k chunks in flight per warp (8 KB per warp)
inline constexpr int kPartialStride = kQkHeadDim + 4;  // fp32; rows 2t apart land 8t banks apart
inline constexpr size_t kMaxSmemPerCta = 227 * 1024;
inline constexpr int kColTile = 16;                          // absorption m-tile (latent columns)
inline constexpr int kColTiles = kKvLoraRank / kColTile;     // 32

// The fused kernel's timeline marks (MLA_TIMELINE builds): each is recorded when the phase it names
// is complete in the CTA (thread 0's view).
enum QueryMark : int {
  kMarkStart,          // kernel entry
  kMarkIssued,         // the pre-wait weight loads are issued
  kMarkWaited,         // griddepcontrol.wait returned
  kMarkRowLoaded,      // the first q_a row (warp 0's) has arrived and its sum of squares is reduced
  kMarkNormed,         // the qn slice is in shared memory
  kMarkProjected,      // the projection loop is done (every warp)
  kMarkPartials,       // the partial tile is written
  kMarkClusterSynced,  // every partial tile of the cluster is visible
  kMarkSummed,         // q is in shared memory, W_UK_T has landed
  kMarkAbsorbed,       // ql is staged (every warp)
  kMarkEnd,            // the query stores are issued, peers are done: dependents are triggered next
  kNumQueryMarks
};
static_assert(kNumQueryMarks <= timeline::kMaxMarks, "the timeline holds timeline::kMaxMarks marks a CTA");
// Their names in a timeline report, in QueryMark order.
inline constexpr const char* kQueryMarkNames[kNumQueryMarks] = {
    "start", "issued", "waited", "row loaded", "normed", "projected", "partials", "cluster synced", "summed", "absorbed",
    "end"};
static_assert(kQueryMarkNames[kNumQueryMarks - 1] != nullptr, "one name per QueryMark");

// The GEMM path's timeline marks (MLA_TIMELINE builds), in one stamps buffer: the norm kernel's CTAs (one a row)
// first, then the absorb kernel's (timeline_ctas, launch.h). The cuBLAS GEMM between them records nothing: in a report
// it is the gap from the norm kernel's last CTA to the absorb kernel's first.
enum GemmNormMark : int {
  kNormMarkStart,   // kernel entry
  kNormMarkWaited,  // griddepcontrol.wait returned (the norm weights were asked for before it)
  kNormMarkSummed,  // both sums of squares are reduced (the row's loads have landed)
  kNormMarkEnd,     // qn and the cache row are stored
  kNumNormMarks
};
inline constexpr const char* kNormMarkNames[kNumNormMarks] = {"start", "waited", "summed", "end"};
enum GemmAbsorbMark : int {
  kAbsorbMarkStart,     // kernel entry
  kAbsorbMarkWaited,    // griddepcontrol.wait returned (the W_UK_T slice's copies were issued before it)
  kAbsorbMarkLoaded,    // the W_UK_T slice and the q tile are in shared memory, the rope part is stored
  kAbsorbMarkComputed,  // ql is staged as e4m3 (every warp)
  kAbsorbMarkEnd,       // the query stores are issued: dependents are triggered next
  kNumAbsorbMarks
};
inline constexpr const char* kAbsorbMarkNames[kNumAbsorbMarks] = {"start", "waited", "loaded", "computed", "end"};
static_assert(kNumNormMarks <= timeline::kMaxMarks && kNumAbsorbMarks <= timeline::kMaxMarks,
              "the timeline holds timeline::kMaxMarks marks a CTA");

struct FusedSmemPlan {
  int row_tile;  // rows per cluster (8 * n-tiles)
  int cluster;   // C: CTAs per cluster (K splits of q_b_proj, column splits of the absorption)
  constexpr int split_len() const { return kQLoraRank / cluster; }
  // Latent columns of rank r: tiles [r*32/C, (r+1)*32/C); cols() is the most any rank holds (the buffers' size).
  constexpr int col_begin(int rank) const { return rank * kColTiles / cluster * kColTile; }
  constexpr int cols_of(int rank) const { return col_begin(rank + 1) - col_begin(rank); }
  constexpr int cols() const { return (kColTiles + cluster - 1) / cluster * kColTile; }
  constexpr int qn_stride() const { return proj_smem_stride(split_len()); }      // bf16 elements
  constexpr int w_stride() const { return cols() + 8; }                          // bf16; ldmatrix conflict-free
  constexpr int q_stride() const { return kNopeDim + 8; }                        // bf16
  constexpr int out_stride() const { return cols() + 16; }                       // bytes
  // Region A holds the normed q_a slice during the projection, then the fp32 partial q tile.
  constexpr size_t qn_bytes() const { return size_t(row_tile) * qn_stride() * 2; }
  constexpr size_t partial_bytes() const { return size_t(row_tile) * kPartialStride * 4; }
  constexpr size_t a_bytes() const { return qn_bytes() > partial_bytes() ? qn_bytes() : partial_bytes(); }
  constexpr size_t w_offset() const { return a_bytes(); }
  constexpr size_t w_bytes() const { return size_t(kNopeDim) * w_stride() * 2; }
  constexpr size_t q_offset() const { return w_offset() + w_bytes(); }
  constexpr size_t q_bytes() const { return size_t(row_tile) * q_stride() * 2; }
  constexpr size_t out_offset() const { return q_offset() + q_bytes(); }
  constexpr size_t out_bytes() const { return size_t(row_tile) * out_stride(); }
  constexpr size_t bytes() const { return out_offset() + out_bytes(); }
};
static_assert(FusedSmemPlan{16, 1}.bytes() <= kMaxSmemPerCta, "C=1 must hold 16 rows");
static_assert(FusedSmemPlan{64, 2}.bytes() <= kMaxSmemPerCta, "C=2 must hold 64 rows");
static_assert(FusedSmemPlan{8, 8}.split_len() % kKChunk == 0, "every K slice must tile by 32");
static_assert(FusedSmemPlan{8, 6}.split_len() % kKChunk == 0, "every K slice must tile by 32");
static_assert(FusedSmemPlan{16, 3}.bytes() <= kMaxSmemPerCta, "C=3 must hold 16 rows");

}  // namespace mla::query
