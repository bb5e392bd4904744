// Planning and launching of the FP8 attention core (kernel.cuh).
#include "core/launch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "common/cuda_check.h"
#include "core/config.h"
#include "core/kernel.cuh"
#include "core/kernel_wgmma_pp.cuh"
#include "core/params.h"

namespace mla::core {
namespace {

constexpr int64_t kMaxGridY = 65535;  // CUDA's limit on gridDim.y

using KernelFn = void (*)(CoreParams);

struct SplitKernel {
  KernelFn fn;
  size_t smem_bytes;
};

// Bounded dispatch on (variant, tile, ring depth, slot deal): a value outside the table is an error, never a fallback.
// mma.sync: two CTAs per SM fit 2 stages; 3 and 4 stages run one CTA per SM. Ping-pong wgmma: one CTA per SM.
// The ping-pong kernel of (tile, ring depth) for the slot deal kSlots (config.h).
template <int kSlots>
SplitKernel pp_kernel_for(int tile_rows, int stages) {
  switch (tile_rows) {
    case 16:
      if (stages == 2) return {core_wgmma_pp_kernel<16, 2, kSlots>, sizeof(WgmmaPpSharedMemoryPlan<16, 2>)};
      return {core_wgmma_pp_kernel<16, 3, kSlots>, sizeof(WgmmaPpSharedMemoryPlan<16, 3>)};
    case 32:
      if (stages == 2) return {core_wgmma_pp_kernel<32, 2, kSlots>, sizeof(WgmmaPpSharedMemoryPlan<32, 2>)};
      return {core_wgmma_pp_kernel<32, 3, kSlots>, sizeof(WgmmaPpSharedMemoryPlan<32, 3>)};
    case 48:
      if (stages == 2) return {core_wgmma_pp_kernel<48, 2, kSlots>, sizeof(WgmmaPpSharedMemoryPlan<48, 2>)};
      return {core_wgmma_pp_kernel<48, 3, kSlots>, sizeof(WgmmaPpSharedMemoryPlan<48, 3>)};
    case 64:
      if (stages == 2) return {core_wgmma_pp_kernel<64, 2, kSlots>, sizeof(WgmmaPpSharedMemoryPlan<64, 2>)};
      return {core_wgmma_pp_kernel<64, 3, kSlots>, sizeof(WgmmaPpSharedMemoryPlan<64, 3>)};
    default: throw_bad_argument("CoreShape.tile_rows", "16, 32, 48 or 64 (0 = planned)", std::to_string(tile_rows));
  }
}

// The mma.sync kernel of a ring depth for the slot deal kSlots.
template <int kSlots>
SplitKernel mma_kernel_for(int stages) {
  switch (stages) {
    case 2: return {core_split_kernel<2, 2, kSlots>, sizeof(SharedMemoryPlan<2>)};
    case 3: return {core_split_kernel<3, 1, kSlots>, sizeof(SharedMemoryPlan<3>)};
    case 4: return {core_split_kernel<4, 1, kSlots>, sizeof(SharedMemoryPlan<4>)};
    default: throw_bad_argument("CoreShape.stages", "2, 3 or 4 for mma.sync (0 = default)", std::to_string(stages));
  }
}

// The split kernel of (variant, tile, ring depth) for the slot deal kSlots.
template <int kSlots>
SplitKernel split_kernel_for(int kernel, int tile_rows, int stages) {
  if (kernel == kKernelMmaSync) return mma_kernel_for<kSlots>(stages);
  // NOTE: 3, not 4: with the f16 query tile (72 KB at 64 rows) a 4-page ring no longer fits 64-row tiles.
  if (stages != 2 && stages != 3) {
    throw_bad_argument("CoreShape.stages", "2 or 3 for wgmma-pp (0 = default)", std::to_string(stages));
  }
  return pp_kernel_for<kSlots>(tile_rows, stages);
}

SplitKernel split_kernel_for(int kernel, int tile_rows, int stages, int slots) {
  switch (slots) {
    case kSlotsUniform: return split_kernel_for<kSlotsUniform>(kernel, tile_rows, stages);
    case kSlotsFlat: return split_kernel_for<kSlotsFlat>(kernel, tile_rows, stages);
    case kSlotsFlatMerged: return split_kernel_for<kSlotsFlatMerged>(kernel, tile_rows, stages);
    default: throw Error("core: no split kernel is built for slot deal " + std::to_string(slots));
  }
}

// Bytes of the split partials in the workspace (latents, then LSEs), rounded up to 8 for the flat slots' records.
size_t partials_bytes(const CorePlan& plan, int64_t rows_m) {
  const size_t bytes = static_cast<size_t>(plan.partial_slots) * rows_m * (kKvLoraRank + 1) * sizeof(float);
  return (bytes + 7) / 8 * 8;
}

// Whether the split kernel writes fp32 partials for a merge (the combine kernel's, or its own: merge_in_split): more
// than one split, or flat slots (a request's pages may span CTAs even at one split a request).
bool merges(const CorePlan& plan) { return plan.num_splits > 1 || plan.flat_slots; }

// Whether the split kernel records each request's slots for the combine kernel (flat slots it does not merge itself).
bool records_slots(const CorePlan& plan) { return plan.flat_slots && !plan.merge_in_split; }

int slot_mode(const CorePlan& plan) {
  if (plan.flat_slots) return plan.merge_in_split ? kSlotsFlatMerged : kSlotsFlat;
  return kSlotsUniform;
}

int threads_for(int kernel) {
  return kernel == kKernelMmaSync ? kNumThreads : kWgThreads;
}

void launch_with_pdl(const void* kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                     void** args, bool pdl = true) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  MLA_CUDA_CHECK(cudaLaunchKernelExC(&config, kernel, args));
}

}  // namespace

// Split count so that (work items x splits) CTAs fill whole waves of the machine: the smallest count
// reaching 95 % wave efficiency, else the best one. NOTE: counted from one split up, not from "at least
// one CTA per SM": one wave of 128 CTAs on 132 slots beat two waves of 256 (wgmma, 16x4k x96: 4 splits
// 102 µs, 8 splits 112 µs). The caller bounds the count by the pages a split must keep.
int choose_splits(int64_t work, int64_t slots, int64_t max_splits) {
  int best = 1;
  double best_eff = 0.0;
  for (int64_t s = 1; s <= max_splits; ++s) {
    const int64_t ctas = work * s;
    const int64_t waves = (ctas + slots - 1) / slots;
    const double eff = static_cast<double>(ctas) / static_cast<double>(waves * slots);
    if (eff >= 0.95) return static_cast<int>(s);
    if (eff > best_eff + 1e-9) {
      best_eff = eff;
      best = static_cast<int>(s);
    }
    if (ctas >= 4 * slots) break;  // past a few waves the tail no longer matters
  }
  return best;
}

// NOTE: measured (H100, 2026-12-06, core_bench --splits, bench/results/core.md): 1 x 128k x 16 251 -> 264 splits 42.9 ->
// 42.3 µs, 1 x 1M x 12 217.1 -> 213.3, 1 x 32k x 12 (3 -> 2 pages a split) 18.8 -> 17.6. With four requests the whole
// wave was slower (4 x 32k x 12: 63 splits 41.6 µs, 66: 43.9), with two mixed (2 x 32k 1.01-1.03x, 2 x 1M 0.991, the
// 2 x 4k x H12 step 0.962; branch core-wave-two), so only one request's count is raised.
int choose_splits_one_request(int64_t tiles, int64_t slots, int64_t max_splits) {
  const int splits = choose_splits(tiles, slots, max_splits);
  if (tiles * splits > slots) return splits;
  return static_cast<int>(std::min(max_splits, slots / tiles));  // >= splits: that count fits both bounds
}

int combine_warps_per_entry(int num_splits) {
  int warps = 1;
  while (warps < kCombineMaxWarps && warps * kCombineLoadsInFlight < num_splits) warps *= 2;
  return warps;
}

int choose_wgmma_tile(int rows_m) {
  for (int tile : {16, 32, 48, 64}) {
    if (rows_m <= tile) return tile;
  }
  // NOTE: above 64 rows the fewest tiles (each re-reads and re-converts every page), then the least
  // padding: H·q = 96 runs two 48-row tiles, not two 64-row ones; 128 runs two 64-row ones.
  const int tiles48 = (rows_m + 47) / 48;
  const int tiles64 = (rows_m + 63) / 64;
  return tiles48 <= tiles64 ? 48 : 64;
}

namespace {

// The plan of one split-kernel variant (kernel != 0); plan_core validated the shape.
CorePlan plan_for_kernel(const CoreShape& shape, int kernel_id) {
  const int64_t requests = shape.rows / shape.q;
  const int rows_m = shape.q * shape.heads;
  CorePlan plan;
  plan.shape = shape;
  plan.kernel = kernel_id;
  if (plan.kernel == kKernelMmaSync) {
    if (shape.tile_rows != 0 && shape.tile_rows != kBlockM) {
      throw_bad_argument("CoreShape.tile_rows", "0 or 16 for mma.sync", std::to_string(shape.tile_rows));
    }
    plan.tile_rows = kBlockM;
    plan.stages = shape.stages == 0 ? 2 : shape.stages;
  } else {
    plan.tile_rows = shape.tile_rows != 0 ? shape.tile_rows : choose_wgmma_tile(rows_m);
    // NOTE: ping-pong: 3 stages at every tile (a page's slot is refilled after both warpgroups' P·V of it: with 2
    // stages the next page's copy is exposed; 128x4k x64 204.9 µs with 2, 177.9 with 3).
    plan.stages = shape.stages == 0 ? 3 : shape.stages;
  }
  const SplitKernel split_kernel = split_kernel_for(plan.kernel, plan.tile_rows, plan.stages, kSlotsUniform);
  const KernelFn kernel = split_kernel.fn;
  plan.smem_bytes = split_kernel.smem_bytes;
  MLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(plan.smem_bytes)));
  int device = 0;
  MLA_CUDA_CHECK(cudaGetDevice(&device));
  MLA_CUDA_CHECK(cudaDeviceGetAttribute(&plan.num_sms, cudaDevAttrMultiProcessorCount, device));
  MLA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&plan.ctas_per_sm, kernel, threads_for(plan.kernel),
                                                               plan.smem_bytes));
  if (plan.ctas_per_sm < 1) throw Error("core: split kernel does not fit on this device");

  plan.m_tiles = (rows_m + plan.tile_rows - 1) / plan.tile_rows;
  const int64_t max_pages = (shape.max_context + kPageSize - 1) / kPageSize;
  // NOTE: at least two pages a split, so that each split overlaps a page's load with the previous
  // page's math; one-page splits also double the fp32 partials the combine reads (measured 4x4k x12:
  // 63 one-page splits 17.8 µs, 32 two-page splits 13.8 µs; bench/results/core.md, small batches).
  const int64_t max_splits = std::min<int64_t>(kMaxSplits, std::max<int64_t>(1, max_pages / 2));
  if (shape.num_splits > 0) {
    if (shape.num_splits > kMaxSplits) {
      throw_bad_argument("CoreShape.num_splits", "<= " + std::to_string(kMaxSplits),
                         std::to_string(shape.num_splits));
    }
    plan.num_splits = shape.num_splits;
  } else {
    const int64_t slots = int64_t{plan.num_sms} * plan.ctas_per_sm;
    // The whole wave only on mma.sync: the ping-pong kernel gained at long requests (1 x 128k x 64 1.05x) but lost
    // where a request far shorter than max_context got one-page splits instead of two (1 x 4k x 96 under a 128k
    // plan 0.89x, its step 0.95x; bench/results/core.md 2026-12-06).
    plan.num_splits = requests == 1 && plan.kernel == kKernelMmaSync
                          ? choose_splits_one_request(plan.m_tiles, slots, max_splits)
                          : choose_splits(requests * plan.m_tiles, slots, max_splits);
  }
  if (plan.m_tiles > 65535 * 64) throw Error("core: too many M-tiles");
  // Flat slots (split_rule.h, flat_cta_range) wherever the batch has more than one request, one planned split
  // included: every CTA then holds at most ceil(P / (S·R)) pages however the lengths spread (src/core/README.md,
  // next steps 7 and 9). Their S x R CTAs are the grid's y (at most 65535); the uniform deal's grid is (M-tiles,
  // splits, requests). Where a request has few segments (one split; two at narrow tiles) the split kernel merges them
  // itself.
  const bool slots_fit_grid = int64_t{plan.num_splits} * requests <= kMaxGridY;
  plan.flat_slots = requests > 1 && slots_fit_grid;
  plan.grid = plan.flat_slots
                  ? dim3(static_cast<unsigned>(plan.m_tiles), static_cast<unsigned>(plan.num_splits * requests), 1)
                  : dim3(static_cast<unsigned>(plan.m_tiles), static_cast<unsigned>(plan.num_splits),
                         static_cast<unsigned>(requests));
  plan.partial_slots = int64_t{plan.num_splits} * requests + (plan.flat_slots ? requests - 1 : 0);
  // The combine indexes partial rows in 32 bits (core_combine_kernel); 2^31 of them would be a 4 TB workspace.
  if (plan.partial_slots * rows_m > INT32_MAX) {
    throw_bad_argument("CoreShape (rows, heads, q, split count)", "<= 2^31 - 1 partial rows (slots x q·H)",
                       std::to_string(plan.partial_slots * rows_m));
  }
  plan.merge_in_split = plan.flat_slots && (plan.num_splits == 1 || (plan.num_splits == 2 &&
                                                                     plan.tile_rows <= kMaxRowsMergedAtTwoSplits));
  // Two ints a (request, M-tile): the mma.sync kernel counts arrivals and stored partials, the ping-pong one the first.
  plan.tile_counters = plan.merge_in_split ? 2 * requests * plan.m_tiles : 0;
  // The flat deals have their own instantiations of the split kernel: same shared memory and occupancy.
  if (plan.flat_slots) {
    const KernelFn dealt = split_kernel_for(plan.kernel, plan.tile_rows, plan.stages, slot_mode(plan)).fn;
    MLA_CUDA_CHECK(cudaFuncSetAttribute(dealt, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(plan.smem_bytes)));
    int dealt_ctas_per_sm = 0;
    MLA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&dealt_ctas_per_sm, dealt, threads_for(plan.kernel),
                                                                 plan.smem_bytes));
    if (dealt_ctas_per_sm != plan.ctas_per_sm) throw Error("core: the flat split kernel's occupancy differs");
  }
  // Partial latents and LSEs, then for the combine under flat slots each request's recorded (first slot, count)
  // (8-byte aligned).
  plan.workspace_bytes = !merges(plan) ? 0 : partials_bytes(plan, rows_m);
  if (records_slots(plan)) plan.workspace_bytes += static_cast<size_t>(requests) * 2 * sizeof(int);
  const int64_t entries = shape.rows * shape.heads;
  // Combine: enough warps per (entry, chunk) that each takes at most kCombineLoadsInFlight splits (one round
  // of loads), up to 16 (251 splits: 16 warps of 16 splits); few splits: 1 warp, 4 (entry, chunk) pairs a
  // CTA, so that few entries still spread over many SMs. NOTE: at 1x4k x12 (32 splits, 48 pairs) 12 CTAs of 16
  // warps and these 48 of 4 ran alike; the ~1 µs lost there was the lengths load in series (fixed in the kernel,
  // src/core/README.md, next step 4).
  plan.combine_warps_per_entry = combine_warps_per_entry(plan.num_splits);
  const int block_warps = std::max(plan.combine_warps_per_entry, kCombineMinWarps);
  const int64_t combine_groups = entries * (kKvLoraRank / kCombineDims);
  const int64_t groups_per_cta = block_warps / plan.combine_warps_per_entry;
  const int64_t combine_ctas = (combine_groups + groups_per_cta - 1) / groups_per_cta;
  if (combine_ctas > 0x7fffffff) throw Error("core: too many combine CTAs");
  plan.combine_grid = dim3(static_cast<unsigned>(combine_ctas));
  plan.combine_block = dim3(static_cast<unsigned>(block_warps * 32));
  return plan;
}

}  // namespace

CorePlan plan_core(const CoreShape& shape) {
  if (shape.q < 1 || shape.q > kMaxQueries) {
    throw_bad_argument("CoreShape.q", "1..8", std::to_string(shape.q));
  }
  if (shape.heads < 1) throw_bad_argument("CoreShape.heads", ">= 1", std::to_string(shape.heads));
  if (shape.rows < shape.q || shape.rows % shape.q != 0) {
    throw_bad_argument("CoreShape.rows", "a positive multiple of q = " + std::to_string(shape.q),
                       std::to_string(shape.rows));
  }
  if (shape.max_context < 1) {
    throw_bad_argument("CoreShape.max_context", ">= 1", std::to_string(shape.max_context));
  }
  const int64_t requests = shape.rows / shape.q;
  if (requests > 65535) throw_bad_argument("CoreShape.rows / q", "<= 65535 requests", std::to_string(requests));
  // The flat deal counts the batch's pages in 32 bits (split_rule.h, flat slots).
  const int64_t max_batch_pages = requests * ((shape.max_context + kPageSize - 1) / kPageSize);
  if (max_batch_pages > INT32_MAX) {
    throw_bad_argument("CoreShape.max_context",
                       "at most 2^31 - 1 pages over the " + std::to_string(requests) + " requests of rows / q",
                       std::to_string(shape.max_context) + " (" + std::to_string(max_batch_pages) + " pages)");
  }
  // The combine finds an entry's request by a 32-bit division (a 64-bit one is a call, and ptxas spilled around it).
  if (shape.rows * shape.heads > INT32_MAX) {
    throw_bad_argument("CoreShape.rows * heads", "<= 2^31 - 1 (row, head) entries",
                       std::to_string(shape.rows * shape.heads));
  }

  // NOTE: 2 was the lockstep wgmma kernel (removed 2026-12-06): the other numbers stay as results and docs quote them.
  if (shape.kernel != 0 && shape.kernel != kKernelMmaSync && shape.kernel != kKernelWgmmaPp) {
    throw_bad_argument("CoreShape.kernel", "0 (planned), 1 (mma.sync) or 3 (wgmma-pp)", std::to_string(shape.kernel));
  }

  // NOTE: the mma.sync kernel (16-row M-tiles) at H·q <= 16, where it measured 1.3x faster than wgmma
  // (128x4k x16: 148 vs 194 µs). Above, one CTA reads a page once for up to 64 folded rows: the ping-pong
  // wgmma kernel at 3 stages, which measured faster than the lockstep two-warpgroup kernel and the
  // warp-specialized one (both since removed) at every 32-, 48- and 64-row shape but one (H100, 2026-12-05 ~15:33 UTC,
  // bench/results/core.md: 128x4k x64 183.5 -> 177.9 µs, x128 364.1 -> 336.1, 16x4k x96 59.3 -> 53.5, 16x64k
  // x96 x4 2198.8 -> 1946.1, 128x4k x32 142.0 -> 139.1 against the ws kernel, 1x4k x96 in 63 splits 19.3 -> 17.6;
  // 4x4k x64 in 2-page splits 25.3 -> 26.8). Its short splits have no serial first page (the ws kernel's
  // weakness) and its long ones overlap one warpgroup's Q·K^T with the other's softmax (the lockstep one's).
  const int rows_m = shape.q * shape.heads;
  if (shape.kernel != 0) return plan_for_kernel(shape, shape.kernel);
  if (rows_m <= kBlockM) return plan_for_kernel(shape, kKernelMmaSync);
  return plan_for_kernel(shape, kKernelWgmmaPp);
}

bool launches_combine(const CorePlan& plan) { return merges(plan) && !plan.merge_in_split; }

void launch_core(const CorePlan& plan, const CoreArgs& args, cudaStream_t stream, bool pdl) {
  const CoreShape& shape = plan.shape;
  const int64_t entries = shape.rows * shape.heads;
  CoreParams params;
  params.query = static_cast<const uint8_t*>(args.query);
  params.cache = static_cast<const uint8_t*>(args.cache);
  params.stride_cache_page = args.stride_cache_page;
  params.block_table = args.block_table;
  params.stride_block_table = args.stride_block_table;
  params.lengths = args.lengths;
  params.totals = args.totals;
  params.num_requests = args.num_requests;
  params.num_heads = shape.heads;
  params.q = shape.q;
  params.num_splits = plan.num_splits;
  params.grid_requests = static_cast<int>(shape.rows / shape.q);
  params.dcp_rank = args.dcp.rank;
  params.dcp_size = args.dcp.size;
  params.dcp_interleave = args.dcp.interleave;
  params.softmax_scale_log2 = args.softmax_scale * 1.4426950408889634f;
  params.k_scale = args.k_scale;
  params.latent = args.latent;
  params.lse = args.lse;
  params.timeline = args.timeline;
  if ((args.l2_prefetch == nullptr) != (args.l2_prefetch_bytes == 0) ||
      reinterpret_cast<uintptr_t>(args.l2_prefetch) % 16 != 0 || args.l2_prefetch_bytes % 16 != 0 ||
      args.l2_prefetch_bytes < 0) {
    throw_bad_argument("CoreArgs.l2_prefetch / l2_prefetch_bytes",
                       "null and 0, or a 16-byte aligned pointer and a positive multiple of 16 bytes",
                       std::to_string(reinterpret_cast<uintptr_t>(args.l2_prefetch)) + " / " +
                           std::to_string(args.l2_prefetch_bytes));
  }
  if (merges(plan)) {
    params.partial_latent = static_cast<float*>(args.workspace);
    params.partial_lse = params.partial_latent + plan.partial_slots * shape.q * shape.heads * kKvLoraRank;
    if (records_slots(plan)) {
      params.request_slots =
          reinterpret_cast<int*>(static_cast<uint8_t*>(args.workspace) + partials_bytes(plan, shape.q * shape.heads));
    }
    if (plan.merge_in_split) {
      if (args.tile_counters == nullptr) {
        throw_bad_argument("CoreArgs.tile_counters", std::to_string(plan.tile_counters) +
                                                         " zeroed ints (CorePlan.merge_in_split)", "null");
      }
      params.tile_counters = args.tile_counters;
    }
  }
  void* split_args[] = {&params};
  launch_with_pdl(reinterpret_cast<const void*>(
                      split_kernel_for(plan.kernel, plan.tile_rows, plan.stages, slot_mode(plan)).fn),
                  plan.grid, dim3(threads_for(plan.kernel)), plan.smem_bytes, stream, split_args, pdl);
  if (!launches_combine(plan)) return;

  CombineParams combine;
  combine.partial_latent = params.partial_latent;
  combine.partial_lse = params.partial_lse;
  combine.request_slots = params.request_slots;
  combine.lengths = args.lengths;
  combine.num_requests = args.num_requests;
  combine.entries_per_request = shape.q * shape.heads;
  combine.num_entries = entries;
  combine.num_splits = plan.num_splits;
  combine.grid_requests = static_cast<int>(shape.rows / shape.q);
  combine.warps_per_entry = plan.combine_warps_per_entry;
  combine.k_scale = args.k_scale;
  combine.latent = args.latent;
  combine.lse = args.lse;
  combine.l2_prefetch = static_cast<const uint8_t*>(args.l2_prefetch);
  combine.l2_prefetch_bytes = args.l2_prefetch_bytes;
  combine.timeline = args.combine_timeline;
  void* combine_args[] = {&combine};
  const auto combine_kernel = plan.flat_slots ? &core_combine_kernel<kSlotsFlat> : &core_combine_kernel<kSlotsUniform>;
  launch_with_pdl(reinterpret_cast<const void*>(combine_kernel),
                  plan.combine_grid, plan.combine_block, 0,
                  stream, combine_args);
}

}  // namespace mla::core
