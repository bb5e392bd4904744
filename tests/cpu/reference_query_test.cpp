// Query stage of the reference: hand-worked norms, projections, absorption and quantization, and the
// whole stage's cache writes (slot and slot -1) through a padded page stride.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "mla/error.h"
#include "reference.h"
#include "reference_test_util.h"

namespace mla::ref {
namespace {

using testing::HostStep;
using testing::random_layer;
using testing::random_step;

std::vector<uint16_t> constant_bf16(int64_t count, double value) {
  return std::vector<uint16_t>(count, bf16_from_double(value));
}

TEST(RefQuery, RmsNormOfConstantRow) {
  std::vector<uint16_t> row(kProjectedGateOffset, bf16_from_double(1.0));
  for (int c = 0; c < kKvLoraRank; ++c) row[kProjectedKvaOffset + c] = bf16_from_double(-2.0);
  const std::vector<uint16_t> q_a_norm = constant_bf16(kQLoraRank, 1.5);
  const std::vector<uint16_t> kv_a_norm = constant_bf16(kKvLoraRank, 0.5);
  // eps = 3: q_a rms is sqrt(1 + 3) = 2, so q_a * 1.5 / 2 = 0.75; kv_a: -2 / sqrt(4 + 3) * 0.5 =
  // -0.377964 = -193.52 * 2^-9, whose bf16 is -194 * 2^-9 = -0.37890625.
  const NormedRow normed = rms_norms(row.data(), q_a_norm.data(), kv_a_norm.data(), 3.0);
  ASSERT_EQ(normed.q_normed.size(), size_t{kQLoraRank});
  ASSERT_EQ(normed.kv_normed.size(), size_t{kKvLoraRank});
  for (double v : normed.q_normed) EXPECT_EQ(v, 0.75);
  for (double v : normed.kv_normed) EXPECT_EQ(v, -0.37890625);
}

TEST(RefQuery, RmsNormRoundsEachElementToBf16) {
  // Alternating 1, 3: mean square 5. 1/sqrt(5) = 0.44721 -> bf16 0.447265625 (229 / 512);
  // 3/sqrt(5) = 1.34164 -> bf16 1.34375 (172 / 128). eps = 1e-5 moves neither across a boundary.
  std::vector<uint16_t> row(kProjectedGateOffset);
  for (int c = 0; c < kProjectedKpeOffset; ++c) row[c] = bf16_from_double(c % 2 ? 3.0 : 1.0);
  const std::vector<uint16_t> ones_q = constant_bf16(kQLoraRank, 1.0);
  const std::vector<uint16_t> ones_kv = constant_bf16(kKvLoraRank, 1.0);
  const NormedRow normed = rms_norms(row.data(), ones_q.data(), ones_kv.data(), 1e-5);
  for (int c = 0; c < kQLoraRank; ++c) EXPECT_EQ(normed.q_normed[c], c % 2 ? 1.34375 : 0.447265625) << c;
  for (int c = 0; c < kKvLoraRank; ++c) EXPECT_EQ(normed.kv_normed[c], c % 2 ? 1.34375 : 0.447265625) << c;
}

TEST(RefQuery, RmsNormIgnoresKpeAndGate) {
  std::vector<uint16_t> row(kProjectedGateOffset, bf16_from_double(2.0));
  const std::vector<uint16_t> ones_q = constant_bf16(kQLoraRank, 1.0);
  const std::vector<uint16_t> ones_kv = constant_bf16(kKvLoraRank, 1.0);
  const NormedRow clean = rms_norms(row.data(), ones_q.data(), ones_kv.data(), 1e-5);
  for (int c = kProjectedKpeOffset; c < kProjectedGateOffset; ++c) row[c] = testing::kBf16NaN;
  const NormedRow with_nan_kpe = rms_norms(row.data(), ones_q.data(), ones_kv.data(), 1e-5);
  EXPECT_EQ(clean.q_normed, with_nan_kpe.q_normed);
  EXPECT_EQ(clean.kv_normed, with_nan_kpe.kv_normed);
}

TEST(RefQuery, QbProjectionWithPermutationRows) {
  constexpr int kHeads = 2;
  std::vector<double> q_normed(kQLoraRank);
  for (int k = 0; k < kQLoraRank; ++k) q_normed[k] = (k % 16) * 0.25 - 2.0;
  // Row r of q_b_proj picks column (7 r) mod 1536 with weight 2: q[r] = 2 * qn[7 r mod 1536].
  std::vector<uint16_t> q_b_proj(int64_t{kHeads} * kQkHeadDim * kQLoraRank, 0);
  for (int r = 0; r < kHeads * kQkHeadDim; ++r) q_b_proj[int64_t{r} * kQLoraRank + (7 * r) % kQLoraRank] = 0x4000;
  const std::vector<double> q = q_b_projection(q_normed, q_b_proj.data(), kHeads);
  ASSERT_EQ(q.size(), size_t{kHeads * kQkHeadDim});
  for (int r = 0; r < kHeads * kQkHeadDim; ++r) EXPECT_EQ(q[r], 2 * q_normed[(7 * r) % kQLoraRank]) << r;
}

TEST(RefQuery, QbProjectionRoundsToBf16) {
  std::vector<double> q_normed(kQLoraRank, 0.0);
  q_normed[0] = 1.0;
  q_normed[1] = 1.0;
  std::vector<uint16_t> q_b_proj(int64_t{kQkHeadDim} * kQLoraRank, 0);
  auto set = [&](int row, int col, double v) { q_b_proj[int64_t{row} * kQLoraRank + col] = bf16_from_double(v); };
  set(0, 0, 1.0), set(0, 1, std::ldexp(1.0, -9));      // 1 + 2^-9: a quarter ulp, down to 1
  set(1, 0, 1.0), set(1, 1, 3 * std::ldexp(1.0, -9));  // 1 + 3 * 2^-9: three quarters, up to 1 + 2^-7
  set(2, 0, 1.0), set(2, 1, std::ldexp(1.0, -8));      // 1 + 2^-8: a tie, to even 1
  const std::vector<double> q = q_b_projection(q_normed, q_b_proj.data(), 1);
  EXPECT_EQ(q[0], 1.0);
  EXPECT_EQ(q[1], 1.0 + std::ldexp(1.0, -7));
  EXPECT_EQ(q[2], 1.0);
  EXPECT_EQ(q[3], 0.0);
}

TEST(RefQuery, AbsorptionIsExactPerHeadAndIgnoresRope) {
  constexpr int kHeads = 2;
  const double a = 1 + std::ldexp(1.0, -7);  // bf16; a * a = 1 + 2^-6 + 2^-14 is not
  std::vector<double> q(kHeads * kQkHeadDim, 0.0);
  for (int h = 0; h < kHeads; ++h) {
    for (int d = 0; d < kNopeDim; ++d) q[h * kQkHeadDim + d] = a;
    for (int d = kNopeDim; d < kQkHeadDim; ++d) q[h * kQkHeadDim + d] = 99.0;  // rope: not absorbed
  }
  // W_UK_T[h][d][c] = (h + 1) * a where d == c mod 128, so ql[h][c] = (h + 1) * a * a.
  std::vector<uint16_t> w_uk_t(int64_t{kHeads} * kNopeDim * kKvLoraRank, 0);
  for (int h = 0; h < kHeads; ++h) {
    for (int c = 0; c < kKvLoraRank; ++c) {
      w_uk_t[(int64_t{h} * kNopeDim + c % kNopeDim) * kKvLoraRank + c] = bf16_from_double((h + 1) * a);
    }
  }
  const std::vector<double> q_latent = absorb_w_uk(q, w_uk_t.data(), kHeads);
  ASSERT_EQ(q_latent.size(), size_t{kHeads * kKvLoraRank});
  for (int h = 0; h < kHeads; ++h) {
    for (int c = 0; c < kKvLoraRank; ++c) EXPECT_EQ(q_latent[h * kKvLoraRank + c], (h + 1) * a * a) << h << " " << c;
  }
}

TEST(RefQuery, QuantizeQueryKnownValues) {
  constexpr double kScale = 0.5;
  std::vector<double> q_latent(kKvLoraRank, 0.0);
  std::vector<double> q(kQkHeadDim, std::nan(""));  // the nope part is only read through q_latent
  q_latent[0] = 0.5;           // 1.0 -> 0x38
  q_latent[1] = 1000.0;        // 2000 -> saturates to 448 (0x7e)
  q_latent[2] = -0.53125;      // -1.0625: the tie between 1 and 1.125 goes to even 1 -> 0xb8
  q_latent[3] = 0.0;
  for (int c = 0; c < kRopeDim; ++c) q[kNopeDim + c] = 0.0;
  q[kNopeDim] = 1.5;           // 3.0 = 1.5 * 2^1 -> exponent field 8, mantissa 4: 0x44
  q[kQkHeadDim - 1] = -224.0;  // -448 -> 0xfe
  std::vector<uint8_t> query(kKeyDim, 0x55);
  quantize_query(q_latent, q, kScale, 1, query.data());
  EXPECT_EQ(query[0], 0x38);
  EXPECT_EQ(query[1], 0x7e);
  EXPECT_EQ(query[2], 0xb8);
  EXPECT_EQ(query[3], 0x00);
  EXPECT_EQ(query[kKvLoraRank], 0x44);
  EXPECT_EQ(query[kKeyDim - 1], 0xfe);
  EXPECT_EQ(query[kKvLoraRank + 1], 0x00);
}

TEST(RefQuery, CacheRowQuantizesKvnAndRawKpe) {
  constexpr double kScale = 0.25;
  std::vector<double> kv_normed(kKvLoraRank, 0.0);
  kv_normed[0] = 0.25;     // 1.0 -> 0x38
  kv_normed[511] = -0.75;  // -3.0 -> 0xc4
  std::vector<uint16_t> row(kProjectedGateOffset, bf16_from_double(0.0));
  for (int c = 0; c < kProjectedKpeOffset; ++c) row[c] = testing::kBf16NaN;  // q_a, kv_a: not read here
  row[kProjectedKpeOffset] = bf16_from_double(0.5);         // 2.0 -> 0x40 (k_pe is not normed)
  row[kProjectedGateOffset - 1] = bf16_from_double(200.0);  // 800 -> saturates: 0x7e
  std::vector<uint8_t> out(kKeyDim, 0x55);
  cache_row(kv_normed, row.data(), kScale, out.data());
  EXPECT_EQ(out[0], 0x38);
  EXPECT_EQ(out[511], 0xc4);
  EXPECT_EQ(out[1], 0x00);
  EXPECT_EQ(out[kKvLoraRank], 0x40);
  EXPECT_EQ(out[kKeyDim - 1], 0x7e);
}

// Expected query and cache row of one projected row, composed from the stage functions.
struct RowExpectation {
  std::vector<uint8_t> query;
  std::vector<uint8_t> cache_row;
};
RowExpectation compose(const testing::HostLayer& layer, const uint16_t* projected_row) {
  const Weights& w = layer.weights;
  const NormedRow normed = rms_norms(projected_row, w.q_a_norm.as<const uint16_t>(), w.kv_a_norm.as<const uint16_t>(),
                                     layer.dims.rms_eps);
  const std::vector<double> q = q_b_projection(normed.q_normed, w.q_b_proj.as<const uint16_t>(), layer.num_heads());
  const std::vector<double> q_latent = absorb_w_uk(q, w.w_uk_t.as<const uint16_t>(), layer.num_heads());
  RowExpectation e{std::vector<uint8_t>(int64_t{layer.num_heads()} * kKeyDim), std::vector<uint8_t>(kKeyDim)};
  quantize_query(q_latent, q, w.q_scale, layer.num_heads(), e.query.data());
  cache_row(normed.kv_normed, projected_row, w.k_scale, e.cache_row.data());
  return e;
}

TEST(RefQuery, QueryStageWritesItsSlotsAndNothingElse) {
  std::mt19937_64 rng(21);
  const testing::HostLayer layer = random_layer(rng, 2);
  HostStep s = random_step(rng, 2, 1, {70, 5, 1});
  s.slots[1] = -1;  // request 1's token is not written
  const std::vector<uint8_t> before = s.cache;
  std::vector<uint8_t> query(s.rows * 2 * kKeyDim);
  query_stage(layer.weights, layer.dims, s.view(), query.data());

  std::vector<uint8_t> expected_cache = before;
  for (int64_t r = 0; r < s.rows; ++r) {
    const RowExpectation e = compose(layer, s.projected_row(r));
    EXPECT_EQ(std::vector<uint8_t>(query.begin() + r * 2 * kKeyDim, query.begin() + (r + 1) * 2 * kKeyDim), e.query)
        << "row " << r;
    if (s.slots[r] < 0) continue;
    std::copy(e.cache_row.begin(), e.cache_row.end(),
              expected_cache.begin() + (s.slots[r] / kPageSize) * s.page_stride + (s.slots[r] % kPageSize) * kKeyDim);
  }
  EXPECT_EQ(s.cache, expected_cache);  // every byte, the page padding included
  EXPECT_NE(s.cache, before);
}

TEST(RefQuery, QueryStageValidatesBeforeWriting) {
  std::mt19937_64 rng(22);
  const testing::HostLayer layer = random_layer(rng, 2);
  HostStep s = random_step(rng, 2, 1, {3, 4});
  s.slots[1] = s.num_pages * kPageSize;  // one past the last slot
  const std::vector<uint8_t> before = s.cache;
  std::vector<uint8_t> query(s.rows * 2 * kKeyDim, 0x55);
  EXPECT_THROW(query_stage(layer.weights, layer.dims, s.view(), query.data()), Error);
  EXPECT_EQ(s.cache, before);
  EXPECT_EQ(query, std::vector<uint8_t>(query.size(), 0x55));
}

TEST(RefQuery, QueryStageDcpOverloadChecksTotals) {
  std::mt19937_64 rng(23);
  const testing::HostLayer layer = random_layer(rng, 1);
  HostStep s = random_step(rng, 1, 1, {64});
  s.totals = {128};  // rank 1 of 4 with interleave 64 holds global tokens [64, 128)
  std::vector<uint8_t> query(s.rows * kKeyDim);
  EXPECT_THROW(query_stage(layer.weights, layer.dims, s.view(), query.data()), Error);  // no DCP: no totals
  EXPECT_NO_THROW(query_stage(layer.weights, layer.dims, s.view(), DcpLayout{1, 4, 64}, query.data()));
  EXPECT_THROW(query_stage(layer.weights, layer.dims, s.view(), DcpLayout{1, 4, 1}, query.data()), Error);  // it holds 32
}

}  // namespace
}  // namespace mla::ref
