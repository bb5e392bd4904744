// Whole-step benchmark (issue 8, DESIGN.md §6): PreparedMla::run (query kernel -> core -> value
// kernel, PDL-chained) against the stock composition of the same step (RMSNorm kernel, cuBLAS GEMM
// for q_b_proj, batched GEMM for W_UK, quantize-and-cache-write kernel, the same core, batched GEMM
// for W_UV, gate kernel) and against that composition with a stock attention (core_bench_stock.cuh:
// bf16 gather, cuBLAS, softmax, cuBLAS; where its intermediates fit), each checked against the fused
// step's out, all as CUDA graphs of 20 steps rotating over replicas whose caches exceed 150 MB and whose weights
// exceed 600 MB (L2-cold under any L2 policy), median of 30 replays; the floor from ceilings measured in the same run.
//
//   step_bench [--csv FILE] [--quick] [--fused-only] [--timeline] [--shape ROWSxCONTEXTxHxQ[v] ...]
//
// Grid: batch rows {1, 4, 16, 64, 256} x context {4k, 32k, 128k} x H {12, 96} x q {1, 4} (rows are
// requests * q, so batch 1 has no q = 4 shape); --quick: rows {1, 16, 256} x context {4k, 128k}; each --shape
// (e.g. 16x4096x12x4) replaces the grid. Every request has the full context, except in a --shape with a
// trailing v (e.g. 16x32768x12x1v): a varlen batch, lengths spread +-50 % around the context as core_bench's
// (bench_inputs.cuh, varlen_length), shown as "32768v". --fused-only times only our step (the stock columns
// stay empty): a quicker before/after of a kernel change. --timeline (a build configured with -DMLA_TIMELINE=ON) prints
// after each row when each kernel of a step starts, waits and ends (step_timeline below); compare its timings only with
// other timeline builds (the marks cost a little).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/cublas_check.h"
#include "common/cuda_check.h"
#include "core/config.h"
#include "core/launch.h"
#include "device_timing.h"
#include "mla/mla.h"
#include "query/config.h"
#include "value/config.h"
#include "bench_inputs.cuh"
#include "core_bench_stock.cuh"
#include "query_bench_stock.cuh"
#include "synthetic.h"
#include "timeline_report.h"

namespace mla::bench {
namespace {

// Gate and zero rows of the stock value stage: out = bf16(v * sigmoid(gate)), zero for empty rows.
__global__ void stock_gate_kernel(const __nv_bfloat16* v, const __nv_bfloat16* projected, int64_t pitch,
                                  const int32_t* lengths, int q, int num_requests, int width, __nv_bfloat16* out) {
  const int row = blockIdx.x;
  const int request = row / q;
  const bool zero = request >= num_requests || lengths[request] == 0;
  for (int c = threadIdx.x; c < width; c += blockDim.x) {
    const float gate = __bfloat162float(projected[row * pitch + kProjectedGateOffset + c]);
    const float x = __bfloat162float(v[int64_t(row) * width + c]);
    out[int64_t(row) * width + c] = __float2bfloat16_rn(zero ? 0.0f : x / (1.0f + expf(-gate)));
  }
}

struct Config {
  int rows, context, heads, q;
  double spread = 0;  // varlen: lengths spread +-spread around the context (0: every request the full context)
  int requests() const { return rows / q; }
  // Request r's length (>= q: its q new tokens are part of it).
  int length(int r) const { return std::max(q, varlen_length(context, spread, r)); }
  int max_length() const {
    int m = 0;
    for (int r = 0; r < requests(); ++r) m = std::max(m, length(r));
    return m;
  }
  // What the step is prepared for: 128k (a deployment's longest sequence, so short contexts run with
  // splits planned for it), or the longest request where a varlen batch goes past it.
  int64_t max_context() const { return std::max<int64_t>(int64_t{1} << 17, max_length()); }
};

// One replica: the layer's weights and a full step on the device, a PreparedMla over them, and the
// stock composition's intermediates.
struct Replica {
  DeviceArena arena;  // declared first: freed last, after the PreparedMla that uses it
  StepInputs inputs;
  Weights weights;
  std::unique_ptr<PreparedMla> mla;
  // stock intermediates
  __nv_bfloat16 *qn, *kvn, *q, *ql, *latent, *v;
  float* lse;
  uint8_t* query;
  void* core_workspace = nullptr;
  int* core_counters = nullptr;  // zeroed once; the core leaves them zero (CoreArgs::tile_counters)
  core::CorePlan core_plan;
};

// `shared_cache`: another replica's cache to read instead of a new one (nullptr: its own, filled at random).
std::unique_ptr<Replica> make_replica(const Config& c, const synth::SyntheticLayer& layer, uint64_t seed,
                                      uint8_t* shared_cache, cudaStream_t stream) {
  auto r = std::make_unique<Replica>();
  const int64_t rows = c.rows, heads = c.heads;
  const int requests = c.requests();
  const int pages_per_request = (c.max_length() + kPageSize - 1) / kPageSize;
  const int64_t num_pages = int64_t{requests} * pages_per_request;
  const int64_t pitch = (projected_width(c.heads) + 7) / 8 * 8;

  r->weights = device_weights(layer, r->arena);

  // The step: random projected rows, a random cache, permuted pages, slots at each request's last q positions.
  synth::Rng rng(synth::stream_seed(seed, 1));
  std::vector<uint16_t> projected(rows * pitch);
  synth::fill_random_bf16(projected, 0.0, 1.0, rng);
  const std::vector<int32_t> pages = shuffled_pages(num_pages, rng);
  std::vector<int32_t> lengths(requests);
  for (int request = 0; request < requests; ++request) lengths[request] = c.length(request);
  std::vector<int64_t> slots(rows);
  for (int64_t row = 0; row < rows; ++row) {
    const int request = static_cast<int>(row / c.q);
    const int64_t position = lengths[request] - c.q + row % c.q;
    slots[row] = int64_t{pages[request * pages_per_request + position / kPageSize]} * kPageSize + position % kPageSize;
  }
  uint8_t* cache = shared_cache;
  if (cache == nullptr) {
    cache = r->arena.alloc<uint8_t>(num_pages * kPageSize * kKeyDim);
    fill_cache_kernel<<<2048, 256, 0, stream>>>(cache, num_pages * kPageSize * kKeyDim, seed);
    MLA_CUDA_CHECK_LAUNCH();
  }

  StepInputs& s = r->inputs;
  s.projected = make_strided_view(r->arena.copy(projected), DType::kBF16, Memory::kDevice,
                                  {rows, projected_width(c.heads)}, {pitch, 1});
  s.out = make_view(r->arena.alloc<uint16_t>(rows * heads * kVHeadDim), DType::kBF16, Memory::kDevice,
                    {rows, heads * kVHeadDim});
  s.cache = make_view(cache, DType::kFP8E4M3, Memory::kDevice, {num_pages, kPageSize, kKeyDim});
  s.slots = make_view(r->arena.copy(slots), DType::kI64, Memory::kDevice, {rows});
  s.block_table = make_view(r->arena.copy(pages), DType::kI32, Memory::kDevice, {requests, pages_per_request});
  s.lengths = make_view(r->arena.copy(lengths), DType::kI32, Memory::kDevice, {requests});
  s.q = c.q;

  const TensorView scratch = make_view(r->arena.alloc<uint8_t>(rows * heads * kKeyDim), DType::kFP8E4M3,
                                       Memory::kDevice, {rows, heads, kKeyDim});
  r->mla = std::make_unique<PreparedMla>(r->weights, LayerDims{c.heads, 1e-5f}, std::map<int64_t, int64_t>{{rows, pitch}},
                                         scratch, PrepareOptions{.max_context = c.max_context(), .queries = {c.q}});
  r->mla->prepare(s.cache);

  // Stock intermediates.
  r->query = scratch.as<uint8_t>();
  r->qn = r->arena.alloc<__nv_bfloat16>(rows * kQLoraRank);
  r->kvn = r->arena.alloc<__nv_bfloat16>(rows * kKvLoraRank);
  r->q = r->arena.alloc<__nv_bfloat16>(rows * heads * kQkHeadDim);
  r->ql = r->arena.alloc<__nv_bfloat16>(rows * heads * kKvLoraRank);
  r->latent = r->arena.alloc<__nv_bfloat16>(rows * heads * kKvLoraRank);
  r->v = r->arena.alloc<__nv_bfloat16>(rows * heads * kVHeadDim);
  r->lse = r->arena.alloc<float>(rows * heads);
  core::CoreShape shape;
  shape.rows = rows;
  shape.heads = c.heads;
  shape.q = c.q;
  shape.max_context = c.max_context();
  r->core_plan = core::plan_core(shape);
  if (r->core_plan.workspace_bytes > 0) r->core_workspace = r->arena.alloc<uint8_t>(r->core_plan.workspace_bytes);
  if (r->core_plan.tile_counters > 0) {
    r->core_counters = r->arena.alloc<int>(r->core_plan.tile_counters);
    MLA_CUDA_CHECK(cudaMemset(r->core_counters, 0, r->core_plan.tile_counters * sizeof(int)));
  }
  return r;
}

// The stock composition of one step on replica `r`: its attention is our core, or with
// `stock_attention` the stock attention of core_bench_stock.cuh (gather to bf16, cuBLAS, softmax,
// cuBLAS), the composition DESIGN.md §6 describes.
void enqueue_stock(Replica& r, const Config& c, cublasHandle_t cublas, cudaStream_t stream,
                   StockCore* stock_attention = nullptr) {
  const int H = c.heads, rows = c.rows;
  const StepInputs& s = r.inputs;
  const auto* projected = s.projected.as<const __nv_bfloat16>();
  const int64_t pitch = s.projected.stride[0];
  const float alpha = 1.f, beta = 0.f;
  stock_rms_norm_kernel<<<rows, 256, 0, stream>>>(projected, pitch, r.weights.q_a_norm.as<const __nv_bfloat16>(),
                                                  r.weights.kv_a_norm.as<const __nv_bfloat16>(), 1e-5f, r.qn, r.kvn);
  MLA_CUDA_CHECK_LAUNCH();
  MLA_CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, H * kQkHeadDim, rows, kQLoraRank, &alpha,
                                r.weights.q_b_proj.data, CUDA_R_16BF, kQLoraRank, r.qn, CUDA_R_16BF, kQLoraRank, &beta, r.q,
                                CUDA_R_16BF, H * kQkHeadDim, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  MLA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(cublas, CUBLAS_OP_N, CUBLAS_OP_N, kKvLoraRank, rows, kNopeDim, &alpha,
                                              r.weights.w_uk_t.data, CUDA_R_16BF, kKvLoraRank, kNopeDim * kKvLoraRank, r.q,
                                              CUDA_R_16BF, H * kQkHeadDim, kQkHeadDim, &beta, r.ql, CUDA_R_16BF,
                                              H * kKvLoraRank, kKvLoraRank, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  stock_quantize_kernel<<<dim3(rows, H), 128, 0, stream>>>(r.q, r.ql, r.kvn, projected, pitch, s.slots.as<const int64_t>(),
                                                           H, 1.0f / r.weights.q_scale, 1.0f / r.weights.k_scale, r.query,
                                                           s.cache.as<uint8_t>(), s.cache.stride[0]);
  MLA_CUDA_CHECK_LAUNCH();
  core::CoreArgs args;
  args.query = r.query;
  args.cache = s.cache.data;
  args.stride_cache_page = s.cache.stride[0];
  args.block_table = s.block_table.as<const int32_t>();
  args.stride_block_table = s.block_table.stride[0];
  args.lengths = s.lengths.as<const int32_t>();
  args.num_requests = static_cast<int>(s.block_table.shape[0]);
  args.softmax_scale = r.weights.q_scale * r.weights.k_scale / std::sqrt(float(kQkHeadDim));
  args.k_scale = r.weights.k_scale;
  args.latent = r.latent;
  args.lse = r.lse;
  args.workspace = r.core_workspace;
  args.tile_counters = r.core_counters;
  const __nv_bfloat16* latent = r.latent;
  if (stock_attention != nullptr) {
    // The cache is scaled by k_scale in the gather, so the logits take only q_scale / sqrt(192).
    stock_attention->run(cublas, stream, s.cache.as<uint8_t>(), args.block_table, args.lengths, r.query,
                         r.weights.q_scale / std::sqrt(float(kQkHeadDim)), r.weights.k_scale);
    latent = stock_attention->latent;
  } else {
    core::launch_core(r.core_plan, args, stream);
  }
  // v^T (128 x rows) = W_UV[h]^T (128 x 512) . latent[h]^T (512 x rows), per head (column-major view).
  MLA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(cublas, CUBLAS_OP_N, CUBLAS_OP_N, kVHeadDim, rows, kKvLoraRank, &alpha,
                                              r.weights.w_uv.data, CUDA_R_16BF, kVHeadDim, kKvLoraRank * kVHeadDim, latent,
                                              CUDA_R_16BF, H * kKvLoraRank, kKvLoraRank, &beta, r.v, CUDA_R_16BF,
                                              H * kVHeadDim, kVHeadDim, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  stock_gate_kernel<<<rows, 256, 0, stream>>>(r.v, projected, pitch, s.lengths.as<const int32_t>(), c.q,
                                              args.num_requests, H * kVHeadDim, s.out.as<__nv_bfloat16>());
  MLA_CUDA_CHECK_LAUNCH();
}

// The stock attention's intermediates (a bf16 copy of the visible cache, fp32 scores) must fit beside
// the replicas: shapes past this skip it (at 256 x 128k the bf16 K alone is 39 GB).
constexpr int64_t kStockAttentionBudgetBytes = int64_t{24} << 30;

// How far a stock composition's out may lie from the fused step's (relative L2) before the row says
// MISMATCH: see the check in main for why it is not ~1e-3.
constexpr double kStockAgreement = 5e-2;

// The replica's out after `enqueue` (bf16 bits).
template <class Enqueue>
std::vector<uint16_t> out_after(Replica& r, cudaStream_t stream, Enqueue enqueue) {
  enqueue();
  std::vector<uint16_t> out(r.inputs.out.numel());
  MLA_CUDA_CHECK(cudaMemcpyAsync(out.data(), r.inputs.out.data, out.size() * 2, cudaMemcpyDeviceToHost, stream));
  MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

// |a - b|_2 / |b|_2 over whole bf16 tensors.
double relative_l2(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = synth::bf16_value(a[i]), y = synth::bf16_value(b[i]);
    diff += (x - y) * (x - y);
    ref += y * y;
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

// --timeline (an MLA_TIMELINE build): where one step's time goes, kernel by kernel. One CUDA graph of
// kTimelineSteps steps over the replicas in turn, as the timed graphs run them, the last two through
// PreparedMla::run_timeline; printed for the last: each kernel's first CTA start, its CTAs' PDL-wait returns
// (median, last) and its last CTA end, in µs from its query kernel's first CTA start (the split kernel's where the
// query takes the GEMM path, which has no marks), the step before's value end, then each kernel's phases.
constexpr int kTimelineSteps = 8;
std::string step_timeline(const std::vector<std::unique_ptr<Replica>>& copies, const Config& c, cudaStream_t stream) {
  const PreparedMla::StepCtas ctas = copies[0]->mla->timeline_ctas(c.rows, c.q);  // every replica's shape is this
  struct Kernel {
    const char* name;
    int ctas, waited_mark;
    std::vector<std::string> marks;
  };
  auto names = [](const auto& array) { return std::vector<std::string>(std::begin(array), std::end(array)); };
  const std::vector<Kernel> kernels = {
      {"query", ctas.query, query::kMarkWaited, names(query::kQueryMarkNames)},
      {"core split", ctas.split, core::kCoreMarkWaited, names(core::kCoreMarkNames)},
      {"combine", ctas.combine, core::kCombineMarkWaited, names(core::kCombineMarkNames)},
      {"value", ctas.value, value::kValueMarkWaited, names(value::kValueMarkNames)}};
  size_t per_step = 0;  // stamps of one step, the kernels' buffers one after the other
  for (const Kernel& k : kernels) per_step += size_t(k.ctas) * timeline::kMaxMarks;
  uint64_t* stamps;
  MLA_CUDA_CHECK(cudaMalloc(&stamps, 2 * per_step * sizeof(uint64_t)));
  MLA_CUDA_CHECK(cudaMemset(stamps, 0, 2 * per_step * sizeof(uint64_t)));
  auto buffer = [&](int step, int kernel) -> uint64_t* {
    size_t offset = step * per_step;
    for (int k = 0; k < kernel; ++k) offset += size_t(kernels[k].ctas) * timeline::kMaxMarks;
    return kernels[kernel].ctas > 0 ? stamps + offset : nullptr;
  };

  cudaGraph_t graph;
  MLA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kTimelineSteps; ++i) {
    Replica& r = *copies[i % copies.size()];
    const int stamped = i - (kTimelineSteps - 2);
    if (stamped < 0) {
      r.mla->run(r.inputs, stream);
    } else {
      r.mla->run_timeline(r.inputs, stream,
                          {buffer(stamped, 0), buffer(stamped, 1), buffer(stamped, 2), buffer(stamped, 3)});
    }
  }
  MLA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  MLA_CUDA_CHECK(cudaGraphDestroy(graph));
  MLA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  MLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  std::vector<uint64_t> host(2 * per_step);
  MLA_CUDA_CHECK(cudaMemcpy(host.data(), stamps, host.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  MLA_CUDA_CHECK(cudaFree(stamps));
  auto launch = [&](int step, int kernel) {
    return LaunchStamps{host.data() + (buffer(step, kernel) - stamps), kernels[kernel].ctas, &kernels[kernel].marks};
  };

  const int first = kernels[0].ctas > 0 ? 0 : 1;  // the step's first kernel with marks
  const double origin = launch(1, first).first_start();
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line,
                "  timeline (graph of %d steps, the last; µs from its %s kernel's first CTA): the step before's value "
                "kernel ended at %+.2f\n    %-11s %6s %12s %22s %9s\n",
                kTimelineSteps, kernels[first].name, (launch(0, 3).last_end() - origin) / 1e3, "kernel", "CTAs",
                "first start", "waited: median / last", "last end");
  out += line;
  for (int k = 0; k < int(kernels.size()); ++k) {
    if (kernels[k].ctas == 0) {
      std::snprintf(line, sizeof line, "    %-11s %6s\n", kernels[k].name,
                    k == 0 ? "GEMM path: no marks" : "none (the splits merge in the split kernel)");
      out += line;
      continue;
    }
    const LaunchStamps l = launch(1, k);
    std::vector<double> waited;
    for (int cta = 0; cta < l.ctas; ++cta) {
      if (l.at(cta, kernels[k].waited_mark) != 0) waited.push_back((l.at(cta, kernels[k].waited_mark) - origin) / 1e3);
    }
    std::sort(waited.begin(), waited.end());
    std::snprintf(line, sizeof line, "    %-11s %6d %12.2f %13.2f / %6.2f %9.2f\n", kernels[k].name, l.ctas,
                  (l.first_start() - origin) / 1e3, waited.empty() ? NAN : waited[waited.size() / 2],
                  waited.empty() ? NAN : waited.back(), (l.last_end() - origin) / 1e3);
    out += line;
  }
  for (int k = 0; k < int(kernels.size()); ++k) {
    if (kernels[k].ctas == 0) continue;
    out += std::string("   ") + kernels[k].name + " phases (since the CTA's previous mark):\n";
    out += phase_report(launch(1, k));
  }
  return out;
}

}  // namespace
}  // namespace mla::bench

int main(int argc, char** argv) {
  using namespace mla;
  std::string csv_path;
  bool quick = false;
  bool fused_only = false, timeline = false;
  std::vector<bench::Config> shapes;  // --shape: replaces the grid
  for (int i = 1; i < argc; ++i) {
    bench::Config c{};
    if (!std::strcmp(argv[i], "--csv") && i + 1 < argc) {
      csv_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--fused-only")) {
      fused_only = true;
    } else if (!std::strcmp(argv[i], "--timeline")) {
      if (!mla::bench::timeline_build("step_bench")) return 2;
      timeline = true;
    } else if (char varlen = 0, extra = 0;
               !std::strcmp(argv[i], "--shape") && i + 1 < argc &&
               [&] {
                 const int n = std::sscanf(argv[++i], "%dx%dx%dx%d%c%c", &c.rows, &c.context, &c.heads, &c.q, &varlen,
                                           &extra);
                 c.spread = n == 5 ? 0.5 : 0.0;
                 return n == 4 || (n == 5 && varlen == 'v');
               }() &&
               c.q >= 1 && c.q <= kMaxQueries && c.rows >= c.q && c.rows % c.q == 0 && c.context >= c.q && c.heads >= 1) {
      shapes.push_back(c);
    } else {
      std::fprintf(stderr,
                   "step_bench: bad argument '%s'\nusage: step_bench [--csv FILE] [--quick] [--fused-only] "
                   "[--timeline] [--shape ROWSxCONTEXTxHxQ[v] ...] (rows a multiple of q, 1 <= q <= %d; v: varlen)\n",
                   argv[i], kMaxQueries);
      return 2;
    }
  }
  try {
    cudaStream_t stream;
    MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cublasHandle_t cublas;
    MLA_CUBLAS_CHECK(cublasCreate(&cublas));
    MLA_CUBLAS_CHECK(cublasSetStream(cublas, stream));
    const timing::Ceilings ceilings = timing::measure_ceilings(stream);
    cudaDeviceProp prop{};
    MLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs; ceilings: %s\n\n", prop.name, prop.multiProcessorCount, ceilings.describe().c_str());

    std::FILE* csv = csv_path.empty() ? nullptr : std::fopen(csv_path.c_str(), "w");
    if (!csv_path.empty() && csv == nullptr) throw Error("step_bench: cannot write --csv " + csv_path);
    if (csv) {
      std::fprintf(csv, "rows,context,heads,q,fused_us,stock_us,floor_us,fused_over_floor,stock_over_fused,gbs,tflops,"
                        "stock_attention_us,stock_attention_over_fused,stock_out_rel_l2,stock_attention_out_rel_l2,varlen\n");
    }
    std::printf("stock: the stock composition with our core; stock attention: the same with the stock attention of "
                "core_bench_stock.cuh (DESIGN.md §6; skipped, '-', where its intermediates exceed %.0f GB). The last column: "
                "relative L2 of each stock composition's out against the fused step's (MISMATCH past %.0e; the stock rounds ql "
                "to bf16 before its FP8 quantization, ~2e-2 apart by that alone).\n\n",
                bench::kStockAttentionBudgetBytes / 1e9, bench::kStockAgreement);
    std::printf("| rows | context | H | q | fused µs | floor µs | fused/floor | stock µs | stock/fused | GB/s | TFLOP/s | "
                "stock attention µs | stock attention/fused | out vs fused: stock, stock attention |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");

    std::map<int, synth::SyntheticLayer> layers;
    if (shapes.empty()) {  // the grid of the file comment (or the quick subset)
      const std::vector<int> batches = quick ? std::vector<int>{1, 16, 256} : std::vector<int>{1, 4, 16, 64, 256};
      const std::vector<int> contexts = quick ? std::vector<int>{4096, 131072} : std::vector<int>{4096, 32768, 131072};
      for (int heads : {12, 96})
        for (int q : {1, 4})
          for (int rows : batches)
            for (int context : contexts)
              if (rows % q == 0) shapes.push_back({rows, context, heads, q});
    }
    for (const bench::Config& c : shapes) {
      const int rows = c.rows, context = c.context, heads = c.heads, q = c.q, requests = c.requests();
      if (layers.count(heads) == 0) layers.emplace(heads, synth::make_layer(heads, 1));
      // The requests' tokens, and the tokens their rows see (row i of a request of length T sees T - q + i + 1).
      double request_tokens = 0, visible = 0;
      for (int r = 0; r < requests; ++r) {
        request_tokens += c.length(r);
        for (int i = 0; i < q; ++i) visible += c.length(r) - q + i + 1;
      }
      const double kv_bytes = request_tokens * kKeyDim;
      const double weight_bytes = 2.0 * heads * (kQkHeadDim * kQLoraRank + kNopeDim * kKvLoraRank + kKvLoraRank * kVHeadDim);
      // L2-cold: the caches a graph rotates over exceed 150 MB, and so do the weights, 4x over: data that an L2 policy
      // marks evict_first leaves the rest of a step's bytes in the L2 longer, and a replica's weights (10 MB at H = 12)
      // must not survive until its next step (in a model, 60 other layers run in between). Replicas past the
      // caches' count read an earlier replica's cache (its writes land in that cache's slots).
      const int cache_replicas = static_cast<int>(std::clamp(std::ceil(150e6 / kv_bytes), 1.0, 8.0));
      const int replicas = std::max(cache_replicas, static_cast<int>(std::clamp(std::ceil(600e6 / weight_bytes), 1.0, 16.0)));
      std::vector<std::unique_ptr<bench::Replica>> copies;
      for (int i = 0; i < replicas; ++i) {
        uint8_t* shared_cache = i < cache_replicas ? nullptr : copies[i % cache_replicas]->inputs.cache.as<uint8_t>();
        copies.push_back(bench::make_replica(c, layers.at(heads), 10 + i, shared_cache, stream));
      }
      MLA_CUDA_CHECK(cudaStreamSynchronize(stream));

      const double fused = timing::time_graph_us(
          stream, [&](int i) { copies[i % replicas]->mla->run(copies[i % replicas]->inputs, stream); });
      const timing::StepCost cost = timing::step_cost(heads, rows, request_tokens, visible);
      const double floor = timing::floor_us(ceilings, cost.bytes(), cost.bf16_flops, cost.fp8_flops);
      // --fused-only leaves every stock column empty (NaN: '-' in the table, nothing in the CSV).
      const double stock = fused_only ? std::nan("")
                                      : timing::time_graph_us(stream, [&](int i) {
                                          bench::enqueue_stock(*copies[i % replicas], c, cublas, stream);
                                        });
      std::unique_ptr<bench::StockCore> stock_attention;
      double stock_attention_us = std::nan("");
      if (!fused_only && bench::StockCore::bytes(requests, q, heads, c.max_length()) <= bench::kStockAttentionBudgetBytes) {
        const StepInputs& inputs = copies[0]->inputs;  // every replica has the same shapes
        stock_attention = std::make_unique<bench::StockCore>(requests, q, heads, c.max_length(),
                                                             static_cast<int>(inputs.block_table.shape[1]),
                                                             inputs.cache.stride[0]);
        stock_attention_us = timing::time_graph_us(
            stream,
            [&](int i) { bench::enqueue_stock(*copies[i % replicas], c, cublas, stream, stock_attention.get()); },
            /*launches=*/20, /*replays=*/10);
      }
      // A broken stock path cannot pass for a slow one: its out must match the fused step's. Not to
      // rounding: the stock rounds ql to bf16 before its e4m3 quantization (DESIGN.md §4 allows it), which
      // moves ~3 % of the query's e4m3 bytes by one step (1.6 % relative RMS of the query; a numpy model of
      // the double rounding), and the out by about as much: measured 1.6-2.5e-2 on every shape
      // (2026-12-04). A broken composition is off by O(1).
      double stock_err = std::nan(""), stock_attention_err = std::nan("");
      if (!fused_only) {
        bench::Replica& r0 = *copies[0];
        const std::vector<uint16_t> fused_out = bench::out_after(r0, stream, [&] { r0.mla->run(r0.inputs, stream); });
        stock_err = bench::relative_l2(
            bench::out_after(r0, stream, [&] { bench::enqueue_stock(r0, c, cublas, stream); }), fused_out);
        if (stock_attention) {
          stock_attention_err = bench::relative_l2(
              bench::out_after(r0, stream,
                               [&] { bench::enqueue_stock(r0, c, cublas, stream, stock_attention.get()); }),
              fused_out);
        }
      }
      const bool agree = fused_only || (stock_err <= bench::kStockAgreement &&
                                        (!stock_attention || stock_attention_err <= bench::kStockAgreement));
      // One cell of the table ('-' for NaN) and of the CSV (empty for NaN).
      auto cell = [](const char* format, double v, const char* missing) {
        char text[32];
        std::snprintf(text, sizeof text, format, v);
        return std::isnan(v) ? std::string(missing) : std::string(text);
      };
      std::printf("| %d | %d%s | %d | %d | %.2f | %.2f | %.2f | %s | %s | %.0f | %.1f | %s | %s | %s, %s%s |\n", rows,
                  context, c.spread > 0 ? "v" : "", heads, q, fused, floor, fused / floor, cell("%.2f", stock, "-").c_str(),
                  cell("%.2f", stock / fused, "-").c_str(), cost.bytes() / (fused * 1e3), cost.flops() / (fused * 1e6),
                  cell("%.2f", stock_attention_us, "-").c_str(), cell("%.2f", stock_attention_us / fused, "-").c_str(),
                  cell("%.1e", stock_err, "-").c_str(), cell("%.1e", stock_attention_err, "-").c_str(),
                  agree ? "" : " MISMATCH");
      if (timeline) std::fputs(bench::step_timeline(copies, c, stream).c_str(), stdout);
      std::fflush(stdout);
      if (csv) {
        std::fprintf(csv, "%d,%d,%d,%d,%.3f,%s,%.3f,%.3f,%s,%.1f,%.2f,%s,%s,%s,%s,%d\n", rows, context, heads, q, fused,
                     cell("%.3f", stock, "").c_str(), floor, fused / floor, cell("%.3f", stock / fused, "").c_str(),
                     cost.bytes() / (fused * 1e3), cost.flops() / (fused * 1e6),
                     cell("%.3f", stock_attention_us, "").c_str(), cell("%.3f", stock_attention_us / fused, "").c_str(),
                     cell("%.2e", stock_err, "").c_str(), cell("%.2e", stock_attention_err, "").c_str(), c.spread > 0 ? 1 : 0);
      }
    }
    if (csv && std::fclose(csv) != 0) throw Error("step_bench: cannot write --csv " + csv_path);
    MLA_CUBLAS_CHECK(cublasDestroy(cublas));
    MLA_CUDA_CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "step_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
