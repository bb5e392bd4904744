// Benchmark of the fused query stage (src/query) against the stock composition (query_bench_stock.cuh),
// DESIGN.md §6: CUDA events over CUDA-graph replays (kLaunchesPerGraph launches per graph, each on a
// different weight set so the weights come from HBM, not L2), median of kReplays; the copy bandwidth
// and the bf16 matrix rate measured in the same run.
//
//   query_bench                    the issue's table: H in {12,16,64,96,128} x rows in {1,4,16,64,256}
//   query_bench --sweep            then, for every shape of the table: the fused kernel at every
//                                  cluster size (the planned row tile; also every tile of at most four a head at
//                                  9-63 rows, 32 and 64 from 64 rows up), and the GEMM path
//   query_bench --gemm-algos       then, per shape: the GEMM path, its q_b_proj GEMM alone (cublasGemmEx as the path
//                                  calls it) and every algorithm cublasLt's heuristic offers for that GEMM
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "bench_device.cuh"
#include "common/cuda_check.h"
#include "device_timing.h"
#include "mla/dims.h"
#include "query/config.h"
#include "query/launch.h"
#include "query_bench_stock.cuh"
#include "timeline_report.h"

namespace {

using namespace mla;
using bench::device_alloc;
using bench::fill_random_bf16;

#define CUBLAS_CHECK(call)                                                                   \
  do {                                                                                       \
    cublasStatus_t s_ = (call);                                                              \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                       \
      std::fprintf(stderr, "cuBLAS error %d at %s:%d\n", int(s_), __FILE__, __LINE__);       \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

constexpr int kLaunchesPerGraph = 20;
constexpr int kReplays = 25;

// Buffers for one (rows, H): rotating weight sets and the per-step tensors.
struct Problem {
  int rows, H;
  int64_t pitch;
  int num_sets;
  std::vector<__nv_bfloat16*> q_b_proj, w_uk_t;
  __nv_bfloat16 *q_a_norm, *kv_a_norm, *projected;
  int64_t* slots;
  uint8_t *query, *cache;
  int64_t num_pages, page_stride;
  // stock path intermediates
  __nv_bfloat16 *qn, *kvn, *q, *ql;
  double weight_bytes() const {
    return double(H) * (kQkHeadDim * kQLoraRank + kNopeDim * kKvLoraRank) * 2 + (kQLoraRank + kKvLoraRank) * 2;
  }
  double must_move_bytes() const { return timing::query_stage_bytes(H, rows); }
  double flops() const { return 2.0 * rows * H * (double(kQkHeadDim) * kQLoraRank + double(kNopeDim) * kKvLoraRank); }
};

Problem make_problem(int rows, int H, cudaStream_t stream) {
  Problem p;
  p.rows = rows;
  p.H = H;
  p.pitch = projected_width(H) + 64;
  const double set_bytes = p.weight_bytes();
  p.num_sets = std::max(2, int(std::ceil(240e6 / set_bytes)));  // > 4x the 60 MB L2 per graph pass
  p.num_sets = std::min(p.num_sets, kLaunchesPerGraph);
  const size_t qb = size_t(H) * kQkHeadDim * kQLoraRank, wu = size_t(H) * kNopeDim * kKvLoraRank;
  for (int s = 0; s < p.num_sets; ++s) {
    p.q_b_proj.push_back(device_alloc<__nv_bfloat16>(qb));
    p.w_uk_t.push_back(device_alloc<__nv_bfloat16>(wu));
    fill_random_bf16<<<1024, 256, 0, stream>>>(p.q_b_proj.back(), qb, 100 + s, 2.f * 1.7f / std::sqrt(1536.f));
    fill_random_bf16<<<1024, 256, 0, stream>>>(p.w_uk_t.back(), wu, 200 + s, 2.f * 1.7f / std::sqrt(128.f));
  }
  p.q_a_norm = device_alloc<__nv_bfloat16>(kQLoraRank);
  p.kv_a_norm = device_alloc<__nv_bfloat16>(kKvLoraRank);
  fill_random_bf16<<<8, 256, 0, stream>>>(p.q_a_norm, kQLoraRank, 3, 2.f);
  fill_random_bf16<<<8, 256, 0, stream>>>(p.kv_a_norm, kKvLoraRank, 4, 2.f);
  p.projected = device_alloc<__nv_bfloat16>(size_t(rows) * p.pitch);
  fill_random_bf16<<<256, 256, 0, stream>>>(p.projected, size_t(rows) * p.pitch, 5, 3.f);
  std::vector<int64_t> slots(rows);
  for (int r = 0; r < rows; ++r) slots[r] = (r * 37) % (rows * 2);
  p.num_pages = (rows * 2 + 63) / 64;
  p.page_stride = 64 * 576;
  p.slots = device_alloc<int64_t>(rows);
  MLA_CUDA_CHECK(cudaMemcpy(p.slots, slots.data(), rows * 8, cudaMemcpyHostToDevice));
  p.query = device_alloc<uint8_t>(size_t(rows) * H * kKeyDim);
  p.cache = device_alloc<uint8_t>(size_t(p.num_pages) * p.page_stride);
  p.qn = device_alloc<__nv_bfloat16>(size_t(rows) * kQLoraRank);
  p.kvn = device_alloc<__nv_bfloat16>(size_t(rows) * kKvLoraRank);
  p.q = device_alloc<__nv_bfloat16>(size_t(rows) * H * kQkHeadDim);
  p.ql = device_alloc<__nv_bfloat16>(size_t(rows) * H * kKvLoraRank);
  MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return p;
}

void free_problem(Problem& p) {
  for (auto* x : p.q_b_proj) MLA_CUDA_CHECK(cudaFree(x));
  for (auto* x : p.w_uk_t) MLA_CUDA_CHECK(cudaFree(x));
  for (void* x : {(void*)p.q_a_norm, (void*)p.kv_a_norm, (void*)p.projected, (void*)p.slots, (void*)p.query,
                  (void*)p.cache, (void*)p.qn, (void*)p.kvn, (void*)p.q, (void*)p.ql})
    MLA_CUDA_CHECK(cudaFree(x));
}

// The arguments of launch i: weight set i % num_sets, so a graph's launches stream distinct weights.
query::QueryArgs query_args(const Problem& p, int i) {
  query::QueryArgs a;
  a.projected = p.projected;
  a.pitch = p.pitch;
  a.q_a_norm = p.q_a_norm;
  a.kv_a_norm = p.kv_a_norm;
  a.q_b_proj = p.q_b_proj[i % p.num_sets];
  a.w_uk_t = p.w_uk_t[i % p.num_sets];
  a.slots = p.slots;
  a.q_scale = 0.02f;
  a.k_scale = 0.01f;
  a.query = p.query;
  a.cache = p.cache;
  a.stride_cache_page = p.page_stride;
  a.num_cache_pages = p.num_pages;
  return a;
}

float time_query(Problem& p, const query::QueryPlan& plan, void* workspace, cublasHandle_t cublas, cudaStream_t stream) {
  return timing::time_graph_us(stream, [&](int i) {
    query::QueryArgs a = query_args(p, i);
    a.workspace = workspace;
    a.cublas = cublas;
    query::launch_query(plan, a, stream, true);
  }, kLaunchesPerGraph, kReplays);
}

// --timeline (an MLA_TIMELINE build): six back-to-back PDL launches of the stage, each with its own stamps. The fused
// kernel: the per-phase report of the last five (common/timeline.cuh). The GEMM path: per launch the norm kernel's
// span, the gap to the absorb kernel's first CTA (the cuBLAS GEMM and two launches) and the absorb kernel's span,
// then both kernels' phases in the last launch.
std::string stage_timeline(Problem& p, const query::QueryPlan& plan, void* workspace, cublasHandle_t cublas,
                           cudaStream_t stream) {
  constexpr int kLaunches = 6;
  const int ctas = query::timeline_ctas(plan);
  const size_t per_launch = size_t(ctas) * timeline::kMaxMarks;
  uint64_t* stamps = device_alloc<uint64_t>(per_launch * kLaunches);
  MLA_CUDA_CHECK(cudaMemsetAsync(stamps, 0, per_launch * kLaunches * sizeof(uint64_t), stream));
  for (int i = 0; i < kLaunches; ++i) {
    query::QueryArgs a = query_args(p, i);
    a.workspace = workspace;
    a.cublas = cublas;
    a.timeline = stamps + i * per_launch;
    query::launch_query(plan, a, stream, true);
  }
  std::vector<uint64_t> host(per_launch * kLaunches);
  MLA_CUDA_CHECK(cudaMemcpyAsync(host.data(), stamps, host.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost, stream));
  MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  MLA_CUDA_CHECK(cudaFree(stamps));
  if (plan.path == query::QueryPath::kFused) {
    return bench::timeline_report(host, kLaunches, ctas,
                                  std::vector<std::string>(std::begin(query::kQueryMarkNames), std::end(query::kQueryMarkNames)));
  }
  const int norm_ctas = int(plan.rows), absorb_ctas = ctas - norm_ctas;
  const std::vector<std::string> norm_names(std::begin(query::kNormMarkNames), std::end(query::kNormMarkNames));
  const std::vector<std::string> absorb_names(std::begin(query::kAbsorbMarkNames), std::end(query::kAbsorbMarkNames));
  auto norm_at = [&](int l) { return bench::LaunchStamps{host.data() + l * per_launch, norm_ctas, &norm_names}; };
  auto absorb_at = [&](int l) {
    return bench::LaunchStamps{host.data() + l * per_launch + size_t(norm_ctas) * timeline::kMaxMarks, absorb_ctas,
                               &absorb_names};
  };
  std::string out;
  char line[256];
  for (int l = 1; l < kLaunches; ++l) {
    const double norm_start = norm_at(l).first_start(), norm_end = norm_at(l).last_end();
    const double absorb_start = absorb_at(l).first_start(), absorb_end = absorb_at(l).last_end();
    std::snprintf(line, sizeof line,
                  "  launch %d: norm kernel %.2f us after the previous absorb's last CTA, span %.2f us; absorb kernel "
                  "%.2f us after it (the cuBLAS GEMM), span %.2f us; chain %.2f us\n",
                  l, (norm_start - absorb_at(l - 1).last_end()) / 1e3, (norm_end - norm_start) / 1e3,
                  (absorb_start - norm_end) / 1e3, (absorb_end - absorb_start) / 1e3, (absorb_end - norm_start) / 1e3);
    out += line;
  }
  out += "   norm kernel phases (the last launch; since the CTA's previous mark):\n" +
         bench::phase_report(norm_at(kLaunches - 1));
  out += "   absorb kernel phases:\n" + bench::phase_report(absorb_at(kLaunches - 1));
  return out;
}

float time_stock(Problem& p, cublasHandle_t cublas, cudaStream_t stream) {
  const int H = p.H, rows = p.rows;
  return timing::time_graph_us(stream, [&](int i) {
    const float alpha = 1.f, beta = 0.f;
    bench::stock_rms_norm_kernel<<<rows, 256, 0, stream>>>(p.projected, p.pitch, p.q_a_norm, p.kv_a_norm, 1e-5f, p.qn, p.kvn);
    MLA_CUDA_CHECK_LAUNCH();
    CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, H * kQkHeadDim, rows, kQLoraRank, &alpha,
                              p.q_b_proj[i % p.num_sets], CUDA_R_16BF, kQLoraRank, p.qn, CUDA_R_16BF, kQLoraRank, &beta,
                              p.q, CUDA_R_16BF, H * kQkHeadDim, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(cublas, CUBLAS_OP_N, CUBLAS_OP_N, kKvLoraRank, rows, kNopeDim, &alpha,
                                            p.w_uk_t[i % p.num_sets], CUDA_R_16BF, kKvLoraRank, kNopeDim * kKvLoraRank,
                                            p.q, CUDA_R_16BF, H * kQkHeadDim, kQkHeadDim, &beta, p.ql, CUDA_R_16BF,
                                            H * kKvLoraRank, kKvLoraRank, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    bench::stock_quantize_kernel<<<dim3(rows, H), 128, 0, stream>>>(p.q, p.ql, p.kvn, p.projected, p.pitch, p.slots, H,
                                                                  50.f, 100.f, p.query, p.cache, p.page_stride);
    MLA_CUDA_CHECK_LAUNCH();
  }, kLaunchesPerGraph, kReplays);
}

// --gemm-algos: the GEMM path's q_b_proj GEMM alone, as launch_gemm calls it (cublasGemmEx, CUBLAS_GEMM_DEFAULT), and
// every algorithm cublasLt's heuristic returns for it (up to 16, within the path's cuBLAS workspace), each
// timed like the stage (weight sets rotated). Says whether the default algorithm leaves bandwidth on the table.
void gemm_algos(Problem& p, const query::QueryPlan& gemm_plan, void* workspace, cublasHandle_t cublas,
                cudaStream_t stream) {
  const int m = p.H * kQkHeadDim, n = p.rows, k = kQLoraRank;
  const double gemm_bytes = double(m) * k * 2 + double(n) * k * 2 + double(m) * n * 2;
  // The path's workspace starts with cuBLAS's own; qn follows it (QueryPlan::gemm_qn_offset).
  const size_t lt_workspace_bytes = gemm_plan.gemm_qn_offset;
  const float alpha = 1.f, beta = 0.f;
  fill_random_bf16<<<256, 256, 0, stream>>>(p.qn, size_t(n) * k, 7, 2.f);  // not zeros: they multiply faster
  MLA_CUDA_CHECK_LAUNCH();
  const float by_default = timing::time_graph_us(stream, [&](int i) {
    CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, p.q_b_proj[i % p.num_sets], CUDA_R_16BF,
                              k, p.qn, CUDA_R_16BF, k, &beta, p.q, CUDA_R_16BF, m, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  }, kLaunchesPerGraph, kReplays);
  std::printf("  cublasGemmEx default %.2f µs (%.0f GB/s)", by_default, gemm_bytes / (by_default * 1e-6) / 1e9);

  cublasLtHandle_t lt;
  CUBLAS_CHECK(cublasLtCreate(&lt));
  cublasLtMatmulDesc_t desc;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof keep));
  cublasLtMatrixLayout_t a_layout, b_layout, c_layout;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a_layout, CUDA_R_16BF, k, m, k));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b_layout, CUDA_R_16BF, k, n, k));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c_layout, CUDA_R_16BF, m, n, m));
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &lt_workspace_bytes,
                                                    sizeof lt_workspace_bytes));
  constexpr int kMaxAlgos = 16;
  cublasLtMatmulHeuristicResult_t results[kMaxAlgos];
  int found = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, desc, a_layout, b_layout, c_layout, c_layout, pref, kMaxAlgos, results,
                                              &found));
  for (int a = 0; a < found; ++a) {
    const float us = timing::time_graph_us(stream, [&](int i) {
      CUBLAS_CHECK(cublasLtMatmul(lt, desc, &alpha, p.q_b_proj[i % p.num_sets], a_layout, p.qn, b_layout, &beta, p.q,
                                  c_layout, p.q, c_layout, &results[a].algo, workspace, lt_workspace_bytes, stream));
    }, kLaunchesPerGraph, kReplays);
    std::printf(" | lt%d %.2f", a, us);
  }
  std::printf("\n");
  CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
  CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(a_layout));
  CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(b_layout));
  CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(c_layout));
  CUBLAS_CHECK(cublasLtMatmulDescDestroy(desc));
  CUBLAS_CHECK(cublasLtDestroy(lt));
}

}  // namespace

int main(int argc, char** argv) {
  bool sweep = false, timeline = false, algos = false;
  std::vector<int> heads = {12, 16, 64, 96, 128}, row_counts = {1, 4, 16, 64, 256};
  std::vector<int> chosen_heads, chosen_rows;  // --heads / --rows: these only (e.g. one shape under ncu)
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if ((!std::strcmp(argv[i], "--heads") || !std::strcmp(argv[i], "--rows")) && has_value) {
      const bool heads_flag = !std::strcmp(argv[i], "--heads");
      int value = 0;
      if (!mla::bench::parse_count("query_bench", argv[i], argv[i + 1], heads_flag ? mla::kMaxHeads : 512, value)) {
        return 2;
      }
      (heads_flag ? chosen_heads : chosen_rows).push_back(value);
      ++i;
    } else if (!std::strcmp(argv[i], "--sweep")) {
      sweep = true;
    } else if (!std::strcmp(argv[i], "--gemm-algos")) {
      algos = true;
    } else if (!std::strcmp(argv[i], "--timeline")) {
      if (!mla::bench::timeline_build("query_bench")) return 2;
      timeline = true;
    } else {
      std::printf(
          "usage: query_bench [--heads H]... [--rows R]... [--sweep] [--gemm-algos] [--timeline]\n"
          "  --heads H   only H heads (repeatable; default 12 16 64 96 128)\n"
          "  --rows R    only R rows (repeatable; default 1 4 16 64 256)\n"
          "  --sweep     also time every fused cluster size and row tile, and the GEMM path at each absorb\n"
          "              row tile (32, 64, 128), per shape\n"
          "  --gemm-algos  also time the GEMM path's q_b_proj GEMM alone and every cublasLt algorithm for it, per shape\n"
          "  --timeline  per-CTA phase times of the stage's kernels after each line (an -DMLA_TIMELINE=ON build)\n");
      return std::strcmp(argv[i], "--help") ? 2 : 0;
    }
  }
  if (!chosen_heads.empty()) heads = chosen_heads;
  if (!chosen_rows.empty()) row_counts = chosen_rows;
  cudaStream_t stream;
  MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t cublas;
  CUBLAS_CHECK(cublasCreate(&cublas));
  CUBLAS_CHECK(cublasSetStream(cublas, stream));
  void* cublas_ws = device_alloc<uint8_t>(64 << 20);
  CUBLAS_CHECK(cublasSetWorkspace(cublas, cublas_ws, 64 << 20));
  cublasHandle_t cublas_ours;  // the GEMM path's own handle (it sets its stream and workspace per launch)
  CUBLAS_CHECK(cublasCreate(&cublas_ours));

  cudaDeviceProp prop;
  MLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const timing::Ceilings ceil = timing::measure_ceilings(stream);
  std::printf("device %s, %d SMs; copy %.0f GB/s (read+write), bf16 GEMM %.0f TFLOP/s\n", prop.name,
              prop.multiProcessorCount, ceil.copy_gbs, ceil.bf16_tflops);

  constexpr size_t kWorkspaceBytes = size_t(256) << 20;  // the GEMM path at 256 rows x 128 heads needs ~112 MB
  void* workspace = device_alloc<uint8_t>(kWorkspaceBytes);
  std::printf("\n| H | rows | ours µs | GB/s | %% copy bw | TFLOP/s | stock µs | stock/ours | plan |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (int H : heads) {
    for (int rows : row_counts) {
      Problem p = make_problem(rows, H, stream);
      const query::QueryPlan plan = query::make_query_plan(rows, H);
      if (plan.workspace_bytes > kWorkspaceBytes) { std::printf("workspace too big\n"); continue; }
      const float fused = time_query(p, plan, workspace, cublas_ours, stream);
      const float stock = time_stock(p, cublas, stream);
      const double gbs = p.must_move_bytes() / (fused * 1e-6) / 1e9;
      char how[96];
      if (plan.path == query::QueryPath::kGemm) {
        std::snprintf(how, sizeof how, "GEMM path T=%d", plan.absorb_row_tile);
      } else {
        std::snprintf(how, sizeof how, "fused R=%d C=%d grid=%ux%ux%u", plan.row_tile, plan.cluster_size, plan.grid.x,
                      plan.grid.y, plan.grid.z);
      }
      std::printf("| %d | %d | %.2f | %.0f | %.0f%% | %.1f | %.2f | %.2fx | %s |\n", H, rows, fused, gbs,
                  100.0 * gbs / ceil.copy_gbs, p.flops() / (fused * 1e-6) / 1e12, stock, stock / fused, how);
      if (timeline) std::printf("%s", stage_timeline(p, plan, workspace, cublas_ours, stream).c_str());
      std::fflush(stdout);
      free_problem(p);
    }
  }
  if (sweep) {
    std::printf("\n## sweep: us by fused row tile R / cluster size C, and the GEMM path\n");
    for (int H : heads) {
      for (int rows : row_counts) {
        Problem p = make_problem(rows, H, stream);
        std::printf("H=%3d rows=%3d:", H, rows);
        const int planned_tile = query::make_query_plan(rows, H).row_tile;
        // The planned tile, and: from 64 rows the 32- and 64-row tiles; at 9-63 rows every tile from four a head up
        // to the smallest that holds them all.
        auto worth_timing = [&](int row_tile) {
          if (row_tile == planned_tile) return true;
          if (rows >= 64) return row_tile >= 32;
          return rows > 8 && (rows + row_tile - 1) / row_tile <= 4 && row_tile / 2 < rows;
        };
        for (int row_tile : {8, 16, 32, 64}) {
          if (!worth_timing(row_tile)) continue;
          for (int cluster : {1, 2, 3, 4, 6, 8}) {
            query::QueryPlan plan;
            try {
              plan = query::make_query_plan(rows, H, {.path = 1, .cluster_size = cluster, .row_tile = row_tile});
            } catch (const Error&) {
              continue;  // shared memory does not fit or the cluster cannot be scheduled
            }
            std::printf("  R%d/C%d %.2f", row_tile, cluster, time_query(p, plan, workspace, cublas_ours, stream));
          }
        }
        const int planned_absorb_tile = query::make_query_plan(rows, H, {.path = 2}).absorb_row_tile;
        for (int tile : {32, 64, 128}) {  // the GEMM path at each absorb row tile (* = planned)
          const query::QueryPlan gemm = query::make_query_plan(rows, H, {.path = 2, .absorb_row_tile = tile});
          if (gemm.workspace_bytes > kWorkspaceBytes) continue;
          std::printf("  gemm/T%d%s %.2f", tile, tile == planned_absorb_tile ? "*" : "",
                      time_query(p, gemm, workspace, cublas_ours, stream));
        }
        std::printf("\n");
        std::fflush(stdout);
        free_problem(p);
      }
    }
  }

  if (algos) {
    std::printf("\n## the GEMM path and its q_b_proj GEMM alone (µs; GB/s over the GEMM's operands)\n");
    for (int H : heads) {
      for (int rows : row_counts) {
        Problem p = make_problem(rows, H, stream);
        const query::QueryPlan gemm = query::make_query_plan(rows, H, {.path = 2});
        std::printf("H=%3d rows=%3d: path %.2f", H, rows, time_query(p, gemm, workspace, cublas_ours, stream));
        gemm_algos(p, gemm, workspace, cublas, stream);
        std::fflush(stdout);
        free_problem(p);
      }
    }
  }

  MLA_CUDA_CHECK(cudaFree(workspace));
  CUBLAS_CHECK(cublasDestroy(cublas));
  CUBLAS_CHECK(cublasDestroy(cublas_ours));
  MLA_CUDA_CHECK(cudaFree(cublas_ws));
  return 0;
}
