#include "query/launch.h"

#include <sstream>

#include "common/cuda_check.h"
#include "mla/dims.h"
#include "mla/error.h"
#include "query/config.h"
#include "query/kernel.cuh"

namespace mla::query {
namespace {

bool divides_chunks(int splits) { return splits >= 1 && kNumKChunks % splits == 0; }

// The one table of proj_kernel instantiations: row tile -> kernel.
using ProjKernel = void (*)(QueryParams);
ProjKernel proj_kernel_for(int row_tile) {
  switch (row_tile) {
    case 8: return proj_kernel<1>;
    case 16: return proj_kernel<2>;
    case 32: return proj_kernel<4>;
    case 64: return proj_kernel<8>;
  }
  throw_bad_argument("row_tile", "8, 16, 32 or 64", std::to_string(row_tile));
}

int round_up8(int64_t x) { return int((x + 7) / 8 * 8); }

}  // namespace

std::string QueryPlan::describe() const {
  std::ostringstream s;
  s << "rows=" << rows << " H=" << num_heads << " row_tile=" << row_tile << " splits=" << num_splits << " trigger=" << (trigger_early ? "early" : "late")
    << " proj_grid=" << proj_grid.x << "x" << proj_grid.y << "x" << proj_grid.z << " absorb_cols=" << absorb_cols
    << " absorb_rows=" << absorb_rows << " absorb_grid=" << absorb_grid.x << "x" << absorb_grid.y << "x"
    << absorb_grid.z << " workspace=" << workspace_bytes;
  return s.str();
}

QueryPlan make_query_plan(int64_t rows, int num_heads, const QueryPlanOverrides& overrides) {
  if (rows < 1 || rows > 512) throw_bad_argument("rows", "1..512", std::to_string(rows));
  if (num_heads < 1 || num_heads > kMaxHeads) throw_bad_argument("num_heads", "1..128", std::to_string(num_heads));
  QueryPlan plan;
  plan.rows = rows;
  plan.num_heads = num_heads;

  // ---- proj_kernel: row tile, then the K split that keeps every SM streaming weights ----
  // NOTE: the table below is the best of a sweep on an H200 (src/query/README.md): few rows are
  // weight-bandwidth bound and want many CTAs; each CTA pays the RMSNorm of its rows (an L2 read of
  // 3 KB per row), so more splits stop paying once the norm traffic matches the weight slice.
  plan.row_tile = overrides.row_tile ? overrides.row_tile
                                     : (rows <= 8 ? 8 : rows <= 16 ? 16 : rows <= 64 ? 64 : 32);
  (void)proj_kernel_for(plan.row_tile);
  const int num_row_chunks = int((rows + plan.row_tile - 1) / plan.row_tile);
  const int feature_groups = (num_heads * kTilesPerHead + kProjWarps - 1) / kProjWarps;
  if (overrides.num_splits) {
    if (!divides_chunks(overrides.num_splits))
      throw_bad_argument("num_splits", "a divisor of 48", std::to_string(overrides.num_splits));
    plan.num_splits = overrides.num_splits;
  } else if (rows <= 8) {
    plan.num_splits = feature_groups <= 24 ? 16 : 8;
  } else if (rows <= 16) {
    plan.num_splits = feature_groups >= 192 ? 2 : 4;
  } else if (rows <= 64) {
    plan.num_splits = 4;
  } else {
    plan.num_splits = 1;
  }
  // Shared memory: the normed q_a slice of the row tile must fit (and leave room for a second CTA).
  while (ProjSmemPlan{plan.row_tile, kQLoraRank / plan.num_splits}.bytes() > 110 * 1024 && plan.num_splits < 48) {
    int next = plan.num_splits + 1;
    while (!divides_chunks(next)) ++next;
    plan.num_splits = next;
  }
  plan.split_len = kQLoraRank / plan.num_splits;
  plan.proj_grid = dim3(num_row_chunks, feature_groups, plan.num_splits);
  plan.proj_smem = ProjSmemPlan{plan.row_tile, plan.split_len}.bytes();
  plan.workspace_bytes = size_t(plan.num_splits) * rows * num_heads * kQkHeadDim * sizeof(float);

  // ---- absorb_kernel: rows per CTA, then columns per CTA so that the grid fills the SMs ----
  plan.absorb_rows = std::min(round_up8(rows), kAbsorbMaxRows);
  const int absorb_row_chunks = int((rows + plan.absorb_rows - 1) / plan.absorb_rows);
  if (overrides.absorb_cols) {
    if (overrides.absorb_cols < 32 || overrides.absorb_cols > 512 || (overrides.absorb_cols & (overrides.absorb_cols - 1)))
      throw_bad_argument("absorb_cols", "32, 64, 128, 256 or 512", std::to_string(overrides.absorb_cols));
    plan.absorb_cols = overrides.absorb_cols;
  } else if (rows <= 16) {
    plan.absorb_cols = num_heads >= 64 ? 128 : 32;
  } else {
    plan.absorb_cols = num_heads >= 128 ? 256 : num_heads >= 64 ? 64 : 32;
  }
  plan.absorb_grid = dim3(kKvLoraRank / plan.absorb_cols, num_heads, absorb_row_chunks);
  plan.absorb_smem = AbsorbSmemPlan{plan.absorb_cols, plan.absorb_rows}.bytes();

  MLA_CUDA_CHECK(cudaFuncSetAttribute(proj_kernel_for(plan.row_tile), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(plan.proj_smem)));
  MLA_CUDA_CHECK(cudaFuncSetAttribute(absorb_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(plan.absorb_smem)));

  // ---- PDL trigger of proj_kernel ----
  if (overrides.trigger < 0 || overrides.trigger > 2)
    throw_bad_argument("trigger", "0 (planner), 1 (early) or 2 (late)", std::to_string(overrides.trigger));
  // NOTE: the default stays early (the measured behaviour of every table in bench/results/query.md);
  // the late trigger (after each CTA's last store) is an override until it has been measured.
  plan.trigger_early = overrides.trigger != 2;
  return plan;
}

void launch_query(const QueryPlan& plan, const QueryArgs& args, cudaStream_t stream, bool pdl) {
  const int num_heads_out = args.num_heads_out ? args.num_heads_out : plan.num_heads;
  auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  if (!args.projected || !aligned16(args.projected)) throw_bad_argument("projected", "16-byte aligned device pointer", "unaligned or null");
  if (args.pitch < projected_width(plan.num_heads) || args.pitch % 8 != 0)
    throw_bad_argument("pitch", ">= " + std::to_string(projected_width(plan.num_heads)) + " and a multiple of 8",
                       std::to_string(args.pitch));
  if (!args.q_b_proj || !args.w_uk_t || !args.q_a_norm || !args.kv_a_norm || !args.slots)
    throw_bad_argument("weights/slots", "device pointers", "null");
  if (!args.query || !aligned16(args.query)) throw_bad_argument("query", "16-byte aligned device pointer", "unaligned or null");
  if (args.head_offset < 0 || args.head_offset + plan.num_heads > num_heads_out)
    throw_bad_argument("head_offset", "0..num_heads_out-H", std::to_string(args.head_offset));
  if (!args.cache || !aligned16(args.cache)) throw_bad_argument("cache", "16-byte aligned device pointer", "unaligned or null");
  if (args.stride_cache_page < kPageSize * kKeyDim || args.stride_cache_page % 16 != 0)
    throw_bad_argument("stride_cache_page", ">= 36864 bytes and a multiple of 16", std::to_string(args.stride_cache_page));
  if (!args.workspace || !aligned16(args.workspace)) throw_bad_argument("workspace", "16-byte aligned device pointer", "unaligned or null");

  QueryParams p;
  p.projected = static_cast<const __nv_bfloat16*>(args.projected);
  p.stride_projected_row = args.pitch;
  p.q_a_norm = static_cast<const __nv_bfloat16*>(args.q_a_norm);
  p.kv_a_norm = static_cast<const __nv_bfloat16*>(args.kv_a_norm);
  p.q_b_proj = static_cast<const __nv_bfloat16*>(args.q_b_proj);
  p.w_uk_t = static_cast<const __nv_bfloat16*>(args.w_uk_t);
  p.slots = args.slots;
  p.rms_eps = args.rms_eps;
  p.inv_q_scale = 1.0f / args.q_scale;
  p.inv_k_scale = 1.0f / args.k_scale;
  p.num_rows = int(plan.rows);
  p.num_heads = plan.num_heads;
  p.query = static_cast<uint8_t*>(args.query);
  p.num_heads_out = num_heads_out;
  p.head_offset = args.head_offset;
  p.cache = static_cast<uint8_t*>(args.cache);
  p.stride_cache_page = args.stride_cache_page;
  p.num_cache_pages = args.num_cache_pages;
  p.workspace = static_cast<float*>(args.workspace);
  p.num_splits = plan.num_splits;
  p.split_len = plan.split_len;
  p.trigger_early = plan.trigger_early ? 1 : 0;
  p.absorb_cols = plan.absorb_cols;
  p.absorb_rows = plan.absorb_rows;

  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;

  cudaLaunchConfig_t proj{};
  proj.gridDim = plan.proj_grid;
  proj.blockDim = dim3(kProjThreads);
  proj.dynamicSmemBytes = plan.proj_smem;
  proj.stream = stream;
  proj.attrs = attr;
  proj.numAttrs = pdl ? 1 : 0;
  MLA_CUDA_CHECK(cudaLaunchKernelEx(&proj, proj_kernel_for(plan.row_tile), p));

  cudaLaunchConfig_t absorb{};
  absorb.gridDim = plan.absorb_grid;
  absorb.blockDim = dim3(kAbsorbThreads);
  absorb.dynamicSmemBytes = plan.absorb_smem;
  absorb.stream = stream;
  absorb.attrs = attr;
  absorb.numAttrs = 1;  // always PDL-chained to proj_kernel: its prologue prefetches W_UK_T
  MLA_CUDA_CHECK(cudaLaunchKernelEx(&absorb, absorb_kernel, p));
}

}  // namespace mla::query
