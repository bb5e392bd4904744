// Benchmark of the value stage (src/value) against the stock composition, DESIGN.md §6: for
// H in {12, 96, 128} x rows in {1, 4, 16, 32, 64, 128, 256, 512}, the µs of
//   cuda-core    value_kernel (W_UV on FMAs), forced through plan_value(..., kCudaCore)
//   tensor-core  value_mma_kernel (mma.sync), forced through plan_value(..., kTensorCore)
//   tensor-core/4  the same with 4 CTAs per (row tile, head), 32 columns each (kTensorCoreSplit)
//   cuda-core/packed  value_kernel with its W_UV slice packed bf16, 3 CTAs an SM (kCudaCorePacked)
//   stock        cuBLAS cublasGemmStridedBatchedEx v[r, h] = latent[r, h] . W_UV[h] (bf16 in, fp32
//                compute; v written in bf16, and again in fp32), then an elementwise gate kernel
// as CUDA events over CUDA-graph replays (timing::time_graph_us: median of kReplays), each launch of a
// graph on the next of enough replicas of weights + latent + gate + out (>= kColdBytes per pass, well
// beyond the 60 MB L2) that the weights and the latent come from HBM. Our kernels run PDL-chained, as
// in PreparedMla (the next launch's W_UV loads overlap the previous launch's tail).
// GB/s counts the bytes that must move: W_UV + latent + gate logits + out (bf16 each); TFLOP/s the
// 2 * rows * H * 512 * 128 of the GEMM; the floor is max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate),
// both measured in the same run. "fastest" names the fastest of our four kernels per shape and the
// last line the shapes where plan_value's pick is > 5 % slower than it (what config.h's plan constants
// are set from).
//
//   value_bench [--out FILE]            the markdown table on stdout (and into FILE)
//   value_bench --heads H --rows ROWS   one shape (e.g. under ncu)
//   value_bench --l2-warm               a diagnostic: one replica, so W_UV, latent and gate stay in L2 between
//                                       launches (what a stage costs when its bytes are not what it waits on)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "bench_device.cuh"
#include "common/cublas_check.h"
#include "common/cuda_check.h"
#include "device_timing.h"
#include "mla/dims.h"
#include "value/config.h"
#include "value/launch.h"

namespace mla::bench {
namespace {

constexpr int kMinLaunchesPerGraph = 20;
constexpr int kReplays = 30;
constexpr double kColdBytes = 150e6;  // per graph pass, > 2x the H200's 60 MB L2
constexpr int kMaxReplicas = 96;

// The stock gate: out = bf16(v * sigmoid(gate)), zero rows 0; one thread per 8 columns (16-byte
// gate loads and out stores), v bf16 or fp32 as the GEMM wrote it. q = 1: request = row.
template <class V>
__global__ void stock_gate_kernel(const V* v, const __nv_bfloat16* projected, int64_t pitch, const int32_t* lengths,
                                  int num_requests, int rows, int width, __nv_bfloat16* out) {
  const int vecs_per_row = width / 8;
  const int64_t vec = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (vec >= int64_t{rows} * vecs_per_row) return;
  const int row = static_cast<int>(vec / vecs_per_row);
  const int column = static_cast<int>(vec % vecs_per_row) * 8;
  const bool zero = row >= num_requests || lengths[row] == 0;
  const uint4 gate_bits = *reinterpret_cast<const uint4*>(projected + row * pitch + kProjectedGateOffset + column);
  const auto* gate = reinterpret_cast<const __nv_bfloat162*>(&gate_bits);
  float x[8];
  if constexpr (sizeof(V) == 4) {
    const float4 a = *reinterpret_cast<const float4*>(v + int64_t{row} * width + column);
    const float4 b = *reinterpret_cast<const float4*>(v + int64_t{row} * width + column + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    const uint4 bits = *reinterpret_cast<const uint4*>(v + int64_t{row} * width + column);
    const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&bits);
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = __low2float(pairs[i]);
      x[2 * i + 1] = __high2float(pairs[i]);
    }
  }
  uint4 result;
  auto* packed = reinterpret_cast<__nv_bfloat162*>(&result);
  for (int i = 0; i < 4; ++i) {
    const float g0 = __low2float(gate[i]), g1 = __high2float(gate[i]);
    packed[i] = __floats2bfloat162_rn(zero ? 0.0f : x[2 * i] / (1.0f + expf(-g0)),
                                      zero ? 0.0f : x[2 * i + 1] / (1.0f + expf(-g1)));
  }
  *reinterpret_cast<uint4*>(out + int64_t{row} * width + column) = result;
}

// One replica of the stage's inputs and output (q = 1, every request non-empty: all rows do work).
struct Replica {
  __nv_bfloat16 *w_uv = nullptr, *latent = nullptr, *projected = nullptr, *out = nullptr;
};

struct Problem {
  int rows = 0, heads = 0;
  int64_t pitch = 0;
  std::vector<Replica> replicas;
  int32_t* lengths = nullptr;
  void* v = nullptr;  // the stock GEMM's output (fp32 size; bf16 uses the first half)

  double weight_bytes() const { return 2.0 * heads * kKvLoraRank * kVHeadDim; }
  double latent_bytes() const { return 2.0 * rows * heads * kKvLoraRank; }
  double gate_bytes() const { return 2.0 * rows * heads * kVHeadDim; }
  double out_bytes() const { return 2.0 * rows * heads * kVHeadDim; }
  double must_move_bytes() const { return weight_bytes() + latent_bytes() + gate_bytes() + out_bytes(); }
  double flops() const { return 2.0 * rows * heads * double(kKvLoraRank) * kVHeadDim; }
  int launches() const { return std::max(kMinLaunchesPerGraph, static_cast<int>(replicas.size())); }
};

Problem make_problem(int rows, int heads, bool l2_warm, cudaStream_t stream) {
  Problem p;
  p.rows = rows;
  p.heads = heads;
  p.pitch = (projected_width(heads) + 64 + 7) / 8 * 8;
  // Bytes one launch moves in its replica.
  const double replica_bytes = p.weight_bytes() + p.latent_bytes() + p.gate_bytes() + p.out_bytes();
  const int count =
      l2_warm ? 1 : std::clamp(static_cast<int>(std::ceil(kColdBytes / replica_bytes)), 2, kMaxReplicas);
  const size_t w_count = size_t(heads) * kKvLoraRank * kVHeadDim;
  const size_t latent_count = size_t(rows) * heads * kKvLoraRank;
  const size_t projected_count = size_t(rows) * p.pitch;
  const size_t out_count = size_t(rows) * heads * kVHeadDim;
  for (int i = 0; i < count; ++i) {
    Replica r;
    r.w_uv = device_alloc<__nv_bfloat16>(w_count);
    r.latent = device_alloc<__nv_bfloat16>(latent_count);
    r.projected = device_alloc<__nv_bfloat16>(projected_count);
    r.out = device_alloc<__nv_bfloat16>(out_count);
    const uint64_t seed = 1000 * uint64_t(i);
    fill_random_bf16<<<1024, 256, 0, stream>>>(r.w_uv, w_count, seed + 1, 2.f * 1.7f / std::sqrt(512.f));
    fill_random_bf16<<<1024, 256, 0, stream>>>(r.latent, latent_count, seed + 2, 1.0f);
    fill_random_bf16<<<1024, 256, 0, stream>>>(r.projected, projected_count, seed + 3, 6.0f);
    MLA_CUDA_CHECK_LAUNCH();
    p.replicas.push_back(r);
  }
  const std::vector<int32_t> lengths(rows, 100);
  p.lengths = device_alloc<int32_t>(rows);
  MLA_CUDA_CHECK(cudaMemcpy(p.lengths, lengths.data(), rows * sizeof(int32_t), cudaMemcpyHostToDevice));
  p.v = device_alloc<float>(out_count);
  MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return p;
}

void free_problem(Problem& p) {
  for (Replica& r : p.replicas) {
    for (void* ptr : {(void*)r.w_uv, (void*)r.latent, (void*)r.projected, (void*)r.out}) MLA_CUDA_CHECK(cudaFree(ptr));
  }
  MLA_CUDA_CHECK(cudaFree(p.lengths));
  MLA_CUDA_CHECK(cudaFree(p.v));
  p.replicas.clear();
}

value::ValueParams value_params(const Problem& p, const Replica& r) {
  value::ValueParams v{};
  v.latent = r.latent;
  v.stride_latent_row = int64_t{p.heads} * kKvLoraRank;
  v.w_uv = r.w_uv;
  v.projected = r.projected;
  v.stride_projected_row = p.pitch;
  v.lengths = p.lengths;
  v.totals = nullptr;
  v.num_requests = p.rows;
  v.q = 1;
  v.out = r.out;
  v.rows = p.rows;
  v.num_heads = p.heads;
  v.num_partials = 0;
  return v;
}

double time_ours(const Problem& p, value::ValueKernel kernel, cudaStream_t stream) {
  const value::ValuePlan plan = value::plan_value(p.rows, p.heads, /*num_partials=*/1, kernel);
  return timing::time_graph_us(
      stream,
      [&](int i) {
        const Replica& r = p.replicas[i % p.replicas.size()];
        value::launch_value(value_params(p, r), plan, stream, /*pdl=*/true);
      },
      p.launches(), kReplays);
}

// The stock composition: batched GEMM (v in bf16 or fp32), then the gate kernel.
double time_stock(const Problem& p, bool fp32_v, cublasHandle_t cublas, cudaStream_t stream) {
  const int width = p.heads * kVHeadDim;
  const int threads = 256;
  const int blocks = static_cast<int>((int64_t{p.rows} * width / 8 + threads - 1) / threads);
  return timing::time_graph_us(
      stream,
      [&](int i) {
        const Replica& r = p.replicas[i % p.replicas.size()];
        const float alpha = 1.f, beta = 0.f;
        // Column-major view: v^T (128 x rows) = W_UV[h]^T (128 x 512) . latent[h]^T (512 x rows), per head.
        MLA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(cublas, CUBLAS_OP_N, CUBLAS_OP_N, kVHeadDim, p.rows, kKvLoraRank, &alpha,
                                                    r.w_uv, CUDA_R_16BF, kVHeadDim, int64_t{kKvLoraRank} * kVHeadDim,
                                                    r.latent, CUDA_R_16BF, p.heads * kKvLoraRank, kKvLoraRank, &beta, p.v,
                                                    fp32_v ? CUDA_R_32F : CUDA_R_16BF, width, kVHeadDim, p.heads,
                                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        if (fp32_v) {
          stock_gate_kernel<float><<<blocks, threads, 0, stream>>>(static_cast<const float*>(p.v), r.projected, p.pitch,
                                                                   p.lengths, p.rows, p.rows, width, r.out);
        } else {
          stock_gate_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(
              static_cast<const __nv_bfloat16*>(p.v), r.projected, p.pitch, p.lengths, p.rows, p.rows, width, r.out);
        }
        MLA_CUDA_CHECK_LAUNCH();
      },
      p.launches(), kReplays);
}

}  // namespace
}  // namespace mla::bench

int main(int argc, char** argv) {
  using namespace mla;
  const char* out_path = nullptr;
  std::vector<int> head_counts = {12, 96, 128};
  std::vector<int> row_counts = {1, 4, 16, 32, 64, 128, 256, 512};
  bool l2_warm = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) {
      out_path = argv[++i];
    } else if ((!std::strcmp(argv[i], "--heads") || !std::strcmp(argv[i], "--rows")) && i + 1 < argc) {
      const bool heads_flag = !std::strcmp(argv[i], "--heads");
      int value = 0;
      if (!bench::parse_count("value_bench", argv[i], argv[i + 1], heads_flag ? kMaxHeads : 512, value)) return 2;
      (heads_flag ? head_counts : row_counts) = {value};
      ++i;
    } else if (!std::strcmp(argv[i], "--l2-warm")) {
      l2_warm = true;
    } else {
      std::fprintf(stderr, "usage: value_bench [--out FILE] [--heads H] [--rows ROWS] [--l2-warm]\n");
      return std::strcmp(argv[i], "--help") ? 2 : 0;
    }
  }
  try {
    cudaStream_t stream;
    MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cublasHandle_t cublas;
    MLA_CUBLAS_CHECK(cublasCreate(&cublas));
    MLA_CUBLAS_CHECK(cublasSetStream(cublas, stream));
    constexpr size_t kCublasWorkspaceBytes = size_t{64} << 20;  // no allocation inside the captured graphs
    void* cublas_workspace = bench::device_alloc<uint8_t>(kCublasWorkspaceBytes);
    MLA_CUBLAS_CHECK(cublasSetWorkspace(cublas, cublas_workspace, kCublasWorkspaceBytes));

    cudaDeviceProp prop{};
    MLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const timing::Ceilings ceilings = timing::measure_ceilings(stream);

    std::string table;
    char line[640];
    std::snprintf(line, sizeof line,
                  "device: %s, %d SMs; ceilings: %s; plan: tensor-core from rows x H >= %d (up to %d rows: CUDA cores "
                  "up to H %d; one row: CUDA cores up to H %d, packed up to H %d), full width from %d CTAs%s\n\n",
                  prop.name, prop.multiProcessorCount, ceilings.describe().c_str(), value::kTensorCoreMinRowHeads,
                  value::kRowsPerPass, value::kCudaCoreMaxHeadsOnePass, value::kCudaCoreMaxHeadsAtOneRow,
                  value::kCudaCorePackedMaxHeadsAtOneRow, value::kFullWidthMinCtas,
                  l2_warm ? "; L2-WARM (--l2-warm, a diagnostic): one replica, its bytes in L2 between launches" : "");
    table += line;
    table +=
        "| H | rows | cuda-core µs | tensor-core µs | tensor-core/4 µs | cuda-core/packed µs | stock µs (bf16 v) | stock µs (fp32 v) "
        "| planned | fastest | stock / planned | floor µs | planned / floor | planned GB/s | planned % copy "
        "| planned TFLOP/s |\n";
    table += "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|\n";
    std::fputs(table.c_str(), stdout);

    constexpr value::ValueKernel kKernels[] = {value::ValueKernel::kCudaCore, value::ValueKernel::kTensorCore,
                                               value::ValueKernel::kTensorCoreSplit, value::ValueKernel::kCudaCorePacked};
    int misplanned = 0;  // shapes where the planned kernel is > 5 % slower than the fastest one
    std::string misplanned_shapes;
    for (int heads : head_counts) {
      for (int rows : row_counts) {
        bench::Problem p = bench::make_problem(rows, heads, l2_warm, stream);
        double us[std::size(kKernels)];
        int fastest = 0;
        for (int k = 0; k < static_cast<int>(std::size(kKernels)); ++k) {
          us[k] = bench::time_ours(p, kKernels[k], stream);
          if (us[k] < us[fastest]) fastest = k;
        }
        const double stock_bf16 = bench::time_stock(p, /*fp32_v=*/false, cublas, stream);
        const double stock_fp32 = bench::time_stock(p, /*fp32_v=*/true, cublas, stream);
        const value::ValueKernel planned = value::plan_value(rows, heads, /*num_partials=*/1).kernel;
        const double ours = us[static_cast<int>(planned)];
        if (ours > 1.05 * us[fastest]) {
          ++misplanned;
          misplanned_shapes += " H" + std::to_string(heads) + "x" + std::to_string(rows);
        }
        const double stock = std::min(stock_bf16, stock_fp32);
        const double floor = timing::floor_us(ceilings, p.must_move_bytes(), p.flops(), 0.0);
        const double gbs = p.must_move_bytes() / (ours * 1e3);
        std::snprintf(line, sizeof line,
                      "| %d | %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %s | %s | %.2fx | %.2f | %.2f | %.0f | %.0f%% | "
                      "%.1f |\n",
                      heads, rows, us[0], us[1], us[2], us[3], stock_bf16, stock_fp32, value::value_kernel_name(planned),
                      value::value_kernel_name(kKernels[fastest]), stock / ours, floor, ours / floor, gbs,
                      100.0 * gbs / ceilings.copy_gbs, p.flops() / (ours * 1e6));
        table += line;
        std::fputs(line, stdout);
        std::fflush(stdout);
        bench::free_problem(p);
      }
    }

    std::string summary = "\nstock / planned: the faster stock variant over the kernel plan_value picks. Shapes where "
                          "the planned kernel is > 5 % slower than the fastest: " +
                          std::to_string(misplanned) + (misplanned ? " (" + misplanned_shapes + " )" : "") + "\n";
    table += summary;
    std::fputs(summary.c_str(), stdout);
    if (out_path != nullptr) mla::bench::write_out_file(out_path, table);
    MLA_CUDA_CHECK(cudaFree(cublas_workspace));
    MLA_CUBLAS_CHECK(cublasDestroy(cublas));
    MLA_CUDA_CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "value_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
