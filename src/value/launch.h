// Host API of the value stage: plan once per shape, launch (only) per step.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "value/params.h"

namespace mla::value {

// Which value kernel a plan runs (config.h has both tile plans).
enum class ValueKernel : int {
  kCudaCore = 0,    // kernel.cuh: W_UV on FMAs, weights in registers; few rows, and every DCP merge
  kTensorCore = 1,  // kernel_mma.cuh: mma.sync bf16 GEMM per (head, 64-row tile); many rows, no merge
  kTensorCoreSplit = 2,  // the same with 4 CTAs per (head, tile), 32 columns each: few row tiles, no merge
  kCudaCorePacked = 3,   // kernel.cuh with the W_UV slice packed bf16 (3 CTAs an SM): one row at H 65..96, no merge
};
// "cuda-core" / "tensor-core" / "tensor-core/4" / "cuda-core/packed"
const char* value_kernel_name(ValueKernel kernel);

struct ValuePlan {
  ValueKernel kernel = ValueKernel::kCudaCore;
  dim3 grid;              // kCudaCore(Packed): (column slices, heads, 16-row tiles); kTensorCore(Split): (64-row
                          // tiles, heads, 1 or 4 column splits)
  dim3 block;
  size_t smem_bytes = 0;  // dynamic shared memory (tensor-core kernels: sizeof(MmaSharedPlan<columns>))
  int rows = 0;           // the shape the plan is for: launch_value checks the params against it
  int num_heads = 0;
};

// The plan for `rows` rows of `num_heads` heads whose latent is merged from `num_partials` DCP partials
// (0 or 1: no merge). Picks a tensor-core kernel from kTensorCoreMinRowHeads rows x heads up (the
// column-split one while the full-width grid has fewer than kFullWidthMinCtas CTAs), except for one pass of rows at
// up to kCudaCoreMaxHeadsOnePass heads and one row at up to kCudaCorePackedMaxHeadsAtOneRow (config.h), and that a DCP
// merge (num_partials > 1) always runs the CUDA-core kernel: its merged latent stays fp32 (DESIGN.md
// §4, DCP: not rounded to bf16 before W_UV), and the tensor-core kernels' operands are bf16.
// Sets the chosen kernel's shared-memory limit (call on the device that will run it). rows < 1,
// num_heads outside 1..kMaxHeads or num_partials outside 0..kMaxPartials are mla::Errors.
ValuePlan plan_value(int rows, int num_heads, int num_partials);
// The kernel that plan_value(rows, num_heads, num_partials) runs: host logic only, no CUDA call.
ValueKernel choose_value_kernel(int rows, int num_heads, int num_partials);
// The same with the kernel forced (tests, benchmarks); any kernel but kCudaCore with num_partials > 1 is an
// error.
ValuePlan plan_value(int rows, int num_heads, int num_partials, ValueKernel kernel);

// Launches on `stream`; with `pdl`, as a programmatic dependent of the previous kernel in the stream
// (every kernel loads W_UV before waiting for the latent). With params.num_partials > 1 the
// DCP-merging CUDA-core kernel runs. No allocation, no synchronization. mla::Errors: a bad
// num_partials or a null partial; a plan made for other rows / heads; a plan of any kernel but kCudaCore
// with num_partials > 1; for the tensor-core kernels a null latent, a latent / w_uv / projected pointer
// not 16-byte aligned, or a stride_latent_row / stride_projected_row not a multiple of 8.
void launch_value(const ValueParams& params, const ValuePlan& plan, cudaStream_t stream, bool pdl);

}  // namespace mla::value
