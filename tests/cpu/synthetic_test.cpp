// The synthetic layer / step generator (tools/synthetic.h) and the CLI's argument parser.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "cli_args.h"
#include "reference.h"
#include "synthetic.h"

namespace mla::synth {
namespace {

bool is_power_of_two(float x) {
  int exponent = 0;
  return x > 0 && std::frexp(x, &exponent) == 0.5f;
}

double mean_of_bf16(const std::vector<uint16_t>& v) {
  double sum = 0;
  for (uint16_t b : v) sum += bf16_value(b);
  return sum / v.size();
}

double rms_of_bf16(const std::vector<uint16_t>& v, double mean) {
  double sum = 0;
  for (uint16_t b : v) sum += (bf16_value(b) - mean) * (bf16_value(b) - mean);
  return std::sqrt(sum / v.size());
}

TEST(SyntheticLayer, DeterministicForASeedAndHeadsArePrefixes) {
  const SyntheticLayer a = make_layer(4, 7);
  const SyntheticLayer b = make_layer(4, 7);
  EXPECT_EQ(a.q_b_proj, b.q_b_proj);
  EXPECT_EQ(a.w_uk_t, b.w_uk_t);
  EXPECT_EQ(a.w_uv, b.w_uv);
  EXPECT_EQ(a.q_scale, b.q_scale);
  EXPECT_EQ(a.k_scale, b.k_scale);

  const SyntheticLayer c = make_layer(4, 8);
  EXPECT_NE(a.q_b_proj, c.q_b_proj);
  EXPECT_NE(a.q_a_norm, c.q_a_norm);

  // Head h does not depend on num_heads: the 4-head layer is the first 4 heads of the 12-head one.
  const SyntheticLayer wide = make_layer(12, 7);
  EXPECT_TRUE(std::equal(a.q_b_proj.begin(), a.q_b_proj.end(), wide.q_b_proj.begin()));
  EXPECT_TRUE(std::equal(a.w_uk_t.begin(), a.w_uk_t.end(), wide.w_uk_t.begin()));
  EXPECT_TRUE(std::equal(a.w_uv.begin(), a.w_uv.end(), wide.w_uv.begin()));
}

TEST(SyntheticLayer, ShapesScalesAndDistributions) {
  const SyntheticLayer layer = make_layer(12, 1);
  EXPECT_EQ(layer.q_b_proj.size(), size_t{12} * 192 * 1536);
  EXPECT_EQ(layer.w_uk_t.size(), size_t{12} * 128 * 512);
  EXPECT_EQ(layer.w_uv.size(), size_t{12} * 512 * 128);
  EXPECT_NEAR(mean_of_bf16(layer.q_a_norm), 1.0, 0.02);
  EXPECT_NEAR(rms_of_bf16(layer.q_a_norm, 1.0), 0.1, 0.01);
  EXPECT_NEAR(rms_of_bf16(layer.q_b_proj, 0.0), 1.0 / std::sqrt(1536.0), 0.001);
  EXPECT_NEAR(rms_of_bf16(layer.w_uk_t, 0.0), 1.0 / std::sqrt(128.0), 0.001);
  EXPECT_NEAR(rms_of_bf16(layer.w_uv, 0.0), 1.0 / std::sqrt(512.0), 0.001);

  // Powers of two that put the data's largest values in the upper half of the e4m3 range.
  EXPECT_TRUE(is_power_of_two(layer.q_scale)) << layer.q_scale;
  EXPECT_TRUE(is_power_of_two(layer.k_scale)) << layer.k_scale;
  EXPECT_GT(layer.q_scale, 1.0f / 1024);
  EXPECT_LT(layer.q_scale, 1.0f / 16);
  EXPECT_GT(layer.k_scale, 1.0f / 1024);
  EXPECT_LT(layer.k_scale, 1.0f / 16);

  const Weights w = layer.weights();
  EXPECT_EQ(w.q_b_proj.shape[0], 12 * 192);
  EXPECT_EQ(w.w_uk_t.rank, 3);
  EXPECT_EQ(w.q_scale, layer.q_scale);
}

TEST(SyntheticLayer, RejectsBadHeads) {
  EXPECT_THROW(make_layer(0, 1), Error);
  EXPECT_THROW(make_layer(129, 1), Error);
}

// Every structural invariant of a step, for any lengths, q and padding.
void check_step(const SyntheticStep& step, const std::vector<int>& lengths, int q, int padded_requests) {
  SCOPED_TRACE("q=" + std::to_string(q));
  const int reqs = static_cast<int>(lengths.size());
  ASSERT_EQ(step.num_requests, reqs);
  ASSERT_EQ(step.rows, int64_t{std::max(reqs, padded_requests)} * q);
  ASSERT_EQ(step.lengths, std::vector<int32_t>(lengths.begin(), lengths.end()));
  ASSERT_EQ(step.block_table.size(), size_t(reqs) * step.max_pages);
  ASSERT_EQ(step.cache.size(), size_t(step.num_pages * step.page_stride));
  ASSERT_EQ(step.projected.size(), size_t(step.rows * step.pitch));
  ASSERT_EQ(step.slots.size(), size_t(step.rows));

  // Block table: every entry a valid page; used pages belong to exactly one request.
  std::set<int32_t> used;
  int64_t used_count = 0;
  for (int b = 0; b < reqs; ++b) {
    const int pages = (lengths[b] + kPageSize - 1) / kPageSize;
    ASSERT_LE(pages, step.max_pages);
    for (int p = 0; p < step.max_pages; ++p) {
      const int32_t page = step.block_table[size_t(b) * step.max_pages + p];
      ASSERT_GE(page, 0);
      ASSERT_LT(page, step.num_pages);
      if (p < pages) {
        used.insert(page);
        ++used_count;
      } else {
        EXPECT_EQ(page, 0);
      }
    }
  }
  EXPECT_EQ(int64_t(used.size()), used_count) << "a page is shared by two requests";

  // Slots: the last q positions of each request, distinct, in range; -1 before position 0 and for
  // padding rows.
  std::set<int64_t> slots;
  for (int64_t r = 0; r < step.rows; ++r) {
    const int b = static_cast<int>(r / q);
    const int64_t position = b < reqs ? int64_t{lengths[b]} - q + r % q : -1;
    if (position < 0) {
      EXPECT_EQ(step.slots[r], -1) << "row " << r;
      EXPECT_EQ(step.visible_tokens(r), 0);
      continue;
    }
    EXPECT_EQ(step.slots[r], step.slot_of(b, position)) << "row " << r;
    EXPECT_GE(step.slots[r], 0);
    EXPECT_LT(step.slots[r], step.num_pages * kPageSize);
    EXPECT_TRUE(slots.insert(step.slots[r]).second) << "slot written twice";
    EXPECT_EQ(step.visible_tokens(r), position + 1);
  }

  // Previous tokens hold finite FP8 bytes; the new-token slots and the tails hold NaN (default fill).
  for (int b = 0; b < reqs; ++b) {
    const int64_t length = lengths[b];
    for (int64_t j = 0; j < length; ++j) {
      const uint8_t* row = step.token_row(b, j);
      const bool any_nan = std::any_of(row, row + kKeyDim, [](uint8_t x) { return (x & 0x7f) == 0x7f; });
      const bool all_nan = std::all_of(row, row + kKeyDim, [](uint8_t x) { return x == 0x7f; });
      if (j < length - q) {
        ASSERT_FALSE(any_nan) << "request " << b << " token " << j;
      } else {
        ASSERT_TRUE(all_nan) << "request " << b << " new token " << j;
      }
    }
  }
  // The output is poisoned.
  EXPECT_TRUE(std::all_of(step.out.begin(), step.out.end(), [](uint16_t x) { return x == 0xffff; }));
}

TEST(SyntheticStep, ShapesSlotsAndBlockTablesForEdgeLengths) {
  const SyntheticLayer layer = make_layer(2, 3);
  const std::vector<int> lengths = {0, 1, 63, 64, 65, 130, 7};
  for (int q : {1, 2, 4, 8}) {
    const SyntheticStep step = make_step(layer, static_cast<int>(lengths.size()), q, lengths, 0, 2, 11);
    check_step(step, lengths, q, 0);
    EXPECT_EQ(step.pitch, projected_width(2));
    EXPECT_EQ(step.max_pages, 3);
    EXPECT_EQ(step.num_pages, 0 + 1 + 1 + 1 + 2 + 3 + 1 + 2);
  }
}

TEST(SyntheticStep, OneLengthForAllRequests) {
  const SyntheticLayer layer = make_layer(1, 3);
  const SyntheticStep step = make_step(layer, 3, 2, {100}, 0, 0, 5);
  check_step(step, {100, 100, 100}, 2, 0);
  EXPECT_THROW(make_step(layer, 3, 2, {100, 100}, 0, 0, 5), Error);
  EXPECT_THROW(make_step(layer, 3, 9, {100}, 0, 0, 5), Error);
  EXPECT_THROW(make_step(layer, 3, 1, {-1}, 0, 0, 5), Error);
  EXPECT_THROW(make_step(layer, 3, 1, {100}, projected_width(1) - 1, 0, 5), Error);
}

TEST(SyntheticStep, DeterministicForASeed) {
  const SyntheticLayer layer = make_layer(3, 1);
  for (CacheFill fill : {CacheFill::kExact, CacheFill::kFast}) {
    StepSpec spec;
    spec.q = 2;
    spec.lengths = {70, 300};
    spec.cache_fill = fill;
    spec.stale_fill = StaleFill::kRandom;
    spec.seed = 42;
    const SyntheticStep a = make_step(layer, spec);
    const SyntheticStep b = make_step(layer, spec);
    EXPECT_EQ(a.projected, b.projected);
    EXPECT_EQ(a.cache, b.cache);
    EXPECT_EQ(a.block_table, b.block_table);
    EXPECT_EQ(a.slots, b.slots);
    spec.seed = 43;
    const SyntheticStep c = make_step(layer, spec);
    EXPECT_NE(a.projected, c.projected);
    EXPECT_NE(a.cache, c.cache);
  }
}

TEST(SyntheticStep, PagesArePermuted) {
  const SyntheticLayer layer = make_layer(1, 1);
  for (uint64_t seed = 0; seed < 20; ++seed) {
    // Two pages: a random shuffle is the identity half the time; the generator must avoid it.
    const SyntheticStep two = make_step(layer, 1, 1, {128}, 0, 0, seed);
    EXPECT_NE(two.block_table, (std::vector<int32_t>{0, 1})) << "seed " << seed;
  }
  const SyntheticStep step = make_step(layer, 4, 1, {1000}, 0, 3, 9);
  std::vector<int32_t> identity(step.block_table.size());
  for (size_t i = 0; i < identity.size(); ++i) identity[i] = static_cast<int32_t>(i);
  EXPECT_NE(step.block_table, identity);
}

TEST(SyntheticStep, PaddedStep) {
  const SyntheticLayer layer = make_layer(2, 1);
  const SyntheticStep step = make_padded_step(layer, 5, 2, {10, 80}, 0, 0, 3);
  check_step(step, {10, 80}, 2, 5);
  EXPECT_EQ(step.rows, 10);
  EXPECT_EQ(step.num_requests, 2);
  EXPECT_EQ(step.total_visible_tokens(), 9 + 10 + 79 + 80);
  EXPECT_THROW(make_padded_step(layer, 1, 2, {10, 80}, 0, 0, 3), Error);
}

TEST(SyntheticStep, PitchPageStrideAndViews) {
  const SyntheticLayer layer = make_layer(2, 1);
  StepSpec spec;
  spec.q = 1;
  spec.lengths = {65, 3};
  spec.pitch = projected_width(2) + 64;
  spec.page_stride = 64 * 576 + 1024;
  spec.max_pages = 4;
  SyntheticStep step = make_step(layer, spec);
  check_step(step, {65, 3}, 1, 0);
  const StepInputs in = step.inputs();
  EXPECT_EQ(in.projected.shape[1], projected_width(2));
  EXPECT_EQ(in.projected.stride[0], spec.pitch);
  EXPECT_EQ(in.cache.stride[0], spec.page_stride);
  EXPECT_EQ(in.cache.shape[0], step.num_pages);
  EXPECT_EQ(in.block_table.shape[1], 4);
  EXPECT_EQ(in.slots.dtype, DType::kI64);
  EXPECT_FALSE(in.totals.present());
  EXPECT_EQ(in.q, 1);
  // Columns past the used width are NaN.
  EXPECT_EQ(step.projected[spec.pitch - 1], 0xffff);
}

TEST(SyntheticStep, PrewrittenNewTokensMatchTheReferenceCacheRow) {
  const SyntheticLayer layer = make_layer(2, 5);
  StepSpec spec;
  spec.q = 3;
  spec.lengths = {5, 2};
  spec.prewrite_new_tokens = true;
  const SyntheticStep step = make_step(layer, spec);
  for (int64_t r = 0; r < step.rows; ++r) {
    if (step.slots[r] < 0) continue;
    const uint16_t* row = step.projected.data() + r * step.pitch;
    const ref::NormedRow normed =
        ref::rms_norms(row, layer.q_a_norm.data(), layer.kv_a_norm.data(), layer.dims.rms_eps);
    std::vector<uint8_t> expected(kKeyDim);
    ref::cache_row(normed.kv_normed, row, layer.k_scale, expected.data());
    const int b = static_cast<int>(r / spec.q);
    const uint8_t* got = step.token_row(b, step.lengths[b] - spec.q + r % spec.q);
    EXPECT_TRUE(std::equal(expected.begin(), expected.end(), got)) << "row " << r;
  }
}

// The fast fill draws from the exact fill's distribution: per-column mean |x| agree.
TEST(SyntheticStep, FastCacheFillMatchesTheExactDistribution) {
  const SyntheticLayer layer = make_layer(1, 2);
  auto column_means = [&](CacheFill fill) {
    StepSpec spec;
    spec.lengths = {4097};
    spec.cache_fill = fill;
    const SyntheticStep step = make_step(layer, spec);
    EXPECT_EQ(step.exact_cache, fill == CacheFill::kExact);
    std::vector<double> mean(kKeyDim, 0);
    for (int j = 0; j < 4096; ++j) {
      const uint8_t* row = step.token_row(0, j);
      for (int c = 0; c < kKeyDim; ++c) mean[c] += std::abs(ref::e4m3_to_double(row[c])) / 4096;
    }
    return mean;
  };
  const std::vector<double> exact = column_means(CacheFill::kExact);
  const std::vector<double> fast = column_means(CacheFill::kFast);
  double exact_kv = 0, fast_kv = 0, exact_pe = 0, fast_pe = 0;
  for (int c = 0; c < kKeyDim; ++c) {
    EXPECT_NEAR(fast[c], exact[c], 0.1 * exact[c]) << "column " << c;
    (c < kKvLoraRank ? exact_kv : exact_pe) += exact[c];
    (c < kKvLoraRank ? fast_kv : fast_pe) += fast[c];
  }
  EXPECT_NEAR(fast_kv, exact_kv, 0.02 * exact_kv);
  EXPECT_NEAR(fast_pe, exact_pe, 0.03 * exact_pe);
}

TEST(SyntheticStep, LongContextUsesTheFastFill) {
  const SyntheticLayer layer = make_layer(1, 2);
  const SyntheticStep step = make_step(layer, 1, 1, {1 << 17}, 0, 0, 4);
  EXPECT_FALSE(step.exact_cache);
  EXPECT_EQ(step.max_pages, 2048);
  EXPECT_EQ(step.total_visible_tokens(), 1 << 17);
}

// The reference runs on a generated step: finite output, exact zeros for empty and padded requests.
TEST(SyntheticStep, ReferenceRunsOnIt) {
  const SyntheticLayer layer = make_layer(2, 1);
  SyntheticStep step = make_padded_step(layer, 4, 2, {0, 1, 70}, 0, 1, 2);
  ref::run_layer(layer.weights(), layer.dims, step.inputs());
  const int64_t width = 2 * kVHeadDim;
  for (int64_t r = 0; r < step.rows; ++r) {
    bool all_zero = true, all_finite = true;
    for (int64_t c = 0; c < width; ++c) {
      const float x = bf16_value(step.out[r * width + c]);
      all_zero = all_zero && x == 0;
      all_finite = all_finite && std::isfinite(x);
    }
    EXPECT_TRUE(all_finite) << "row " << r;
    EXPECT_EQ(all_zero, step.visible_tokens(r) == 0) << "row " << r;
  }
}

TEST(Synthetic, Bf16BitsRoundToNearestEven) {
  EXPECT_EQ(bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(bf16_bits(-2.0f), 0xc000);
  for (float x : {0.1f, 3.14159f, -1e-3f, 65504.0f, 1e30f}) {
    EXPECT_EQ(bf16_bits(x), ref::bf16_from_double(x)) << x;
  }
  EXPECT_TRUE(std::isnan(bf16_value(bf16_bits(NAN))));
}

TEST(Synthetic, RandomLengths) {
  const std::vector<int> a = random_lengths(100, 0, 70, 1);
  EXPECT_EQ(a, random_lengths(100, 0, 70, 1));
  EXPECT_TRUE(std::all_of(a.begin(), a.end(), [](int x) { return x >= 0 && x <= 70; }));
  EXPECT_THROW(random_lengths(3, 5, 4, 1), Error);
}

}  // namespace
}  // namespace mla::synth

namespace mla::cli {
namespace {

Invocation parse(std::vector<std::string> args) { return parse_args(args); }

TEST(CliArgs, DefaultsAndFlags) {
  const Invocation d = parse({"run"});
  EXPECT_EQ(d.command, Command::kRun);
  EXPECT_EQ(d.run.heads, 12);
  EXPECT_EQ(d.run.batch, 4);
  EXPECT_EQ(d.run.context, 4096);
  EXPECT_EQ(d.run.q, 1);
  EXPECT_EQ(d.run.steps, 1);

  const Invocation r = parse({"run", "--heads", "96", "--batch=8", "--context", "65", "--q", "4", "--seed",
                              "18446744073709551615", "--steps=10"});
  EXPECT_EQ(r.run.heads, 96);
  EXPECT_EQ(r.run.batch, 8);
  EXPECT_EQ(r.run.context, 65);
  EXPECT_EQ(r.run.q, 4);
  EXPECT_EQ(r.run.seed, 18446744073709551615ull);
  EXPECT_EQ(r.run.steps, 10);
}

TEST(CliArgs, Help) {
  EXPECT_EQ(parse({"--help"}).command, Command::kHelp);
  EXPECT_EQ(parse({"-h"}).command, Command::kHelp);
  EXPECT_EQ(parse({"help"}).command, Command::kHelp);
  EXPECT_EQ(parse({"run", "--heads", "3", "--help"}).command, Command::kHelp);
  EXPECT_NE(usage().find("--context"), std::string::npos);
}

TEST(CliArgs, Errors) {
  auto message = [](std::vector<std::string> args) {
    try {
      parse_args(args);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({}).find("missing command"), std::string::npos);
  EXPECT_NE(message({"fly"}).find("unknown command 'fly'"), std::string::npos);
  EXPECT_NE(message({"run", "--hedas", "3"}).find("unknown flag '--hedas'"), std::string::npos);
  EXPECT_NE(message({"run", "--hedas=3"}).find("unknown flag '--hedas'"), std::string::npos);
  EXPECT_NE(message({"run", "--heads"}).find("--heads: missing value"), std::string::npos);
  EXPECT_NE(message({"run", "--heads", "0"}).find("--heads: expected an integer in 1..128, got '0'"),
            std::string::npos);
  EXPECT_NE(message({"run", "--heads", "129"}).find("got '129'"), std::string::npos);
  EXPECT_NE(message({"run", "--q", "9"}).find("--q"), std::string::npos);
  EXPECT_NE(message({"run", "--batch", "4x"}).find("got '4x'"), std::string::npos);
  EXPECT_NE(message({"run", "--batch", ""}).find("got ''"), std::string::npos);
  EXPECT_NE(message({"run", "--seed", "-1"}).find("--seed"), std::string::npos);
  EXPECT_NE(message({"run", "--context", "131073"}).find("--context"), std::string::npos);
  EXPECT_NE(message({"run", "--steps", "0"}).find("--steps"), std::string::npos);
  EXPECT_NE(message({"run", "extra"}).find("unexpected argument 'extra'"), std::string::npos);
}

}  // namespace
}  // namespace mla::cli
