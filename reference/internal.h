// Helpers shared by the reference's translation units; not part of the reference's API.
#pragma once

#include <cstdint>

#include "reference.h"

namespace mla::ref::internal {

// The query stage of every row (query bytes and cache writes) on inputs the caller has validated.
void query_stage_unchecked(const Weights& weights, const LayerDims& dims, const StepInputs& step,
                           uint8_t* query_out);

// Element reads of host metadata through the view's strides (engines pass sliced, strided views).
inline int64_t read_index(const TensorView& t, int64_t i) {
  const int64_t offset = i * t.stride[0];
  return t.dtype == DType::kI64 ? t.as<const int64_t>()[offset] : t.as<const int32_t>()[offset];
}
inline int64_t read_index(const TensorView& t, int64_t i, int64_t j) {
  const int64_t offset = i * t.stride[0] + j * t.stride[1];
  return t.dtype == DType::kI64 ? t.as<const int64_t>()[offset] : t.as<const int32_t>()[offset];
}

// Byte `d` of token `offset` of cache page `page`, through the cache view's strides.
inline uint8_t* cache_byte(const TensorView& cache, int64_t page, int64_t offset, int64_t d) {
  return cache.as<uint8_t>() + page * cache.stride[0] + offset * cache.stride[1] + d * cache.stride[2];
}

}  // namespace mla::ref::internal
