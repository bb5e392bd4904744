#include "query/launch.h"

#include <sstream>
#include <type_traits>

#include "common/cuda_check.h"
#include "mla/dims.h"
#include "mla/error.h"
#include "query/config.h"
#include "query/fused_kernel.cuh"
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

template <int kRowTile, int kCluster>
ProjKernel fused_instance() {
  if constexpr (FusedSmemPlan{kRowTile, kCluster}.bytes() <= kMaxSmemPerCta) {
    return fused_query_kernel<kRowTile / 8, kCluster>;
  } else {
    return nullptr;
  }
}

// The one table of fused_query_kernel instantiations: (row tile, cluster size) -> kernel, or null
// where the shared-memory plan does not fit (C = 1 holds at most 16 rows) or the pair is not one.
ProjKernel fused_kernel_for(int row_tile, int cluster) {
  auto for_rows = [row_tile](auto c) -> ProjKernel {
    constexpr int kC = decltype(c)::value;
    switch (row_tile) {
      case 8: return fused_instance<8, kC>();
      case 16: return fused_instance<16, kC>();
      case 32: return fused_instance<32, kC>();
      case 64: return fused_instance<64, kC>();
    }
    return nullptr;
  };
  switch (cluster) {
    case 1: return for_rows(std::integral_constant<int, 1>{});
    case 2: return for_rows(std::integral_constant<int, 2>{});
    case 4: return for_rows(std::integral_constant<int, 4>{});
    case 8: return for_rows(std::integral_constant<int, 8>{});
    case 16: return for_rows(std::integral_constant<int, 16>{});
  }
  return nullptr;
}

bool valid_cluster(int c) { return c == 1 || c == 2 || c == 4 || c == 8 || c == 16; }

// Sets the fused kernel's attributes for (row tile, C) and returns how many of its clusters can be
// resident at once (0: the configuration cannot run on this device).
int prepare_fused(int row_tile, int cluster, size_t smem) {
  ProjKernel kernel = fused_kernel_for(row_tile, cluster);
  MLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  if (cluster > 8) MLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(cluster), 1, 1);
  config.blockDim = dim3(kFusedThreads);
  config.dynamicSmemBytes = smem;
  config.attrs = attr;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();  // not a sticky error: this configuration just cannot run here
    return 0;
  }
  return clusters;
}

// Fused plan: rows per cluster from the batch, then the cluster size C.
// NOTE: the kernel streams weights, so its time is about (rounds of resident clusters) x (bytes per
// CTA, which scale as 1/C); the planner minimizes that product, preferring the smaller C on ties
// (each CTA norms all rows of its tile and reads C partial tiles). Measured: bench/results/query.md.
void plan_fused(QueryPlan& plan, const QueryPlanOverrides& overrides) {
  const int64_t rows = plan.rows;
  if (overrides.num_splits || overrides.absorb_cols || overrides.trigger)
    throw_bad_argument("num_splits/absorb_cols/trigger", "0 for the fused kernel (two-kernel path only)",
                       std::to_string(overrides.num_splits) + "/" + std::to_string(overrides.absorb_cols) + "/" +
                           std::to_string(overrides.trigger));
  if (overrides.row_tile && overrides.row_tile != 8 && overrides.row_tile != 16 && overrides.row_tile != 32 &&
      overrides.row_tile != 64)
    throw_bad_argument("row_tile", "8, 16, 32 or 64", std::to_string(overrides.row_tile));
  if (overrides.cluster_size && !valid_cluster(overrides.cluster_size))
    throw_bad_argument("cluster_size", "1, 2, 4, 8 or 16", std::to_string(overrides.cluster_size));
  plan.row_tile = overrides.row_tile ? overrides.row_tile : (rows <= 8 ? 8 : rows <= 16 ? 16 : rows <= 32 ? 32 : 64);
  const int row_tiles = int((rows + plan.row_tile - 1) / plan.row_tile);
  const int64_t clusters = int64_t(row_tiles) * plan.num_heads;
  int cluster = overrides.cluster_size;
  if (!cluster) {
    double best = 0;
    for (int c : {1, 2, 4, 8, 16}) {
      if (fused_kernel_for(plan.row_tile, c) == nullptr) continue;
      const int active = prepare_fused(plan.row_tile, c, FusedSmemPlan{plan.row_tile, c}.bytes());
      if (active < 1) continue;
      const double cost = double((clusters + active - 1) / active) / c;
      if (!cluster || cost < best * 0.999) {
        cluster = c;
        best = cost;
      }
    }
  }
  if (fused_kernel_for(plan.row_tile, cluster) == nullptr)
    throw_bad_argument("cluster_size", "a size whose shared memory fits " + std::to_string(plan.row_tile) + " rows",
                       std::to_string(cluster));
  plan.cluster_size = cluster;
  plan.fused_grid = dim3(unsigned(cluster), unsigned(row_tiles), unsigned(plan.num_heads));
  plan.fused_smem = FusedSmemPlan{plan.row_tile, cluster}.bytes();
  if (prepare_fused(plan.row_tile, cluster, plan.fused_smem) < 1)
    throw_bad_argument("cluster_size", "a cluster this device can schedule", std::to_string(cluster));
  plan.num_splits = 1;
  plan.split_len = kQLoraRank;
  plan.workspace_bytes = overrides.store_q ? size_t(rows) * plan.num_heads * kQkHeadDim * sizeof(float) : 0;
}

}  // namespace

std::string QueryPlan::describe() const {
  std::ostringstream s;
  if (fused) {
    s << "rows=" << rows << " H=" << num_heads << " fused row_tile=" << row_tile << " cluster=" << cluster_size
      << " grid=" << fused_grid.x << "x" << fused_grid.y << "x" << fused_grid.z << " smem=" << fused_smem
      << " workspace=" << workspace_bytes;
    return s.str();
  }
  s << "two-kernel rows=" << rows << " H=" << num_heads << " row_tile=" << row_tile << " splits=" << num_splits << " trigger=" << (trigger_early ? "early" : "late")
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
  if (overrides.two_kernel < 0 || overrides.two_kernel > 1)
    throw_bad_argument("two_kernel", "0 or 1", std::to_string(overrides.two_kernel));
  plan.fused = overrides.two_kernel == 0;
  if (plan.fused) {
    plan_fused(plan, overrides);
    return plan;
  }
  if (overrides.cluster_size || overrides.store_q)
    throw_bad_argument("cluster_size/store_q", "0 for the two-kernel path", std::to_string(overrides.cluster_size));

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
  if (plan.workspace_bytes > 0 && (!args.workspace || !aligned16(args.workspace)))
    throw_bad_argument("workspace", "16-byte aligned device pointer", "unaligned or null");

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
  p.workspace = plan.workspace_bytes > 0 ? static_cast<float*>(args.workspace) : nullptr;
  p.num_splits = plan.num_splits;
  p.split_len = plan.split_len;
  p.trigger_early = plan.trigger_early ? 1 : 0;
  p.absorb_cols = plan.absorb_cols;
  p.absorb_rows = plan.absorb_rows;

  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;

  if (plan.fused) {
    cudaLaunchAttribute fused_attr[2];
    fused_attr[0].id = cudaLaunchAttributeClusterDimension;
    fused_attr[0].val.clusterDim.x = unsigned(plan.cluster_size);
    fused_attr[0].val.clusterDim.y = 1;
    fused_attr[0].val.clusterDim.z = 1;
    fused_attr[1] = attr[0];
    cudaLaunchConfig_t fused{};
    fused.gridDim = plan.fused_grid;
    fused.blockDim = dim3(kFusedThreads);
    fused.dynamicSmemBytes = plan.fused_smem;
    fused.stream = stream;
    fused.attrs = fused_attr;
    fused.numAttrs = pdl ? 2 : 1;
    MLA_CUDA_CHECK(cudaLaunchKernelEx(&fused, fused_kernel_for(plan.row_tile, plan.cluster_size), p));
    return;
  }

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
