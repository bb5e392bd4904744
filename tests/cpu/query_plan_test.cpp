// The fused query plan's rope CTAs (query/launch.h, choose_rope_ctas), without a GPU: only at C = 1 with one
// row tile, and only where the SMs no head CTA occupies take every rope tile at most one a warp. The GPU tests
// run the kernel with them (Query.RopeCtasGiveTheSameBytes).
#include <gtest/gtest.h>

#include "query/config.h"
#include "query/launch.h"

namespace mla {
namespace {

using query::choose_rope_ctas;

TEST(QueryPlanRopeCtas, TheSpareSmsTakeEveryRopeTile) {
  // H = 96 on 132 SMs: 384 rope tiles over 36 spare SMs -> 11 a CTA, 35 CTAs (the last one partial).
  const query::RopeCtas h96 = choose_rope_ctas(96, 1, 1, 132);
  EXPECT_EQ(h96.tiles_per_cta, 11);
  EXPECT_EQ(h96.ctas, 35);
  for (int heads = 1; heads <= 128; ++heads) {
    const query::RopeCtas r = choose_rope_ctas(heads, 1, 1, 132);
    if (r.ctas == 0) continue;
    SCOPED_TRACE(heads);
    EXPECT_LE(r.tiles_per_cta, query::kFusedWarps);                                  // a warp a tile
    EXPECT_GE(r.ctas * r.tiles_per_cta, heads * query::kRopeTilesPerHead);           // every tile
    EXPECT_LT((r.ctas - 1) * r.tiles_per_cta, heads * query::kRopeTilesPerHead);     // no empty CTA
    EXPECT_LE(heads + r.ctas, 132);                                                  // one wave
  }
}

TEST(QueryPlanRopeCtas, NoneWhereTheyCannotHelp) {
  EXPECT_EQ(choose_rope_ctas(128, 1, 1, 132).ctas, 0);  // 4 spare SMs for 512 tiles
  EXPECT_EQ(choose_rope_ctas(100, 1, 1, 132).ctas, 0);  // 13 tiles a CTA: more than its 12 warps
  EXPECT_EQ(choose_rope_ctas(96, 2, 1, 132).ctas, 0);   // a cluster splits K: no whole-K rope tile
  EXPECT_EQ(choose_rope_ctas(96, 1, 2, 132).ctas, 0);   // two row tiles
  EXPECT_EQ(choose_rope_ctas(132, 1, 1, 132).ctas, 0);  // no spare SM
}

}  // namespace
}  // namespace mla
