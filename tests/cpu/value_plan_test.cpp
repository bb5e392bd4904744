// plan_value's kernel choice (value/launch.h, constants in value/config.h), without a GPU: the rule the
// H200 measurements set (bench/results/value.md). The GPU tests check that each kernel is correct.
#include <gtest/gtest.h>

#include "value/config.h"
#include "value/launch.h"

namespace mla {
namespace {

using value::choose_value_kernel;
using value::ValueKernel;

TEST(ValuePlan, CudaCoresBelowTheRowHeadThreshold) {
  // H 12 x 1 row is the one measured shape where the CUDA-core kernel wins (3.6 vs 4.4 µs).
  EXPECT_EQ(choose_value_kernel(1, 12, 1), ValueKernel::kCudaCore);
  EXPECT_EQ(choose_value_kernel(3, 12, 0), ValueKernel::kCudaCore);
  // One pass of rows over a one-wave grid (H <= kCudaCoreMaxHeadsOnePass): CUDA cores; a second pass: tensor cores
  // once rows x heads reach kTensorCoreMinRowHeads, CUDA cores below it.
  static_assert((value::kRowsPerPass + 1) * 12 >= value::kTensorCoreMinRowHeads,
                "H 12's second pass is planned on tensor cores");
  EXPECT_EQ(choose_value_kernel(value::kRowsPerPass, 12, 1), ValueKernel::kCudaCore);
  EXPECT_EQ(choose_value_kernel(value::kRowsPerPass, value::kCudaCoreMaxHeadsOnePass, 0), ValueKernel::kCudaCore);
  EXPECT_EQ(choose_value_kernel(value::kRowsPerPass + 1, 12, 1), ValueKernel::kTensorCoreSplit);
  EXPECT_EQ(choose_value_kernel(2, value::kCudaCoreMaxHeadsOnePass + 1, 0), ValueKernel::kTensorCoreSplit);
  EXPECT_EQ(choose_value_kernel(value::kTensorCoreMinRowHeads / 8 - 1, 8, 0), ValueKernel::kCudaCore);
  EXPECT_EQ(choose_value_kernel(value::kTensorCoreMinRowHeads / 8, 8, 0), ValueKernel::kTensorCoreSplit);
  // One row up to H 64 (W_UV in L2 by PreparedMla's prefetch): the CUDA-core kernel's one round trip.
  EXPECT_EQ(choose_value_kernel(1, value::kCudaCoreMaxHeadsAtOneRow, 0), ValueKernel::kCudaCore);
  EXPECT_EQ(choose_value_kernel(2, value::kCudaCoreMaxHeadsAtOneRow, 0), ValueKernel::kTensorCoreSplit);
  // Above it, up to H 96, the packed-slice kernel (3 CTAs an SM: 4 x 96 CTAs in one wave); beyond, tensor cores.
  EXPECT_EQ(choose_value_kernel(1, value::kCudaCoreMaxHeadsAtOneRow + 1, 0), ValueKernel::kCudaCorePacked);
  EXPECT_EQ(choose_value_kernel(1, 96, 1), ValueKernel::kCudaCorePacked);
  EXPECT_EQ(choose_value_kernel(1, value::kCudaCorePackedMaxHeadsAtOneRow + 1, 0), ValueKernel::kTensorCoreSplit);
  EXPECT_EQ(choose_value_kernel(2, 96, 0), ValueKernel::kTensorCoreSplit);
}

TEST(ValuePlan, SplitUntilTheFullWidthGridIsLargeEnough) {
  // Full-width CTAs = H x ceil(rows / 64).
  EXPECT_EQ(choose_value_kernel(512, 12, 1), ValueKernel::kTensorCoreSplit);  // 96 CTAs
  EXPECT_EQ(choose_value_kernel(64, 96, 1), ValueKernel::kTensorCoreSplit);   // 96 CTAs
  EXPECT_EQ(choose_value_kernel(65, 96, 1), ValueKernel::kTensorCore);        // 192 CTAs
  EXPECT_EQ(choose_value_kernel(1, 128, 1), ValueKernel::kTensorCore);        // 128 CTAs
  EXPECT_EQ(choose_value_kernel(512, 128, 0), ValueKernel::kTensorCore);
}

TEST(ValuePlan, DcpMergeAlwaysOnCudaCores) {
  // The merged latent stays fp32 (DESIGN.md §4, DCP); the tensor-core kernels take bf16 operands.
  for (int partials : {2, 4, 8}) {
    EXPECT_EQ(choose_value_kernel(512, 128, partials), ValueKernel::kCudaCore);
    EXPECT_EQ(choose_value_kernel(1, 12, partials), ValueKernel::kCudaCore);
    EXPECT_EQ(choose_value_kernel(1, 96, partials), ValueKernel::kCudaCore);  // not the packed one
  }
}

}  // namespace
}  // namespace mla
