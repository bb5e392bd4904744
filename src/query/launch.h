// Host API of the fused query stage: plan once per (rows, H) at prepare time, then launch only.
//
//   QueryPlan plan = make_query_plan(rows, H);      // grid, cluster size, workspace bytes; smem limits
//   // caller allocates plan.workspace_bytes of device memory once (0 for the default plan)
//   launch_query(plan, args, stream);                // one fused kernel launch; graph-capturable
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "query/params.h"

namespace mla::query {

// Optional overrides of the planner's choices (benchmark sweeps, tests); 0 = the planner decides.
struct QueryPlanOverrides {
  int path = 0;          // 1 = the fused kernel, 2 = the GEMM path (norm kernel, cuBLAS GEMMs, quantize kernel)
  int cluster_size = 0;  // fused: CTAs per (head, row tile): 1, 2, 3, 4, 6 or 8 (1, 3 and 6: row tiles <= 16)
  int store_q = 0;       // fused: 1 = store the fp32 q (before its bf16 rounding) in the workspace (tests)
  int row_tile = 0;      // fused: rows per cluster: 8, 16, 32 or 64
  int no_rope_ctas = 0;  // fused: 1 = no rope CTAs even where the planner would add them (QueryPlan.rope_ctas)
  int absorb_row_tile = 0;  // GEMM: the absorb kernel's rows a CTA: 32, 64 or 128 (QueryPlan.absorb_row_tile)
};

enum class QueryPath { kFused = 1, kGemm = 2 };

// The fused path: one fused_query_kernel launch, grid (C, row tiles, H + rope CTAs), clusters of C CTAs along x.
// The GEMM path (large batches): gemm_norm_kernel, the cuBLAS q_b_proj GEMM, gemm_absorb_kernel.
struct QueryPlan {
  int64_t rows = 0;
  int num_heads = 0;
  QueryPath path = QueryPath::kFused;
  int row_tile = 8;      // rows per cluster (8 * n-tiles)
  int cluster_size = 1;  // C
  int rope_ctas = 0;           // fused, C = 1, one row tile: CTAs past the H head CTAs that project the heads'
  int rope_tiles_per_cta = 0;  //   rope features, this many 16-feature tiles each (kernel.cuh); 0 = none
  int absorb_row_tile = 0;     // GEMM path: the absorb kernel's rows a CTA (32, 64 or 128: the fewest waves, launch.cu)
  dim3 grid;
  size_t smem_bytes = 0;
  // Fused: 0, or with store_q the fp32 q [rows, H*192]. GEMM path: the cuBLAS workspace, then qn
  // bf16 [rows, 1536] at gemm_qn_offset and q bf16 [rows, H*192] at gemm_q_offset. The caller
  // allocates it (256-byte aligned: cudaMalloc).
  size_t workspace_bytes = 0;
  size_t gemm_qn_offset = 0, gemm_q_offset = 0;

  std::string describe() const;  // "rows=16 H=12 row_tile=16 cluster=8 ..." for logs and benchmarks
};

// The fused plan's rope CTAs (QueryPlan.rope_ctas, kernel.cuh) for H heads at cluster size C over `row_tiles`
// row tiles on `num_sms` SMs: {CTAs, 16-feature rope tiles a CTA}, or {0, 0}. Only at C = 1 with one row tile,
// and only where the SMs no head CTA occupies can take every rope tile with at most one a warp (pure host rule).
struct RopeCtas {
  int ctas = 0;
  int tiles_per_cta = 0;
};
RopeCtas choose_rope_ctas(int num_heads, int cluster, int row_tiles, int num_sms);

// Throws mla::Error for rows outside 1..512, H outside 1..128 or invalid overrides (including a
// (row_tile, cluster_size) whose shared memory does not fit or whose cluster cannot be scheduled).
// Sets the kernels' dynamic shared-memory limits (host-side, once).
QueryPlan make_query_plan(int64_t rows, int num_heads, const QueryPlanOverrides& overrides = {});

// The CTAs a QueryArgs::timeline buffer of this plan must hold ([CTAs, timeline::kMaxMarks] stamps): the fused
// kernel's grid, or on the GEMM path the norm kernel's CTAs (one a row) and then the absorb kernel's.
int timeline_ctas(const QueryPlan& plan);

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
  cublasHandle_t cublas = nullptr;       // GEMM path: the caller's handle (this sets its stream, workspace and math
                                         // mode: no reduced-precision split-K reduction)
  uint64_t* timeline = nullptr;          // MLA_TIMELINE builds only: [timeline_ctas(plan), timeline::kMaxMarks]
                                         // stamps (QueryMark, or GemmNormMark then GemmAbsorbMark); null records nothing
};

// Launches the plan's kernels. With `pdl`, the first is launched as a programmatic dependent of
// whatever precedes it on `stream` (it waits before reading `projected` and before any store); the
// last triggers its dependents after its last store. Only launches (cuBLAS included): no allocation,
// no synchronization, graph-capturable. Throws mla::Error on bad arguments (checked on the host only:
// pointers, pitch, alignment, the cuBLAS handle of a GEMM plan) or a failed launch.
void launch_query(const QueryPlan& plan, const QueryArgs& args, cudaStream_t stream, bool pdl = true);

}  // namespace mla::query
