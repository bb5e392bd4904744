// The split-KV rule of the attention core (DESIGN.md §4, split-KV): how a request's pages are dealt to the
// splits planned for its shape. The split kernels and the combine (kernel.cuh) must agree on it, and it is
// plain arithmetic, so it is shared here and also checked on the CPU against the reference's rule
// (tests/cpu/core_split_rule_test.cpp).
#pragma once

#include "mla/dims.h"

#if defined(__CUDACC__)
#define MLA_CORE_SPLIT_RULE_FN __host__ __device__ __forceinline__
#else
#define MLA_CORE_SPLIT_RULE_FN inline
#endif

namespace mla::core {

// Whole pages, pages_per_split = ceil(pages / num_splits) (the reference's rule), so a request's pages fill
// its first splits.
// NOTE: a request shorter than max_context gets one-page splits; a floor of two pages a split at run time
// measured slower where the splits are few (1 x 4k x 12 planned for 128k: 64 one-page splits 9.2 µs, 32
// two-page ones 11.1; src/core/README.md, 2026-12-05).
struct SplitRule {
  int pages = 0;            // the request's pages
  int pages_per_split = 0;  // 0 when it has none
};
MLA_CORE_SPLIT_RULE_FN SplitRule split_rule(int length, int num_splits) {
  SplitRule r;
  r.pages = (length + kPageSize - 1) / kPageSize;
  r.pages_per_split = (r.pages + num_splits - 1) / num_splits;
  return r;
}

// Splits of a request of `length` tokens that hold pages: ceil(pages / pages_per_split), the first ones.
// The split count is planned for max_context, so a short request leaves the others empty; with more than
// one split they write nothing and the combine merges none of them.
MLA_CORE_SPLIT_RULE_FN int nonempty_splits(int length, int num_splits) {
  const SplitRule r = split_rule(length, num_splits);
  return r.pages == 0 ? 0 : (r.pages + r.pages_per_split - 1) / r.pages_per_split;
}

// Pages [page_begin, page_begin + num_pages) of split `split` (num_pages = 0: an empty split).
struct SplitRange {
  int page_begin = 0;
  int num_pages = 0;
};
MLA_CORE_SPLIT_RULE_FN SplitRange split_range(int length, int num_splits, int split) {
  const SplitRule r = split_rule(length, num_splits);
  SplitRange s;
  const int begin = split * r.pages_per_split;
  s.page_begin = begin < r.pages ? begin : r.pages;
  const int end = s.page_begin + r.pages_per_split;
  s.num_pages = (end < r.pages ? end : r.pages) - s.page_begin;
  return s;
}

}  // namespace mla::core

#undef MLA_CORE_SPLIT_RULE_FN
