// Timing on the device shared by the CLI and the benchmarks (DESIGN.md §6): CUDA events over CUDA
// graph replays with the median of many, and the two ceilings of the floor measured in the same run
// (device-to-device copy bandwidth; dense bf16 and FP8 matrix rates through cuBLAS(Lt) on random data).
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <vector>

namespace mla::timing {

double median(std::vector<double> values);

// Median time in microseconds of one `enqueue(i)` (i = launch index within a graph): `launches`
// enqueues are captured into one graph, the graph is replayed `replays` times (after warm-up), and
// each replay's event time is divided by `launches`.
double time_graph_us(cudaStream_t stream, const std::function<void(int)>& enqueue, int launches = 20,
                     int replays = 30);

struct Ceilings {
  double copy_gbs = 0;      // device-to-device copy, bytes read + written per second / 1e9
  double bf16_tflops = 0;   // dense bf16 GEMM (fp32 accumulate), 8192^3, random data
  double fp8_tflops = 0;    // dense FP8 e4m3 GEMM (fp32 accumulate), 8192^3, random data
  std::string describe() const;  // "copy 4300 GB/s, bf16 780 TFLOP/s, fp8 1450 TFLOP/s"
};

// Device-to-device copy bandwidth (2 GiB each way, median of 10), bytes read + written per second / 1e9.
double measure_copy_gbs(cudaStream_t stream);

// Measures the ceilings on the current device (about a second).
Ceilings measure_ceilings(cudaStream_t stream);

// Bytes that must move and FLOPs of one whole decode step (DESIGN.md §6).
struct StepCost {
  double weight_bytes = 0;      // norms, q_b_proj, W_UK_T, W_UV, read once
  double kv_bytes = 0;          // each request's visible KV read once for all its q rows (576 B a token)
  double activation_bytes = 0;  // projected rows in, out rows and new cache rows out
  double bf16_flops = 0;        // the three projections
  double fp8_flops = 0;         // the core: 2 * (576 + 512) per (visible token x row x head)
  double bytes() const { return weight_bytes + kv_bytes + activation_bytes; }
  double flops() const { return bf16_flops + fp8_flops; }
};
// `request_tokens`: sum over requests of their lengths; `visible_row_tokens`: sum over rows of the
// tokens each row sees.
StepCost step_cost(int heads, int64_t rows, double request_tokens, double visible_row_tokens);

// Bytes the query stage must move at `rows` rows (DESIGN.md §6 for that stage): its weights (norms, q_b_proj, W_UK_T)
// once, each row's q_a and kv_a columns of `projected`, the FP8 query rows and cache rows it writes.
double query_stage_bytes(int heads, int64_t rows);

// Floor of a step: max(bytes / copy bandwidth, bf16 FLOPs / bf16 rate + fp8 FLOPs / fp8 rate), in µs.
double floor_us(const Ceilings& ceilings, double bytes, double bf16_flops, double fp8_flops);

}  // namespace mla::timing
