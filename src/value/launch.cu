#include <string>

#include "common/cuda_check.h"
#include "value/kernel.cuh"
#include "value/launch.h"

namespace mla::value {

ValuePlan plan_value(int rows, int num_heads) {
  ValuePlan plan;
  plan.grid = dim3(kColumnSlices, num_heads, (rows + kRowsPerCta - 1) / kRowsPerCta);
  plan.block = dim3(kThreads);
  return plan;
}

void launch_value(const ValueParams& params, const ValuePlan& plan, cudaStream_t stream, bool pdl) {
  cudaLaunchConfig_t config = {};
  config.gridDim = plan.grid;
  config.blockDim = plan.block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  // Bounded dispatch: one partial (or none) runs the plain kernel, 2..8 the DCP merge.
  if (params.num_partials < 0 || params.num_partials > kMaxPartials) {
    throw_bad_argument("ValueParams.num_partials", "0.." + std::to_string(kMaxPartials),
                       std::to_string(params.num_partials));
  }
  if (params.num_partials > 1) {
    for (int r = 0; r < params.num_partials; ++r) {
      if (params.partial_latent[r] == nullptr || params.partial_lse[r] == nullptr) {
        throw_bad_argument("ValueParams.partial_latent / partial_lse[" + std::to_string(r) + "]", "a device pointer",
                           "null");
      }
    }
    MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, value_kernel<true>, params));
  } else {
    MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, value_kernel<false>, params));
  }
}

}  // namespace mla::value
