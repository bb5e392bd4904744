// The split-KV rule of the attention core (DESIGN.md §4, split-KV): how a batch's CTA slots are dealt to its
// requests and each request's pages to its slots. The split kernels and the combine (kernel.cuh) must agree on it, and it is
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
// The pages of a request of `length` tokens (the last one partly filled).
MLA_CORE_SPLIT_RULE_FN int pages_of(int length) { return (length + kPageSize - 1) / kPageSize; }

struct SplitRule {
  int pages = 0;            // the request's pages
  int pages_per_split = 0;  // 0 when it has none
};
MLA_CORE_SPLIT_RULE_FN SplitRule split_rule(int length, int num_splits) {
  SplitRule r;
  r.pages = pages_of(length);
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

// ---- Flat slots (the mma.sync and ping-pong kernels, more than one request; src/core/README.md, next step 7) -----
// N = num_splits · R CTAs share the batch's P pages in request order, across request boundaries: CTA c takes the
// flattened pages [c·ppc, min((c + 1)·ppc, P)), ppc = ceil(P / N), so every CTA holds at most ppc pages however the
// lengths spread. Its part of request r (a segment) is one partial, at slot r + c: request r's segments come from
// CTAs c_first(r) = ⌊p_r / ppc⌋ .. c_last(r) = ⌊(p_r + pages_r − 1) / ppc⌋ (p_r: its pages before it), so its slots are
// [r + c_first, r + c_last], and no two (request, CTA) pairs share a slot (a later CTA never holds an earlier
// request's page). Slots: N + R − 1. NOTE: 32-bit: plan_core rejects R · max_context pages of 2^31 or more.
MLA_CORE_SPLIT_RULE_FN int flat_pages_per_cta(int total_pages, int num_ctas) {
  return total_pages == 0 ? 1 : (total_pages + num_ctas - 1) / num_ctas;
}
// CTA c's flattened pages [begin, end) (empty past the batch's last page).
struct FlatRange {
  int begin = 0;
  int end = 0;
};
MLA_CORE_SPLIT_RULE_FN FlatRange flat_cta_range(int cta, int total_pages, int pages_per_cta) {
  const int64_t begin = int64_t{cta} * pages_per_cta;
  FlatRange r;
  r.begin = begin < total_pages ? static_cast<int>(begin) : total_pages;
  r.end = begin + pages_per_cta < total_pages ? static_cast<int>(begin + pages_per_cta) : total_pages;
  return r;
}
// Request `request`'s slots [first, first + count) (count 0 without pages).
struct FlatSlots {
  int first = 0;
  int count = 0;
};
MLA_CORE_SPLIT_RULE_FN FlatSlots flat_request_slots(int request, int pages_before, int pages, int pages_per_cta) {
  FlatSlots s;
  s.first = request + pages_before / pages_per_cta;
  s.count = pages == 0 ? 0 : (pages_before + pages - 1) / pages_per_cta - pages_before / pages_per_cta + 1;
  return s;
}

}  // namespace mla::core

#undef MLA_CORE_SPLIT_RULE_FN
