// Value stage of the reference: hand-computed W_UV products and sigmoid gates, the gate's columns
// per head, the projected pitch, and exactly-zero rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "mla/error.h"
#include "reference.h"
#include "reference_test_util.h"

namespace mla::ref {
namespace {

// A value-stage case of `rows` rows and `heads` heads: zero W_UV, projected padded past its width
// with NaN (a read beyond the gate columns would show).
struct ValueCase {
  int heads;
  int64_t rows;
  int64_t pitch;
  std::vector<uint16_t> w_uv;
  std::vector<uint16_t> projected;
  std::vector<double> latent;
  std::vector<uint16_t> out;
  Weights weights;
  LayerDims dims;

  ValueCase(int num_heads, int64_t num_rows)
      : heads(num_heads), rows(num_rows), pitch(projected_width(num_heads) + 8),
        w_uv(int64_t{num_heads} * kKvLoraRank * kVHeadDim, 0), projected(num_rows * pitch, testing::kBf16NaN),
        latent(num_rows * num_heads * kKvLoraRank, 0.0), out(num_rows * num_heads * kVHeadDim, testing::kBf16NaN) {
    for (int64_t r = 0; r < rows; ++r) {
      std::fill_n(projected.begin() + r * pitch + kProjectedGateOffset, num_heads * kVHeadDim, 0);
    }
    weights.w_uv = make_view(w_uv.data(), DType::kBF16, Memory::kHost, {num_heads, kKvLoraRank, kVHeadDim});
    dims.num_heads = num_heads;
  }
  void set_w_uv(int h, int d, int c, double v) { w_uv[(int64_t{h} * kKvLoraRank + d) * kVHeadDim + c] = bf16_from_double(v); }
  void set_gate(int64_t r, int h, int c, double v) {
    projected[r * pitch + kProjectedGateOffset + h * kVHeadDim + c] = bf16_from_double(v);
  }
  double& latent_at(int64_t r, int h, int d) { return latent[(r * heads + h) * kKvLoraRank + d]; }
  void run(const std::vector<bool>& zero_rows) {
    const TensorView view = make_strided_view(projected.data(), DType::kBF16, Memory::kHost,
                                              {rows, projected_width(heads)}, {pitch, 1});
    value_stage(latent, weights, dims, view, zero_rows, out.data());
  }
  double out_at(int64_t r, int h, int c) const { return bf16_to_double(out[(r * heads + h) * kVHeadDim + c]); }
};

TEST(RefValue, HandComputedSigmoidGate) {
  // latent[0] = 2, W_UV[0][0][c] = 0.5: v = 1 for every column; the gate picks sigmoid(0) = 0.5,
  // sigmoid(2) = 0.880797 -> bf16 0.87890625 (225 / 256), sigmoid(-2) = 0.119203 -> 0.119140625 (244 / 2048).
  ValueCase v(1, 1);
  v.latent_at(0, 0, 0) = 2.0;
  v.latent_at(0, 0, 1) = 0.0;
  for (int c = 0; c < kVHeadDim; ++c) {
    v.set_w_uv(0, 0, c, 0.5);
    v.set_w_uv(0, 1, c, 7.0);  // multiplied by latent[1] = 0
    v.set_gate(0, 0, c, c % 3 == 0 ? 0.0 : (c % 3 == 1 ? 2.0 : -2.0));
  }
  v.run({false});
  for (int c = 0; c < kVHeadDim; ++c) {
    EXPECT_EQ(v.out_at(0, 0, c), c % 3 == 0 ? 0.5 : (c % 3 == 1 ? 0.87890625 : 0.119140625)) << c;
  }
}

TEST(RefValue, LatentTimesWuvSumsOverTheLatent) {
  // v[c] = sum_d latent[d] * W_UV[d][c] with latent[d] = 1 for d < 4 and W_UV[d][c] = d + 1: 10,
  // gate 0 halves it: 5. Column c = 1 also reads latent[511] = -0.5 * W_UV[511][1] = 4: 10 - 2 = 8 -> 4.
  ValueCase v(1, 1);
  for (int d = 0; d < 4; ++d) {
    v.latent_at(0, 0, d) = 1.0;
    for (int c = 0; c < kVHeadDim; ++c) v.set_w_uv(0, d, c, d + 1.0);
  }
  v.latent_at(0, 0, 511) = -0.5;
  v.set_w_uv(0, 511, 1, 4.0);
  v.run({false});
  EXPECT_EQ(v.out_at(0, 0, 0), 5.0);
  EXPECT_EQ(v.out_at(0, 0, 1), 4.0);
  EXPECT_EQ(v.out_at(0, 0, 127), 5.0);
}

TEST(RefValue, EachHeadUsesItsWeightsAndGateColumns) {
  // Head 0: v = 1, gate 0 -> 0.5. Head 1: v = 2, gate 2 -> bf16(1.7615942) = 1.7578125.
  ValueCase v(2, 2);
  for (int64_t r = 0; r < 2; ++r) {
    v.latent_at(r, 0, 0) = 1.0;
    v.latent_at(r, 1, 0) = 1.0;
    for (int c = 0; c < kVHeadDim; ++c) v.set_gate(r, 1, c, 2.0);
  }
  for (int c = 0; c < kVHeadDim; ++c) v.set_w_uv(0, 0, c, 1.0), v.set_w_uv(1, 0, c, 2.0);
  v.run({false, false});
  for (int64_t r = 0; r < 2; ++r) {
    for (int c = 0; c < kVHeadDim; ++c) {
      EXPECT_EQ(v.out_at(r, 0, c), 0.5) << r << " " << c;
      EXPECT_EQ(v.out_at(r, 1, c), 1.7578125) << r << " " << c;
    }
  }
}

TEST(RefValue, ZeroRowsAreExactlyZeroWhateverTheirInputs) {
  ValueCase v(2, 3);
  for (int h = 0; h < 2; ++h) {
    for (int c = 0; c < kVHeadDim; ++c) v.set_w_uv(h, 0, c, 1.0);
    for (int64_t r = 0; r < 3; ++r) v.latent_at(r, h, 0) = 3.0;
  }
  for (int c = 0; c < 2 * kVHeadDim; ++c) v.projected[1 * v.pitch + kProjectedGateOffset + c] = testing::kBf16NaN;
  v.latent_at(1, 0, 5) = std::nan("");
  v.run({false, true, false});
  for (int c = 0; c < 2 * kVHeadDim; ++c) {
    EXPECT_EQ(v.out[1 * 2 * kVHeadDim + c], 0x0000) << c;  // +0 exactly, not NaN, not -0
    EXPECT_EQ(v.out_at(0, c / kVHeadDim, c % kVHeadDim), 1.5) << c;
    EXPECT_EQ(v.out_at(2, c / kVHeadDim, c % kVHeadDim), 1.5) << c;
  }
}

TEST(RefValue, RejectsMismatchedSizes) {
  ValueCase v(1, 2);
  EXPECT_THROW(v.run({false}), Error);  // one flag for two rows
  v.latent.resize(kKvLoraRank);
  EXPECT_THROW(v.run({false, false}), Error);
}

}  // namespace
}  // namespace mla::ref
