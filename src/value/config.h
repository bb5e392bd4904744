// Tile plans of the two value kernels (DESIGN.md §4, value stage).
//
// CUDA-core kernel (kernel.cuh; few rows, and every DCP merge): one CTA owns one head, a 32-column
// slice of that head's 128 outputs and up to 16 rows: the CTA keeps its W_UV slice (512 x 32 bf16 =
// 32 KB) in registers, so the weight bytes are read from memory once per row tile, and before the PDL
// wait, under the previous kernel.
//
// Tensor-core kernel (kernel_mma.cuh; many rows, no DCP merge): one CTA owns one head and a 64-row
// tile, all 128 output columns, so every latent row is read from memory exactly once (the latent is
// the largest stream: rows x H x 1 KB) and W_UV[h] (128 KB) once per row tile, from L2 after the first
// tile of a head (the row tiles of a head are consecutive in the grid). mma.sync m16n8k16 (bf16 in,
// fp32 accumulate) over K chunks of 64 that cp.async streams through a 3-stage ring. Its split variant
// gives each of 4 CTAs 32 of the 128 columns (W_UV[h] read once, the latent tile 4 times, from L2):
// with few row tiles, H CTAs stream the weights too slowly (one SM's cp.async ring holds 48 KB).
#pragma once

#include <cuda_bf16.h>

#include "common/timeline.h"
#include "mla/dims.h"

namespace mla::value {

// ---- CUDA-core kernel -------------------------------------------------------------------------------
inline constexpr int kThreads = 256;
inline constexpr int kColumnsPerCta = 32;              // output columns of one head per CTA
inline constexpr int kColumnsPerThread = 8;            // one 16-byte W_UV load per k row
inline constexpr int kColumnGroups = kColumnsPerCta / kColumnsPerThread;  // 4 threads span the slice
inline constexpr int kKSlices = kThreads / kColumnGroups;                 // 64 slices of the reduction
inline constexpr int kKPerThread = kKvLoraRank / kKSlices;                // 8 latent elements each
inline constexpr int kRowsPerCta = 16;                 // rows whose outputs share the registers' W slice
inline constexpr int kRowsPerPass = 4;                 // rows reduced together (bounds accumulators)
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kColumnSlices = kVHeadDim / kColumnsPerCta;

static_assert(kColumnsPerCta % kColumnsPerThread == 0, "a thread covers whole 16-byte column groups");
static_assert(kThreads % kColumnGroups == 0 && kKvLoraRank % kKSlices == 0, "the reduction splits evenly");
static_assert(kKPerThread == 8, "a thread's latent elements are one 16-byte load");
static_assert(kVHeadDim % kColumnsPerCta == 0, "column slices tile a head");
static_assert(kRowsPerCta % kRowsPerPass == 0, "passes tile the row tile");

// Shared memory: per pass, each warp's partial sums for its rows and the CTA's columns.
struct SharedPlan {
  float partial[kRowsPerPass][kWarps][kColumnsPerCta];
};

// ---- Which kernel plan_value picks --------------------------------------------------------------------
// Without a DCP merge: the CUDA-core kernel below kTensorCoreMinRowHeads rows x heads (its grid of
// 4 column slices x H x rows/16 CTAs streams the weights with every SM when the GEMM is tiny); above it
// a tensor-core kernel: the full-width one once its grid (H x rows/64 CTAs) has kFullWidthMinCtas CTAs,
// else the 4-way column split.
// NOTE: set from bench/value_bench (bench/results/value.md, H200), which times all three kernels: the
// CUDA-core kernel wins only at H 12 x 1 row (3.6 vs 4.4 µs); the split one from H 12 x 4 rows and up to
// 96 full-width CTAs (H 96 x 32 rows: 9.6 vs 11.3 µs; H 96 x 64 a tie), the full-width one from 128
// (H 128 x 1 row: 8.8 vs 10.9 µs; H 96 x 128 rows: 16.6 vs 20.8).
inline constexpr int kTensorCoreMinRowHeads = 48;
// Up to one pass of rows (kRowsPerPass) the CUDA-core kernel also wins where its 4 x H CTAs fit one wave of 132 SMs:
// once it issued a pass's latent loads together (value-lengths-late), H = 12 x 4 rows took 3.41 µs against the split
// tensor-core kernel's 4.29 (H100, bench/results/value.md, 2026-12-06 ~23:45 UTC); from 16 rows (4 passes) it is 8.2
// against 4.9.
inline constexpr int kCudaCoreMaxHeadsOnePass = 32;
// One row up to this many heads also takes the CUDA-core kernel: its W_UV loads all go out before the PDL wait (one
// round trip), and PreparedMla has asked L2 for W_UV during the core's merge up to this size (8 MB), where the
// tensor-core kernels' chunk pipeline still takes ~7 µs at H = 96 with W_UV in L2 (value_bench --l2-warm).
inline constexpr int kCudaCoreMaxHeadsAtOneRow = 64;
// Above it, one row up to this many heads takes the packed-slice CUDA-core kernel (ValueKernel::kCudaCorePacked, 3
// CTAs an SM): its 4 x H CTAs then run in one wave of 132 SMs (H = 96: 384 CTAs, 1.45 waves at 2 an SM). W_UV comes
// from DRAM there (over PreparedMla's prefetch bound). Measured on an H100 (bench/results/value.md, 2026-12-06 ~07:35
// UTC): H = 96 x 1 row 9.65 -> 7.91 µs against the unpacked kernel (tensor-core/4: 8.2), steps 1 x 4k / 32k / 128k x
// H96 1.033 / 1.022 / 1.016x; where the unpacked grid already fits its waves the widening costs (H = 64 x 1 row step
// 0.981x, H = 12 x 4-64 rows 0.86-0.93x, H = 128 x 1 row (512 CTAs, two waves either way) 1.008x).
inline constexpr int kCudaCorePackedMaxHeadsAtOneRow = 96;
inline constexpr int kPackedCtasPerSm = 3;
inline constexpr int kUnpackedCtasPerSm = 2;  // 128 registers
inline constexpr int kFullWidthMinCtas = 128;

// ---- Tensor-core kernel -------------------------------------------------------------------------------
inline constexpr int kMmaRowTile = 64;      // rows of one CTA (M); W_UV[h] is re-read once per row tile
inline constexpr int kMmaWarps = 8;
inline constexpr int kMmaThreads = kMmaWarps * 32;
inline constexpr int kMmaChunkK = 64;       // K elements per pipeline stage
inline constexpr int kMmaNumChunks = kKvLoraRank / kMmaChunkK;  // 8
inline constexpr int kMmaStages = 3;        // cp.async ring: two chunks in flight while one is consumed
inline constexpr int kMmaMinCtasPerSm = 2;  // <= 128 registers a thread
// Column splits of the narrow variant (ValueKernel::kTensorCoreSplit): 4 CTAs share a (row tile, head),
// each with 32 of its 128 columns, so that few rows still put 4 x H CTAs to work on the weights.
inline constexpr int kMmaColumnSplits = 4;

// The tile plan of a CTA owning 64 rows x kCols output columns of one head (kCols = 128: the whole
// head; 32: one column split). Warp (wm, wn) of the kWarpsM x kWarpsN grid owns kWarpRows x kWarpCols.
// NOTE: 32 x 32 per warp (kCols 128) balances shared-memory reads and math: per k16 step a warp issues 2
// ldmatrix.x4 (A) + 2 ldmatrix.x4.trans (B) for 8 mma. The 32-column CTA takes 16 x 16 per warp: it
// runs where the weight stream, not the tensor cores, bounds the time.
template <int kCols>
struct MmaTile {
  static constexpr int kWarpsM = kCols == kVHeadDim ? 2 : 4;
  static constexpr int kWarpsN = kMmaWarps / kWarpsM;
  static constexpr int kWarpRows = kMmaRowTile / kWarpsM;
  static constexpr int kWarpCols = kCols / kWarpsN;
  static constexpr int kMTiles = kWarpRows / 16;
  static constexpr int kNTiles = kWarpCols / 8;
  // Shared row strides (bf16 elements). NOTE: each row padded by 16 bytes so that consecutive rows start
  // an odd number of 16-byte units apart: the 8 row addresses of one ldmatrix 8x8 matrix (and 8
  // consecutive 16-byte cp.async writes) hit 8 different 16-byte bank groups.
  static constexpr int kLatentStride = kMmaChunkK + 8;  // latent tile [row][k]
  static constexpr int kWStride = kCols + 8;            // W_UV tile [k][column]
  static constexpr int kOutStride = kCols + 8;          // gate-in / out-staging tile [row][column]

  static_assert(kCols == kVHeadDim || kCols == kVHeadDim / kMmaColumnSplits, "a whole head or one column split");
  static_assert(kMmaRowTile % (16 * kWarpsM) == 0, "warps tile the rows by whole m16 tiles");
  static_assert(kCols % (16 * kWarpsN) == 0, "warps tile the columns by pairs of n8 tiles (ldmatrix.x4.trans)");
  static_assert(kKvLoraRank % kMmaChunkK == 0 && kMmaChunkK % 16 == 0, "K chunks are whole k16 steps");
  static_assert(kMmaNumChunks >= kMmaStages - 1, "the prologue fills kMmaStages - 1 stages");
  static_assert((kLatentStride * 2) % 32 == 16 && (kWStride * 2) % 32 == 16 && (kOutStride * 2) % 32 == 16,
                "rows an odd number of 16-byte units apart: 16-byte aligned, conflict-free ldmatrix");
};

// Shared memory of the tensor-core kernel (dynamic; its size is sizeof, nothing recomputed by hand).
template <int kCols>
struct MmaSharedPlan {
  using Tile = MmaTile<kCols>;
  alignas(16) __nv_bfloat16 latent[kMmaStages][kMmaRowTile][Tile::kLatentStride];  // A: K chunk of 64 rows
  alignas(16) __nv_bfloat16 w[kMmaStages][kMmaChunkK][Tile::kWStride];              // B: K chunk of W_UV[h]
  alignas(16) __nv_bfloat16 gate_out[kMmaRowTile][Tile::kOutStride];               // gate logits, then out
};
static_assert(sizeof(MmaSharedPlan<kVHeadDim>) <= 113 * 1024, "two CTAs a SM (228 KB, 1 KB reserved per CTA)");

// ---- Timeline marks (MLA_TIMELINE builds; common/timeline.cuh), both kernels ----------------------------------
enum ValueMark : int {
  kValueMarkStart,   // kernel entry
  kValueMarkWaited,  // griddepcontrol.wait returned (the W_UV loads before it are issued)
  kValueMarkEnd,     // the last store is issued: dependents are triggered next
  kNumValueMarks
};
inline constexpr const char* kValueMarkNames[kNumValueMarks] = {"start", "waited", "end"};
static_assert(kNumValueMarks <= timeline::kMaxMarks, "the timeline holds timeline::kMaxMarks marks a CTA");

}  // namespace mla::value
