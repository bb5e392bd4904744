// plan_core's wgmma N-tile choice (core/launch.h), without a GPU: the smallest tile holding a request's
// q*heads rows, above 64 the fewest tiles with the least padding. The GPU tests run every tile.
#include <gtest/gtest.h>

#include "core/config.h"
#include "core/launch.h"
#include "error_of.h"

namespace mla {
namespace {

using core::choose_wgmma_tile;

// Rejected before any CUDA call: the flat deal's page counts are 32-bit.
TEST(CorePlanShape, RejectsAMaxContextWhoseBatchPagesPass32Bits) {
  const int64_t max_context = int64_t{1} << 28;  // 2^22 pages a request, 512 requests: 2^31 pages
  EXPECT_ERROR_HAS(core::plan_core({.rows = 512, .heads = 16, .q = 1, .max_context = max_context}),
                   "CoreShape.max_context: expected at most 2^31 - 1 pages over the 512 requests");
  EXPECT_ERROR_HAS(core::plan_core({.rows = 512, .heads = 16, .q = 1, .max_context = max_context}),
                   "(2147483648 pages)");
}

TEST(CorePlanTile, SmallestTileHoldingTheRows) {
  EXPECT_EQ(choose_wgmma_tile(1), 16);
  EXPECT_EQ(choose_wgmma_tile(16), 16);
  EXPECT_EQ(choose_wgmma_tile(17), 32);
  EXPECT_EQ(choose_wgmma_tile(24), 32);  // H12 q2
  EXPECT_EQ(choose_wgmma_tile(33), 48);
  EXPECT_EQ(choose_wgmma_tile(48), 48);  // H12 q4
  EXPECT_EQ(choose_wgmma_tile(49), 64);
  EXPECT_EQ(choose_wgmma_tile(64), 64);
}

TEST(CorePlanTile, AboveSixtyFourFewestTilesThenLeastPadding) {
  EXPECT_EQ(choose_wgmma_tile(80), 48);    // 2 x 48 (96 rows), not 2 x 64 (128)
  EXPECT_EQ(choose_wgmma_tile(96), 48);    // H96 q1: 2 x 48, no padding
  EXPECT_EQ(choose_wgmma_tile(97), 64);    // 3 x 48 vs 2 x 64
  EXPECT_EQ(choose_wgmma_tile(128), 64);   // H128 q1
  EXPECT_EQ(choose_wgmma_tile(144), 48);   // 3 x 48, no padding
  EXPECT_EQ(choose_wgmma_tile(384), 64);   // H96 q4: 6 x 64, not 8 x 48
  EXPECT_EQ(choose_wgmma_tile(1024), 64);  // H128 q8
}

// choose_splits: one step fills the machine (>= 95 % of whole waves) with the fewest splits, bounded by
// the pages a split must keep; the numbers are the H200's (132 SMs).
TEST(CorePlanSplits, FewestSplitsFillingWholeWaves) {
  using core::choose_splits;
  EXPECT_EQ(choose_splits(1, 264, 1024), 251);   // 1 request, mma.sync 2 CTAs/SM: 251 of 264 slots
  EXPECT_EQ(choose_splits(1, 132, 1024), 126);   // 1 CTA/SM: 126 of 132 (95.5 %)
  EXPECT_EQ(choose_splits(128, 264, 1024), 2);   // 256 CTAs on 264 slots
  EXPECT_EQ(choose_splits(132, 132, 1024), 1);   // already one full wave
  EXPECT_EQ(choose_splits(1, 264, 32), 32);      // bounded by max_context's pages / 2
  EXPECT_EQ(choose_splits(1000, 132, 1024), 1);  // many waves: the tail no longer matters
  auto efficiency = [](int64_t work, int64_t splits, int64_t slots) {
    const int64_t ctas = work * splits;
    return static_cast<double>(ctas) / static_cast<double>((ctas + slots - 1) / slots * slots);
  };
  for (int64_t work : {1, 3, 7, 16, 33, 64, 100, 129, 500}) {
    for (int64_t slots : {132, 264}) {
      SCOPED_TRACE(::testing::Message() << work << " items on " << slots << " slots");
      const int s = choose_splits(work, slots, 1024);
      ASSERT_GE(s, 1);
      // No smaller count reaches 95 %; the count reaches it, or none does before the CTAs pass four waves
      // and the count is the most efficient of those searched.
      for (int smaller = 1; smaller < s; ++smaller) EXPECT_LT(efficiency(work, smaller, slots), 0.95) << smaller;
      if (efficiency(work, s, slots) < 0.95) {
        for (int other = 1; other <= 1024 && work * (other - 1) < 4 * slots; ++other) {
          EXPECT_LE(efficiency(work, other, slots), efficiency(work, s, slots) + 1e-9) << other;
        }
      }
    }
  }
}

// choose_splits_one_request: one request fills the whole wave where the fewest-splits count fits in one.
TEST(CorePlanSplits, OneRequestFillsTheWave) {
  using core::choose_splits;
  using core::choose_splits_one_request;
  EXPECT_EQ(choose_splits_one_request(1, 264, 1024), 264);  // mma.sync, 2 CTAs/SM: every slot (251 before)
  EXPECT_EQ(choose_splits_one_request(1, 132, 1024), 132);  // 1 CTA/SM (126 before)
  EXPECT_EQ(choose_splits_one_request(2, 132, 1024), 66);   // two 48-row tiles (H96): 2 x 66 slots
  EXPECT_EQ(choose_splits_one_request(1, 264, 32), 32);     // still bounded by max_context's pages / 2
  EXPECT_EQ(choose_splits_one_request(132, 132, 1024), 1);  // already one full wave
  EXPECT_EQ(choose_splits_one_request(300, 264, 1024), choose_splits(300, 264, 1024));  // more than a wave
  for (int64_t tiles : {1, 2, 3, 7, 16, 64, 100, 129, 300}) {
    for (int64_t slots : {132, 264}) {
      for (int64_t max_splits : {1, 2, 31, 1024}) {
        SCOPED_TRACE(::testing::Message() << tiles << " tiles on " << slots << " slots, <= " << max_splits);
        const int base = choose_splits(tiles, slots, max_splits);
        const int s = choose_splits_one_request(tiles, slots, max_splits);
        EXPECT_GE(s, base);
        EXPECT_LE(s, max_splits);
        if (tiles * base <= slots) {
          EXPECT_LE(tiles * s, slots);  // one wave still
          EXPECT_TRUE(s == max_splits || tiles * (s + 1) > slots) << s;  // and as full as the bound allows
        } else {
          EXPECT_EQ(s, base);
        }
      }
    }
  }
}

// launches_combine: the combine kernel runs where the split kernel leaves partials it does not merge itself (what
// PreparedMla::timeline_ctas and core_bench --timeline size its stamps by).
TEST(CorePlanCombine, LaunchedWhereTheSplitKernelLeavesPartials) {
  core::CorePlan plan;
  plan.num_splits = 1;
  EXPECT_FALSE(core::launches_combine(plan));  // one split writes the latent itself
  plan.num_splits = 4;
  EXPECT_TRUE(core::launches_combine(plan));
  plan.merge_in_split = true;
  EXPECT_FALSE(core::launches_combine(plan));
  plan.num_splits = 1;
  plan.flat_slots = true;  // a request's pages may span CTAs even at one split
  EXPECT_FALSE(core::launches_combine(plan));
  plan.merge_in_split = false;
  EXPECT_TRUE(core::launches_combine(plan));
}

// combine_warps_per_entry: every split in one round of kCombineLoadsInFlight rows a warp, up to the cap.
TEST(CorePlanCombine, WarpsTakeEverySplitInOneRound) {
  using core::combine_warps_per_entry;
  EXPECT_EQ(combine_warps_per_entry(1), 1);
  EXPECT_EQ(combine_warps_per_entry(core::kCombineLoadsInFlight), 1);
  EXPECT_EQ(combine_warps_per_entry(core::kCombineLoadsInFlight + 1), 2);
  EXPECT_EQ(combine_warps_per_entry(1024), core::kCombineMaxWarps);
  for (int splits = 1; splits <= 1024; ++splits) {
    const int g = combine_warps_per_entry(splits);
    EXPECT_EQ(g & (g - 1), 0) << splits;  // a power of two: groups tile a block
    EXPECT_LE(g, core::kCombineMaxWarps);
    if (g < core::kCombineMaxWarps) {
      EXPECT_GE(g * core::kCombineLoadsInFlight, splits);
    }
    if (g > 1) {
      EXPECT_LT(g / 2 * core::kCombineLoadsInFlight, splits);  // the smallest such
    }
  }
}

}  // namespace
}  // namespace mla
