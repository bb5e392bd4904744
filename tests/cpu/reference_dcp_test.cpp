// DCP in the reference: position ownership, a global cache sharded by ownership and merged by LSE
// equals the single-GPU core, and the whole layer on D simulated ranks equals one GPU with D*H heads.
#include <gtest/gtest.h>

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
using testing::expect_same_core;
using testing::random_e4m3;
using testing::random_layer;
using testing::random_step;
using testing::shard_step;

TEST(RefDcp, PositionOwnershipIsConsistent) {
  for (int size : {1, 2, 4, 8}) {
    for (int interleave : {1, 3, 64}) {
      for (int64_t g = 0; g < 1200; ++g) {
        const DcpLayout owner{dcp_owner(g, {0, size, interleave}), size, interleave};
        ASSERT_EQ(owner.rank, (g / interleave) % size);
        ASSERT_EQ(dcp_global_position(dcp_local_index(g, owner), owner), g) << size << " " << interleave;
      }
      for (int64_t total = 0; total < 700; total += 7) {
        int64_t sum = 0;
        for (int k = 0; k < size; ++k) {
          const DcpLayout dcp{k, size, interleave};
          int64_t owned = 0;
          for (int64_t g = 0; g < total; ++g) owned += dcp_owner(g, dcp) == k;
          ASSERT_EQ(dcp_local_length(total, dcp), owned) << size << " " << interleave << " " << total << " " << k;
          sum += owned;
          // Local tokens are the owned positions in increasing order.
          for (int64_t j = 0; j + 1 < owned; ++j) ASSERT_LT(dcp_global_position(j, dcp), dcp_global_position(j + 1, dcp));
        }
        ASSERT_EQ(sum, total);
      }
    }
  }
}

TEST(RefDcp, ShardedCoreMergedByLseEqualsSingleGpu) {
  constexpr int kHeads = 3;
  for (int size : {2, 4, 8}) {
    for (int interleave : {1, 64}) {
      SCOPED_TRACE("D " + std::to_string(size) + " I " + std::to_string(interleave));
      std::mt19937_64 rng(100 + size * 10 + interleave);
      // Totals include 0 and 1 (most ranks empty) and, at D = 8 and I = 64, a rank with no tokens at all.
      HostStep global = random_step(rng, 1, 2, {0, 1, 5, 64, 65, 130, 300}, /*padding=*/1);
      const std::vector<uint8_t> query = random_e4m3(rng, global.rows * kHeads * kKeyDim);
      const CoreResult single = attention_core(testing::core_inputs(global, query, kHeads));

      std::vector<CoreResult> per_rank;
      bool some_rank_empty = false;
      for (int k = 0; k < size; ++k) {
        const DcpLayout dcp{k, size, interleave};
        HostStep shard = shard_step(global, dcp);
        some_rank_empty |= std::all_of(shard.lengths.begin(), shard.lengths.end(), [](int32_t l) { return l == 0; });
        CoreInputs in = testing::core_inputs(shard, query, kHeads);
        in.dcp = dcp;
        per_rank.push_back(merge_partials(core_partials(in, 1 + k % 3)));  // split counts differ per rank
      }
      EXPECT_EQ(some_rank_empty, size == 8 && interleave == 64);
      expect_same_core(single, dcp_merge(per_rank));
    }
  }
}

TEST(RefDcp, EmptyShardWeighsExactlyZero) {
  std::mt19937_64 rng(7);
  HostStep global = random_step(rng, 1, 1, {40});
  const std::vector<uint8_t> query = random_e4m3(rng, global.rows * kKeyDim);
  const CoreResult single = attention_core(testing::core_inputs(global, query, 1));
  std::vector<CoreResult> per_rank;
  for (int k = 0; k < 2; ++k) {
    HostStep shard = shard_step(global, {k, 2, 64});  // rank 1 holds nothing of 40 tokens
    CoreInputs in = testing::core_inputs(shard, query, 1);
    in.dcp = {k, 2, 64};
    per_rank.push_back(attention_core(in));
  }
  ASSERT_EQ(per_rank[1].lse[0], -std::numeric_limits<double>::infinity());
  const CoreResult merged = dcp_merge(per_rank);
  EXPECT_EQ(merged.lse, single.lse);        // bit for bit: the empty shard adds exp(-inf) = 0
  EXPECT_EQ(merged.latent, single.latent);
}

// The step of rank k of D, cut from a global step of D*H heads: its shard of the cache, the shared
// q_a / kv_a / k_pe columns and its own heads' gate columns.
HostStep rank_step(const HostStep& global, const DcpLayout& dcp, int heads) {
  HostStep s = shard_step(global, dcp);
  s.num_heads = heads;
  s.pitch = projected_width(heads) + testing::kPitchPadding;
  s.projected.assign(s.rows * s.pitch, testing::kBf16NaN);
  for (int64_t r = 0; r < s.rows; ++r) {
    const uint16_t* from = global.projected_row(r);
    std::copy(from, from + kProjectedGateOffset, s.projected.begin() + r * s.pitch);
    const uint16_t* gate = from + kProjectedGateOffset + int64_t{dcp.rank} * heads * kVHeadDim;
    std::copy(gate, gate + heads * kVHeadDim, s.projected.begin() + r * s.pitch + kProjectedGateOffset);
  }
  s.out.assign(s.rows * heads * kVHeadDim, testing::kBf16NaN);
  return s;
}

TEST(RefDcp, LayerOnDRanksEqualsOneGpuWithAllHeads) {
  // Each rank's latent is the LSE merge of D partials instead of one softmax over all tokens: equal
  // up to double rounding (~1e-16 relative). The latent is rounded to bf16 before W_UV, so a merged
  // value within that distance of a bf16 rounding boundary can round the other way; the 1-ulp latent
  // change moves v by ~2^-9 of one term, which can in turn flip the output's bf16 rounding by at
  // most one ulp. Hence: outputs equal to within 1 bf16 ulp (and in practice bit for bit).
  constexpr int kHeads = 2;
  for (int size : {2, 4, 8}) {
    for (int interleave : {1, 64}) {
      SCOPED_TRACE("D " + std::to_string(size) + " I " + std::to_string(interleave));
      std::mt19937_64 rng(200 + size * 10 + interleave);
      const HostLayer layer = random_layer(rng, size * kHeads);
      HostStep global = random_step(rng, size * kHeads, 2, {0, 1, 66, 130}, /*padding=*/1);
      std::vector<HostStep> ranks;
      for (int k = 0; k < size; ++k) ranks.push_back(rank_step(global, {k, size, interleave}, kHeads));

      run_layer(layer.weights, layer.dims, global.view());
      std::vector<HostLayer> rank_layers;
      std::vector<Weights> rank_weights;
      std::vector<StepInputs> rank_views;
      for (int k = 0; k < size; ++k) rank_layers.push_back(layer.heads(k * kHeads, kHeads));
      for (int k = 0; k < size; ++k) {
        rank_weights.push_back(rank_layers[k].weights);
        rank_views.push_back(ranks[k].view());
      }
      run_layer_dcp(rank_weights, rank_layers[0].dims, rank_views, interleave);

      int worst_ulp = 0;
      int64_t nonzero = 0;
      for (int k = 0; k < size; ++k) {
        for (int64_t r = 0; r < global.rows; ++r) {
          for (int c = 0; c < kHeads * kVHeadDim; ++c) {
            const uint16_t expected = global.out[r * size * kHeads * kVHeadDim + k * kHeads * kVHeadDim + c];
            const uint16_t got = ranks[k].out[r * kHeads * kVHeadDim + c];
            worst_ulp = std::max(worst_ulp, testing::bf16_ulp_distance(expected, got));
            nonzero += expected != 0;
          }
        }
        // The new tokens landed in their owners' shards: the global cache after the step, sharded,
        // is every rank's cache after the step.
        EXPECT_EQ(shard_step(global, {k, size, interleave}).cache, ranks[k].cache) << "rank " << k;
      }
      EXPECT_LE(worst_ulp, 1);
      EXPECT_GT(nonzero, 0);
    }
  }
}

TEST(RefDcp, LayerRejectsInconsistentRanks) {
  std::mt19937_64 rng(300);
  const HostLayer layer = random_layer(rng, 2);
  HostStep global = random_step(rng, 2, 1, {10});
  std::vector<HostStep> ranks = {rank_step(global, {0, 2, 1}, 1), rank_step(global, {1, 2, 1}, 1)};
  std::vector<HostLayer> rank_layers;
  rank_layers.push_back(layer.heads(0, 1));
  rank_layers.push_back(layer.heads(1, 1));
  rank_layers[1].weights.k_scale *= 2;  // the cache of rank 1 would be read with another scale
  const std::vector<uint8_t> before = ranks[0].cache;
  const std::vector<StepInputs> views = {ranks[0].view(), ranks[1].view()};
  EXPECT_THROW(run_layer_dcp({rank_layers[0].weights, rank_layers[1].weights}, rank_layers[0].dims, views, 1), Error);
  EXPECT_EQ(ranks[0].cache, before);  // rank 0 is valid but nothing was written
  EXPECT_THROW(run_layer_dcp({rank_layers[0].weights}, rank_layers[0].dims, views, 1), Error);
  rank_layers[1].weights.k_scale = rank_layers[0].weights.k_scale;
  EXPECT_THROW(run_layer_dcp({rank_layers[0].weights, rank_layers[1].weights}, rank_layers[0].dims, views, 64), Error)
      << "local lengths of interleave 1 under interleave 64";
}

}  // namespace
}  // namespace mla::ref
