// plan_core's wgmma N-tile choice (core/launch.h), without a GPU: the smallest tile holding a request's
// q*heads rows, above 64 the fewest tiles with the least padding. The GPU tests run every tile.
#include <gtest/gtest.h>

#include "core/launch.h"

namespace mla {
namespace {

using core::choose_wgmma_tile;

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

}  // namespace
}  // namespace mla
