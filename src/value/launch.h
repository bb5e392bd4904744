// Host API of the value kernel: plan once per shape, launch (only) per step.
#pragma once

#include <cuda_runtime_api.h>

#include "value/params.h"

namespace mla::value {

struct ValuePlan {
  dim3 grid;   // (column slices, heads, row tiles)
  dim3 block;
};

ValuePlan plan_value(int rows, int num_heads);

// Launches on `stream`; with `pdl`, as a programmatic dependent of the previous kernel in the stream
// (it loads W_UV before waiting for the latent). With params.num_partials > 1 the DCP-merging kernel
// runs. No allocation, no synchronization; a bad num_partials or a null partial is an mla::Error.
void launch_value(const ValueParams& params, const ValuePlan& plan, cudaStream_t stream, bool pdl);

}  // namespace mla::value
