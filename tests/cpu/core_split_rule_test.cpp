// The attention core's split rule (core/split_rule.h), without a GPU: the split kernels and the combine
// deal a request's pages with it, and the CPU reference (reference/core.cpp, core_partials) deals tokens
// with ceil(pages / num_splits) pages a split. Both must cover the same tokens, every page exactly once,
// the nonempty splits first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "core/split_rule.h"
#include "mla/dims.h"

namespace mla {
namespace {

using core::nonempty_splits;
using core::split_range;
using core::SplitRange;

constexpr int kLengths[] = {0, 1, 63, 64, 65, 127, 128, 129, 4095, 4096, 4097, 64 * 251 + 1, 131072, 1 << 20};
constexpr int kSplitCounts[] = {1, 2, 3, 7, 12, 30, 32, 63, 64, 100, 251, 1024};

TEST(CoreSplitRule, EveryPageOnceNonemptySplitsFirst) {
  for (int length : kLengths) {
    for (int splits : kSplitCounts) {
      SCOPED_TRACE(::testing::Message() << "length " << length << ", " << splits << " splits");
      const int pages = (length + kPageSize - 1) / kPageSize;
      const int nonempty = nonempty_splits(length, splits);
      EXPECT_LE(nonempty, splits);
      EXPECT_EQ(nonempty == 0, pages == 0);
      int next_page = 0;
      for (int s = 0; s < splits; ++s) {
        const SplitRange r = split_range(length, splits, s);
        if (s < nonempty) {
          EXPECT_EQ(r.page_begin, next_page) << "split " << s;
          EXPECT_GE(r.num_pages, 1) << "split " << s;
          next_page += r.num_pages;
        } else {
          EXPECT_EQ(r.num_pages, 0) << "split " << s;
        }
      }
      EXPECT_EQ(next_page, pages);
    }
  }
}

TEST(CoreSplitRule, SameTokensAsTheReference) {
  for (int length : kLengths) {
    for (int splits : kSplitCounts) {
      SCOPED_TRACE(::testing::Message() << "length " << length << ", " << splits << " splits");
      // reference/core.cpp: split s covers tokens [min(L, s·pps·64), min(L, (s + 1)·pps·64)).
      const int64_t pages = (length + kPageSize - 1) / kPageSize;
      const int64_t pages_per_split = (pages + splits - 1) / splits;
      for (int s = 0; s < splits; ++s) {
        const int64_t ref_begin = std::min<int64_t>(length, s * pages_per_split * kPageSize);
        const int64_t ref_end = std::min<int64_t>(length, (s + 1) * pages_per_split * kPageSize);
        const SplitRange r = split_range(length, splits, s);
        const int64_t begin = std::min<int64_t>(length, int64_t{r.page_begin} * kPageSize);
        const int64_t end = std::min<int64_t>(length, int64_t{r.page_begin + r.num_pages} * kPageSize);
        EXPECT_EQ(begin, ref_begin) << "split " << s;
        EXPECT_EQ(end, ref_end) << "split " << s;
      }
    }
  }
}

// Flat slots (split_rule.h): the N CTAs' flattened page ranges cut at request boundaries give every page of every
// request to exactly one (request, CTA) segment; the segment's slot r + c lies in the request's slots
// (flat_request_slots, what the combine merges), every one of those slots holds exactly one segment, no slot is
// shared, and none lies past N + R - 1. No CTA holds more than ceil(P / N) pages.
TEST(CoreSplitRule, FlatSlotsCoverEveryPageOnce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    const int requests = 1 + static_cast<int>(rng() % 70);
    const int splits = 1 + static_cast<int>(rng() % 9);
    const int max_length = trial % 3 == 0 ? 300 : 20000;
    std::vector<int> pages(requests), before(requests);
    int total = 0;
    for (int r = 0; r < requests; ++r) {
      const int length = rng() % 5 == 0 ? 0 : static_cast<int>(rng() % max_length);
      pages[r] = (length + kPageSize - 1) / kPageSize;
      before[r] = total;
      total += pages[r];
    }
    const int ctas = splits * requests;
    const int per_cta = core::flat_pages_per_cta(total, ctas);
    SCOPED_TRACE(::testing::Message() << requests << " requests, " << splits << " splits, " << total << " pages");
    std::vector<int> slot_pages(ctas + requests - 1, 0);  // pages written to each slot
    std::vector<int> page_owner(total, -1);
    for (int c = 0; c < ctas; ++c) {
      const core::FlatRange range = core::flat_cta_range(c, total, per_cta);
      EXPECT_LE(range.end - range.begin, per_cta);
      for (int r = 0; r < requests; ++r) {
        const int begin = std::max(range.begin, before[r]);
        const int end = std::min(range.end, before[r] + pages[r]);
        if (begin >= end) continue;
        const int slot = r + c;
        ASSERT_LT(slot, ctas + requests - 1);
        EXPECT_EQ(slot_pages[slot], 0) << "slot " << slot << " written twice";
        slot_pages[slot] = end - begin;
        const core::FlatSlots mine = core::flat_request_slots(r, before[r], pages[r], per_cta);
        EXPECT_GE(slot, mine.first);
        EXPECT_LT(slot, mine.first + mine.count);
        for (int g = begin; g < end; ++g) {
          EXPECT_EQ(page_owner[g], -1);
          page_owner[g] = c;
        }
      }
    }
    for (int g = 0; g < total; ++g) EXPECT_NE(page_owner[g], -1) << "page " << g;
    for (int r = 0; r < requests; ++r) {  // the combine's slots of r all hold a segment of r
      const core::FlatSlots mine = core::flat_request_slots(r, before[r], pages[r], per_cta);
      int merged = 0;
      for (int s = mine.first; s < mine.first + mine.count; ++s) {
        EXPECT_GT(slot_pages[s], 0) << "request " << r << " slot " << s;
        merged += slot_pages[s];
      }
      EXPECT_EQ(merged, pages[r]) << "request " << r;
    }
  }
}

}  // namespace
}  // namespace mla
