// Benchmark of the FP8 attention core (src/core): the shapes of issue 4 on random (never zero) FP8
// data, CUDA events over graph replays (a graph of 20-1024 launches, median of the replays), one page set
// per launch, rotated so that a set is read again only after ~400 MB of others (the L2 holds 50 MB).
// Reports µs per step, GB/s over the visible KV bytes (576 B per visible token), % of the device-to-device
// copy bandwidth measured in the same run (read + write bytes), TFLOP/s at 2 * (576 + 512) FLOP per
// (visible token x row x head).
//
//   core_bench [--out results.md] [--variant planned|mma.sync|mma.sync3|mma.sync4|wgmma-pp2|wgmma-pp3 ...]
//              [--small-batch] [--splits N ...] [--tile N ...] [--shape BATCHxCONTEXTxHxQ[v] ...] [--stock]
//              [--l2-resident] [--max-context TOKENS] [--peer LIB.so] [--timeline] [--read-floor]
// The last shapes are varlen batches: lengths spread +-50 % around the mean context. --small-batch
// times the latency-bound shapes of a decode step instead (batch 1, 4, 16 x 4k, 32k x H 12, 96; H 12 x q 2, 4),
// each --splits N forces that split count (0 = planned) to find where the split plan should stop, each --tile N
// (16, 32, 48 or 64; 0 = planned) the ping-pong kernel's N-tile in its variants (wgmma-pp2/3; the others ignore it),
// and
// each --shape (e.g. 128x4096x16x1, a trailing v for varlen) replaces the shape list: one shape to
// profile (ncu --launch-skip then counts launches of that shape only). --stock also times the stock
// composition of bench/core_bench_stock.cuh on the same inputs and checks its LSE against ours.
// --l2-resident is a diagnostic, not a result: every block-table entry points into a pool of 128 pages
// (4.7 MB, L2-resident), so the same kernels run without DRAM latency or bandwidth in the way; its time
// against the normal run's says how much of a shape's time is waiting for memory (the % copy column
// then counts bytes the kernel read from L2).
// --max-context plans the split count (and kernel) for that many tokens instead of each shape's own longest request, as
// PreparedMla does for a deployment's longest sequence (its default 1 << 17): a short request then fills only its first
// splits (the others exit at once), which is the core's cost inside `step_bench`.
// --peer times a peer's core (a shared library with bench/peer_core.h's interface, e.g. FP8 FlashMLA built in
// the git-ignored peers/ folder) on the same inputs in the same run, and checks its LSE and latent against ours.
// --timeline (a build configured with -DMLA_TIMELINE=ON) prints after each row where the core's time goes: per launch
// the split kernel's and the combine's spans and the gaps between them, and each kernel's phases (core/config.h,
// CoreMark / CombineMark; common/timeline.cuh). Compare its timings only with other timeline builds.
// --read-floor also times a kernel that only reads the same visible KV bytes (bench/page_read_floor.cuh) in the same
// way: the part of a shape's time that the bytes alone take at that size (launch, first latency and tail included).
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cublas_check.h"
#include "common/cuda_check.h"
#include "bench_device.cuh"
#include "bench_inputs.cuh"
#include "core_bench_stock.cuh"
#include "device_timing.h"
#include "core/config.h"
#include "core/launch.h"
#include "mla/dims.h"
#include "page_read_floor.cuh"
#include "peer_core.h"
#include "synthetic.h"
#include "timeline_report.h"

namespace {

// Random e4m3 bytes in (-2, 2): bit 6 (the top exponent bit) cleared, so no NaN and no huge values.
__global__ void fill_fp8(uint8_t* data, int64_t bytes, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < bytes; i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = (static_cast<uint64_t>(i) + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    data[i] = static_cast<uint8_t>(h) & 0xbf;
  }
}

struct Shape {
  int batch;
  int context;        // mean tokens per request
  int heads;
  int q;
  double spread = 0;  // varlen: lengths uniform in context * [1 - spread, 1 + spread] (0 = all equal)
};

struct Variant {
  const char* name;
  int kernel;  // CoreShape.kernel (0 = planned)
  int stages;  // CoreShape.stages (0 = default)
};
constexpr Variant kVariants[] = {{"planned", 0, 0},          {"mma.sync", mla::core::kKernelMmaSync, 2},
                                 {"mma.sync3", mla::core::kKernelMmaSync, 3}, {"mma.sync4", mla::core::kKernelMmaSync, 4},
                                 {"wgmma-pp2", mla::core::kKernelWgmmaPp, 2}, {"wgmma-pp3", mla::core::kKernelWgmmaPp, 3}};

constexpr float kSoftmaxScale = 0.0721688f;  // 1/sqrt(192), k_scale 1: the logits of ours and the stock path

// A peer's core from --peer: its library and the four functions of bench/peer_core.h.
class PeerCore {
 public:
  explicit PeerCore(const char* path) : library_(dlopen(path, RTLD_NOW | RTLD_LOCAL)) {
    if (library_ == nullptr) throw std::runtime_error(std::string("--peer ") + path + ": " + dlerror());
    name = symbol<decltype(&mla_peer_core_name)>("mla_peer_core_name");
    prepare = symbol<decltype(&mla_peer_core_prepare)>("mla_peer_core_prepare");
    run = symbol<decltype(&mla_peer_core_run)>("mla_peer_core_run");
    release = symbol<decltype(&mla_peer_core_release)>("mla_peer_core_release");
  }
  ~PeerCore() { dlclose(library_); }
  PeerCore(const PeerCore&) = delete;
  PeerCore& operator=(const PeerCore&) = delete;

  decltype(&mla_peer_core_name) name;
  decltype(&mla_peer_core_prepare) prepare;
  decltype(&mla_peer_core_run) run;
  decltype(&mla_peer_core_release) release;

 private:
  template <typename F>
  F symbol(const char* what) {
    void* f = dlsym(library_, what);
    if (f == nullptr) throw std::runtime_error(std::string("--peer: the library exports no ") + what);
    return reinterpret_cast<F>(f);
  }
  void* library_;
};

struct Result {
  double us, gbs, pct, tflops;
  int splits, stages, ctas_per_sm, kernel, tile_rows;
  double stock_us = 0;         // with --stock
  double stock_lse_diff = 0;   // max |LSE(stock) - LSE(ours)| over the rows (set 0 of the page sets)
  double stock_latent_err = 0; // max over (row, head) of |latent(stock) - latent(ours)|_2 / |latent(ours)|_2
  double peer_us = 0;          // with --peer (0: it cannot run the shape, peer_note says why)
  std::string peer_note;
  double peer_lse_diff = 0, peer_latent_err = 0;  // as the stock ones, peer vs ours
  std::string timeline;        // with --timeline (an MLA_TIMELINE build): the per-phase report
  double read_us = 0;          // with --read-floor: bench/page_read_floor.cuh's read of the same bytes
};

// --timeline (an MLA_TIMELINE build): kTimelineLaunches back-to-back PDL launches of the core (split kernel, then the
// combine where the plan has one), each with its own stamps, and the report of the last ones: per launch the chain
// (the split kernel's start after the previous launch's end, its span, the combine's start after the split kernel's
// last CTA, its span) and both kernels' phases (config.h, CoreMark / CombineMark).
constexpr int kTimelineLaunches = 6;
std::string core_timeline(const mla::core::CorePlan& plan, const std::function<mla::core::CoreArgs(int)>& core_args,
                          cudaStream_t stream) {
  const int split_ctas = int(plan.grid.x * plan.grid.y * plan.grid.z);
  const bool combine = mla::core::launches_combine(plan);
  const int combine_ctas = combine ? int(plan.combine_grid.x * plan.combine_grid.y * plan.combine_grid.z) : 0;
  const size_t split_per_launch = size_t(split_ctas) * mla::timeline::kMaxMarks;
  const size_t combine_per_launch = size_t(combine_ctas) * mla::timeline::kMaxMarks;
  const size_t total = (split_per_launch + combine_per_launch) * kTimelineLaunches;
  uint64_t* stamps;
  MLA_CUDA_CHECK(cudaMalloc(&stamps, total * sizeof(uint64_t)));
  MLA_CUDA_CHECK(cudaMemset(stamps, 0, total * sizeof(uint64_t)));
  uint64_t* combine_stamps = stamps + split_per_launch * kTimelineLaunches;
  for (int i = 0; i < kTimelineLaunches; ++i) {
    mla::core::CoreArgs args = core_args(i);
    args.timeline = stamps + i * split_per_launch;
    args.combine_timeline = combine ? combine_stamps + i * combine_per_launch : nullptr;
    mla::core::launch_core(plan, args, stream);
  }
  MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<uint64_t> host(total);
  MLA_CUDA_CHECK(cudaMemcpy(host.data(), stamps, total * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  MLA_CUDA_CHECK(cudaFree(stamps));
  const std::vector<std::string> split_names(std::begin(mla::core::kCoreMarkNames), std::end(mla::core::kCoreMarkNames));
  const std::vector<std::string> combine_names(std::begin(mla::core::kCombineMarkNames),
                                               std::end(mla::core::kCombineMarkNames));
  auto split_at = [&](int l) {
    return mla::bench::LaunchStamps{host.data() + l * split_per_launch, split_ctas, &split_names};
  };
  auto combine_at = [&](int l) {
    return mla::bench::LaunchStamps{host.data() + split_per_launch * kTimelineLaunches + l * combine_per_launch,
                                    combine_ctas, &combine_names};
  };
  std::string out;
  char line[256];
  for (int l = 1; l < kTimelineLaunches; ++l) {
    const double previous_end = combine ? combine_at(l - 1).last_end() : split_at(l - 1).last_end();
    const double split_start = split_at(l).first_start(), split_end = split_at(l).last_end();
    std::snprintf(line, sizeof line, "  launch %d: split kernel %.2f us after the previous launch's last CTA, span %.2f us",
                  l, (split_start - previous_end) / 1e3, (split_end - split_start) / 1e3);
    out += line;
    if (combine) {
      const double combine_start = combine_at(l).first_start(), combine_end = combine_at(l).last_end();
      std::snprintf(line, sizeof line, "; combine %.2f us after its last CTA, span %.2f us; chain %.2f us",
                    (combine_start - split_end) / 1e3, (combine_end - combine_start) / 1e3,
                    (combine_end - previous_end) / 1e3);
      out += line;
    }
    out += "\n";
    if (l == kTimelineLaunches - 1) {  // the phases of the last launch (the others are alike)
      out += "   split kernel phases (since the CTA's previous mark):\n" + mla::bench::phase_report(split_at(l));
      if (combine) out += "   combine phases:\n" + mla::bench::phase_report(combine_at(l));
    }
  }
  return out;
}

// The largest relative L2 difference of two device bf16 latents [rows * heads, 512].
double max_latent_err(const void* a, const void* b, int64_t row_heads) {
  const int64_t n = row_heads * mla::kKvLoraRank;
  std::vector<uint16_t> ha(n), hb(n);
  MLA_CUDA_CHECK(cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost));
  MLA_CUDA_CHECK(cudaMemcpy(hb.data(), b, n * 2, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (int64_t r = 0; r < row_heads; ++r) {
    double diff = 0, ref = 0;
    for (int d = 0; d < mla::kKvLoraRank; ++d) {
      const double x = mla::synth::bf16_value(ha[r * mla::kKvLoraRank + d]);
      const double y = mla::synth::bf16_value(hb[r * mla::kKvLoraRank + d]);
      diff += (x - y) * (x - y);
      ref += y * y;
    }
    worst = std::max(worst, ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff));
  }
  return worst;
}

// The largest |a - b| over two device LSE arrays (equal infinities count as 0, a lone one as inf).
double max_lse_diff(const float* a, const float* b, int64_t n) {
  std::vector<float> ha(n), hb(n);
  MLA_CUDA_CHECK(cudaMemcpy(ha.data(), a, n * sizeof(float), cudaMemcpyDeviceToHost));
  MLA_CUDA_CHECK(cudaMemcpy(hb.data(), b, n * sizeof(float), cudaMemcpyDeviceToHost));
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (ha[i] == hb[i]) continue;
    const double d = std::fabs(double(ha[i]) - double(hb[i]));
    worst = std::max(worst, std::isnan(d) ? INFINITY : d);
  }
  return worst;
}

constexpr int64_t kL2ResidentPages = 128;
constexpr int kMinLaunches = 20;     // launches a timed graph holds at least
constexpr int kMaxLaunches = 1024;   // and at most (one per page set: the rotation that keeps the L2 cold)

Result bench_shape(const Shape& s, const Variant& variant, int num_splits, int tile_rows, double copy_gbs,
                   cublasHandle_t stock, const PeerCore* peer, bool l2_resident, int64_t max_context, bool timeline,
                   bool read_floor) {
  const int64_t rows = int64_t{s.batch} * s.q;
  const int max_length = static_cast<int>(s.context * (1.0 + s.spread)) + 1;
  const int pages_per_request = (max_length + mla::kPageSize - 1) / mla::kPageSize;
  const int64_t pages_per_set = int64_t{s.batch} * pages_per_request;
  const int64_t page_bytes = int64_t{mla::kPageSize} * mla::kKeyDim;
  const int64_t set_bytes = pages_per_set * page_bytes;
  // L2-cold (DESIGN.md §6): every launch of a graph reads the next set of pages, so a set comes back only after all the
  // others' bytes (~400 MB; the L2 holds 50 MB). The graph holds one launch per set, at least 20 (so a large set is
  // timed over 20 launches) and at most kMaxLaunches (a set of one or two pages is then read again after 37-74 MB).
  const int num_sets = l2_resident ? 1
                                   : static_cast<int>(std::clamp<int64_t>((int64_t{400} << 20) / set_bytes + 1, 1,
                                                                          kMaxLaunches));
  const int launches = std::max(kMinLaunches, num_sets);
  const int64_t num_pages = pages_per_set * num_sets;
  const int64_t pool_pages = l2_resident ? std::min(num_pages, kL2ResidentPages) : num_pages;

  uint8_t *cache, *query;
  int32_t *tables, *lengths;
  void *latent, *workspace = nullptr;
  int* counters = nullptr;  // zeroed once; the core leaves them zero (CoreArgs::tile_counters)
  float* lse;
  MLA_CUDA_CHECK(cudaMalloc(&cache, pool_pages * page_bytes));
  MLA_CUDA_CHECK(cudaMalloc(&query, rows * s.heads * mla::kKeyDim));
  MLA_CUDA_CHECK(cudaMalloc(&tables, num_pages * sizeof(int32_t)));
  MLA_CUDA_CHECK(cudaMalloc(&lengths, s.batch * sizeof(int32_t)));
  MLA_CUDA_CHECK(cudaMalloc(&latent, rows * s.heads * mla::kKvLoraRank * 2));
  MLA_CUDA_CHECK(cudaMalloc(&lse, rows * s.heads * sizeof(float)));
  fill_fp8<<<1024, 256>>>(cache, pool_pages * page_bytes, 1);
  fill_fp8<<<1024, 256>>>(query, rows * s.heads * mla::kKeyDim, 2);
  MLA_CUDA_CHECK_LAUNCH();
  // Page p of set k: a strided permutation so neighbouring block-table entries are far apart.
  std::vector<int32_t> table(num_pages);
  for (int64_t i = 0; i < num_pages; ++i) table[i] = static_cast<int32_t>((i * 7919) % pool_pages);
  MLA_CUDA_CHECK(cudaMemcpy(tables, table.data(), table.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  std::vector<int32_t> len(s.batch);
  double total_tokens = 0;   // KV tokens read
  double visible_pairs = 0;  // (row, visible token) pairs: row i of a request's q sees L - q + 1 + i tokens
  for (int b = 0; b < s.batch; ++b) {
    total_tokens += len[b] = mla::bench::varlen_length(s.context, s.spread, b);
    for (int i = 0; i < s.q; ++i) visible_pairs += std::clamp(len[b] - s.q + 1 + i, 0, len[b]);
  }
  MLA_CUDA_CHECK(cudaMemcpy(lengths, len.data(), len.size() * sizeof(int32_t), cudaMemcpyHostToDevice));

  mla::core::CoreShape shape;
  shape.rows = rows;
  shape.heads = s.heads;
  shape.q = s.q;
  shape.max_context = std::max<int64_t>(max_length, max_context);
  shape.kernel = variant.kernel;
  shape.stages = variant.stages;
  shape.num_splits = num_splits;
  shape.tile_rows = tile_rows;
  const mla::core::CorePlan plan = mla::core::plan_core(shape);
  if (plan.workspace_bytes > 0) MLA_CUDA_CHECK(cudaMalloc(&workspace, plan.workspace_bytes));
  if (plan.tile_counters > 0) {
    MLA_CUDA_CHECK(cudaMalloc(&counters, plan.tile_counters * sizeof(int)));
    MLA_CUDA_CHECK(cudaMemset(counters, 0, plan.tile_counters * sizeof(int)));
  }

  cudaStream_t stream;
  MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto core_args = [&](int i) {
    mla::core::CoreArgs args;
    args.query = query;
    args.cache = cache;
    args.stride_cache_page = page_bytes;
    args.block_table = tables + (i % num_sets) * pages_per_set;
    args.stride_block_table = pages_per_request;
    args.lengths = lengths;
    args.num_requests = s.batch;
    args.softmax_scale = kSoftmaxScale;
    args.k_scale = 1.0f;
    args.latent = latent;
    args.lse = lse;
    args.workspace = workspace;
    args.tile_counters = counters;
    return args;
  };
  const double us = mla::timing::time_graph_us(stream, [&](int i) { mla::core::launch_core(plan, core_args(i), stream); },
                                               launches, /*replays=*/10);
  const double kv_bytes = total_tokens * mla::kKeyDim;
  const double flops = 2.0 * (mla::kKeyDim + mla::kKvLoraRank) * visible_pairs * s.heads;
  Result r;
  r.us = us;
  r.gbs = kv_bytes / (us * 1e-6) / 1e9;
  r.pct = 100.0 * r.gbs / copy_gbs;
  r.tflops = flops / (us * 1e-6) / 1e12;
  r.splits = plan.num_splits;
  r.stages = plan.stages;
  r.ctas_per_sm = plan.ctas_per_sm;
  r.kernel = plan.kernel;
  r.tile_rows = plan.tile_rows;
  if (timeline) r.timeline = core_timeline(plan, core_args, stream);
  if (read_floor) {
    auto set_of = [&](int i) {
      return mla::bench::ReadFloorParams{.cache = cache, .stride_cache_page = page_bytes,
                                         .block_table = tables + (i % num_sets) * pages_per_set,
                                         .stride_block_table = pages_per_request, .lengths = lengths,
                                         .num_requests = s.batch};
    };
    r.read_us = mla::bench::time_read_floor_us(stream, launches, /*replays=*/10, set_of, pool_pages * page_bytes,
                                               table.data(), len.data());
  }
  if (stock != nullptr) {
    MLA_CUBLAS_CHECK(cublasSetStream(stock, stream));
    mla::bench::StockCore composition(s.batch, s.q, s.heads, max_length, pages_per_request, page_bytes);
    auto run_stock = [&](int i) {
      composition.run(stock, stream, cache, tables + (i % num_sets) * pages_per_set, lengths, query, kSoftmaxScale);
    };
    r.stock_us = mla::timing::time_graph_us(stream, run_stock, launches, /*replays=*/10);
    mla::core::launch_core(plan, core_args(0), stream);
    run_stock(0);
    MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
    r.stock_lse_diff = max_lse_diff(composition.lse, lse, rows * s.heads);
    r.stock_latent_err = max_latent_err(composition.latent, latent, rows * s.heads);
  }
  if (peer != nullptr) {
    const MlaPeerCoreShape peer_shape{.batch = s.batch, .q = s.q, .heads = s.heads, .max_pages = pages_per_request,
                                      .num_pages = pool_pages, .lengths = lengths, .softmax_scale = kSoftmaxScale};
    char error[256] = "";
    void* state = peer->prepare(&peer_shape, stream, error, sizeof error);
    if (state == nullptr) {
      r.peer_note = error[0] ? error : "cannot run this shape";
    } else {
      void* peer_latent;
      float* peer_lse;
      MLA_CUDA_CHECK(cudaMalloc(&peer_latent, rows * s.heads * mla::kKvLoraRank * 2));
      MLA_CUDA_CHECK(cudaMalloc(&peer_lse, rows * s.heads * sizeof(float)));
      auto run_peer = [&](int i) {
        const MlaPeerCoreIo io{.query = query, .cache = cache, .block_table = tables + (i % num_sets) * pages_per_set,
                               .latent = peer_latent, .lse = peer_lse};
        MLA_CUDA_CHECK(static_cast<cudaError_t>(peer->run(state, &io, stream)));
      };
      r.peer_us = mla::timing::time_graph_us(stream, run_peer, launches, /*replays=*/10);
      mla::core::launch_core(plan, core_args(0), stream);
      run_peer(0);
      MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
      r.peer_lse_diff = max_lse_diff(peer_lse, lse, rows * s.heads);
      r.peer_latent_err = max_latent_err(peer_latent, latent, rows * s.heads);
      peer->release(state);
      MLA_CUDA_CHECK(cudaFree(peer_latent));
      MLA_CUDA_CHECK(cudaFree(peer_lse));
    }
  }

  MLA_CUDA_CHECK(cudaStreamDestroy(stream));
  MLA_CUDA_CHECK(cudaFree(cache));
  MLA_CUDA_CHECK(cudaFree(query));
  MLA_CUDA_CHECK(cudaFree(tables));
  MLA_CUDA_CHECK(cudaFree(lengths));
  MLA_CUDA_CHECK(cudaFree(latent));
  MLA_CUDA_CHECK(cudaFree(lse));
  if (workspace) MLA_CUDA_CHECK(cudaFree(workspace));
  if (counters) MLA_CUDA_CHECK(cudaFree(counters));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const char* out_path = nullptr;
  std::vector<Variant> variants;
  std::vector<int> split_counts;
  std::vector<int> tile_rows_list;  // --tile: the ping-pong variants' N-tiles (0 = planned)
  bool small_batch = false, with_stock = false, l2_resident = false, timeline = false, read_floor = false;
  int64_t max_context = 0;  // 0: each shape's longest request
  const char* peer_path = nullptr;
  std::vector<Shape> chosen_shapes;
  for (int i = 1; i < argc; ++i) {
    bool known = false;
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) {
      out_path = argv[++i];
      known = true;
    } else if (!std::strcmp(argv[i], "--variant") && i + 1 < argc) {
      ++i;
      for (const Variant& v : kVariants) {
        if (!std::strcmp(argv[i], v.name)) {
          variants.push_back(v);
          known = true;
        }
      }
    } else if (!std::strcmp(argv[i], "--small-batch")) {
      small_batch = known = true;
    } else if (!std::strcmp(argv[i], "--stock")) {
      with_stock = known = true;
    } else if (!std::strcmp(argv[i], "--read-floor")) {
      read_floor = known = true;
    } else if (!std::strcmp(argv[i], "--l2-resident")) {
      l2_resident = known = true;
    } else if (!std::strcmp(argv[i], "--timeline")) {
      if (!mla::bench::timeline_build("core_bench")) return 2;
      timeline = known = true;
    } else if (!std::strcmp(argv[i], "--splits") && i + 1 < argc) {
      split_counts.push_back(std::atoi(argv[++i]));
      known = split_counts.back() >= 0;
    } else if (!std::strcmp(argv[i], "--tile") && i + 1 < argc) {
      tile_rows_list.push_back(std::atoi(argv[++i]));
      const int t = tile_rows_list.back();
      known = t == 0 || t == 16 || t == 32 || t == 48 || t == 64;
    } else if (!std::strcmp(argv[i], "--peer") && i + 1 < argc) {
      peer_path = argv[++i];
      known = true;
    } else if (!std::strcmp(argv[i], "--max-context") && i + 1 < argc) {
      max_context = std::atoll(argv[++i]);
      known = max_context >= 1;
    } else if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) {
      Shape s{};
      char varlen = 0, extra = 0;
      const int n = std::sscanf(argv[++i], "%dx%dx%dx%d%c%c", &s.batch, &s.context, &s.heads, &s.q, &varlen, &extra);
      known = (n == 4 || (n == 5 && varlen == 'v')) && s.batch >= 1 && s.context >= 1 && s.heads >= 1 &&
              s.heads <= mla::kMaxHeads && s.q >= 1 && s.q <= mla::kMaxQueries;
      s.spread = n == 5 ? 0.5 : 0.0;
      if (known) chosen_shapes.push_back(s);
    }
    if (!known) {
      std::fprintf(stderr,
                   "core_bench: bad argument '%s'\nusage: core_bench [--out file.md] [--variant "
                   "planned|mma.sync|mma.sync3|mma.sync4|wgmma-pp2|wgmma-pp3 ...] [--small-batch] [--splits N ...] "
                   "[--tile N ...] "
                   "[--shape BATCHxCONTEXTxHxQ[v] ...] [--stock] [--l2-resident] [--max-context TOKENS] [--peer LIB.so] [--timeline] "
                   "[--read-floor]\n",
                   argv[i]);
      return 2;
    }
  }
  if (variants.empty()) variants.push_back(kVariants[0]);
  if (split_counts.empty()) split_counts.push_back(0);
  if (tile_rows_list.empty()) tile_rows_list.push_back(0);
  try {
    std::unique_ptr<PeerCore> peer;  // loaded first: a bad library fails before any GPU work
    if (peer_path != nullptr) peer = std::make_unique<PeerCore>(peer_path);
    cudaDeviceProp prop;
    MLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const double copy_gbs = mla::timing::measure_copy_gbs(nullptr);
    cublasHandle_t stock = nullptr;
    void* stock_workspace = nullptr;
    if (with_stock) {
      constexpr size_t kStockWorkspaceBytes = size_t{32} << 20;  // set explicitly: cuBLAS inside graph capture
      MLA_CUBLAS_CHECK(cublasCreate(&stock));
      MLA_CUDA_CHECK(cudaMalloc(&stock_workspace, kStockWorkspaceBytes));
      MLA_CUBLAS_CHECK(cublasSetWorkspace(stock, stock_workspace, kStockWorkspaceBytes));
    }
    const std::vector<Shape> small_shapes = {{1, 4096, 12, 1},  {4, 4096, 12, 1},  {16, 4096, 12, 1},
                                             {1, 32768, 12, 1}, {4, 32768, 12, 1}, {16, 32768, 12, 1},
                                             {1, 4096, 96, 1},  {4, 4096, 96, 1},  {16, 4096, 96, 1},
                                             {4, 32768, 96, 1}, {16, 4096, 12, 2}, {4, 32768, 12, 4}};
    const std::vector<Shape> issue_shapes = {{128, 4096, 16, 1}, {128, 4096, 64, 1}, {128, 4096, 128, 1},
                                       {64, 8192, 16, 4},  {1, 131072, 16, 1}, {1, 1 << 20, 12, 1},
                                       {32, 32768, 12, 1}, {16, 65536, 96, 4},
                                       // varlen batches: lengths spread +-50 % around the mean
                                       {128, 4096, 16, 1, 0.5}, {64, 8192, 16, 4, 0.5}, {32, 32768, 12, 1, 0.5}};
    const std::vector<Shape>& shapes = !chosen_shapes.empty() ? chosen_shapes : small_batch ? small_shapes : issue_shapes;
    std::string table;
    char line[512];
    std::snprintf(line, sizeof line, "device: %s, %d SMs; copy bandwidth (D2D, read+write): %.0f GB/s\n\n",
                  prop.name, prop.multiProcessorCount, copy_gbs);
    table += line;
    if (peer) table += std::string("Peer (--peer): ") + peer->name() + ", on the same inputs in the same run.\n\n";
    if (l2_resident) table += "**--l2-resident: a diagnostic, every page read from a 128-page L2-resident pool.**\n\n";
    if (with_stock) {
      table += "Stock: a batched GEMM over every request padded to the batch's longest (varlen rows: ~1.5x the "
               "tokens of ours, so stock/ours there is an upper bound).\n\n";
    }
    if (max_context > 0) {
      std::snprintf(line, sizeof line, "Splits planned for max_context = %lld tokens (--max-context).\n\n",
                    static_cast<long long>(max_context));
      table += line;
    }
    table += "| batch x context x H x q | variant | kernel | tile | stages | CTAs/SM | splits | µs | GB/s (visible KV) | % copy BW | TFLOP/s |";
    std::string rule = "|---|---|---|---|---|---|---|---|---|---|---|";
    if (with_stock) {
      table += " stock µs | stock/ours | stock vs ours: max abs LSE diff, max latent rel. L2 |";
      rule += "---|---|---|";
    }
    if (read_floor) {
      table += " read-only µs | read-only % copy BW | ours/read-only |";
      rule += "---|---|---|";
    }
    if (peer) {
      table += " peer µs | peer % copy BW | peer TFLOP/s | peer/ours (time) | peer vs ours: max abs LSE diff, max latent rel. L2 |";
      rule += "---|---|---|---|---|";
    }
    table += "\n" + rule + "\n";
    for (const Shape& s : shapes) {
      for (const Variant& variant : variants) {
        for (int num_splits : split_counts) {
          for (int tile_rows : variant.kernel == mla::core::kKernelWgmmaPp ? tile_rows_list : std::vector<int>{0}) {
            const Result r = bench_shape(s, variant, num_splits, tile_rows, copy_gbs, stock, peer.get(), l2_resident,
                                         max_context, timeline, read_floor);
            std::snprintf(line, sizeof line,
                          "| %d x %dk%s x %d x %d | %s | %s | %d | %d | %d | %d | %.1f | %.0f | %.1f | %.1f |",
                          s.batch, s.context / 1024, s.spread > 0 ? " (varlen +-50%)" : "", s.heads, s.q, variant.name,
                          mla::core::kernel_name(r.kernel), r.tile_rows, r.stages,
                          r.ctas_per_sm, r.splits, r.us, r.gbs, r.pct, r.tflops);
            std::string row = line;
            if (with_stock) {
              // The stock LSE must agree with ours (fp32 vs bf16 operands: ~1e-3): a broken stock path
              // cannot pass for a slow one.
              const bool agree = r.stock_lse_diff <= 2e-2 && r.stock_latent_err <= 2e-2;
              std::snprintf(line, sizeof line, " %.1f | %.2fx | %.1e, %.1e%s |", r.stock_us, r.stock_us / r.us,
                            r.stock_lse_diff, r.stock_latent_err, agree ? "" : " MISMATCH");
              row += line;
            }
            if (read_floor) {
              std::snprintf(line, sizeof line, " %.1f | %.1f | %.2fx |", r.read_us, r.pct * r.us / r.read_us,
                            r.us / r.read_us);
              row += line;
            }
            if (peer && r.peer_us == 0) {
              row += " - | - | - | - | cannot run: " + r.peer_note + " |";
            } else if (peer) {
              // Its own rounding (e.g. FP8 P·V) may keep its latent ~1e-2 from ours; the LSE must agree closely.
              std::snprintf(line, sizeof line, " %.1f | %.1f | %.1f | %.2fx | %.1e, %.1e%s |", r.peer_us,
                            r.pct * r.us / r.peer_us, r.tflops * r.us / r.peer_us, r.peer_us / r.us, r.peer_lse_diff,
                            r.peer_latent_err, r.peer_lse_diff <= 1e-3 && r.peer_latent_err <= 5e-2 ? "" : " MISMATCH");
              row += line;
            }
            row += "\n";
            table += row;
            std::fputs(row.c_str(), stdout);
            if (timeline) std::fputs(r.timeline.c_str(), stdout);
            std::fflush(stdout);
          }
        }
      }
    }
    if (stock != nullptr) {
      MLA_CUBLAS_CHECK(cublasDestroy(stock));
      MLA_CUDA_CHECK(cudaFree(stock_workspace));
    }
    std::printf("\n%s", table.c_str());
    if (out_path) mla::bench::write_out_file(out_path, table);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "core_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
