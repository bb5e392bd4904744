// The value kernel against mla::ref::value_stage: every output element within one bf16 step of the
// reference (the kernel sums in fp32, the reference in double: they differ only at rounding
// boundaries) or, where a dot product cancels to near zero, within 1e-4 of its (row, head) RMS (the
// fp32 sum's absolute error is ~1e-6 of it); zero rows exactly +0; poisoned outputs overwritten.
#include <gtest/gtest.h>

#include <cmath>
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

struct ValueCase {
  int heads;
  int q;
  int padded_requests;
  std::vector<int> lengths;  // one per present request (0 = empty request)
};

void run_case(const ValueCase& c, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "H=" << c.heads << " q=" << c.q << " padded=" << c.padded_requests
                                    << " requests=" << c.lengths.size());
  const synth::SyntheticLayer layer = synth::make_layer(c.heads, seed);
  synth::StepSpec spec;
  spec.q = c.q;
  spec.lengths = c.lengths;
  spec.padded_requests = c.padded_requests;
  spec.pitch = projected_width(c.heads) + 40;  // a pitch larger than the row
  spec.cache_fill = synth::CacheFill::kFast;
  spec.seed = seed;
  synth::SyntheticStep step = synth::make_step(layer, spec);
  const int64_t rows = step.rows;

  // A random bf16 latent (the core's output), exactly what the reference sees.
  synth::Rng rng(synth::stream_seed(seed, 77));
  std::vector<uint16_t> latent_bits(rows * c.heads * kKvLoraRank);
  synth::fill_random_bf16(latent_bits, 0.0, 0.5, rng);
  std::vector<double> latent(latent_bits.size());
  for (size_t i = 0; i < latent.size(); ++i) latent[i] = ref::bf16_to_double(latent_bits[i]);

  std::vector<bool> zero_rows(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t request = r / c.q;
    zero_rows[r] = request >= step.num_requests || step.lengths[request] == 0;
  }
  std::vector<uint16_t> expected(rows * c.heads * kVHeadDim);
  ref::value_stage(latent, layer.weights(), layer.dims, step.projected_view(), zero_rows, expected.data());

  DeviceBuffer<uint16_t> d_latent(latent_bits.size()), d_w_uv(layer.w_uv.size()), d_projected(step.projected.size()),
      d_out(expected.size());
  DeviceBuffer<int32_t> d_lengths(std::max<size_t>(1, step.lengths.size()));
  d_latent.upload(latent_bits);
  d_w_uv.upload(layer.w_uv);
  d_projected.upload(step.projected);
  if (!step.lengths.empty()) d_lengths.upload(step.lengths);
  d_out.poison(0xff);

  value::ValueParams p{};
  p.latent = reinterpret_cast<const __nv_bfloat16*>(d_latent.get());
  p.stride_latent_row = int64_t{c.heads} * kKvLoraRank;
  p.w_uv = reinterpret_cast<const __nv_bfloat16*>(d_w_uv.get());
  p.projected = reinterpret_cast<const __nv_bfloat16*>(d_projected.get());
  p.stride_projected_row = step.pitch;
  p.lengths = d_lengths.get();
  p.totals = nullptr;
  p.num_requests = step.num_requests;
  p.q = c.q;
  p.out = reinterpret_cast<__nv_bfloat16*>(d_out.get());
  p.rows = static_cast<int>(rows);
  p.num_heads = c.heads;
  value::launch_value(p, value::plan_value(p.rows, c.heads), nullptr, /*pdl=*/true);
  MLA_CUDA_CHECK(cudaDeviceSynchronize());

  const std::vector<uint16_t> got = d_out.download();
  const std::vector<double> slice_rms = test::slice_rms(expected);  // scale of the fp32 rounding allowance
  int64_t mismatches = 0, off_by_one = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int64_t row = static_cast<int64_t>(i) / (c.heads * kVHeadDim);
    if (zero_rows[row]) {
      if (got[i] != 0) ++mismatches;  // exactly +0
      continue;
    }
    const int steps = bf16_steps(got[i], expected[i]);
    const double difference = std::abs(double(synth::bf16_value(got[i])) - synth::bf16_value(expected[i]));
    if (steps > 1 && !(difference <= 1e-4 * slice_rms[i / kVHeadDim])) {
      if (++mismatches <= 5) {
        ADD_FAILURE() << "element " << i << " (row " << row << "): got " << synth::bf16_value(got[i]) << " expected "
                      << synth::bf16_value(expected[i]);
      }
    }
    off_by_one += steps == 1;
  }
  EXPECT_EQ(mismatches, 0);
  // One-step differences come only from rounding boundaries: rare, never systematic.
  EXPECT_LE(off_by_one, static_cast<int64_t>(got.size() / 50 + 1));
}

TEST(ValueKernel, HeadsAndRowCounts) {
  MLA_REQUIRE_GPU();
  uint64_t seed = 100;
  for (int heads : {1, 8, 12, 16, 64, 96, 128}) {
    run_case({heads, 1, 1, {5}}, ++seed);
    run_case({heads, 1, 7, {3, 1, 9, 2, 64, 65, 1}}, ++seed);
  }
  run_case({12, 1, 64, synth::random_lengths(64, 1, 300, 5)}, ++seed);
  run_case({96, 4, 64, synth::random_lengths(16, 4, 300, 6)}, ++seed);
}

TEST(ValueKernel, EmptyAndPaddedRequestsAreExactlyZero) {
  MLA_REQUIRE_GPU();
  run_case({12, 2, 6, {0, 7, 0}}, 7);     // requests 0 and 2 empty, requests 3..5 padding
  run_case({16, 8, 4, {0, 0, 0, 0}}, 8);  // every request empty
  run_case({8, 1, 33, {1}}, 9);           // one real row, 32 padding rows (several row tiles)
}

TEST(ValueKernel, LargeBatch) {
  MLA_REQUIRE_GPU();
  run_case({12, 1, 512, synth::random_lengths(512, 1, 100, 11)}, 12);
}

}  // namespace
}  // namespace mla
