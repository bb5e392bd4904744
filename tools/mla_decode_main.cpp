// mla-decode: runs the decode step of one synthetic Kimi K3 MLA layer and prints what it computed.
//
//   mla-decode run --heads 12 --batch 4 --context 4096 --q 1 --steps 3
//
// The step (seeded weights, a paged FP8 cache whose pages are permuted, a batch of requests) comes
// from tools/synthetic.h. On a GPU, PreparedMla runs it through CUDA graphs: a sample is checked
// against the CPU reference, then per-stage and per-step times are printed against the floor of
// DESIGN.md §6 (ceilings measured in the same run). Without a GPU the CPU reference runs a small case.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cli_args.h"
#include "common/cuda_check.h"
#include "device_timing.h"
#include "mla/mla.h"
#include "reference.h"
#include "synthetic.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// "NVIDIA H200 (sm_90, 132 SMs)" for device 0, or "" where no CUDA device can be used.
std::string find_cuda_device() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return "";
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    return "";
  }
  return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ", " +
         std::to_string(prop.multiProcessorCount) + " SMs)";
}

// Multiply-adds the reference spends on one step (all tokens visible: an upper bound).
double reference_macs(const mla::cli::RunOptions& o) {
  const double rows = double(o.batch) * o.q;
  const double per_row_head = double(mla::kQkHeadDim) * mla::kQLoraRank + double(mla::kNopeDim) * mla::kKvLoraRank +
                              double(mla::kKvLoraRank) * mla::kVHeadDim +
                              double(o.context) * (mla::kKeyDim + mla::kKvLoraRank);
  return rows * o.heads * per_row_head;
}

// The CPU reference computes in double: shrink the case (context first, then the batch; never heads
// or q, which decide the shapes) until one step is about a second, and run at most 3 steps.
mla::cli::RunOptions clamp_for_reference(const mla::cli::RunOptions& requested) {
  constexpr double kMacBudget = 5e8;
  constexpr int kMaxReferenceSteps = 3;
  mla::cli::RunOptions o = requested;
  o.steps = std::min(o.steps, kMaxReferenceSteps);
  while (reference_macs(o) > kMacBudget) {
    if (o.context > 256) {
      o.context = std::max(o.context / 2, 256);
    } else if (o.batch > 1) {
      o.batch = std::max(o.batch / 2, 1);
    } else {
      break;
    }
  }
  if (o.context != requested.context || o.batch != requested.batch || o.steps != requested.steps) {
    std::printf("clamped for the CPU reference: batch %d -> %d, context %d -> %d, steps %d -> %d\n",
                requested.batch, o.batch, requested.context, o.context, requested.steps, o.steps);
  }
  return o;
}

void print_case(const mla::synth::SyntheticLayer& layer, const mla::synth::SyntheticStep& step,
                const mla::cli::RunOptions& o, double generate_s) {
  std::printf("case: H=%d batch=%d q=%d context=%d seed=%llu (generated in %.3f s, %s cache fill)\n",
              o.heads, o.batch, o.q, o.context, static_cast<unsigned long long>(o.seed), generate_s,
              step.exact_cache ? "exact" : "fast");
  std::printf("  projected   bf16[%lld, %lld] pitch %lld\n", (long long)step.rows,
              (long long)mla::projected_width(layer.num_heads), (long long)step.pitch);
  std::printf("  cache       fp8_e4m3[%lld, %d, %d] (%.1f MiB%s)\n", (long long)step.num_pages, mla::kPageSize,
              mla::kKeyDim, double(step.cache.size()) / (1 << 20),
              step.num_pages > 1 ? ", pages in a random order" : "");
  std::printf("  block_table i32[%d, %d], lengths i32[%d], slots i64[%lld]\n", step.num_requests,
              step.max_pages, step.num_requests, (long long)step.rows);
  std::printf("  out         bf16[%lld, %d]\n", (long long)step.rows, layer.num_heads * mla::kVHeadDim);
  std::printf("  scales      q_scale=%g k_scale=%g softmax_scale=%g\n", layer.q_scale, layer.k_scale,
              double(layer.q_scale) * layer.k_scale / std::sqrt(double(mla::kQkHeadDim)));
}

// What the reference computed inside the step (query bytes, core LSE) and in `out`.
void print_result(const mla::synth::SyntheticStep& step, const mla::ref::LayerTrace& trace) {
  // Query stage: FP8 query and the cache slots written.
  int64_t saturated = 0;
  for (uint8_t byte : trace.query) saturated += (byte & 0x7f) == 0x7e;  // +-448
  const int64_t written = std::count_if(step.slots.begin(), step.slots.end(), [](int64_t s) { return s >= 0; });
  std::printf("query stage: query fp8[%lld, %d, %d], %lld of %zu bytes saturated at +-448, %lld cache slots written\n",
              (long long)step.rows, step.num_heads, mla::kKeyDim, (long long)saturated, trace.query.size(),
              (long long)written);

  // Core: visible tokens per row and the LSE range.
  int64_t min_visible = std::numeric_limits<int64_t>::max(), max_visible = 0;
  for (int64_t r = 0; r < step.rows; ++r) {
    min_visible = std::min(min_visible, step.visible_tokens(r));
    max_visible = std::max(max_visible, step.visible_tokens(r));
  }
  double lse_min = INFINITY, lse_max = -INFINITY;
  int64_t empty = 0;
  for (double lse : trace.core.lse) {
    if (std::isinf(lse) && lse < 0) {
      ++empty;
      continue;
    }
    lse_min = std::min(lse_min, lse);
    lse_max = std::max(lse_max, lse);
  }
  char lse_range[64] = "none finite";
  if (lse_min <= lse_max) std::snprintf(lse_range, sizeof(lse_range), "%.4f..%.4f", lse_min, lse_max);
  std::printf("core:        %lld visible tokens in all (per row %lld..%lld), lse (natural log) %s, "
              "%lld (row, head) with nothing visible\n",
              (long long)step.total_visible_tokens(), (long long)min_visible, (long long)max_visible, lse_range,
              (long long)empty);

  // Value stage: checksums of out.
  double sum_abs = 0;
  int64_t non_finite = 0, zero_rows = 0;
  const int64_t width = int64_t{step.num_heads} * mla::kVHeadDim;
  for (int64_t r = 0; r < step.rows; ++r) {
    bool all_zero = true;
    for (int64_t c = 0; c < width; ++c) {
      const double x = mla::synth::bf16_value(step.out[r * width + c]);
      if (!std::isfinite(x)) ++non_finite;
      else sum_abs += std::abs(x);
      all_zero = all_zero && x == 0;
    }
    zero_rows += all_zero;
  }
  const uint64_t hash = mla::synth::fnv1a64(step.out.data(), step.out.size() * sizeof(uint16_t));
  std::printf("value stage: out sum|x| = %.6f, fnv1a64(bf16 bits) = %016llx, %lld non-finite, %lld all-zero rows\n",
              sum_abs, static_cast<unsigned long long>(hash), (long long)non_finite, (long long)zero_rows);
}

// The step on the CPU reference, `o.steps` times (the cache writes are idempotent).
int run_reference(const mla::cli::RunOptions& o) {
  const Clock::time_point start = Clock::now();
  const mla::synth::SyntheticLayer layer = mla::synth::make_layer(o.heads, o.seed);
  mla::synth::SyntheticStep step = mla::synth::make_step(layer, o.batch, o.q, {o.context}, 0, 0, o.seed + 1);
  print_case(layer, step, o, seconds_since(start));

  std::vector<double> times;
  mla::ref::LayerTrace trace;
  for (int s = 0; s < o.steps; ++s) {
    const Clock::time_point t0 = Clock::now();
    mla::ref::run_layer(layer.weights(), layer.dims, step.inputs(), {}, &trace);
    times.push_back(seconds_since(t0));
  }
  print_result(step, trace);
  std::printf("time:        CPU reference %.3f s per step (median of %d)\n", median(times), o.steps);
  return 0;
}

// ---- The GPU path ------------------------------------------------------------------------------

// A device copy of a host vector, freed at scope exit.
class DeviceCopy {
 public:
  template <class T>
  explicit DeviceCopy(const std::vector<T>& host) : bytes_(std::max<size_t>(16, host.size() * sizeof(T))) {
    MLA_CUDA_CHECK(cudaMalloc(&ptr_, bytes_));
    if (!host.empty()) MLA_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  explicit DeviceCopy(size_t bytes) : bytes_(bytes) { MLA_CUDA_CHECK(cudaMalloc(&ptr_, bytes_)); }
  ~DeviceCopy() { cudaFree(ptr_); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  void* get() const { return ptr_; }
  template <class T>
  std::vector<T> download(size_t count) const {
    std::vector<T> host(count);
    MLA_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

mla::TensorView on_device(mla::TensorView view, void* data) {
  view.data = data;
  view.memory = mla::Memory::kDevice;
  view.device_index = 0;
  return view;
}

// One copy of the layer and the step on the device with its prepared object. The timing rotates
// among several replicas so that weights and KV come from HBM, not from the 60 MB L2.
struct Replica {
  DeviceCopy q_a_norm, kv_a_norm, q_b_proj, w_uk_t, w_uv;
  DeviceCopy projected, out, cache, slots, block_table, lengths, scratch;
  mla::StepInputs inputs;
  std::unique_ptr<mla::PreparedMla> mla;

  Replica(const mla::synth::SyntheticLayer& layer, mla::synth::SyntheticStep& step)
      : q_a_norm(layer.q_a_norm), kv_a_norm(layer.kv_a_norm), q_b_proj(layer.q_b_proj), w_uk_t(layer.w_uk_t),
        w_uv(layer.w_uv), projected(step.projected), out(step.out), cache(step.cache), slots(step.slots),
        block_table(step.block_table), lengths(step.lengths),
        scratch(static_cast<size_t>(step.rows) * layer.num_heads * mla::kKeyDim) {
    mla::Weights w = layer.weights();
    w.q_a_norm = on_device(w.q_a_norm, q_a_norm.get());
    w.kv_a_norm = on_device(w.kv_a_norm, kv_a_norm.get());
    w.q_b_proj = on_device(w.q_b_proj, q_b_proj.get());
    w.w_uk_t = on_device(w.w_uk_t, w_uk_t.get());
    w.w_uv = on_device(w.w_uv, w_uv.get());
    const mla::StepInputs host = step.inputs();
    inputs = host;
    inputs.projected = on_device(host.projected, projected.get());
    inputs.out = on_device(host.out, out.get());
    inputs.cache = on_device(host.cache, cache.get());
    inputs.slots = on_device(host.slots, slots.get());
    inputs.block_table = on_device(host.block_table, block_table.get());
    inputs.lengths = on_device(host.lengths, lengths.get());
    const mla::TensorView scratch_view =
        mla::make_view(scratch.get(), mla::DType::kFP8E4M3, mla::Memory::kDevice, {step.rows, layer.num_heads, mla::kKeyDim});
    mla = std::make_unique<mla::PreparedMla>(w, layer.dims, std::map<int64_t, int64_t>{{step.rows, step.pitch}},
                                             scratch_view, mla::PrepareOptions{.max_context = 1 << 17, .queries = {step.q}});
    mla->prepare(inputs.cache);
  }
};

mla::timing::StepCost step_cost(const mla::synth::SyntheticStep& step, int heads) {
  double request_tokens = 0, visible_row_tokens = 0;
  for (int b = 0; b < step.num_requests; ++b) request_tokens += step.lengths[b];
  for (int64_t r = 0; r < step.rows; ++r) visible_row_tokens += double(step.visible_tokens(r));
  return mla::timing::step_cost(heads, step.rows, request_tokens, visible_row_tokens);
}

// Checks the first request's rows of the GPU's first step against the CPU reference.
void check_sample(const mla::synth::SyntheticLayer& layer, const mla::synth::SyntheticStep& before,
                  const std::vector<uint16_t>& gpu_out) {
  const double reference_macs = double(before.lengths.empty() ? 0 : before.lengths[0]) * before.q * layer.num_heads *
                                (mla::kKeyDim + mla::kKvLoraRank);
  if (before.num_requests == 0 || reference_macs > 4e9) {
    std::printf("check:       skipped (the CPU reference of one request at this size takes too long; the GPU tests "
                "cover it)\n");
    return;
  }
  Clock::time_point start = Clock::now();
  mla::synth::SyntheticStep sample = before;
  mla::StepInputs one = sample.inputs();  // the first request only: its q rows
  one.projected.shape[0] = one.out.shape[0] = one.slots.shape[0] = before.q;
  one.block_table.shape[0] = one.lengths.shape[0] = 1;
  mla::ref::run_layer(layer.weights(), layer.dims, one);
  double err2 = 0, ref2 = 0;
  const size_t count = size_t(before.q) * layer.num_heads * mla::kVHeadDim;
  for (size_t i = 0; i < count; ++i) {
    const double g = mla::synth::bf16_value(gpu_out[i]), e = mla::synth::bf16_value(sample.out[i]);
    err2 += (g - e) * (g - e);
    ref2 += e * e;
  }
  const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  constexpr double kBound = 2e-2;  // the end-to-end bound of tests/gpu/pipeline
  std::printf("check:       request 0 (%d rows) vs the CPU reference: relative L2 error of out %.2e (bound %.0e): %s "
              "(%.1f s)\n",
              before.q, rel, kBound, rel <= kBound ? "ok" : "FAILED", seconds_since(start));
  if (!(rel <= kBound)) throw mla::Error("the GPU result does not match the CPU reference");
}

int run_on_gpu(const mla::cli::RunOptions& o) {
  cudaStream_t stream;
  MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("measuring the ceilings (copy bandwidth, bf16 and fp8 GEMM rates)...\n");
  std::fflush(stdout);
  const mla::timing::Ceilings ceilings = mla::timing::measure_ceilings(stream);
  std::printf("ceilings:    %s\n", ceilings.describe().c_str());

  Clock::time_point start = Clock::now();
  if (double(o.batch) * o.context * mla::kKeyDim > 2e9) {
    std::printf("generating %.1f GB of FP8 cache...\n", double(o.batch) * o.context * mla::kKeyDim / 1e9);
    std::fflush(stdout);
  }
  const mla::synth::SyntheticLayer layer = mla::synth::make_layer(o.heads, o.seed);
  mla::synth::StepSpec spec;
  spec.q = o.q;
  spec.lengths = {o.context};
  spec.num_requests = o.batch;
  spec.pitch = (mla::projected_width(o.heads) + 7) / 8 * 8;
  spec.seed = o.seed + 1;
  mla::synth::SyntheticStep step = mla::synth::make_step(layer, spec);
  print_case(layer, step, o, seconds_since(start));

  // Replicas: enough to exceed twice the L2 with weights + KV, at most 8.
  const mla::timing::StepCost cost = step_cost(step, o.heads);
  const double footprint = cost.weight_bytes + double(step.cache.size());
  const int replicas = static_cast<int>(std::clamp(std::ceil(120e6 / footprint), 1.0, 8.0));
  std::vector<std::unique_ptr<Replica>> copies;
  for (int i = 0; i < replicas; ++i) copies.push_back(std::make_unique<Replica>(layer, step));
  std::printf("memory:      %.1f MiB of stage buffers per prepared layer (workspace_bytes(); the layers of a "
              "model can share one)\n",
              double(copies[0]->mla->workspace_bytes()) / (1 << 20));

  // 1. One step, checked against the reference.
  const mla::synth::SyntheticStep before = step;
  copies[0]->mla->run(copies[0]->inputs, stream);
  MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  check_sample(layer, before, copies[0]->out.download<uint16_t>(step.out.size()));

  // 2. Per step through CUDA graphs (each launch a different replica), and per stage.
  std::vector<double> step_times;
  for (int s = 0; s < o.steps; ++s) {
    step_times.push_back(mla::timing::time_graph_us(
        stream, [&](int i) { copies[i % replicas]->mla->run(copies[i % replicas]->inputs, stream); }));
  }
  std::array<cudaEvent_t, 4> events;
  for (cudaEvent_t& e : events) MLA_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<double> stage_us[3];
  for (int i = 0; i < 50; ++i) {
    Replica& r = *copies[i % replicas];
    r.mla->run_profiled(r.inputs, stream, events);
    MLA_CUDA_CHECK(cudaEventSynchronize(events[3]));
    for (int s = 0; s < 3; ++s) {
      float ms = 0;
      MLA_CUDA_CHECK(cudaEventElapsedTime(&ms, events[s], events[s + 1]));
      stage_us[s].push_back(ms * 1e3);
    }
  }
  for (cudaEvent_t& e : events) MLA_CUDA_CHECK(cudaEventDestroy(e));

  const double step_us = mla::timing::median(step_times);
  const double floor = mla::timing::floor_us(ceilings, cost.bytes(), cost.bf16_flops, cost.fp8_flops);
  const char* names[3] = {"query", "core", "value"};
  const double stage_bytes[3] = {
      2.0 * (mla::kQLoraRank + mla::kKvLoraRank + double(o.heads) * (mla::kQkHeadDim * mla::kQLoraRank +
                                                                     mla::kNopeDim * mla::kKvLoraRank)),
      cost.kv_bytes, 2.0 * double(o.heads) * mla::kKvLoraRank * mla::kVHeadDim};
  std::printf("stages (events between stages, so without PDL overlap; %d replicas rotated, %s):\n", replicas,
              footprint * replicas > 120e6 ? "L2-cold" : "partly L2-warm");
  for (int s = 0; s < 3; ++s) {
    const double us = mla::timing::median(stage_us[s]);
    std::printf("  %-6s %9.2f us  %7.0f GB/s over its weights / KV  (%.0f %% of copy bandwidth)\n", names[s], us,
                stage_bytes[s] / (us * 1e3), 100.0 * stage_bytes[s] / (us * 1e3) / ceilings.copy_gbs);
  }
  std::printf("step:        %.2f us per step (CUDA graph, median of %d x 30 replays of 20 steps): %.0f GB/s, "
              "%.1f TFLOP/s; floor %.2f us (%.1f MB, %.2f GFLOP): %.2fx the floor\n",
              step_us, o.steps, cost.bytes() / (step_us * 1e3), (cost.bf16_flops + cost.fp8_flops) / (step_us * 1e6),
              floor, cost.bytes() / 1e6, (cost.bf16_flops + cost.fp8_flops) / 1e9, step_us / floor);
  MLA_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

int run(const mla::cli::RunOptions& options) {
  const std::string device = find_cuda_device();
  if (device.empty()) {
    std::printf("no CUDA device found: running the CPU reference on a small case instead\n");
    return run_reference(clamp_for_reference(options));
  }
  std::printf("CUDA device 0: %s\n", device.c_str());
  return run_on_gpu(options);
}

}  // namespace

int main(int argc, char** argv) {
  mla::cli::Invocation invocation;
  try {
    invocation = mla::cli::parse_args(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const mla::cli::UsageError& e) {
    std::cerr << "mla-decode: " << e.what() << "\nrun 'mla-decode --help' for usage\n";
    return 2;
  }
  if (invocation.command == mla::cli::Command::kHelp) {
    std::cout << mla::cli::usage();
    return 0;
  }
  try {
    return run(invocation.run);
  } catch (const std::exception& e) {
    std::cerr << "mla-decode: error: " << e.what() << "\n";
    return 1;
  }
}
