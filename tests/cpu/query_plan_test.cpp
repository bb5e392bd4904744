// The fused query plan's rope CTAs (query/launch.h, choose_rope_ctas), without a GPU: only at C = 1 with one
// row tile, and only where the SMs no head CTA occupies take every rope tile at most one a warp. The GPU tests
// run the kernel with them (Query.RopeCtasGiveTheSameBytes). Also the cluster's column deal (FusedSmemPlan).
#include <gtest/gtest.h>

#include <cstdint>

#include "cpu/error_of.h"
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

// The absorption's 512 latent columns dealt to the C ranks of a cluster (FusedSmemPlan::col_begin / cols_of): whole
// 16-column tiles, in rank order, every column once, none beyond cols() (the buffers' size); C = 3 and 6 unevenly.
TEST(QueryPlanColumns, EveryClusterDealsEveryColumnOnce) {
  for (int c : {1, 2, 3, 4, 6, 8}) {
    SCOPED_TRACE(c);
    const query::FusedSmemPlan plan{8, c};
    int next = 0;
    for (int rank = 0; rank < c; ++rank) {
      EXPECT_EQ(plan.col_begin(rank), next);
      EXPECT_EQ(plan.cols_of(rank) % query::kColTile, 0);
      EXPECT_GT(plan.cols_of(rank), 0);
      EXPECT_LE(plan.cols_of(rank), plan.cols());
      next += plan.cols_of(rank);
    }
    EXPECT_EQ(next, kKvLoraRank);
    EXPECT_EQ(plan.split_len() * c, kQLoraRank);  // and K splits evenly
    EXPECT_EQ(plan.split_len() % query::kKChunk, 0);
  }
  constexpr query::FusedSmemPlan kSix{8, 6};
  EXPECT_EQ(kSix.cols_of(0), 80);  // tiles 0-4
  EXPECT_EQ(kSix.cols(), 96);      // the largest share, 6 tiles
}


// A GEMM plan whose absorb row tile is none of the absorb kernel's (a hand-edited plan: make_query_plan never makes
// one) is rejected before the first launch, so the norm kernel writes no cache row. The pointers are never
// dereferenced: the error comes before any CUDA call (without the check first, the norm kernel's launch would).
TEST(QueryPlanLaunch, RejectsAnAbsorbRowTileBeforeAnyLaunch) {
  query::QueryPlan plan;
  plan.rows = 64;
  plan.num_heads = 12;
  plan.path = query::QueryPath::kGemm;
  plan.absorb_row_tile = 48;
  plan.workspace_bytes = 256;
  alignas(256) static uint8_t fake[256];  // aligned stand-ins for device pointers
  const int64_t slots[1] = {-1};
  query::QueryArgs args;
  args.projected = args.q_a_norm = args.kv_a_norm = args.q_b_proj = args.w_uk_t = fake;
  args.pitch = 4096;
  args.slots = slots;
  args.query = args.cache = args.workspace = fake;
  args.cublas = reinterpret_cast<cublasHandle_t>(fake);
  EXPECT_ERROR_HAS(query::launch_query(plan, args, nullptr), "QueryPlan.absorb_row_tile");
}

}  // namespace
}  // namespace mla
