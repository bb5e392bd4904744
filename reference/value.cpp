// Value stage of the reference (DESIGN.md §4): latent x W_UV per head, times sigmoid(gate).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "reference.h"

namespace mla::ref {

void value_stage(const std::vector<double>& latent, const Weights& weights, const LayerDims& dims,
                 const TensorView& projected, const std::vector<bool>& zero_rows, uint16_t* out) {
  const int num_heads = dims.num_heads;
  const int64_t rows = projected.shape[0];
  const int64_t out_width = int64_t{num_heads} * kVHeadDim;
  if (static_cast<int64_t>(latent.size()) != rows * num_heads * kKvLoraRank) {
    throw_bad_argument("value_stage: latent", std::to_string(rows * num_heads * kKvLoraRank) + " values",
                       std::to_string(latent.size()));
  }
  if (static_cast<int64_t>(zero_rows.size()) != rows) {
    throw_bad_argument("value_stage: zero_rows", std::to_string(rows) + " flags", std::to_string(zero_rows.size()));
  }
  const uint16_t* w_uv = weights.w_uv.as<const uint16_t>();
  std::vector<double> v(kVHeadDim);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* out_row = out + r * out_width;
    if (zero_rows[r]) {
      // Exactly +0 whatever the gate holds: padded rows may carry garbage.
      for (int64_t c = 0; c < out_width; ++c) out_row[c] = 0;
      continue;
    }
    const uint16_t* gate = projected.as<const uint16_t>() + r * projected.stride[0] + kProjectedGateOffset;
    for (int h = 0; h < num_heads; ++h) {
      const double* head_latent = latent.data() + (r * num_heads + h) * kKvLoraRank;
      std::fill(v.begin(), v.end(), 0.0);
      for (int d = 0; d < kKvLoraRank; ++d) {
        const uint16_t* weight_row = w_uv + (int64_t{h} * kKvLoraRank + d) * kVHeadDim;
        for (int c = 0; c < kVHeadDim; ++c) v[c] += head_latent[d] * bf16_to_double(weight_row[c]);
      }
      for (int c = 0; c < kVHeadDim; ++c) {
        const double gate_logit = bf16_to_double(gate[h * kVHeadDim + c]);
        out_row[h * kVHeadDim + c] = bf16_from_double(v[c] / (1.0 + std::exp(-gate_logit)));
      }
    }
  }
}

}  // namespace mla::ref
