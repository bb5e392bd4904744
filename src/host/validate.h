// Input validation shared by every path (the GPU pipeline, the CPU reference, the PyTorch ops).
// Each check throws mla::Error naming the argument, what was expected and what came; the callers run
// every check before they write anything.
#pragma once

#include <cstdint>
#include <vector>

#include "mla/mla.h"

namespace mla::detail {

// What a step must look like for the object (or reference) that runs it.
struct StepContract {
  int num_heads = 0;          // H of this rank
  int64_t pitch = 0;          // required row stride of projected; 0 = any stride >= projected_width
  int64_t max_context = 0;    // bound on lengths (and totals); 0 = no bound
  std::vector<int> queries;   // allowed q values; empty = any q in 1..8
  DcpLayout dcp;              // size 1 = no DCP: totals must be absent; size > 1: totals required
  Memory memory = Memory::kHost;  // where every tensor must live
  int device_index = 0;           // for Memory::kDevice
  // Read slots / block_table / lengths / totals and check their values (pages and slots in range,
  // lengths within the block table and max_context). Only possible for host-visible tensors.
  bool check_values = true;
};

// Shapes, dtypes and strides of the weights; finite positive scales and eps.
void validate_weights(const Weights& weights, const LayerDims& dims, Memory memory, int device_index);
void validate_dims(const LayerDims& dims);

// Shapes, dtypes, strides, q, and (with check_values) the metadata values of one step.
void validate_step(const StepInputs& step, const StepContract& contract);

// The paged cache [num_pages >= 1, 64, 576] FP8 or u8: token stride 576, page stride >= 64 * 576 and
// a multiple of 16, a 16-byte aligned base.
void validate_cache(const TensorView& cache, Memory memory, int device_index);

// A caller's stage workspace: u8 [bytes] contiguous device memory on `device_index`, 256-byte aligned
// (its size is checked against the plan in prepare()).
void validate_workspace(const TensorView& workspace, int device_index);

// query scratch [>= rows, heads, 576] FP8 or u8, contiguous, 16-byte aligned.
void validate_query_scratch(const TensorView& scratch, int64_t rows, int heads, Memory memory,
                            int device_index);

}  // namespace mla::detail
