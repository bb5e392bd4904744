// Attention core of the reference: hand-computed softmaxes over one or two tokens, the causal mask,
// empty and padded requests, block-table indirection, split invariance and spec-verify causality.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "mla/error.h"
#include "reference.h"
#include "reference_test_util.h"

namespace mla::ref {
namespace {

using testing::HostStep;
using testing::expect_same_core;
using testing::random_e4m3;
using testing::random_step;

constexpr double kMinusInf = -std::numeric_limits<double>::infinity();

// A hand-filled cache of `num_pages` pages (contiguous pages, zero bytes) and one request per entry
// of `lengths`, whose block table row lists `pages`.
struct TinyCase {
  std::vector<uint8_t> cache;
  std::vector<int32_t> block_table;
  std::vector<int32_t> lengths;
  std::vector<uint8_t> query;
  int64_t num_pages = 0;
  int64_t max_pages = 0;

  TinyCase(int64_t pages, const std::vector<std::vector<int32_t>>& tables, std::vector<int32_t> lens, int64_t rows,
           int heads)
      : cache(pages * kPageSize * kKeyDim, 0), lengths(std::move(lens)), query(rows * heads * kKeyDim, 0),
        num_pages(pages) {
    for (const auto& t : tables) max_pages = std::max<int64_t>(max_pages, t.size());
    block_table.assign(tables.size() * max_pages, 0);
    for (size_t b = 0; b < tables.size(); ++b) std::copy(tables[b].begin(), tables[b].end(), block_table.begin() + b * max_pages);
  }
  void set_key(int64_t page, int64_t offset, int d, double value) {
    cache[(page * kPageSize + offset) * kKeyDim + d] = e4m3_from_double(value);
  }
  void set_query(int64_t rh, int d, double value) { query[rh * kKeyDim + d] = e4m3_from_double(value); }
  CoreInputs inputs(int64_t rows, int heads, int q, double softmax_scale, double k_scale) {
    return {.query = query.data(),
            .rows = rows,
            .heads = heads,
            .q = q,
            .cache = make_view(cache.data(), DType::kU8, Memory::kHost, {num_pages, kPageSize, kKeyDim}),
            .block_table = make_view(block_table.data(), DType::kI32, Memory::kHost,
                                     {int64_t(lengths.size()), max_pages}),
            .lengths = make_view(lengths.data(), DType::kI32, Memory::kHost, {int64_t(lengths.size())}),
            .totals = {},
            .softmax_scale = softmax_scale,
            .k_scale = k_scale,
            .dcp = {}};
  }
};

double latent_at(const CoreResult& r, int64_t row, int head, int c) {
  return r.latent[(row * r.heads + head) * kKvLoraRank + c];
}
double lse_at(const CoreResult& r, int64_t row, int head) { return r.lse[row * r.heads + head]; }

void expect_empty(const CoreResult& r, int64_t row) {
  for (int h = 0; h < r.heads; ++h) {
    EXPECT_EQ(lse_at(r, row, h), kMinusInf) << "row " << row << " head " << h;
    for (int c = 0; c < kKvLoraRank; ++c) ASSERT_EQ(latent_at(r, row, h, c), 0.0) << "row " << row << " c " << c;
  }
}

TEST(RefCore, SingleTokenIsItsOwnValue) {
  TinyCase t(1, {{0}}, {1}, 1, 1);
  t.set_query(0, 0, 2.0);
  t.set_query(0, 520, 1.0);                // rope dims count in the logit
  t.set_key(0, 0, 0, 3.0);
  t.set_key(0, 0, 7, -1.5);
  t.set_key(0, 0, 520, 4.0);               // ... but not in the latent
  const CoreResult r = attention_core(t.inputs(1, 1, 1, 0.125, 0.5));
  EXPECT_DOUBLE_EQ(lse_at(r, 0, 0), 0.125 * (2.0 * 3.0 + 1.0 * 4.0));
  EXPECT_EQ(latent_at(r, 0, 0, 0), 1.5);
  EXPECT_EQ(latent_at(r, 0, 0, 7), -0.75);
  EXPECT_EQ(latent_at(r, 0, 0, 1), 0.0);
}

TEST(RefCore, TwoTokensWithKnownSoftmax) {
  // logit_0 = s * 2 = ln 3 and logit_1 = 0: softmax (3/4, 1/4), lse = ln 4.
  TinyCase t(1, {{0}}, {2}, 1, 1);
  t.set_query(0, 0, 1.0);
  t.set_key(0, 0, 0, 2.0), t.set_key(0, 0, 1, 1.0);
  t.set_key(0, 1, 0, 0.0), t.set_key(0, 1, 1, 2.0);
  const CoreResult r = attention_core(t.inputs(1, 1, 1, std::log(3.0) / 2, 0.5));
  EXPECT_NEAR(lse_at(r, 0, 0), std::log(4.0), 1e-15);
  EXPECT_NEAR(latent_at(r, 0, 0, 0), 0.5 * (0.75 * 2.0), 1e-15);
  EXPECT_NEAR(latent_at(r, 0, 0, 1), 0.5 * (0.75 * 1.0 + 0.25 * 2.0), 1e-15);
}

TEST(RefCore, HeadsReadTheirOwnQuery) {
  TinyCase t(1, {{0}}, {2}, 1, 2);
  t.set_key(0, 0, 0, 1.0), t.set_key(0, 0, 2, 1.0);
  t.set_key(0, 1, 1, 1.0), t.set_key(0, 1, 3, 1.0);
  t.set_query(0, 0, 1.0);  // head 0 prefers token 0: logits (ln 2, 0) -> (2/3, 1/3)
  t.set_query(1, 1, 2.0);  // head 1 prefers token 1: logits (0, 2 ln 2) -> (1/5, 4/5)
  const CoreResult r = attention_core(t.inputs(1, 2, 1, std::log(2.0), 1.0));
  EXPECT_NEAR(latent_at(r, 0, 0, 0), 2.0 / 3, 1e-15);
  EXPECT_NEAR(latent_at(r, 0, 0, 1), 1.0 / 3, 1e-15);
  EXPECT_NEAR(latent_at(r, 0, 1, 0), 1.0 / 5, 1e-15);
  EXPECT_NEAR(latent_at(r, 0, 1, 3), 4.0 / 5, 1e-15);
  EXPECT_NEAR(lse_at(r, 0, 0), std::log(3.0), 1e-15);
  EXPECT_NEAR(lse_at(r, 0, 1), std::log(5.0), 1e-15);
}

TEST(RefCore, CausalMaskHidesLaterTokensFromEarlierRows) {
  // q = 2, length 2: row 0 sees token 0, row 1 sees tokens 0 and 1. Zero query: uniform softmax.
  TinyCase t(1, {{0}}, {2}, 2, 1);
  t.set_key(0, 0, 0, 1.0);
  t.set_key(0, 1, 0, 2.0);
  const CoreResult r = attention_core(t.inputs(2, 1, 2, 1.0, 1.0));
  EXPECT_EQ(latent_at(r, 0, 0, 0), 1.0);
  EXPECT_EQ(lse_at(r, 0, 0), 0.0);
  EXPECT_NEAR(latent_at(r, 1, 0, 0), 1.5, 1e-15);
  EXPECT_NEAR(lse_at(r, 1, 0), std::log(2.0), 1e-15);
}

TEST(RefCore, RowsBeforeTheFirstTokenSeeNothing) {
  // Length 1 < q = 4: rows 0..2 would see positions <= -3, -2, -1.
  TinyCase t(1, {{0}}, {1}, 4, 1);
  t.set_key(0, 0, 0, 1.0);
  const CoreResult r = attention_core(t.inputs(4, 1, 4, 1.0, 1.0));
  for (int i = 0; i < 3; ++i) expect_empty(r, i);
  EXPECT_EQ(lse_at(r, 3, 0), 0.0);
  EXPECT_EQ(latent_at(r, 3, 0, 0), 1.0);
}

TEST(RefCore, EmptyRequestGivesZeroLatentAndMinusInf) {
  TinyCase t(1, {{0}, {0}}, {0, 1}, 2, 1);
  t.set_key(0, 0, 0, 1.0);
  const CoreResult r = attention_core(t.inputs(2, 1, 1, 1.0, 1.0));
  expect_empty(r, 0);
  EXPECT_EQ(latent_at(r, 1, 0, 0), 1.0);
}

TEST(RefCore, PaddedRequestsHaveNoTokens) {
  TinyCase t(1, {{0}}, {3}, 6, 1);  // one request in the table, rows for three at q = 2
  t.set_key(0, 0, 0, 1.0);
  const CoreResult r = attention_core(t.inputs(6, 1, 2, 1.0, 1.0));
  EXPECT_NEAR(lse_at(r, 1, 0), std::log(3.0), 1e-15);
  for (int row = 2; row < 6; ++row) expect_empty(r, row);
}

TEST(RefCore, BlockTableIndirectionAndPageStride) {
  // Length 65 over pages {2, 0}: positions 0..63 in page 2 (value 1), position 64 at page 0, offset
  // 0 (value 2). Page 0's other tokens (100) are beyond the length, page 1 (-100) is unreferenced.
  // The cache view has a padded page stride. Zero query: uniform softmax over 65 tokens.
  constexpr int64_t kStride = int64_t{kPageSize} * kKeyDim + 40;
  std::vector<uint8_t> cache(3 * kStride, testing::kCacheSentinel);
  auto key = [&](int64_t page, int64_t offset) { return cache.data() + page * kStride + offset * kKeyDim; };
  for (int64_t o = 0; o < kPageSize; ++o) {
    std::fill_n(key(0, o), kKeyDim, e4m3_from_double(100.0));
    std::fill_n(key(1, o), kKeyDim, e4m3_from_double(-100.0));
    std::fill_n(key(2, o), kKeyDim, e4m3_from_double(1.0));
  }
  std::fill_n(key(0, 0), kKeyDim, e4m3_from_double(2.0));
  std::vector<int32_t> block_table = {2, 0, 1};
  std::vector<int32_t> lengths = {65};
  std::vector<uint8_t> query(kKeyDim, 0);
  const CoreInputs in{.query = query.data(),
                      .rows = 1,
                      .heads = 1,
                      .q = 1,
                      .cache = make_strided_view(cache.data(), DType::kU8, Memory::kHost, {3, kPageSize, kKeyDim},
                                                 {kStride, kKeyDim, 1}),
                      .block_table = make_view(block_table.data(), DType::kI32, Memory::kHost, {1, 3}),
                      .lengths = make_view(lengths.data(), DType::kI32, Memory::kHost, {1}),
                      .totals = {},
                      .softmax_scale = 1.0,
                      .k_scale = 0.25,
                      .dcp = {}};
  const CoreResult r = attention_core(in);
  EXPECT_NEAR(lse_at(r, 0, 0), std::log(65.0), 1e-14);
  for (int c = 0; c < kKvLoraRank; ++c) EXPECT_NEAR(latent_at(r, 0, 0, c), 0.25 * 66.0 / 65.0, 1e-15) << c;
}

TEST(RefCore, MergeWeighsPartialsByLse) {
  SplitPartials p;
  p.num_splits = 3;
  for (int s = 0; s < 3; ++s) {
    CoreResult part;
    part.rows = 1, part.heads = 1;
    part.latent.assign(kKvLoraRank, 0.0);
    part.lse = {kMinusInf};
    p.splits.push_back(part);
  }
  p.splits[0].lse = {0.0};            // sum 1
  p.splits[0].latent[0] = 1.0;
  p.splits[2].lse = {std::log(3.0)};  // sum 3
  p.splits[2].latent[0] = 2.0;
  p.splits[1].latent[0] = 1e300;      // an empty split weighs exactly 0 whatever it stored
  const CoreResult m = merge_partials(p);
  EXPECT_NEAR(m.lse[0], std::log(4.0), 1e-15);
  EXPECT_NEAR(m.latent[0], (1.0 * 1.0 + 3.0 * 2.0) / 4.0, 1e-15);
}

// A NaN byte in a visible token's key makes its rows' logits NaN: NaN latent and LSE (DESIGN.md §4: only rows
// with nothing visible are 0 and -inf), whatever the split count; rows that cannot see the token stay finite.
TEST(RefCore, NanKeyOfAVisibleTokenGivesNanNotEmpty) {
  constexpr uint8_t kE4m3Nan = 0x7f;
  TinyCase t(2, {{0, 1}}, {70}, 2, 1);  // one request of 70 tokens over two pages, q = 2
  t.set_query(0, 0, 1.0), t.set_query(1, 0, 1.0);
  for (int j = 0; j < 70; ++j) t.set_key(j / kPageSize, j % kPageSize, 0, 1.0);
  t.cache[(int64_t{1} * kPageSize + 69 - kPageSize) * kKeyDim + 5] = kE4m3Nan;  // token 69: only row 1 sees it
  const CoreInputs in = t.inputs(2, 1, 2, 0.5, 1.0);
  for (int splits : {1, 2}) {
    const CoreResult r = merge_partials(core_partials(in, splits));
    EXPECT_TRUE(std::isfinite(lse_at(r, 0, 0))) << splits << " splits";
    EXPECT_NEAR(latent_at(r, 0, 0, 0), 1.0, 1e-12) << splits << " splits";
    EXPECT_TRUE(std::isnan(lse_at(r, 1, 0))) << splits << " splits: " << lse_at(r, 1, 0);
    EXPECT_TRUE(std::isnan(latent_at(r, 1, 0, 0))) << splits << " splits: " << latent_at(r, 1, 0, 0);
  }
  // A key whose every visible token is NaN (one token): NaN too, not the empty row.
  TinyCase one(1, {{0}}, {1}, 1, 1);
  one.set_query(0, 0, 1.0);
  one.cache[3] = kE4m3Nan;
  const CoreResult r = attention_core(one.inputs(1, 1, 1, 0.5, 1.0));
  EXPECT_TRUE(std::isnan(lse_at(r, 0, 0))) << lse_at(r, 0, 0);
  EXPECT_TRUE(std::isnan(latent_at(r, 0, 0, 0))) << latent_at(r, 0, 0, 0);
}

TEST(RefCore, MergeKeepsANanPart) {
  CoreResult nan_part, finite_part;
  nan_part.rows = finite_part.rows = 1;
  nan_part.heads = finite_part.heads = 1;
  nan_part.latent.assign(kKvLoraRank, std::numeric_limits<double>::quiet_NaN());
  nan_part.lse = {std::numeric_limits<double>::quiet_NaN()};
  finite_part.latent.assign(kKvLoraRank, 1.0);
  finite_part.lse = {0.0};
  for (const std::vector<CoreResult>& parts : {std::vector<CoreResult>{nan_part}, {finite_part, nan_part},
                                               {nan_part, finite_part}}) {
    const CoreResult m = dcp_merge(parts);
    EXPECT_TRUE(std::isnan(m.lse[0])) << m.lse[0];
    EXPECT_TRUE(std::isnan(m.latent[0])) << m.latent[0];
  }
}

TEST(RefCore, MergeOfOnlyEmptyPartsIsZeroAndMinusInf) {
  CoreResult empty;
  empty.rows = 1, empty.heads = 2;
  empty.latent.assign(2 * kKvLoraRank, 0.0);
  empty.lse = {kMinusInf, kMinusInf};
  const CoreResult m = dcp_merge({empty, empty, empty});
  expect_empty(m, 0);
}

TEST(RefCore, MergeRejectsMismatchedParts) {
  CoreResult a, b;
  a.rows = 1, a.heads = 1, a.latent.assign(kKvLoraRank, 0.0), a.lse = {0.0};
  b.rows = 1, b.heads = 2, b.latent.assign(2 * kKvLoraRank, 0.0), b.lse = {0.0, 0.0};
  EXPECT_THROW(dcp_merge({a, b}), Error);
  EXPECT_THROW(dcp_merge({}), Error);
}

TEST(RefCore, RoundLatentRoundsEachElementToBf16) {
  CoreResult r;
  r.rows = 1, r.heads = 1, r.lse = {0.0};
  r.latent.assign(kKvLoraRank, 1 + std::ldexp(3.0, -9));
  const std::vector<double> rounded = round_latent(r);
  for (double v : rounded) EXPECT_EQ(v, 1 + std::ldexp(1.0, -7));
}

// A random multi-request case: q rows per request, `heads` heads, the lengths the splits must handle.
struct RandomCore {
  HostStep step;
  std::vector<uint8_t> query;
  int heads;
  RandomCore(uint64_t seed, int q, int num_heads, const std::vector<int32_t>& lengths, int padding = 0)
      : heads(num_heads) {
    std::mt19937_64 rng(seed);
    step = random_step(rng, 1, q, lengths, padding);
    query = random_e4m3(rng, step.rows * heads * kKeyDim);
  }
  CoreInputs inputs() { return testing::core_inputs(step, query, heads); }
};

TEST(RefCore, SplitCountDoesNotChangeTheResult) {
  for (int q : {1, 2}) {
    RandomCore c(31 + q, q, 3, {0, 1, 63, 64, 65, 200}, /*padding=*/1);
    const CoreResult one = attention_core(c.inputs());
    for (int splits : {2, 3, 7, 16}) {  // 16 > the 4 pages of the longest request
      SCOPED_TRACE("q " + std::to_string(q) + " splits " + std::to_string(splits));
      const SplitPartials partials = core_partials(c.inputs(), splits);
      ASSERT_EQ(partials.num_splits, splits);
      ASSERT_EQ(partials.splits.size(), size_t(splits));
      expect_same_core(one, merge_partials(partials));
    }
  }
}

TEST(RefCore, SplitsCoverWholePagesInOrder) {
  // 200 tokens = 4 pages; 3 splits of ceil(4 / 3) = 2 pages: [0, 128), [128, 200), nothing.
  RandomCore c(41, 1, 2, {200});
  const SplitPartials p = core_partials(c.inputs(), 3);
  expect_empty(p.splits[2], 0);

  HostStep first = c.step;  // the first two pages alone, all visible to the row
  first.lengths = {128};
  expect_same_core(attention_core(testing::core_inputs(first, c.query, 2)), p.splits[0]);

  HostStep second = c.step;  // the last two pages alone, 72 tokens
  second.lengths = {72};
  for (int64_t col = 0; col + 2 < second.max_pages; ++col) {
    second.block_table[col] = c.step.block_table[col + 2];
  }
  expect_same_core(attention_core(testing::core_inputs(second, c.query, 2)), p.splits[1]);
}

TEST(RefCore, MoreSplitsThanPagesLeavesTrailingSplitsEmpty) {
  RandomCore c(43, 1, 1, {65});  // 2 pages
  const SplitPartials p = core_partials(c.inputs(), 5);
  EXPECT_NE(p.splits[0].lse[0], kMinusInf);
  EXPECT_NE(p.splits[1].lse[0], kMinusInf);
  for (int s = 2; s < 5; ++s) expect_empty(p.splits[s], 0);
}

TEST(RefCore, RejectsBadSplitCountAndQ) {
  RandomCore c(44, 2, 1, {3});
  EXPECT_THROW(core_partials(c.inputs(), 0), Error);
  CoreInputs bad = c.inputs();
  bad.q = 3;  // 2 rows are not a multiple of 3
  EXPECT_THROW(core_partials(bad, 1), Error);
}

TEST(RefCore, SpecVerifyRowsEqualDecodesAtShorterLengths) {
  // Row i of a q-row request over length L sees exactly what a q = 1 decode at length L - q + i + 1
  // sees over the same cache.
  for (int q : {2, 4, 8}) {
    SCOPED_TRACE("q " + std::to_string(q));
    const std::vector<int32_t> lengths = {1, 5, 10, 64, 65, 150};
    RandomCore c(50 + q, q, 2, lengths);
    const CoreResult all = attention_core(c.inputs());
    for (size_t b = 0; b < lengths.size(); ++b) {
      for (int i = 0; i < q; ++i) {
        const int64_t r = int64_t(b) * q + i;
        HostStep single = c.step;
        single.q = 1;
        single.rows = 1;
        single.lengths = {std::max(0, lengths[b] - q + i + 1)};
        single.block_table.assign(c.step.block_table.begin() + b * c.step.max_pages,
                                  c.step.block_table.begin() + (b + 1) * c.step.max_pages);
        const std::vector<uint8_t> row_query(c.query.begin() + r * 2 * kKeyDim, c.query.begin() + (r + 1) * 2 * kKeyDim);
        const CoreResult decode = attention_core(testing::core_inputs(single, row_query, 2));
        CoreResult row;
        row.rows = 1, row.heads = 2;
        row.lse.assign(all.lse.begin() + r * 2, all.lse.begin() + (r + 1) * 2);
        row.latent.assign(all.latent.begin() + r * 2 * kKvLoraRank, all.latent.begin() + (r + 1) * 2 * kKvLoraRank);
        SCOPED_TRACE("request " + std::to_string(b) + " row " + std::to_string(i));
        expect_same_core(decode, row);
      }
    }
  }
}

}  // namespace
}  // namespace mla::ref
