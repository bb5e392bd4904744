// Host API of the fused query stage: plan once per (rows, H) at prepare time, then launch only.
//
//   QueryPlan plan = make_query_plan(rows, H);      // grid, cluster size, workspace bytes; smem limits
//   // caller allocates plan.workspace_bytes of device memory once (0 for the default plan)
//   launch_query(plan, args, stream);                // one kernel (or the two-kernel path); graph-capturable
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "query/params.h"

namespace mla::query {

// Optional overrides of the planner's choices (benchmark sweeps, tests); 0 = the planner decides.
struct QueryPlanOverrides {
  int two_kernel = 0;    // 1: the two-kernel path (proj_kernel + absorb_kernel) instead of the fused one
  int cluster_size = 0;  // fused: CTAs per (head, row tile): 1, 2, 4, 8 or 16
  int store_q = 0;       // fused: 1 = store the fp32 q (before its bf16 rounding) in the workspace (tests)
  int num_splits = 0;    // two-kernel: K splits of q_b_proj: a divisor of 48 (1, 2, 3, 4, 6, 8, 12, 16, 24, 48)
  int absorb_cols = 0;   // two-kernel: latent columns per absorb CTA: 32, 64, 128, 256 or 512
  int row_tile = 0;      // rows per proj CTA / per fused cluster: 8, 16, 32 or 64
  int trigger = 0;       // two-kernel: 0 = planner (early), 1 = early, 2 = after each proj CTA's last store
};

struct QueryPlan {
  int64_t rows = 0;
  int num_heads = 0;
  bool fused = true;         // one fused_query_kernel launch; false: proj_kernel + absorb_kernel
  // fused_query_kernel: grid (C, row tiles, H), clusters of C CTAs (row_tile below)
  int cluster_size = 1;
  dim3 fused_grid;
  size_t fused_smem = 0;
  // proj_kernel
  int row_tile = 8;          // 8 * n-tiles
  int num_splits = 1;
  int split_len = 1536;
  bool trigger_early = true;  // proj_kernel lets absorb_kernel launch right after its own wait
  dim3 proj_grid;
  size_t proj_smem = 0;
  // absorb_kernel
  int absorb_cols = 512;
  int absorb_rows = 64;
  dim3 absorb_grid;
  size_t absorb_smem = 0;
  // Two-kernel path: fp32 split-K partials [num_splits, rows, H*192]. Fused path: 0, or with
  // store_q the fp32 q [rows, H*192] (num_splits = 1). The caller allocates it (16-byte aligned).
  size_t workspace_bytes = 0;

  std::string describe() const;  // "rows=16 H=12 row_tile=16 splits=8 ..." for logs and benchmarks
};

// Throws mla::Error for rows outside 1..512, H outside 1..128 or invalid overrides (including a
// fused (row_tile, cluster_size) whose shared memory does not fit or whose cluster cannot be scheduled).
// Sets the kernels' dynamic shared-memory limits (host-side, once).
QueryPlan make_query_plan(int64_t rows, int num_heads, const QueryPlanOverrides& overrides = {});

// What one launch reads and writes. Device pointers; see QueryParams for shapes.
struct QueryArgs {
  const void* projected = nullptr;       // bf16 [rows, pitch]
  int64_t pitch = 0;                     // elements, >= 2112 + H*128
  const void* q_a_norm = nullptr;        // bf16 [1536]
  const void* kv_a_norm = nullptr;       // bf16 [512]
  const void* q_b_proj = nullptr;        // bf16 [H*192, 1536]
  const void* w_uk_t = nullptr;          // bf16 [H, 128, 512]
  const int64_t* slots = nullptr;        // [rows], -1 = no cache write
  float rms_eps = 1e-5f;
  float q_scale = 1.0f;                  // query bytes = e4m3(q / q_scale)
  float k_scale = 1.0f;                  // cache bytes = e4m3(k / k_scale)
  void* query = nullptr;                 // e4m3 [rows, num_heads_out, 576]
  int num_heads_out = 0;                 // 0 = H
  int head_offset = 0;
  void* cache = nullptr;                 // e4m3 [num_pages, 64, 576]
  int64_t stride_cache_page = 64 * 576;  // bytes, multiple of 16
  int64_t num_cache_pages = 0;
  void* workspace = nullptr;             // plan.workspace_bytes (may be null when that is 0)
};

// Launches fused_query_kernel (or proj_kernel then absorb_kernel, PDL-chained to it). With `pdl`, the
// first kernel is launched as a programmatic dependent of whatever precedes it on `stream` (it waits
// before reading `projected` and before any store). Only launches: no allocation, no synchronization. Throws mla::Error on bad
// arguments (checked on the host only: pointers, pitch, alignment) or a failed launch.
void launch_query(const QueryPlan& plan, const QueryArgs& args, cudaStream_t stream, bool pdl = true);

}  // namespace mla::query
