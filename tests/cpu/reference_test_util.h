// Random layers, steps and caches for the CPU reference tests, at realistic scales: weights
// ~N(0, 0.02), activations ~N(0, 1), FP8 scales chosen so that quantized values use the e4m3 range.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "mla/mla.h"
#include "reference.h"

namespace mla::ref::testing {

inline std::vector<uint16_t> random_bf16(std::mt19937_64& rng, int64_t count, double mean, double stddev) {
  std::normal_distribution<double> normal(mean, stddev);
  std::vector<uint16_t> values(count);
  for (uint16_t& v : values) v = bf16_from_double(normal(rng));
  return values;
}

// FP8 bytes of N(0, 1) values at a scale that puts ~4 sigma near 448.
inline std::vector<uint8_t> random_e4m3(std::mt19937_64& rng, int64_t count) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<uint8_t> values(count);
  for (uint8_t& v : values) v = e4m3_from_double(normal(rng) * 100.0);
  return values;
}

// |ql| reaches ~1 and |q_rope| ~4; |kvn| and |k_pe| ~4-5: these scales put the largest near 448.
inline constexpr float kQScale = 4.0f / 448.0f;
inline constexpr float kKScale = 4.5f / 448.0f;

// A layer's weights with their storage. Move-only: `weights` points into the vectors' buffers,
// which a move keeps and a copy would not.
struct HostLayer {
  std::vector<uint16_t> q_a_norm, kv_a_norm, q_b_proj, w_uk_t, w_uv;
  LayerDims dims;
  Weights weights;

  HostLayer(std::vector<uint16_t> q_a_norm_, std::vector<uint16_t> kv_a_norm_, std::vector<uint16_t> q_b_proj_,
            std::vector<uint16_t> w_uk_t_, std::vector<uint16_t> w_uv_, int num_heads)
      : q_a_norm(std::move(q_a_norm_)), kv_a_norm(std::move(kv_a_norm_)), q_b_proj(std::move(q_b_proj_)),
        w_uk_t(std::move(w_uk_t_)), w_uv(std::move(w_uv_)), dims{.num_heads = num_heads, .rms_eps = 1e-5f} {
    weights = {.q_a_norm = make_view(q_a_norm.data(), DType::kBF16, Memory::kHost, {kQLoraRank}),
               .kv_a_norm = make_view(kv_a_norm.data(), DType::kBF16, Memory::kHost, {kKvLoraRank}),
               .q_b_proj = make_view(q_b_proj.data(), DType::kBF16, Memory::kHost,
                                     {int64_t{num_heads} * kQkHeadDim, kQLoraRank}),
               .w_uk_t = make_view(w_uk_t.data(), DType::kBF16, Memory::kHost, {num_heads, kNopeDim, kKvLoraRank}),
               .w_uv = make_view(w_uv.data(), DType::kBF16, Memory::kHost, {num_heads, kKvLoraRank, kVHeadDim}),
               .q_scale = kQScale,
               .k_scale = kKScale};
  }
  HostLayer(HostLayer&&) = default;
  HostLayer& operator=(HostLayer&&) = default;
  HostLayer(const HostLayer&) = delete;
  HostLayer& operator=(const HostLayer&) = delete;

  int num_heads() const { return dims.num_heads; }

  // Heads [first, first + count) of this layer, as a rank of a DCP group holds them.
  HostLayer heads(int first, int count) const {
    auto slice = [&](const std::vector<uint16_t>& all, int64_t per_head) {
      return std::vector<uint16_t>(all.begin() + first * per_head, all.begin() + (first + count) * per_head);
    };
    return HostLayer(q_a_norm, kv_a_norm, slice(q_b_proj, int64_t{kQkHeadDim} * kQLoraRank),
                     slice(w_uk_t, int64_t{kNopeDim} * kKvLoraRank), slice(w_uv, int64_t{kKvLoraRank} * kVHeadDim),
                     count);
  }
};

inline HostLayer random_layer(std::mt19937_64& rng, int num_heads) {
  return HostLayer(random_bf16(rng, kQLoraRank, 1.0, 0.1), random_bf16(rng, kKvLoraRank, 1.0, 0.1),
                   random_bf16(rng, int64_t{num_heads} * kQkHeadDim * kQLoraRank, 0.0, 0.02),
                   random_bf16(rng, int64_t{num_heads} * kNopeDim * kKvLoraRank, 0.0, 0.02),
                   random_bf16(rng, int64_t{num_heads} * kKvLoraRank * kVHeadDim, 0.0, 0.02), num_heads);
}

// One step's host tensors. `view()` builds the views from the current storage, so copies are safe.
struct HostStep {
  int num_heads = 0;
  int q = 1;
  int64_t rows = 0;
  int64_t pitch = 0;        // row stride of projected, > its width so that the tail shows
  int64_t num_pages = 0;
  int64_t page_stride = 0;  // bytes, > 64 * 576 so that stray page accesses show
  int64_t max_pages = 0;
  std::vector<uint16_t> projected, out;
  std::vector<uint8_t> cache;
  std::vector<int64_t> slots;
  std::vector<int32_t> block_table, lengths, totals;

  StepInputs view() {
    StepInputs step;
    step.projected = make_strided_view(projected.data(), DType::kBF16, Memory::kHost,
                                       {rows, projected_width(num_heads)}, {pitch, 1});
    step.out = make_view(out.data(), DType::kBF16, Memory::kHost, {rows, int64_t{num_heads} * kVHeadDim});
    step.cache = make_strided_view(cache.data(), DType::kU8, Memory::kHost, {num_pages, kPageSize, kKeyDim},
                                   {page_stride, kKeyDim, 1});
    step.slots = make_view(slots.data(), DType::kI64, Memory::kHost, {rows});
    const int64_t num_requests = static_cast<int64_t>(lengths.size());
    step.block_table = make_view(block_table.data(), DType::kI32, Memory::kHost, {num_requests, max_pages});
    step.lengths = make_view(lengths.data(), DType::kI32, Memory::kHost, {num_requests});
    if (!totals.empty()) step.totals = make_view(totals.data(), DType::kI32, Memory::kHost, {num_requests});
    step.q = q;
    return step;
  }

  const uint8_t* cache_token(int64_t page, int64_t offset) const {
    return cache.data() + page * page_stride + offset * kKeyDim;
  }
  // Position `j` of request `b` through the block table.
  const uint8_t* token(int64_t b, int64_t j) const {
    return cache_token(block_table[b * max_pages + j / kPageSize], j % kPageSize);
  }
  const uint16_t* projected_row(int64_t r) const { return projected.data() + r * pitch; }
};

inline constexpr uint16_t kBf16NaN = 0x7fc0;
inline constexpr uint8_t kCacheSentinel = 0xAA;
inline constexpr int64_t kPitchPadding = 24;   // elements past the projected width
inline constexpr int64_t kPagePadding = 96;    // bytes past 64 * 576 in each page

// A step of `lengths.size()` requests (plus `padding_requests` missing ones) with q rows each:
// random pages in a shuffled block table (unused entries point at page 0), a random cache, random
// projected rows, and each row's slot at its own position L - q + i (-1 where that is negative).
inline HostStep random_step(std::mt19937_64& rng, int num_heads, int q, const std::vector<int32_t>& lengths,
                            int padding_requests = 0) {
  HostStep s;
  s.num_heads = num_heads;
  s.q = q;
  s.lengths = lengths;
  const int64_t num_requests = static_cast<int64_t>(lengths.size());
  s.rows = (num_requests + padding_requests) * q;
  s.pitch = projected_width(num_heads) + kPitchPadding;
  int64_t used_pages = 0;
  for (int32_t length : lengths) {
    s.max_pages = std::max<int64_t>(s.max_pages, (length + kPageSize - 1) / kPageSize);
    used_pages += (length + kPageSize - 1) / kPageSize;
  }
  s.max_pages = std::max<int64_t>(s.max_pages, 1) + 1;  // a spare column: the table is wider than used
  s.num_pages = used_pages + 2;                          // unreferenced pages too
  s.page_stride = int64_t{kPageSize} * kKeyDim + kPagePadding;
  s.cache.assign(s.num_pages * s.page_stride, kCacheSentinel);
  for (int64_t p = 0; p < s.num_pages; ++p) {
    const std::vector<uint8_t> page = random_e4m3(rng, int64_t{kPageSize} * kKeyDim);
    std::copy(page.begin(), page.end(), s.cache.begin() + p * s.page_stride);
  }
  std::vector<int32_t> pool(s.num_pages);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  s.block_table.assign(num_requests * s.max_pages, 0);
  int64_t next = 0;
  for (int64_t b = 0; b < num_requests; ++b) {
    for (int64_t p = 0; p < (lengths[b] + kPageSize - 1) / kPageSize; ++p) {
      s.block_table[b * s.max_pages + p] = pool[next++];
    }
  }
  s.projected.assign(s.rows * s.pitch, kBf16NaN);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < projected_width(num_heads); ++c) s.projected[r * s.pitch + c] = bf16_from_double(normal(rng));
  }
  s.out.assign(s.rows * num_heads * kVHeadDim, kBf16NaN);
  s.slots.assign(s.rows, -1);
  for (int64_t b = 0; b < num_requests; ++b) {
    for (int i = 0; i < q; ++i) {
      const int64_t position = lengths[b] - q + i;
      if (position < 0) continue;
      s.slots[b * q + i] = int64_t{s.block_table[b * s.max_pages + position / kPageSize]} * kPageSize +
                           position % kPageSize;
    }
  }
  return s;
}

// Core inputs over a step's cache and metadata with a given query [rows, heads, 576].
inline CoreInputs core_inputs(HostStep& s, const std::vector<uint8_t>& query, int heads) {
  const StepInputs v = s.view();
  return {.query = query.data(),
          .rows = s.rows,
          .heads = heads,
          .q = s.q,
          .cache = v.cache,
          .block_table = v.block_table,
          .lengths = v.lengths,
          .totals = v.totals,
          .softmax_scale = double{kQScale} * kKScale / std::sqrt(192.0),
          .k_scale = kKScale,
          .dcp = {}};
}

// Largest |a - b| over `a`, relative to the largest |a| in each group of `group` elements (a latent
// row): a norm-relative error, since single elements of a softmax average may be near zero.
inline double max_group_relative_error(const std::vector<double>& a, const std::vector<double>& b, int group) {
  double worst = 0;
  for (size_t start = 0; start + group <= a.size(); start += group) {
    double scale = 0, error = 0;
    for (int c = 0; c < group; ++c) {
      scale = std::max(scale, std::fabs(a[start + c]));
      error = std::max(error, std::fabs(a[start + c] - b[start + c]));
    }
    if (scale > 0) worst = std::max(worst, error / scale);
    else worst = std::max(worst, error);
  }
  return worst;
}

}  // namespace mla::ref::testing

namespace mla::ref::testing {

// Rank `dcp.rank`'s shard of a global step (whose lengths are the global totals): its local tokens
// copied out of the global cache into its own pages, local lengths, the global totals, and slots
// only for the new tokens it owns. Projected rows and out are left to the caller.
inline HostStep shard_step(const HostStep& global, const DcpLayout& dcp) {
  HostStep s;
  s.num_heads = global.num_heads;
  s.q = global.q;
  s.rows = global.rows;
  s.pitch = global.pitch;
  s.totals = global.lengths;
  const int64_t num_requests = static_cast<int64_t>(global.lengths.size());
  for (int32_t total : global.lengths) s.lengths.push_back(static_cast<int32_t>(dcp_local_length(total, dcp)));
  s.max_pages = global.max_pages;
  // Pages in reverse request order with one unused page first, so that local page indices differ
  // from the global ones.
  s.block_table.assign(num_requests * s.max_pages, 0);
  int64_t next_page = 1;
  for (int64_t b = num_requests - 1; b >= 0; --b) {
    for (int64_t p = 0; p < (s.lengths[b] + kPageSize - 1) / kPageSize; ++p) {
      s.block_table[b * s.max_pages + p] = static_cast<int32_t>(next_page++);
    }
  }
  s.num_pages = next_page;
  s.page_stride = global.page_stride;
  s.cache.assign(s.num_pages * s.page_stride, kCacheSentinel);
  for (int64_t b = 0; b < num_requests; ++b) {
    for (int64_t j = 0; j < s.lengths[b]; ++j) {
      const uint8_t* from = global.token(b, dcp_global_position(j, dcp));
      std::copy(from, from + kKeyDim, s.cache.begin() + (s.block_table[b * s.max_pages + j / kPageSize] * s.page_stride +
                                                         (j % kPageSize) * kKeyDim));
    }
  }
  s.slots.assign(s.rows, -1);
  for (int64_t b = 0; b < num_requests; ++b) {
    for (int i = 0; i < s.q; ++i) {
      const int64_t position = s.totals[b] - s.q + i;
      if (position < 0 || dcp_owner(position, dcp) != dcp.rank) continue;
      const int64_t j = dcp_local_index(position, dcp);
      s.slots[b * s.q + i] = int64_t{s.block_table[b * s.max_pages + j / kPageSize]} * kPageSize + j % kPageSize;
    }
  }
  return s;
}

// Distance in bf16 units in the last place (the bit patterns ordered as integers).
inline int bf16_ulp_distance(uint16_t a, uint16_t b) {
  auto ordered = [](uint16_t x) { return (x & 0x8000) ? -int(x & 0x7fff) : int(x); };
  return std::abs(ordered(a) - ordered(b));
}

}  // namespace mla::ref::testing

namespace mla::ref::testing {

// Same core result to 1e-12: LSE absolutely (-inf exactly), latent relative to each latent row's
// largest element.
inline void expect_same_core(const CoreResult& expected, const CoreResult& got) {
  ASSERT_EQ(expected.rows, got.rows);
  ASSERT_EQ(expected.heads, got.heads);
  ASSERT_EQ(expected.lse.size(), got.lse.size());
  ASSERT_EQ(expected.latent.size(), got.latent.size());
  for (size_t e = 0; e < expected.lse.size(); ++e) {
    if (expected.lse[e] == -std::numeric_limits<double>::infinity()) {
      EXPECT_EQ(got.lse[e], expected.lse[e]) << "row x head " << e;
    } else {
      EXPECT_NEAR(got.lse[e], expected.lse[e], 1e-12) << "row x head " << e;
    }
  }
  EXPECT_LE(max_group_relative_error(expected.latent, got.latent, kKvLoraRank), 1e-12);
}

}  // namespace mla::ref::testing
