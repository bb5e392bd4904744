// The GPU DCP tests' inputs (tests/dcp_test_util.h) checked on the CPU: rank steps sharded from one
// synthetic global step of D*H heads, run through mla::ref::run_layer_dcp, give the one-GPU output of
// the global step (within 1 bf16 ulp, as in RefDcp.LayerOnDRanksEqualsOneGpuWithAllHeads) and leave
// every rank's cache equal to its shard of the global cache after the step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dcp_test_util.h"
#include "reference.h"
#include "synthetic.h"

namespace mla {
namespace {

int bf16_ulp_distance(uint16_t a, uint16_t b) {
  auto ordered = [](uint16_t x) { return (x & 0x8000) ? -int(x & 0x7fff) : int(x); };
  return std::abs(ordered(a) - ordered(b));
}

TEST(DcpShard, RankStepsThroughTheReferenceEqualOneGpu) {
  constexpr int kHeads = 2;
  for (int size : {2, 4, 8}) {
    for (int interleave : {1, 64}) {
      SCOPED_TRACE(::testing::Message() << "D=" << size << " I=" << interleave);
      const synth::SyntheticLayer layer = synth::make_layer(size * kHeads, 40 + size + interleave);
      synth::StepSpec spec;
      spec.q = 2;
      spec.lengths = {0, 1, 66, 130};
      spec.padded_requests = 5;
      spec.seed = 50 + size + interleave;
      synth::SyntheticStep global = synth::make_step(layer, spec);
      std::vector<test::RankStep> ranks = test::shard_all(global, size, interleave, kHeads);

      std::vector<test::RankWeights> weights;
      std::vector<Weights> views;
      std::vector<StepInputs> steps;
      for (int k = 0; k < size; ++k) weights.emplace_back(layer, k * kHeads, kHeads);
      for (int k = 0; k < size; ++k) {
        views.push_back(weights[k].host());
        steps.push_back(ranks[k].inputs());
      }
      ref::run_layer_dcp(views, LayerDims{kHeads, 1e-5f}, steps, interleave);
      ref::run_layer(layer.weights(), layer.dims, global.inputs());

      int worst_ulp = 0;
      int64_t nonzero = 0;
      const int64_t global_width = int64_t{size} * kHeads * kVHeadDim;
      for (int k = 0; k < size; ++k) {
        for (int64_t r = 0; r < global.rows; ++r) {
          for (int c = 0; c < kHeads * kVHeadDim; ++c) {
            const uint16_t expected = global.out[r * global_width + int64_t{k} * kHeads * kVHeadDim + c];
            const uint16_t got = ranks[k].out[r * kHeads * kVHeadDim + c];
            worst_ulp = std::max(worst_ulp, bf16_ulp_distance(expected, got));
            nonzero += expected != 0;
          }
        }
        EXPECT_EQ(test::shard_step(global, {k, size, interleave}, kHeads, ranks[k].num_pages).cache, ranks[k].cache)
            << "rank " << k << ": its cache after the step is not its shard of the global cache";
      }
      EXPECT_LE(worst_ulp, 1);
      EXPECT_GT(nonzero, 0);
    }
  }
}

// The GPU tests' "same bytes" expectation, fed the reference's own query bytes and caches, is exactly
// the reference layer on D ranks.
TEST(DcpShard, ReferenceFromBytesReproducesTheLayer) {
  constexpr int kSize = 4, kHeads = 2, kInterleave = 64;
  const synth::SyntheticLayer layer = synth::make_layer(kSize * kHeads, 70);
  synth::StepSpec spec;
  spec.q = 4;
  spec.lengths = {3, 200, 0};
  spec.padded_requests = 4;
  spec.seed = 71;
  const synth::SyntheticStep global = synth::make_step(layer, spec);
  std::vector<test::RankStep> ranks = test::shard_all(global, kSize, kInterleave, kHeads);
  std::vector<test::RankWeights> weights;
  for (int k = 0; k < kSize; ++k) weights.emplace_back(layer, k * kHeads, kHeads);

  // Each rank's query stage on its own copy (its cache writes included), assembled into one mailbox.
  std::vector<test::RankStep> after = ranks;
  const int64_t rows = ranks[0].rows;
  std::vector<uint8_t> mailbox(rows * kSize * kHeads * kKeyDim);
  std::vector<uint8_t> own(rows * kHeads * kKeyDim);
  for (int k = 0; k < kSize; ++k) {
    ref::query_stage(weights[k].host(), LayerDims{kHeads, 1e-5f}, after[k].inputs(), {k, kSize, kInterleave},
                     own.data());
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(own.begin() + r * kHeads * kKeyDim, kHeads * kKeyDim,
                  mailbox.begin() + (r * kSize + k) * kHeads * kKeyDim);
    }
  }
  const std::vector<std::vector<uint16_t>> expected =
      test::reference_from_bytes(weights, after, std::vector<std::vector<uint8_t>>(kSize, mailbox), kInterleave);

  std::vector<Weights> views;
  std::vector<StepInputs> steps;
  for (int k = 0; k < kSize; ++k) {
    views.push_back(weights[k].host());
    steps.push_back(ranks[k].inputs());
  }
  ref::run_layer_dcp(views, LayerDims{kHeads, 1e-5f}, steps, kInterleave);
  for (int k = 0; k < kSize; ++k) {
    EXPECT_EQ(expected[k], ranks[k].out) << "rank " << k;
    EXPECT_EQ(after[k].cache, ranks[k].cache) << "rank " << k;
  }
}

TEST(DcpShard, OwnershipOfTokensAndSlots) {
  const synth::SyntheticLayer layer = synth::make_layer(8, 60);
  synth::StepSpec spec;
  spec.q = 4;
  spec.lengths = {2, 130};
  const synth::SyntheticStep global = synth::make_step(layer, spec);
  const std::vector<test::RankStep> ranks = test::shard_all(global, 4, 1, 2);
  for (int k = 0; k < 4; ++k) {
    // Request 0: positions 0, 1 on ranks 0, 1. Request 1: 130 = 32 * 4 + 2 tokens.
    EXPECT_EQ(ranks[k].lengths, (std::vector<int32_t>{k < 2 ? 1 : 0, k < 2 ? 33 : 32})) << "rank " << k;
    EXPECT_EQ(ranks[k].totals, (std::vector<int32_t>{2, 130}));
    // Request 1's new positions 126..129 are owned by ranks 2, 3, 0, 1: one slot each.
    EXPECT_EQ(std::count_if(ranks[k].slots.begin() + 4, ranks[k].slots.end(), [](int64_t s) { return s >= 0; }), 1);
    // Request 0's rows see positions -2, -1 (no slot), then 0 and 1.
    EXPECT_EQ(ranks[k].slots[2] >= 0, k == 0);
    EXPECT_EQ(ranks[k].slots[3] >= 0, k == 1);
    EXPECT_EQ(ranks[k].slots[0], -1);
  }
}

}  // namespace
}  // namespace mla
