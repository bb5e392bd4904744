// Query stage of the reference (DESIGN.md §4): RMSNorms, q_b_proj, W_UK absorption, FP8 quantization
// of the query and of this step's cache rows.
#include <cmath>
#include <cstdint>
#include <vector>

#include "host/validate.h"
#include "internal.h"
#include "parallel_for.h"
#include "reference.h"

namespace mla::ref {
namespace {

// bf16(x * rsqrt(mean(x^2) + eps) * weight) over `width` elements.
std::vector<double> rms_norm(const uint16_t* x, const uint16_t* weight, int width, double eps) {
  double sum_squares = 0;
  for (int c = 0; c < width; ++c) sum_squares += bf16_to_double(x[c]) * bf16_to_double(x[c]);
  const double inv_rms = 1.0 / std::sqrt(sum_squares / width + eps);
  std::vector<double> normed(width);
  for (int c = 0; c < width; ++c) {
    normed[c] = bf16_round(bf16_to_double(x[c]) * inv_rms * bf16_to_double(weight[c]));
  }
  return normed;
}

}  // namespace

NormedRow rms_norms(const uint16_t* projected_row, const uint16_t* q_a_norm, const uint16_t* kv_a_norm,
                    double eps) {
  return {rms_norm(projected_row + kProjectedQaOffset, q_a_norm, kQLoraRank, eps),
          rms_norm(projected_row + kProjectedKvaOffset, kv_a_norm, kKvLoraRank, eps)};
}

std::vector<double> q_b_projection(const std::vector<double>& q_normed, const uint16_t* q_b_proj,
                                   int num_heads) {
  const int64_t out_rows = int64_t{num_heads} * kQkHeadDim;
  std::vector<double> q(out_rows);
  for (int64_t row = 0; row < out_rows; ++row) {
    const uint16_t* weight_row = q_b_proj + row * kQLoraRank;
    double sum = 0;
    for (int k = 0; k < kQLoraRank; ++k) sum += bf16_to_double(weight_row[k]) * q_normed[k];
    q[row] = bf16_round(sum);
  }
  return q;
}

std::vector<double> absorb_w_uk(const std::vector<double>& q, const uint16_t* w_uk_t, int num_heads) {
  std::vector<double> q_latent(int64_t{num_heads} * kKvLoraRank, 0.0);
  for (int h = 0; h < num_heads; ++h) {
    double* out = q_latent.data() + int64_t{h} * kKvLoraRank;
    for (int d = 0; d < kNopeDim; ++d) {
      const double q_nope = q[int64_t{h} * kQkHeadDim + d];
      const uint16_t* weight_row = w_uk_t + (int64_t{h} * kNopeDim + d) * kKvLoraRank;
      for (int c = 0; c < kKvLoraRank; ++c) out[c] += q_nope * bf16_to_double(weight_row[c]);
    }
  }
  return q_latent;
}

void quantize_query(const std::vector<double>& q_latent, const std::vector<double>& q, double q_scale,
                    int num_heads, uint8_t* query_out) {
  for (int h = 0; h < num_heads; ++h) {
    uint8_t* out = query_out + int64_t{h} * kKeyDim;
    for (int c = 0; c < kKvLoraRank; ++c) {
      out[c] = e4m3_from_double(q_latent[int64_t{h} * kKvLoraRank + c] / q_scale);
    }
    for (int c = 0; c < kRopeDim; ++c) {
      out[kKvLoraRank + c] = e4m3_from_double(q[int64_t{h} * kQkHeadDim + kNopeDim + c] / q_scale);
    }
  }
}

void cache_row(const std::vector<double>& kv_normed, const uint16_t* projected_row, double k_scale,
               uint8_t* row_out) {
  for (int c = 0; c < kKvLoraRank; ++c) row_out[c] = e4m3_from_double(kv_normed[c] / k_scale);
  for (int c = 0; c < kRopeDim; ++c) {
    row_out[kKvLoraRank + c] = e4m3_from_double(bf16_to_double(projected_row[kProjectedKpeOffset + c]) / k_scale);
  }
}

void internal::query_stage_unchecked(const Weights& weights, const LayerDims& dims, const StepInputs& step,
                                     uint8_t* query_out) {
  const int num_heads = dims.num_heads;
  const int64_t rows = step.projected.shape[0];
  auto projected_row = [&](int64_t r) { return step.projected.as<const uint16_t>() + r * step.projected.stride[0]; };
  std::vector<NormedRow> normed(rows);
  parallel_for(rows, kQLoraRank + kKvLoraRank, [&](int64_t r) {
    normed[r] = rms_norms(projected_row(r), weights.q_a_norm.as<const uint16_t>(),
                          weights.kv_a_norm.as<const uint16_t>(), dims.rms_eps);
  });
  // Each (row, head) on its own: the head's q_b_proj rows, its W_UK slice, its 576 query bytes.
  parallel_for(rows * num_heads, kQkHeadDim * kQLoraRank + kNopeDim * kKvLoraRank, [&](int64_t row_head) {
    const int64_t r = row_head / num_heads;
    const int64_t h = row_head % num_heads;
    const std::vector<double> q = q_b_projection(
        normed[r].q_normed, weights.q_b_proj.as<const uint16_t>() + h * kQkHeadDim * kQLoraRank, 1);
    const std::vector<double> q_latent =
        absorb_w_uk(q, weights.w_uk_t.as<const uint16_t>() + h * kNopeDim * kKvLoraRank, 1);
    quantize_query(q_latent, q, weights.q_scale, 1, query_out + row_head * kKeyDim);
  });
  // The cache rows in row order (a slot named twice keeps the last row's bytes, as before).
  std::vector<uint8_t> row_bytes(kKeyDim);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot = internal::read_index(step.slots, r);
    if (slot < 0) continue;
    cache_row(normed[r].kv_normed, projected_row(r), weights.k_scale, row_bytes.data());
    for (int d = 0; d < kKeyDim; ++d) {
      *internal::cache_byte(step.cache, slot / kPageSize, slot % kPageSize, d) = row_bytes[d];
    }
  }
}

void query_stage(const Weights& weights, const LayerDims& dims, const StepInputs& step, uint8_t* query_out) {
  query_stage(weights, dims, step, DcpLayout{}, query_out);
}

void query_stage(const Weights& weights, const LayerDims& dims, const StepInputs& step, const DcpLayout& dcp,
                 uint8_t* query_out) {
  detail::validate_weights(weights, dims, Memory::kHost, 0);
  detail::StepContract contract;  // any pitch, any q, no context bound: the reference runs every shape
  contract.num_heads = dims.num_heads;
  contract.dcp = dcp;
  contract.memory = Memory::kHost;
  contract.check_values = true;
  detail::validate_step(step, contract);
  internal::query_stage_unchecked(weights, dims, step, query_out);
}

}  // namespace mla::ref
