// The whole layer of the reference: run_layer composes the stage functions, writes exactly this
// step's cache rows, zeroes empty and padded rows, is split-invariant and validates before writing.
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

using testing::HostLayer;
using testing::HostStep;
using testing::random_layer;
using testing::random_step;

// Lengths 2 and 70 (q = 2 rows each see the cache), 1 < q (row 0 sees nothing), 0 (empty), and one
// padded request beyond the block table.
const std::vector<int32_t> kLengths = {2, 70, 1, 0};
constexpr int kPaddingRequests = 1;
constexpr int kQ = 2;
constexpr int kHeads = 8;

TEST(RefLayer, RunLayerComposesTheStagesAndWritesTheCache) {
  std::mt19937_64 rng(400);
  const HostLayer layer = random_layer(rng, kHeads);
  HostStep s = random_step(rng, kHeads, kQ, kLengths, kPaddingRequests);
  // Engines leave garbage in padded rows and may in the rows of empty requests: their outputs must
  // still be exactly zero.
  for (int64_t r = 4 * kQ; r < s.rows; ++r) std::fill_n(s.projected.begin() + r * s.pitch, s.pitch, testing::kBf16NaN);
  for (int64_t r = 3 * kQ; r < 4 * kQ; ++r) {
    std::fill_n(s.projected.begin() + r * s.pitch + kProjectedGateOffset, kHeads * kVHeadDim, testing::kBf16NaN);
  }
  const HostStep before = s;
  LayerTrace trace;
  run_layer(layer.weights, layer.dims, s.view(), {}, &trace);

  // Query stage: the same bytes as the stage run alone on the step as it was, and the same cache.
  HostStep alone = before;
  std::vector<uint8_t> query(s.rows * kHeads * kKeyDim);
  query_stage(layer.weights, layer.dims, alone.view(), query.data());
  EXPECT_EQ(trace.query, query);
  EXPECT_EQ(s.cache, alone.cache);
  // ... which differs from the old cache exactly in the slots' rows, holding cache_row of the row.
  std::vector<uint8_t> expected_cache = before.cache;
  int written = 0;
  for (int64_t r = 0; r < s.rows; ++r) {
    if (s.slots[r] < 0) continue;
    const Weights& w = layer.weights;
    const NormedRow normed = rms_norms(s.projected_row(r), w.q_a_norm.as<const uint16_t>(),
                                       w.kv_a_norm.as<const uint16_t>(), layer.dims.rms_eps);
    cache_row(normed.kv_normed, s.projected_row(r), w.k_scale,
              expected_cache.data() + (s.slots[r] / kPageSize) * s.page_stride + (s.slots[r] % kPageSize) * kKeyDim);
    ++written;
  }
  EXPECT_EQ(written, 2 + 2 + 1);
  EXPECT_EQ(s.cache, expected_cache);

  // Core over the written cache, then the value stage on the bf16 latent.
  const CoreResult core = attention_core(testing::core_inputs(s, query, kHeads));
  testing::expect_same_core(core, trace.core);
  std::vector<bool> zero_rows(s.rows, false);
  for (int64_t r = 3 * kQ; r < s.rows; ++r) zero_rows[r] = true;  // length 0, padding
  std::vector<uint16_t> out(s.out.size());
  value_stage(round_latent(core), layer.weights, layer.dims, s.view().projected, zero_rows, out.data());
  EXPECT_EQ(s.out, out);

  // Finite everywhere, exactly zero where nothing is visible, and not trivially zero elsewhere.
  const int64_t width = kHeads * kVHeadDim;
  for (int64_t r = 0; r < s.rows; ++r) {
    int64_t nonzero = 0;
    for (int64_t c = 0; c < width; ++c) {
      const double v = bf16_to_double(s.out[r * width + c]);
      ASSERT_TRUE(std::isfinite(v)) << "row " << r << " col " << c;
      nonzero += v != 0;
    }
    const bool sees_nothing = zero_rows[r] || r == 2 * kQ;  // request 2 row 0: length 1 < q
    EXPECT_EQ(nonzero == 0, sees_nothing) << "row " << r;
  }
  for (int64_t r = 3 * kQ; r < s.rows; ++r) {
    for (int64_t c = 0; c < width; ++c) ASSERT_EQ(s.out[r * width + c], 0x0000) << "row " << r;
    for (int h = 0; h < kHeads; ++h) EXPECT_EQ(trace.core.lse[r * kHeads + h], -INFINITY) << "row " << r;
  }
}

TEST(RefLayer, RunLayerLseAndLatentAreSane) {
  // At realistic scales the logits are O(1): the LSE of n visible tokens is near ln n, and every
  // latent element lies within the cache's dequantized range.
  std::mt19937_64 rng(401);
  const HostLayer layer = random_layer(rng, kHeads);
  HostStep s = random_step(rng, kHeads, kQ, kLengths, kPaddingRequests);
  LayerTrace trace;
  run_layer(layer.weights, layer.dims, s.view(), {}, &trace);
  for (int h = 0; h < kHeads; ++h) {
    const double lse = trace.core.lse[(1 * kQ + 1) * kHeads + h];  // request 1, row 1: 70 tokens
    EXPECT_GT(lse, std::log(70.0) - 2) << h;
    EXPECT_LT(lse, std::log(70.0) + 2) << h;
  }
  for (double v : trace.core.latent) ASSERT_LE(std::fabs(v), 448.0 * layer.weights.k_scale);
}

TEST(RefLayer, SplitCountsGiveTheSameOutput) {
  // The latent agrees to ~1e-16 across split counts; its bf16 rounding (and then the output's) can
  // only flip at a boundary, by one ulp.
  std::mt19937_64 rng(402);
  const HostLayer layer = random_layer(rng, kHeads);
  const HostStep base = random_step(rng, kHeads, kQ, {0, 1, 63, 64, 65, 200});
  HostStep one = base;
  run_layer(layer.weights, layer.dims, one.view());
  for (int splits : {2, 3, 7, 16}) {
    HostStep split = base;
    run_layer(layer.weights, layer.dims, split.view(), {.num_splits = splits});
    int worst = 0;
    for (size_t e = 0; e < one.out.size(); ++e) worst = std::max(worst, testing::bf16_ulp_distance(one.out[e], split.out[e]));
    EXPECT_LE(worst, 1) << splits << " splits";
    EXPECT_EQ(one.cache, split.cache);
  }
}

TEST(RefLayer, RunLayerValidatesBeforeWriting) {
  std::mt19937_64 rng(403);
  const HostLayer layer = random_layer(rng, 2);
  HostStep s = random_step(rng, 2, 1, {10, 70});
  s.block_table[1 * s.max_pages + 1] = static_cast<int32_t>(s.num_pages);  // page out of range
  const HostStep before = s;
  EXPECT_THROW(run_layer(layer.weights, layer.dims, s.view()), Error);
  EXPECT_EQ(s.cache, before.cache);
  EXPECT_EQ(s.out, before.out);
  s.block_table = before.block_table;
  EXPECT_THROW(run_layer(layer.weights, layer.dims, s.view(), {.num_splits = 0}), Error);
  EXPECT_EQ(s.cache, before.cache);
}

TEST(RefLayer, RunLayerRejectsTotalsWithoutDcp) {
  std::mt19937_64 rng(404);
  const HostLayer layer = random_layer(rng, 1);
  HostStep s = random_step(rng, 1, 1, {10});
  s.totals = {10};
  EXPECT_THROW(run_layer(layer.weights, layer.dims, s.view()), Error);
}

}  // namespace
}  // namespace mla::ref
