// The two rules every softmax sum and LSE merge of the core and the value kernel follows where a visible logit is
// NaN (a NaN byte in the cache or the query): the row comes out NaN, latent and LSE, as the reference's
// (DESIGN.md §4: only a row with nothing visible is 0 and -inf). fmaxf drops a NaN operand and `sum > 0` is false
// for a NaN sum, so either alone turned a NaN row into an empty one (0 and -inf), which a merge then weighed 0.
#pragma once

namespace mla {

// max(a, b), NaN if either is (PTX max.NaN; fmaxf returns the other operand).
__device__ __forceinline__ float max_keep_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// Whether a softmax sum (of weights >= 0) weighs anything: false only for exactly 0, the sum of a row that sees no
// token; a NaN sum weighs, so that its NaN reaches the outputs.
__device__ __forceinline__ bool sum_weighs(float sum) { return sum != 0.0f; }

}  // namespace mla
