#include <cstdint>
#include <string>

#include "common/cuda_check.h"
#include "value/kernel.cuh"
#include "value/kernel_mma.cuh"
#include "value/launch.h"

namespace mla::value {
namespace {

// The grid each kernel runs for (rows, heads): one source for plan_value and launch_value's check.
dim3 value_grid(ValueKernel kernel, int rows, int num_heads) {
  switch (kernel) {
    case ValueKernel::kCudaCore:
    case ValueKernel::kCudaCorePacked:
      return dim3(kColumnSlices, num_heads, (rows + kRowsPerCta - 1) / kRowsPerCta);
    case ValueKernel::kTensorCore:
      return dim3((rows + kMmaRowTile - 1) / kMmaRowTile, num_heads, 1);
    case ValueKernel::kTensorCoreSplit:
      return dim3((rows + kMmaRowTile - 1) / kMmaRowTile, num_heads, kMmaColumnSplits);
  }
  throw_bad_argument("ValueKernel", "kCudaCore, kTensorCore, kTensorCoreSplit or kCudaCorePacked",
                     std::to_string(static_cast<int>(kernel)));
}

// Dynamic shared memory and the carveout of one tensor-core kernel instantiation.
template <int kCols>
size_t prepare_mma_kernel() {
  const size_t bytes = sizeof(MmaSharedPlan<kCols>);
  MLA_CUDA_CHECK(cudaFuncSetAttribute(value_mma_kernel<kCols>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
  // All of the carveout to shared memory: two full-width CTAs a SM need 2 x 95 KB; the kernel's global
  // loads are cp.async.cg (no L1), so L1 would only hold the few `lengths` reads.
  MLA_CUDA_CHECK(cudaFuncSetAttribute(value_mma_kernel<kCols>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      static_cast<int>(cudaSharedmemCarveoutMaxShared)));
  return bytes;
}

// The value kernels read 16-byte vectors (the tensor-core ones by cp.async).
void require_aligned16(const char* argument, const void* ptr) {
  const uintptr_t offset = reinterpret_cast<uintptr_t>(ptr) % 16;
  if (offset != 0) {
    throw_bad_argument(argument, "a 16-byte aligned pointer",
                       "an address " + std::to_string(offset) + " bytes past a 16-byte boundary");
  }
}

}  // namespace

const char* value_kernel_name(ValueKernel kernel) {
  switch (kernel) {
    case ValueKernel::kCudaCore:
      return "cuda-core";
    case ValueKernel::kTensorCore:
      return "tensor-core";
    case ValueKernel::kTensorCoreSplit:
      return "tensor-core/4";
    case ValueKernel::kCudaCorePacked:
      return "cuda-core/packed";
  }
  return "unknown";
}

ValueKernel choose_value_kernel(int rows, int num_heads, int num_partials) {
  // NOTE: the DCP merge is never given to the tensor-core kernel (launch.h, kernel_mma.cuh): an
  // explicit rule of the plan, not a fallback.
  if (num_partials > 1 || int64_t{rows} * num_heads < kTensorCoreMinRowHeads) return ValueKernel::kCudaCore;
  if (rows <= kRowsPerPass && num_heads <= kCudaCoreMaxHeadsOnePass) return ValueKernel::kCudaCore;
  if (rows == 1 && num_heads <= kCudaCoreMaxHeadsAtOneRow) return ValueKernel::kCudaCore;
  if (rows == 1 && num_heads <= kCudaCorePackedMaxHeadsAtOneRow) return ValueKernel::kCudaCorePacked;
  const int64_t full_width_ctas = int64_t{(rows + kMmaRowTile - 1) / kMmaRowTile} * num_heads;
  return full_width_ctas >= kFullWidthMinCtas ? ValueKernel::kTensorCore : ValueKernel::kTensorCoreSplit;
}

ValuePlan plan_value(int rows, int num_heads, int num_partials) {
  return plan_value(rows, num_heads, num_partials, choose_value_kernel(rows, num_heads, num_partials));
}

ValuePlan plan_value(int rows, int num_heads, int num_partials, ValueKernel kernel) {
  if (rows < 1) throw_bad_argument("plan_value: rows", ">= 1", std::to_string(rows));
  if (num_heads < 1 || num_heads > kMaxHeads) {
    throw_bad_argument("plan_value: num_heads", "1.." + std::to_string(kMaxHeads), std::to_string(num_heads));
  }
  if (num_partials < 0 || num_partials > kMaxPartials) {
    throw_bad_argument("plan_value: num_partials", "0.." + std::to_string(kMaxPartials),
                       std::to_string(num_partials));
  }
  ValuePlan plan;
  plan.kernel = kernel;
  plan.grid = value_grid(kernel, rows, num_heads);
  plan.rows = rows;
  plan.num_heads = num_heads;
  if (num_partials > 1 && kernel != ValueKernel::kCudaCore) {
    throw_bad_argument("plan_value: kernel for num_partials = " + std::to_string(num_partials),
                       "cuda-core (the DCP merge keeps its merged latent in fp32; the packed slice was measured "
                       "slower there)",
                       value_kernel_name(kernel));
  }
  switch (kernel) {
    case ValueKernel::kCudaCore:
    case ValueKernel::kCudaCorePacked:
      plan.block = dim3(kThreads);
      plan.smem_bytes = 0;  // static shared memory only (SharedPlan)
      break;
    case ValueKernel::kTensorCore:
    case ValueKernel::kTensorCoreSplit:
      plan.block = dim3(kMmaThreads);
      plan.smem_bytes = kernel == ValueKernel::kTensorCore ? prepare_mma_kernel<kVHeadDim>()
                                                           : prepare_mma_kernel<kVHeadDim / kMmaColumnSplits>();
      break;
  }
  return plan;
}

void launch_value(const ValueParams& params, const ValuePlan& plan, cudaStream_t stream, bool pdl) {
  // Bounded dispatch: one partial (or none) runs a plain kernel, 2..8 the DCP merge.
  if (params.num_partials < 0 || params.num_partials > kMaxPartials) {
    throw_bad_argument("ValueParams.num_partials", "0.." + std::to_string(kMaxPartials),
                       std::to_string(params.num_partials));
  }
  const bool merge = params.num_partials > 1;
  if (merge) {
    for (int r = 0; r < params.num_partials; ++r) {
      if (params.partial_latent[r] == nullptr || params.partial_lse[r] == nullptr) {
        throw_bad_argument("ValueParams.partial_latent / partial_lse[" + std::to_string(r) + "]", "a device pointer",
                           "null");
      }
    }
  }
  if (plan.rows != params.rows || plan.num_heads != params.num_heads) {
    throw_bad_argument("ValuePlan", "a plan for rows=" + std::to_string(params.rows) + " heads=" +
                                        std::to_string(params.num_heads) + " (plan_value)",
                       "rows=" + std::to_string(plan.rows) + " heads=" + std::to_string(plan.num_heads));
  }
  // NOTE: the DCP merge runs only on the unpacked CUDA-core kernel (fp32 merged latent; plan_value never makes
  // another pairing), so reaching this means a plan for another step.
  if (merge && plan.kernel != ValueKernel::kCudaCore) {
    throw_bad_argument("ValuePlan.kernel for num_partials = " + std::to_string(params.num_partials),
                       "cuda-core (the DCP merge keeps its merged latent in fp32)", value_kernel_name(plan.kernel));
  }
  const dim3 grid = value_grid(plan.kernel, params.rows, params.num_heads);
  if (plan.grid.x != grid.x || plan.grid.y != grid.y || plan.grid.z != grid.z) {
    throw_bad_argument("ValuePlan.grid", "the grid of the " + std::string(value_kernel_name(plan.kernel)) +
                                             " kernel (make the plan with plan_value, do not edit it)",
                       std::to_string(plan.grid.x) + "x" + std::to_string(plan.grid.y) + "x" +
                           std::to_string(plan.grid.z));
  }

#if !(defined(MLA_TIMELINE) && MLA_TIMELINE)
  if (params.timeline != nullptr) {
    throw_bad_argument("ValueParams.timeline", "null (this build has no timeline: -DMLA_TIMELINE=ON)", "a pointer");
  }
#endif

  // Every kernel reads W_UV and the latent (or each partial latent) in 16-byte vectors.
  require_aligned16("ValueParams.w_uv", params.w_uv);
  if (merge) {
    for (int r = 0; r < params.num_partials; ++r) {
      if (reinterpret_cast<uintptr_t>(params.partial_latent[r]) % 16 == 0) continue;  // the name only for an error
      require_aligned16(("ValueParams.partial_latent[" + std::to_string(r) + "]").c_str(), params.partial_latent[r]);
    }
  } else {
    if (params.latent == nullptr) throw_bad_argument("ValueParams.latent", "a device pointer", "null");
    require_aligned16("ValueParams.latent", params.latent);
  }
  if (params.stride_latent_row % 8 != 0) {
    throw_bad_argument("ValueParams.stride_latent_row", "a multiple of 8 elements (16-byte aligned rows)",
                       std::to_string(params.stride_latent_row));
  }

  cudaLaunchConfig_t config = {};
  config.gridDim = plan.grid;
  config.blockDim = plan.block;
  config.dynamicSmemBytes = plan.smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;

  switch (plan.kernel) {
    case ValueKernel::kCudaCore:
      if (merge) {
        MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, value_kernel<true, false>, params));
      } else {
        MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, value_kernel<false, false>, params));
      }
      return;
    case ValueKernel::kCudaCorePacked:
      MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, value_kernel<false, true>, params));
      return;
    case ValueKernel::kTensorCore:
    case ValueKernel::kTensorCoreSplit:
      // These kernels also stage the gate logits in 16-byte vectors.
      require_aligned16("ValueParams.projected", params.projected);
      if (params.stride_projected_row % 8 != 0) {
        throw_bad_argument("ValueParams.stride_projected_row", "a multiple of 8 elements (16-byte aligned rows)",
                           std::to_string(params.stride_projected_row));
      }
      if (plan.kernel == ValueKernel::kTensorCore) {
        MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, value_mma_kernel<kVHeadDim>, params));
      } else {
        MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, value_mma_kernel<kVHeadDim / kMmaColumnSplits>, params));
      }
      return;
  }
  throw_bad_argument("ValuePlan.kernel", "kCudaCore, kTensorCore, kTensorCoreSplit or kCudaCorePacked",
                     std::to_string(static_cast<int>(plan.kernel)));
}

}  // namespace mla::value
