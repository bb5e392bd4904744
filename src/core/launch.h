// Host API of the FP8 attention core: plan once per shape, then launch only (no allocation, no
// synchronization, graph-capturable, PDL-chained). DESIGN.md §4 (core, split-KV, DCP mapping).
//
//   mla::core::CorePlan plan = mla::core::plan_core({.rows = 128, .heads = 16, .q = 1});
//   workspace = cudaMalloc(plan.workspace_bytes);            // caller-owned, once
//   mla::core::launch_core(plan, args, stream);              // every step
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "mla/mla.h"

namespace mla::core {

// One launch shape of the core.
struct CoreShape {
  int64_t rows = 0;                        // query rows (= requests * q, padding requests included)
  int heads = 0;                           // H_core: H, or D*H under DCP
  int q = 1;                               // rows per request, 1..8
  int64_t max_context = int64_t{1} << 17;  // longest local sequence: bounds the split count
  int num_splits = 0;                      // 0 = choose so that one step fills every SM; > 0 forces it
  int kernel = 0;                          // 0 = planned; forces one: kKernelMmaSync or kKernelWgmmaPp
  int stages = 0;                          // page ring depth: mma.sync 2, 3 or 4, wgmma-pp 2 or 3; 0 = default
  int tile_rows = 0;                       // wgmma-pp N-tile 16, 32, 48 or 64; 0 = choose_wgmma_tile(q*heads)
};

// Flat slots merge in the split kernel (CorePlan::merge_in_split) at one planned split, and at two where the M-tile
// has at most kMaxRowsMergedAtTwoSplits rows: a request then spans few CTAs (about S + 1 at a ±50 % spread) and the
// CTA that merges it reads their partials, slots x tile rows x 2 KB, on its own path. Measured at two splits (H100,
// 2026-12-05 ~21:32-21:40 UTC, bench/results/core.md): 16-row tiles 1.00-1.03x against the combine kernel, 64-row
// tiles 0.96x on a varlen batch (64 x 8k ±50 % x 16 x 4). Elsewhere the combine kernel spreads the merge over the
// machine.
inline constexpr int kMaxRowsMergedAtTwoSplits = 16;

// Split-kernel variants (CoreShape.kernel / CorePlan.kernel). NOTE: 2 was the lockstep wgmma kernel, never planned and
// removed 2026-12-06 (src/core/README.md); the others keep their numbers, which results and docs quote.
inline constexpr int kKernelMmaSync = 1;  // version 1: mma.sync, 16-row M tiles (kernel.cuh)
inline constexpr int kKernelWgmmaPp = 3;  // wgmma, ping-pong: two warpgroups taking pages in turns (kernel_wgmma_pp.cuh)

// The variant's name in tables and test traces.
inline const char* kernel_name(int kernel) {
  switch (kernel) {
    case kKernelMmaSync: return "mma.sync";
    case kKernelWgmmaPp: return "wgmma-pp";
    default: return "unknown";
  }
}

// What plan_core fixed for a shape. Plain data: copy it freely.
struct CorePlan {
  CoreShape shape;
  int num_splits = 1;          // split-KV count (1: the split kernel writes latent/lse directly)
  int kernel = kKernelMmaSync; // split-kernel variant
  int tile_rows = 16;          // rows of a request's q*heads M side per CTA (mma.sync: 16)
  int m_tiles = 1;             // tiles of tile_rows over a request's q*heads M side
  int stages = 2;              // K/V page ring depth
  int ctas_per_sm = 1;         // occupancy of the split kernel
  int num_sms = 0;             // multiprocessors of the planned device
  dim3 grid;                   // split kernel grid (m_tiles, num_splits, requests); flat: (m_tiles,
                               // num_splits * requests, 1), the batch's pages dealt over the CTAs (split_rule.h)
  bool flat_slots = false;     // the batch's pages flattened over num_splits * requests CTAs across request
                               // boundaries (split_rule.h, flat_cta_range): more than one request and
                               // num_splits * requests <= 65535 (grid y)
  int64_t partial_slots = 1;   // partial rows' slots in the workspace: num_splits * requests (+ requests - 1 flat)
  bool merge_in_split = false; // flat slots at one split (two at <= kMaxRowsMergedAtTwoSplits rows): the segment CTA that finishes a
                               // request's M-tile last merges it (kernel.cuh: mma.sync into its registers, core_split_kernel;
                               // ping-pong merge_if_last_segment); no combine
  int64_t tile_counters = 0;   // ints of CoreArgs::tile_counters the merge needs: 2 * requests * m_tiles (0: none)
  size_t smem_bytes = 0;       // dynamic shared memory of the split kernel
  size_t workspace_bytes = 0;  // device workspace the caller provides (0 when the split kernel writes the latent)
  int combine_warps_per_entry = 1;  // combine kernel: warps per (entry, 128-dim chunk)
  dim3 combine_grid;                // combine kernel grid and block (unused when num_splits == 1)
  dim3 combine_block;
};

// The ping-pong wgmma kernel's planned N-tile for a request's q*heads rows: the smallest tile holding them, and
// above 64 the fewest tiles with the least padding (pure host rule, no CUDA call).
int choose_wgmma_tile(int rows_m);

// The split count for `work` CTAs' worth of (request, tile) items on `slots` CTA slots (SMs x CTAs/SM): the
// smallest count up to max_splits whose CTAs fill whole waves to >= 95 %, else the most efficient one
// (pure host rule, no CUDA call).
int choose_splits(int64_t work, int64_t slots, int64_t max_splits);

// The split count of a batch of one request (its `tiles` M-tiles): choose_splits' count, raised to the whole wave
// (slots / tiles, up to max_splits) where that count fits in one wave. One request's longest split holds
// ceil(pages / splits) pages, so the wave's last slots shorten it (pure host rule, no CUDA call).
int choose_splits_one_request(int64_t tiles, int64_t slots, int64_t max_splits);

// The combine's warps per (entry, 128-dim chunk) for `num_splits` splits: the smallest power of two up to
// kCombineMaxWarps whose warps, kCombineLoadsInFlight rows each, take every split in one round (pure).
int combine_warps_per_entry(int num_splits);

// Plans `shape` for the current device (sets the kernels' shared-memory limits). Throws mla::Error
// on a bad shape.
CorePlan plan_core(const CoreShape& shape);

// Whether launch_core runs the combine kernel after the split kernel for this plan (its grid: combine_grid).
bool launches_combine(const CorePlan& plan);

// Device pointers and per-step values. All tensors contiguous unless a stride is given.
struct CoreArgs {
  const void* query = nullptr;           // [rows, heads, 576] FP8 e4m3
  const void* cache = nullptr;           // [num_pages, 64, 576] FP8 e4m3, 16-byte aligned
  int64_t stride_cache_page = 64 * 576;  // bytes between pages (multiple of 16)
  const int32_t* block_table = nullptr;  // [num_requests, max_pages]
  int64_t stride_block_table = 0;        // elements between rows of block_table
  const int32_t* lengths = nullptr;      // [num_requests] local tokens
  const int32_t* totals = nullptr;       // [num_requests] global lengths (DCP); null = lengths
  int num_requests = 0;                  // <= rows / q; the rest are padding (zero latent, -inf lse)
  DcpLayout dcp;                         // local -> global positions (size 1 = none)
  float softmax_scale = 0;               // multiplies the raw FP8 dot products (natural-log logits)
  float k_scale = 1;                     // multiplies the output latent
  void* latent = nullptr;                // [rows, heads, 512] bf16 out
  float* lse = nullptr;                  // [rows, heads] fp32 natural log out
  void* workspace = nullptr;             // plan.workspace_bytes, 16-byte aligned (may be null if 0)
  // plan.tile_counters ints (plan.merge_in_split; may be null if 0), zero before the first launch: every launch
  // leaves them zero. Unlike the workspace they hold state between launches: not scratch anyone else may write, and
  // one set per stream of launches (PreparedMla owns its own).
  int* tile_counters = nullptr;
  // The next stage's weights (PreparedMla: W_UV), asked into L2 by the combine kernel's CTAs before their PDL wait,
  // each its share (cp.async.bulk.prefetch.L2): a hint, nothing here reads them, and only where the plan launches the
  // combine kernel (it merges, and not in the split kernel). Null = none; else 16-byte aligned, a multiple of 16
  // bytes. During the merge DRAM is mostly idle; at few rows the value stage is a latency chain over its weights.
  const void* l2_prefetch = nullptr;
  int64_t l2_prefetch_bytes = 0;
  // Profiling only (MLA_TIMELINE builds, core_bench --timeline; other builds record nothing): the split kernel's
  // (mma.sync or ping-pong) [grid CTAs, timeline::kMaxMarks] and the combine's [combine grid CTAs, ...] %globaltimer stamps
  // (config.h, CoreMark / CombineMark); null records nothing.
  uint64_t* timeline = nullptr;
  uint64_t* combine_timeline = nullptr;
};

// Launches the split kernel (with `pdl`, PDL-dependent on the previous kernel in `stream`; without,
// it starts after everything before it completed) and, where partials need merging and the split kernel does not
// merge them itself (merge_in_split), the combine kernel (PDL-chained). Only launches.
void launch_core(const CorePlan& plan, const CoreArgs& args, cudaStream_t stream, bool pdl = true);

}  // namespace mla::core
