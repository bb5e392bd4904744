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
  MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, value_kernel, params));
}

}  // namespace mla::value
