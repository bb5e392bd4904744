// Value stage of the reference (DESIGN.md §4): latent x W_UV per head, times sigmoid(gate).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel_for.h"
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
  parallel_for(rows * num_heads, kKvLoraRank * kVHeadDim, [&](int64_t row_head) {
    const int64_t r = row_head / num_heads;
    const int h = static_cast<int>(row_head % num_heads);
    uint16_t* out_head = out + r * out_width + h * kVHeadDim;
    if (zero_rows[r]) {
      // Exactly +0 whatever the gate holds: padded rows may carry garbage.
      std::fill_n(out_head, kVHeadDim, uint16_t{0});
      return;
    }
    const uint16_t* gate = projected.as<const uint16_t>() + r * projected.stride[0] + kProjectedGateOffset;
    const double* head_latent = latent.data() + row_head * kKvLoraRank;
    std::vector<double> v(kVHeadDim, 0.0);
    for (int d = 0; d < kKvLoraRank; ++d) {
      const uint16_t* weight_row = w_uv + (int64_t{h} * kKvLoraRank + d) * kVHeadDim;
      for (int c = 0; c < kVHeadDim; ++c) v[c] += head_latent[d] * bf16_to_double(weight_row[c]);
    }
    for (int c = 0; c < kVHeadDim; ++c) {
      const double gate_logit = bf16_to_double(gate[h * kVHeadDim + c]);
      out_head[c] = bf16_from_double(v[c] / (1.0 + std::exp(-gate_logit)));
    }
  });
}

}  // namespace mla::ref
