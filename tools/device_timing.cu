#include "device_timing.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "common/cublas_check.h"
#include "common/cuda_check.h"
#include "mla/dims.h"

namespace mla::timing {
namespace {

__device__ uint32_t hash32(uint64_t i) {
  uint64_t x = i * 0x9e3779b97f4a7c15ull;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return static_cast<uint32_t>(x);
}

// Random finite data: never zeros (they run faster than real data).
__global__ void fill_random_bf16(__nv_bfloat16* data, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = __float2bfloat16(static_cast<float>(hash32(i) % 2001) / 1000.0f - 1.0f);
  }
}
__global__ void fill_random_fp8(uint8_t* data, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = static_cast<uint8_t>((hash32(i) & 0xbf) | 0x08);  // exponent bit 6 clear: finite, non-zero
  }
}

class DeviceBytes {
 public:
  explicit DeviceBytes(size_t bytes) { MLA_CUDA_CHECK(cudaMalloc(&ptr_, bytes)); }
  ~DeviceBytes() { cudaFree(ptr_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

double time_events_us(cudaStream_t stream, const std::function<void()>& work, int repeats) {
  cudaEvent_t start, stop;
  MLA_CUDA_CHECK(cudaEventCreate(&start));
  MLA_CUDA_CHECK(cudaEventCreate(&stop));
  work();  // warm-up
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    MLA_CUDA_CHECK(cudaEventRecord(start, stream));
    work();
    MLA_CUDA_CHECK(cudaEventRecord(stop, stream));
    MLA_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    MLA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms * 1e3);
  }
  MLA_CUDA_CHECK(cudaEventDestroy(start));
  MLA_CUDA_CHECK(cudaEventDestroy(stop));
  return median(times);
}

constexpr int kGemmSize = 8192;

double measure_bf16_tflops(cudaStream_t stream) {
  const int64_t n = kGemmSize;
  DeviceBytes a(n * n * 2), b(n * n * 2), c(n * n * 2);
  fill_random_bf16<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(a.get()), n * n);
  fill_random_bf16<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(b.get()), n * n);
  MLA_CUDA_CHECK_LAUNCH();
  cublasHandle_t handle;
  MLA_CUBLAS_CHECK(cublasCreate(&handle));
  MLA_CUBLAS_CHECK(cublasSetStream(handle, stream));
  const float alpha = 1.0f, beta = 0.0f;
  const double us = time_events_us(
      stream,
      [&] {
        MLA_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.get(), CUDA_R_16BF, n,
                                      b.get(), CUDA_R_16BF, n, &beta, c.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
      },
      10);
  MLA_CUBLAS_CHECK(cublasDestroy(handle));
  return 2.0 * n * n * n / (us * 1e-6) / 1e12;
}

double measure_fp8_tflops(cudaStream_t stream) {
  const int64_t n = kGemmSize;
  DeviceBytes a(n * n), b(n * n), c(n * n * 2);
  const size_t workspace_bytes = size_t{32} << 20;
  DeviceBytes workspace(workspace_bytes);
  fill_random_fp8<<<1024, 256, 0, stream>>>(static_cast<uint8_t*>(a.get()), n * n);
  fill_random_fp8<<<1024, 256, 0, stream>>>(static_cast<uint8_t*>(b.get()), n * n);
  MLA_CUDA_CHECK_LAUNCH();

  // FP8 GEMMs take the "TN" form: A transposed, B not.
  cublasLtHandle_t lt;
  MLA_CUBLAS_CHECK(cublasLtCreate(&lt));
  cublasLtMatmulDesc_t op;
  MLA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  MLA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof transa));
  MLA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof transb));
  cublasLtMatrixLayout_t la, lb, lc;
  MLA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, n, n, n));
  MLA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, n, n, n));
  MLA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, n, n));
  cublasLtMatmulPreference_t preference;
  MLA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  MLA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                        &workspace_bytes, sizeof workspace_bytes));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  MLA_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, preference, 1, &heuristic, &found));
  if (found == 0) throw Error("cublasLt: no FP8 GEMM algorithm for the ceiling measurement");
  const float alpha = 1.0f, beta = 0.0f;
  const double us = time_events_us(
      stream,
      [&] {
        MLA_CUBLAS_CHECK(cublasLtMatmul(lt, op, &alpha, a.get(), la, b.get(), lb, &beta, c.get(), lc, c.get(), lc,
                                        &heuristic.algo, workspace.get(), workspace_bytes, stream));
      },
      10);
  cublasLtMatmulPreferenceDestroy(preference);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
  return 2.0 * n * n * n / (us * 1e-6) / 1e12;
}

}  // namespace

double measure_copy_gbs(cudaStream_t stream) {
  const size_t bytes = size_t{2} << 30;  // 2 GiB each way: far beyond the 60 MB L2
  DeviceBytes a(bytes), b(bytes);
  MLA_CUDA_CHECK(cudaMemsetAsync(a.get(), 0x5a, bytes, stream));
  const double us = time_events_us(
      stream, [&] { MLA_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, stream)); }, 10);
  return 2.0 * bytes / (us * 1e-6) / 1e9;
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

double time_graph_us(cudaStream_t stream, const std::function<void(int)>& enqueue, int launches, int replays) {
  cudaGraph_t graph;
  MLA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) enqueue(i);
  MLA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double us = time_events_us(stream, [&] { MLA_CUDA_CHECK(cudaGraphLaunch(exec, stream)); }, replays);
  MLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MLA_CUDA_CHECK(cudaGraphDestroy(graph));
  return us / launches;
}

std::string Ceilings::describe() const {
  char line[160];
  std::snprintf(line, sizeof line, "copy %.0f GB/s, bf16 %.0f TFLOP/s, fp8 %.0f TFLOP/s", copy_gbs, bf16_tflops,
                fp8_tflops);
  return line;
}

Ceilings measure_ceilings(cudaStream_t stream) {
  Ceilings c;
  c.copy_gbs = measure_copy_gbs(stream);
  c.bf16_tflops = measure_bf16_tflops(stream);
  c.fp8_tflops = measure_fp8_tflops(stream);
  return c;
}

StepCost step_cost(int heads, int64_t rows, double request_tokens, double visible_row_tokens) {
  StepCost c;
  const double h = heads, r = static_cast<double>(rows);
  c.weight_bytes = 2.0 * (kQLoraRank + kKvLoraRank + h * kQkHeadDim * kQLoraRank + h * kNopeDim * kKvLoraRank +
                          h * kKvLoraRank * kVHeadDim);
  c.kv_bytes = request_tokens * kKeyDim;
  c.activation_bytes = r * (2.0 * projected_width(heads) + 2.0 * h * kVHeadDim + kKeyDim);
  c.bf16_flops = 2.0 * r * h *
                 (double(kQkHeadDim) * kQLoraRank + double(kNopeDim) * kKvLoraRank + double(kKvLoraRank) * kVHeadDim);
  c.fp8_flops = 2.0 * double(kKeyDim + kKvLoraRank) * visible_row_tokens * h;
  return c;
}

double query_stage_bytes(int heads, int64_t rows) {
  const double h = heads, r = static_cast<double>(rows);
  const double weights = h * (double(kQkHeadDim) * kQLoraRank + double(kNopeDim) * kKvLoraRank) * 2 +
                         double(kQLoraRank + kKvLoraRank) * 2;
  return weights + r * kProjectedGateOffset * 2 + r * h * kKeyDim + r * kKeyDim;
}

double floor_us(const Ceilings& ceilings, double bytes, double bf16_flops, double fp8_flops) {
  const double memory_us = bytes / (ceilings.copy_gbs * 1e3);
  const double math_us = bf16_flops / (ceilings.bf16_tflops * 1e6) + fp8_flops / (ceilings.fp8_tflops * 1e6);
  return std::max(memory_us, math_us);
}

}  // namespace mla::timing
