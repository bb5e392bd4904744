// The value kernel's DCP merge (num_partials = D > 1) against mla::ref::dcp_merge + value_stage on
// the same bf16 partials: rank k of D reads heads [k*H, (k+1)*H) of D partial latents [rows, D*H, 512]
// and LSEs [rows, D*H]. The kernel merges in fp32 and does not round the merged latent, so the
// reference gets the unrounded merge: outputs within one bf16 step (rounding boundaries) or 1e-4 of
// the slice RMS where a dot product cancels. Empty shards (lse = -inf) hold NaN latents here: they must
// weigh exactly 0; an all-empty (row, head) gives exactly 0; zero rows exactly +0. One (row, head) has a NaN LSE on
// rank 0 only and one on every rank (a NaN logit on those shards): both must come out NaN, as the reference's.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "gpu_compare.h"
#include "gpu_test_util.h"
#include "reference.h"
#include "synthetic.h"
#include "value/launch.h"

namespace mla {
namespace {

using test::DeviceBuffer;

using test::bf16_steps;

struct MergeCase {
  int size;        // D
  int rank;        // k: whose heads are merged
  int heads;       // H
  int q;
  int padded_requests;
  std::vector<int> totals;  // per present request (0 = empty request: zero rows)
};

void run_case(const MergeCase& c, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "D=" << c.size << " k=" << c.rank << " H=" << c.heads << " q=" << c.q);
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const synth::SyntheticLayer layer = synth::make_layer(c.heads, seed);
  synth::StepSpec spec;
  spec.q = c.q;
  spec.lengths = c.totals;
  spec.padded_requests = c.padded_requests;
  spec.cache_fill = synth::CacheFill::kFast;
  spec.seed = seed;
  synth::SyntheticStep step = synth::make_step(layer, spec);
  const int64_t rows = step.rows;
  const int core_heads = c.size * c.heads;

  // Partials: random bf16 latents and LSEs in [-6, 6]; ~1/4 of the (rank, row, head) entries empty
  // (lse -inf, NaN latent), and (row 0, head 0) empty on every rank.
  synth::Rng rng(synth::stream_seed(seed, 91));
  std::vector<std::vector<uint16_t>> latent_bits(c.size, std::vector<uint16_t>(rows * core_heads * kKvLoraRank));
  std::vector<std::vector<float>> lse(c.size, std::vector<float>(rows * core_heads));
  std::vector<ref::CoreResult> own(c.size);  // the reference's view: this rank's heads, empty latent = 0
  for (int p = 0; p < c.size; ++p) {
    synth::fill_random_bf16(latent_bits[p], 0.0, 0.5, rng);
    own[p].rows = rows;
    own[p].heads = c.heads;
    own[p].latent.assign(rows * c.heads * kKvLoraRank, 0.0);
    own[p].lse.assign(rows * c.heads, -kInf);
    for (int64_t r = 0; r < rows; ++r) {
      for (int h = 0; h < core_heads; ++h) {
        const int64_t e = r * core_heads + h;
        const bool empty = rng() % 4 == 0 || (r == 0 && h == c.rank * c.heads);
        lse[p][e] = empty ? -std::numeric_limits<float>::infinity()
                          : static_cast<float>(int64_t(rng() % 12001) - 6000) / 1000.0f;
        if (empty) std::fill_n(latent_bits[p].begin() + e * kKvLoraRank, kKvLoraRank, uint16_t{0xffff});
        if (h < c.rank * c.heads || h >= (c.rank + 1) * c.heads || empty) continue;
        const int64_t o = r * c.heads + (h - c.rank * c.heads);
        own[p].lse[o] = lse[p][e];
        for (int d = 0; d < kKvLoraRank; ++d) {
          own[p].latent[o * kKvLoraRank + d] = ref::bf16_to_double(latent_bits[p][e * kKvLoraRank + d]);
        }
      }
    }
  }
  std::vector<bool> zero_rows(rows);
  for (int64_t r = 0; r < rows; ++r) zero_rows[r] = r / c.q >= step.num_requests || step.lengths[r / c.q] == 0;
  // The NaN entries: this rank's first and last head of the last row that is not a zero row (heads >= 2 here).
  int64_t nan_row = rows - 1;
  while (nan_row > 0 && zero_rows[nan_row]) --nan_row;
  ASSERT_FALSE(zero_rows[nan_row]);
  ASSERT_GE(c.heads, 2);
  for (int p = 0; p < c.size; ++p) {
    for (const int h : {0, c.heads - 1}) {
      if (h == 0 && p > 0) continue;  // head 0: rank 0's partial only; the last head: every rank's
      lse[p][nan_row * core_heads + c.rank * c.heads + h] = std::numeric_limits<float>::quiet_NaN();
      own[p].lse[nan_row * c.heads + h] = std::numeric_limits<double>::quiet_NaN();
    }
  }
  const ref::CoreResult merged = ref::dcp_merge(own);
  std::vector<uint16_t> expected(rows * c.heads * kVHeadDim);
  ref::value_stage(merged.latent, layer.weights(), layer.dims, step.projected_view(), zero_rows, expected.data());

  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> d_latent;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> d_lse;
  for (int p = 0; p < c.size; ++p) {
    d_latent.push_back(std::make_unique<DeviceBuffer<uint16_t>>(latent_bits[p].size()));
    d_latent.back()->upload(latent_bits[p]);
    d_lse.push_back(std::make_unique<DeviceBuffer<float>>(lse[p].size()));
    d_lse.back()->upload(lse[p]);
  }
  DeviceBuffer<uint16_t> d_w_uv(layer.w_uv.size()), d_projected(step.projected.size()), d_out(expected.size());
  DeviceBuffer<int32_t> d_totals(std::max<size_t>(1, step.lengths.size()));
  d_w_uv.upload(layer.w_uv);
  d_projected.upload(step.projected);
  if (!step.lengths.empty()) d_totals.upload(step.lengths);
  d_out.poison(0xff);

  value::ValueParams params{};
  params.latent = nullptr;
  params.stride_latent_row = int64_t{core_heads} * kKvLoraRank;
  params.w_uv = reinterpret_cast<const __nv_bfloat16*>(d_w_uv.get());
  params.projected = reinterpret_cast<const __nv_bfloat16*>(d_projected.get());
  params.stride_projected_row = step.pitch;
  params.lengths = d_totals.get();  // local lengths are not read when totals are given
  params.totals = d_totals.get();
  params.num_requests = step.num_requests;
  params.q = c.q;
  params.out = reinterpret_cast<__nv_bfloat16*>(d_out.get());
  params.rows = static_cast<int>(rows);
  params.num_heads = c.heads;
  params.num_partials = c.size;
  params.stride_lse_row = core_heads;
  for (int p = 0; p < c.size; ++p) {
    params.partial_latent[p] =
        reinterpret_cast<const __nv_bfloat16*>(d_latent[p]->get()) + int64_t{c.rank} * c.heads * kKvLoraRank;
    params.partial_lse[p] = d_lse[p]->get() + int64_t{c.rank} * c.heads;
  }
  // The merge always runs the CUDA-core kernel (its merged latent stays fp32), at every batch size.
  const value::ValuePlan plan = value::plan_value(params.rows, c.heads, c.size);
  ASSERT_EQ(plan.kernel, value::ValueKernel::kCudaCore);
  value::launch_value(params, plan, nullptr, /*pdl=*/false);
  MLA_CUDA_CHECK(cudaDeviceSynchronize());

  const std::vector<uint16_t> got = d_out.download();
  const std::vector<double> slice_rms = test::slice_rms(expected);  // scale of the fp32 rounding allowance
  int64_t mismatches = 0, nan_elements = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int64_t row = static_cast<int64_t>(i) / (c.heads * kVHeadDim);
    const bool all_empty = merged.lse[i / kVHeadDim] == -kInf;
    if (!zero_rows[row] && std::isnan(merged.lse[i / kVHeadDim])) {  // a NaN partial: the reference's out is NaN
      ++nan_elements;
      if (!(std::isnan(synth::bf16_value(got[i])) && std::isnan(synth::bf16_value(expected[i]))) && ++mismatches <= 5) {
        ADD_FAILURE() << "element " << i << " (row " << row << ") merges a NaN LSE: got " << synth::bf16_value(got[i])
                      << " expected " << synth::bf16_value(expected[i]);
      }
      continue;
    }
    if (zero_rows[row] || all_empty) {
      if (got[i] != 0) ++mismatches;  // exactly +0: a zero latent times the gate
      continue;
    }
    const double difference = std::abs(double(synth::bf16_value(got[i])) - synth::bf16_value(expected[i]));
    if (bf16_steps(got[i], expected[i]) > 1 && !(difference <= 1e-4 * slice_rms[i / kVHeadDim])) {
      if (++mismatches <= 5) {
        ADD_FAILURE() << "element " << i << " (row " << row << "): got " << synth::bf16_value(got[i]) << " expected "
                      << synth::bf16_value(expected[i]);
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(nan_elements, 2 * kVHeadDim);  // both NaN entries reached the comparison
}

TEST(ValueKernelDcpMerge, RanksHeadsAndRows) {
  MLA_REQUIRE_GPU();
  uint64_t seed = 300;
  for (int size : {2, 4, 8}) {
    for (int heads : {12, 16}) {
      run_case({size, size - 1, heads, 1, 5, {3, 0, 9, 70}}, ++seed);
      run_case({size, 0, heads, 4, 4, {5, 1}}, ++seed);
    }
  }
  run_case({8, 3, 128, 1, 20, synth::random_lengths(18, 0, 50, 7)}, ++seed);  // several row tiles
  run_case({2, 1, 12, 1, 70, synth::random_lengths(66, 0, 50, 8)}, ++seed);  // 70 rows: still the CUDA-core kernel
}

}  // namespace
}  // namespace mla
