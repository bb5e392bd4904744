#include "query/launch.h"

#include <sstream>
#include <type_traits>

#include "common/cuda_check.h"
#include "mla/dims.h"
#include "mla/error.h"
#include "query/config.h"
#include "query/gemm_kernels.cuh"
#include "query/kernel.cuh"

namespace mla::query {
namespace {

using FusedKernel = void (*)(QueryParams);

// Clusters of 3 and 6 only for row tiles of 8 and 16 (few rows: they give H = 25-33 and 13-16 a third more
// streaming SMs than C = 2 and 4); larger tiles take C = 2 or 4 anyway.
template <int kRowTile, int kCluster, bool kRopeCtas = false>
FusedKernel fused_instance() {
  constexpr bool kUnevenCluster = kColTiles % kCluster != 0;
  if constexpr (FusedSmemPlan{kRowTile, kCluster}.bytes() <= kMaxSmemPerCta && (!kUnevenCluster || kRowTile <= 16)) {
    return fused_query_kernel<kRowTile / 8, kCluster, kRopeCtas>;
  } else {
    return nullptr;
  }
}

// The one table of fused_query_kernel instantiations: (row tile, cluster size) -> kernel, or null
// where the shared-memory plan does not fit (C = 1 holds at most 16 rows) or the pair is not one.
// NOTE: no C = 16 (non-portable clusters): it was the slowest size at every shape of the sweep.
FusedKernel fused_kernel_for(int row_tile, int cluster, bool rope_ctas = false) {
  if (rope_ctas) {  // C = 1 with up to 16 rows only (QueryPlan.rope_ctas)
    if (cluster != 1) return nullptr;
    return row_tile == 8 ? fused_instance<8, 1, true>() : row_tile == 16 ? fused_instance<16, 1, true>() : nullptr;
  }
  auto for_rows = [row_tile](auto c) -> FusedKernel {
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
    case 3: return for_rows(std::integral_constant<int, 3>{});
    case 4: return for_rows(std::integral_constant<int, 4>{});
    case 6: return for_rows(std::integral_constant<int, 6>{});
    case 8: return for_rows(std::integral_constant<int, 8>{});
  }
  return nullptr;
}

bool valid_cluster(int c) { return c == 1 || c == 2 || c == 3 || c == 4 || c == 6 || c == 8; }

int num_sms_of_device() {
  int device = 0, num_sms = 0;
  MLA_CUDA_CHECK(cudaGetDevice(&device));
  MLA_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  return num_sms;
}

// Sets the fused kernel's attributes for (row tile, C) and returns how many of its clusters can be
// resident at once (0: the configuration cannot run on this device).
int prepare_fused(int row_tile, int cluster, size_t smem, bool rope_ctas = false) {
  FusedKernel kernel = fused_kernel_for(row_tile, cluster, rope_ctas);
  MLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
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

// The rule's cluster size for rows x H in tiles of row_tile, 0 where none fits (plan_fused's comment has the rule).
int planned_cluster(int64_t rows, int num_heads, int row_tile, int num_sms) {
  const int64_t clusters = (rows + row_tile - 1) / row_tile * num_heads;
  int chosen = 0;
  for (int c : {8, 6, 4, 3, 2, 1}) {
    if (fused_kernel_for(row_tile, c) == nullptr) continue;
    // C = 4 only where no C = 3 kernel exists (row tiles of 32 and 64): at 8 and 16 rows C = 3 measured faster
    // wherever both fit (H100 2026-12-07 ~09:10 UTC, bench/results/query.md: H 20 / 24 x 1-16 rows 1.02-1.07x).
    if (c == 4 && fused_kernel_for(row_tile, 3) != nullptr) continue;
    // No C = 8 at 16-row tiles (H <= 12 at 9-12 rows): C = 6 measured faster (H100 2026-12-07 ~09:20 UTC,
    // bench/results/branches.md: H 8-12 x 9-12 rows 1.00-1.03x).
    if (c == 8 && row_tile == 16) continue;
    const int active = prepare_fused(row_tile, c, FusedSmemPlan{row_tile, c}.bytes());
    if (active < 1) continue;
    chosen = c;  // the smallest feasible C so far: the fallback when none fits one wave
    const int64_t ctas = clusters * c;
    const int64_t budget = c >= 3 ? num_sms * 3 / 4 : num_sms;
    if (ctas <= budget && clusters <= active) break;
  }
  return chosen;
}

// 17-32 rows: whether 8-row tiles get clusters of 3 or more, the one tiling of the fused kernel there that beat both
// one 32-row tile (H 8 x 17-32 rows: 8.8-9.8 against 10.2-12.8 µs) and, where it also fills the SMs, the GEMM path
// (H100 2026-12-07 ~10:00 UTC, bench/results/query.md). Used by fused_planned (the path) and plan_fused (the tile).
bool eight_row_tiles_get_large_clusters(int64_t rows, int num_heads, int num_sms) {
  return rows > 16 && rows <= 32 && planned_cluster(rows, num_heads, 8, num_sms) >= 3;
}

// The plan: rows per cluster from the batch, then the cluster size C.
// NOTE: chosen by measurement (bench/results/query.md, the sweep of every (R, C) at H {12, 16, 64, 96,
// 128} x rows {1, 4, 16, 64, 256}); this rule picks the fastest measured pair at every one of them:
//   R = 8 up to 8 rows, 16 up to 12, 8 again at 13-16 rows where two tiles get clusters (below); at 17-32 rows (where
//   fused_planned takes this kernel) 8 where the tiles get clusters of 3 or more, else 32; 32 up to 64 rows and 64
//   above, on forced fused plans only (two 32-row tiles beat one 64-row tile: the norm and the projection of a tile
//   are serial in its CTAs; 64-row tiles re-read the weights less);
//   C = the largest of 8 (not at 16-row tiles), 6, 4 (32/64-row tiles only), 3, 2, 1 whose CTAs (H x row tiles
//   x C) fit in one wave, where clusters of 3 and more must leave a quarter of the SMs free (128 CTAs as 16
//   clusters of 8 or 32 of 4 ran 1.2-1.5x slower than 64 CTAs of half the cluster size: a cluster needs all its SMs
//   free in one GPC, which the previous kernel of the stream still holds in part under PDL); the smallest C
//   whose shared memory holds R otherwise (C = 2 from 32 rows). C = 6 and 3 (row tiles 8 and 16 only)
//   give H = 13-16 and 25-33 96-99 CTAs where C = 4 and 2 gave 52-66. At 8-row tiles from 48 heads C = 1
//   with rope CTAs instead of C = 2 (below).
void plan_fused(QueryPlan& plan, const QueryPlanOverrides& overrides) {
  const int64_t rows = plan.rows;
  if (overrides.row_tile && overrides.row_tile != 8 && overrides.row_tile != 16 && overrides.row_tile != 32 &&
      overrides.row_tile != 64)
    throw_bad_argument("row_tile", "8, 16, 32 or 64", std::to_string(overrides.row_tile));
  if (overrides.cluster_size && !valid_cluster(overrides.cluster_size))
    throw_bad_argument("cluster_size", "1, 2, 3, 4, 6 or 8", std::to_string(overrides.cluster_size));
  if (overrides.no_rope_ctas != 0 && overrides.no_rope_ctas != 1)
    throw_bad_argument("no_rope_ctas", "0 or 1", std::to_string(overrides.no_rope_ctas));
  if (overrides.absorb_row_tile)
    throw_bad_argument("absorb_row_tile", "0 for the fused path", std::to_string(overrides.absorb_row_tile));
  const int num_sms = num_sms_of_device();
  plan.row_tile = overrides.row_tile ? overrides.row_tile : (rows <= 8 ? 8 : rows <= 16 ? 16 : rows <= 64 ? 32 : 64);
  if (!overrides.row_tile && eight_row_tiles_get_large_clusters(rows, plan.num_heads, num_sms)) plan.row_tile = 8;
  int cluster = overrides.cluster_size;
  if (!cluster) {
    cluster = planned_cluster(rows, plan.num_heads, plan.row_tile, num_sms);
    // 13-16 rows: two 8-row tiles where they still get clusters (C >= 2), instead of one 16-row tile (H100 2026-12-07
    // ~09:10 UTC, bench/results/query.md: H 8-32 x 13-16 rows 1.00-1.18x; at 9-12 rows, and from 48 heads, where two
    // 8-row tiles get C = 1 without rope CTAs, the 16-row tile is faster).
    if (!overrides.row_tile && rows > 12 && rows <= 16) {
      const int two_tiles_cluster = planned_cluster(rows, plan.num_heads, 8, num_sms);
      if (two_tiles_cluster >= 2) {
        plan.row_tile = 8;
        cluster = two_tiles_cluster;
      }
    }
  }
  const int row_tiles = int((rows + plan.row_tile - 1) / plan.row_tile);
  if (!overrides.cluster_size) {
    // At 8-row tiles from kMinHeadsOneCtaAHead heads, one CTA a head with rope CTAs on the spare SMs beats the pair of
    // C = 2: no cluster barrier and remote sum, and every SM still streams (H100 sweep 2026-12-07 ~08:58 UTC,
    // bench/results/query.md: H 48-66 x 1-8 rows 1.01-1.06x; H 40 and 16-row tiles keep C = 2).
    if (cluster == 2 && plan.row_tile == 8 && plan.num_heads >= kMinHeadsOneCtaAHead && !overrides.no_rope_ctas &&
        choose_rope_ctas(plan.num_heads, 1, row_tiles, num_sms).ctas > 0)
      cluster = 1;
  }
  if (cluster == 0 || fused_kernel_for(plan.row_tile, cluster) == nullptr)
    throw_bad_argument("cluster_size",
                       "a size with a kernel for row tile " + std::to_string(plan.row_tile) +
                           " (C = 1: tiles up to 16 rows, shared memory; C = 3 and 6: tiles of 8 and 16 rows)",
                       std::to_string(cluster));
  plan.cluster_size = cluster;
  plan.smem_bytes = FusedSmemPlan{plan.row_tile, cluster}.bytes();
  if (!overrides.no_rope_ctas) {
    const RopeCtas rope = choose_rope_ctas(plan.num_heads, cluster, row_tiles, num_sms);
    plan.rope_ctas = rope.ctas;
    plan.rope_tiles_per_cta = rope.tiles_per_cta;
  }
  plan.grid = dim3(unsigned(cluster), unsigned(row_tiles), unsigned(plan.num_heads + plan.rope_ctas));
  if (prepare_fused(plan.row_tile, cluster, plan.smem_bytes, plan.rope_ctas > 0) < 1)
    throw_bad_argument("cluster_size", "a cluster this device can schedule", std::to_string(cluster));
  plan.workspace_bytes = overrides.store_q ? size_t(rows) * plan.num_heads * kQkHeadDim * sizeof(float) : 0;
}

// The GEMM path's workspace: cuBLAS's own (the size NVIDIA recommends for Hopper), then its buffers.
inline constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
size_t align256(size_t x) { return (x + 255) / 256 * 256; }

using AbsorbKernel = void (*)(QueryParams, const __nv_bfloat16*);
AbsorbKernel absorb_kernel_of(int row_tile) {
  switch (row_tile) {
    case 32: return gemm_absorb_kernel<32>;
    case 64: return gemm_absorb_kernel<64>;
    case 128: return gemm_absorb_kernel<128>;
    default: throw_bad_argument("QueryPlan.absorb_row_tile", "32, 64 or 128", std::to_string(row_tile));
  }
}

// The absorb kernel's row tile: the fewest waves of one CTA an SM (4 column slices x row tiles x H CTAs), the smaller
// tile on a tie (less padding; 32 and 64 run three CTAs an SM, 128 two).
// NOTE: chosen by measurement (H100 2026-12-07 ~15:00 UTC, `query_bench --sweep`, bench/results/query.md): the rule
// picks the fastest of the three tiles at all 25 shapes of H {12, 16, 64, 96, 128} x rows {33, 64, 128, 256, 512}:
// 32 at H 12 / 16 x 33-64 rows (2.5-5 % faster than 64), 128 from 256 rows and at H >= 64 x 128 rows (up to 16 % at
// H 16 x 512, 4-9 % at H 64-128 x 128-512), 64 elsewhere.
int choose_absorb_row_tile(int64_t rows, int num_heads, int num_sms) {
  int best_tile = 0;
  int64_t best_waves = 0;
  for (const int tile : {32, 64, 128}) {
    const int64_t ctas = int64_t{kKvLoraRank / kAbsorbCols} * ((rows + tile - 1) / tile) * num_heads;
    const int64_t waves = (ctas + num_sms - 1) / num_sms;
    if (best_tile == 0 || waves < best_waves) {
      best_tile = tile;
      best_waves = waves;
    }
  }
  return best_tile;
}

void plan_gemm(QueryPlan& plan, const QueryPlanOverrides& overrides) {
  if (overrides.cluster_size || overrides.store_q || overrides.row_tile || overrides.no_rope_ctas)
    throw_bad_argument("cluster_size/store_q/row_tile/no_rope_ctas", "0 for the GEMM path",
                       std::to_string(overrides.cluster_size) + "/" + std::to_string(overrides.store_q) + "/" +
                           std::to_string(overrides.row_tile) + "/" + std::to_string(overrides.no_rope_ctas));
  const int tile = overrides.absorb_row_tile;
  if (tile != 0 && tile != 32 && tile != 64 && tile != 128)
    throw_bad_argument("absorb_row_tile", "0 (planner), 32, 64 or 128", std::to_string(tile));
  plan.path = QueryPath::kGemm;
  plan.absorb_row_tile = tile ? tile : choose_absorb_row_tile(plan.rows, plan.num_heads, num_sms_of_device());
  plan.grid = dim3(unsigned(kKvLoraRank / kAbsorbCols),
                   unsigned((plan.rows + plan.absorb_row_tile - 1) / plan.absorb_row_tile), unsigned(plan.num_heads));
  plan.smem_bytes = absorb_smem_bytes(plan.absorb_row_tile);
  MLA_CUDA_CHECK(cudaFuncSetAttribute(absorb_kernel_of(plan.absorb_row_tile),
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, int(plan.smem_bytes)));
  plan.gemm_qn_offset = kCublasWorkspaceBytes;
  plan.gemm_q_offset = plan.gemm_qn_offset + align256(size_t(plan.rows) * kQLoraRank * 2);
  plan.workspace_bytes = plan.gemm_q_offset + size_t(plan.rows) * plan.num_heads * kQkHeadDim * 2;
}

void check_cublas(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) throw Error(std::string("query: ") + call + " failed: cuBLAS status " + std::to_string(int(status)));
}

void launch_gemm(const QueryPlan& plan, const QueryParams& p, const QueryArgs& args, cudaStream_t stream, bool pdl) {
  uint8_t* ws = static_cast<uint8_t*>(args.workspace);
  auto* qn = reinterpret_cast<__nv_bfloat16*>(ws + plan.gemm_qn_offset);
  auto* q = reinterpret_cast<__nv_bfloat16*>(ws + plan.gemm_q_offset);
  const int rows = int(plan.rows), H = plan.num_heads;
  // Resolved before the first launch: a bad row tile throws before the norm kernel writes any cache row.
  const AbsorbKernel absorb_kernel = absorb_kernel_of(plan.absorb_row_tile);

  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t norm{};
  norm.gridDim = dim3(unsigned(rows));
  norm.blockDim = dim3(kGemmNormThreads);
  norm.stream = stream;
  norm.attrs = attr;
  norm.numAttrs = pdl ? 1 : 0;
  MLA_CUDA_CHECK(cudaLaunchKernelEx(&norm, gemm_norm_kernel, p, qn));

  check_cublas(cublasSetStream(args.cublas, stream), "cublasSetStream");
  check_cublas(cublasSetWorkspace(args.cublas, ws, kCublasWorkspaceBytes), "cublasSetWorkspace");
  // DESIGN.md rounds q once: bf16 of the fp32 sum. cuBLAS' default math mode lets a split-K algorithm reduce its
  // partials in the output type (bf16), which its heuristic may pick at few rows (e.g. H 12 x 33 rows: 18 output tiles).
  constexpr auto kOneRoundingMath =
      static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
  check_cublas(cublasSetMathMode(args.cublas, kOneRoundingMath), "cublasSetMathMode");
  const float one = 1.f, zero = 0.f;
  // q [rows, H*192] (row-major) = qn [rows, 1536] . q_b_proj [H*192, 1536]^T: column-major C^T = A^T B.
  check_cublas(cublasGemmEx(args.cublas, CUBLAS_OP_T, CUBLAS_OP_N, H * kQkHeadDim, rows, kQLoraRank, &one, p.q_b_proj,
                            CUDA_R_16BF, kQLoraRank, qn, CUDA_R_16BF, kQLoraRank, &zero, q, CUDA_R_16BF, H * kQkHeadDim,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx (q_b_proj)");

  cudaLaunchConfig_t absorb{};
  absorb.gridDim = plan.grid;
  absorb.blockDim = dim3(kAbsorbThreads);
  absorb.dynamicSmemBytes = plan.smem_bytes;
  absorb.stream = stream;
  absorb.attrs = attr;
  absorb.numAttrs = 1;  // always a programmatic dependent of the GEMM: its W_UK slice loads overlap the GEMM's tail
  QueryParams absorb_params = p;  // its timeline stamps follow the norm kernel's (timeline_ctas)
  if (p.timeline != nullptr) absorb_params.timeline = p.timeline + plan.rows * timeline::kMaxMarks;
  MLA_CUDA_CHECK(cudaLaunchKernelEx(&absorb, absorb_kernel, absorb_params,
                                    static_cast<const __nv_bfloat16*>(q)));
}

}  // namespace

int timeline_ctas(const QueryPlan& plan) {
  const int grid_ctas = int(plan.grid.x * plan.grid.y * plan.grid.z);
  return plan.path == QueryPath::kGemm ? int(plan.rows) + grid_ctas : grid_ctas;
}

std::string QueryPlan::describe() const {
  std::ostringstream s;
  if (path == QueryPath::kGemm) {
    s << "rows=" << rows << " H=" << num_heads << " gemm (norm kernel, cuBLAS q_b_proj, absorb kernel of " << absorb_row_tile
      << "-row tiles) workspace=" << workspace_bytes;
    return s.str();
  }
  s << "rows=" << rows << " H=" << num_heads << " fused row_tile=" << row_tile << " cluster=" << cluster_size
    << " grid=" << grid.x << "x" << grid.y << "x" << grid.z;
  if (rope_ctas > 0) s << " (" << rope_ctas << " rope CTAs of " << rope_tiles_per_cta << " tiles)";
  s << " smem=" << smem_bytes << " workspace=" << workspace_bytes;
  return s.str();
}

// Rope CTAs (kernel.cuh): with C = 1 and one row tile, the SMs that no head CTA occupies take the heads' rope
// tiles (16 features x the whole K each, a warp a tile), so that every SM streams q_b_proj: where each of them
// gets at most one tile a warp, i.e. about the bytes of a head CTA's 8 nope tiles plus its W_UK slice.
// Measured (H100, bench/results/query.md): H = 96 at <= 16 rows (36 spare SMs of 132) 4-8 % faster.
RopeCtas choose_rope_ctas(int num_heads, int cluster, int row_tiles, int num_sms) {
  const int rope_tiles = num_heads * kRopeTilesPerHead;
  const int spare = num_sms - num_heads;
  if (cluster != 1 || row_tiles != 1 || spare <= 0 || (rope_tiles + spare - 1) / spare > kFusedWarps) return {};
  RopeCtas rope;
  rope.tiles_per_cta = (rope_tiles + spare - 1) / spare;
  rope.ctas = (rope_tiles + rope.tiles_per_cta - 1) / rope.tiles_per_cta;
  return rope;
}

// Which path the planner takes. NOTE: measured (H100 2026-12-07 ~10:00 UTC, bench/results/query.md: every fused (R, C)
// and the GEMM path at H 8-128 x 17-64 rows; the <= 16-row sweeps of ~09:05 UTC): the fused kernel up to 16 rows, where
// it streams the weights from every SM; at 17-32 rows only where its CTAs still fill the SMs: 8-row tiles that get
// clusters of 3 or more (H <= 8; H <= 11 up to 24 rows), or one 32-row tile of pairs from kMinHeadsFusedPairs heads up
// to one wave (2H <= SMs: H 48-64 x 17-32 rows 1.00-1.09x faster than the GEMM path); from 33 rows, and at H 12-47 or
// past one wave of pairs at 17-32 rows, the GEMM path (cuBLAS and the absorb kernel), which was 1.02-1.71x faster there
// (H 12 x 64 rows 14.8 -> 11.2 µs, H 128 x 48 rows 65.7 -> 47.3).
bool fused_planned(int64_t rows, int num_heads, int num_sms) {
  if (rows <= 16) return true;
  if (rows > 32) return false;
  return eight_row_tiles_get_large_clusters(rows, num_heads, num_sms) ||
         (num_heads >= kMinHeadsFusedPairs && 2 * num_heads <= num_sms);
}

QueryPlan make_query_plan(int64_t rows, int num_heads, const QueryPlanOverrides& overrides) {
  if (rows < 1 || rows > 512) throw_bad_argument("rows", "1..512", std::to_string(rows));
  if (num_heads < 1 || num_heads > kMaxHeads) throw_bad_argument("num_heads", "1..128", std::to_string(num_heads));
  QueryPlan plan;
  plan.rows = rows;
  plan.num_heads = num_heads;
  if (overrides.path < 0 || overrides.path > 2)
    throw_bad_argument("path", "0 (planner), 1 (fused) or 2 (GEMM)", std::to_string(overrides.path));
  const bool gemm = overrides.path == 2 || (overrides.path == 0 && !fused_planned(rows, num_heads, num_sms_of_device()));
  if (gemm) {
    plan_gemm(plan, overrides);
  } else {
    plan_fused(plan, overrides);
  }
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
  if (plan.path == QueryPath::kGemm && (reinterpret_cast<uintptr_t>(args.workspace) & 255) != 0)
    throw_bad_argument("workspace", "a 256-byte aligned device pointer (cuBLAS workspace of the GEMM path)", "unaligned");
  if (plan.path == QueryPath::kGemm && args.cublas == nullptr)
    throw_bad_argument("cublas", "a cuBLAS handle (the GEMM path of " + plan.describe() + ")", "null");

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
  p.rope_tiles_per_cta = plan.rope_tiles_per_cta;
  p.query = static_cast<uint8_t*>(args.query);
  p.num_heads_out = num_heads_out;
  p.head_offset = args.head_offset;
  p.cache = static_cast<uint8_t*>(args.cache);
  p.stride_cache_page = args.stride_cache_page;
  p.num_cache_pages = args.num_cache_pages;
  p.workspace = plan.workspace_bytes > 0 ? static_cast<float*>(args.workspace) : nullptr;
#if !(defined(MLA_TIMELINE) && MLA_TIMELINE)
  if (args.timeline) throw_bad_argument("timeline", "null (this build has no timeline: -DMLA_TIMELINE=ON)", "a pointer");
#endif
  p.timeline = args.timeline;

  if (plan.path == QueryPath::kGemm) {
    launch_gemm(plan, p, args, stream, pdl);
    return;
  }
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(plan.cluster_size);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = plan.grid;
  config.blockDim = dim3(kFusedThreads);
  config.dynamicSmemBytes = plan.smem_bytes;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = pdl ? 2 : 1;
  MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, fused_kernel_for(plan.row_tile, plan.cluster_size, plan.rope_ctas > 0), p));
}

}  // namespace mla::query
