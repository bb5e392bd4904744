// mla-decode: runs the decode step of one synthetic Kimi K3 MLA layer and prints what it computed.
//
//   mla-decode run --heads 12 --batch 4 --context 4096 --q 1 --steps 3
//
// The step (seeded weights, a paged FP8 cache whose pages are permuted, a batch of requests) comes
// from tools/synthetic.h. The CPU reference (reference/reference.h) runs it; the GPU pipeline
// (PreparedMla::run) is not implemented yet, so with a device present the reference runs as well.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "cli_args.h"
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

int run(const mla::cli::RunOptions& options) {
  const std::string device = find_cuda_device();
  if (device.empty()) {
    std::printf("no CUDA device found: running the CPU reference on a small case instead\n");
  } else {
    std::printf("CUDA device 0: %s\n", device.c_str());
    std::printf("the GPU pipeline (PreparedMla::run) is not implemented yet: running the CPU reference "
                "on a small case instead\n");
  }
  return run_reference(clamp_for_reference(options));
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
