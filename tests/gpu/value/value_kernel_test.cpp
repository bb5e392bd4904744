// The value kernels (CUDA-core and tensor-core, each forced through its plan) against
// mla::ref::value_stage: every output element within one bf16 step of the reference (the kernels sum
// in fp32, the reference in double: they differ only at rounding boundaries) or, where a dot product
// cancels to near zero, within 1e-4 of its (row, head) RMS (the fp32 sum's absolute error is ~1e-6 of
// it); zero rows exactly +0; poisoned outputs overwritten, and nothing written outside `out` (a
// poisoned guard row after the last row, and before an unaligned `out`).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <vector>

#include "cpu/error_of.h"
#include "gpu_compare.h"
#include "gpu_test_util.h"
#include "reference.h"
#include "synthetic.h"
#include "value/config.h"
#include "value/launch.h"

namespace mla {
namespace {

using test::DeviceBuffer;

using test::bf16_steps;
using value::ValueKernel;

constexpr ValueKernel kAllKernels[] = {ValueKernel::kCudaCore, ValueKernel::kTensorCore,
                                       ValueKernel::kTensorCoreSplit, ValueKernel::kCudaCorePacked};

struct ValueCase {
  int heads;
  int q;
  int padded_requests;
  std::vector<int> lengths;  // one per present request (0 = empty request)
  int latent_pad = 0;        // stride_latent_row = H*512 + latent_pad (a latent pitch larger than the row)
  int out_offset = 0;        // `out` starts this many bf16 past a 16-byte boundary (1: unaligned stores)
};

// One layer per head count: building a layer (q_b_proj, W_UK_T, W_UV) costs far more than a case.
const synth::SyntheticLayer& layer_for(int heads) {
  static std::map<int, synth::SyntheticLayer> layers;
  auto it = layers.find(heads);
  if (it == layers.end()) it = layers.emplace(heads, synth::make_layer(heads, 1000 + heads)).first;
  return it->second;
}

// `count` lengths in [1, 50], with requests i % 4 < empty_of_4 empty (spread over every row tile).
std::vector<int> lengths_with_empty(int count, int empty_of_4, uint64_t seed) {
  std::vector<int> lengths = synth::random_lengths(count, 1, 50, seed);
  for (int i = 0; i < count; ++i) {
    if (i % 4 < empty_of_4) lengths[i] = 0;
  }
  return lengths;
}

// Runs `c` through both kernels (each plan forced to it) against one reference result.
void run_case(const ValueCase& c, uint64_t seed) {
  const synth::SyntheticLayer& layer = layer_for(c.heads);
  synth::StepSpec spec;
  spec.q = c.q;
  spec.lengths = c.lengths;
  spec.padded_requests = c.padded_requests;
  spec.pitch = projected_width(c.heads) + 40;  // a pitch larger than the row (its tail is NaN)
  spec.cache_fill = synth::CacheFill::kFast;
  spec.seed = seed;
  synth::SyntheticStep step = synth::make_step(layer, spec);
  const int64_t rows = step.rows;
  SCOPED_TRACE(::testing::Message() << "H=" << c.heads << " q=" << c.q << " rows=" << rows
                                    << " requests=" << c.lengths.size() << " latent_pad=" << c.latent_pad
                                    << " out_offset=" << c.out_offset);

  // A random bf16 latent (the core's output), exactly what the reference sees; the pad past each
  // row's H*512 values is NaN, so reading it shows.
  const int64_t stride_latent_row = int64_t{c.heads} * kKvLoraRank + c.latent_pad;
  synth::Rng rng(synth::stream_seed(seed, 77));
  std::vector<uint16_t> latent_bits(rows * stride_latent_row, uint16_t{0xffff});
  std::vector<double> latent(rows * c.heads * kKvLoraRank);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* row = latent_bits.data() + r * stride_latent_row;
    synth::fill_random_bf16(row, int64_t{c.heads} * kKvLoraRank, 0.0, 0.5, rng);
    for (int64_t i = 0; i < int64_t{c.heads} * kKvLoraRank; ++i) {
      latent[r * c.heads * kKvLoraRank + i] = ref::bf16_to_double(row[i]);
    }
  }

  std::vector<bool> zero_rows(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t request = r / c.q;
    zero_rows[r] = request >= step.num_requests || step.lengths[request] == 0;
  }
  std::vector<uint16_t> expected(rows * c.heads * kVHeadDim);
  ref::value_stage(latent, layer.weights(), layer.dims, step.projected_view(), zero_rows, expected.data());
  const std::vector<double> slice_rms = test::slice_rms(expected);  // scale of the fp32 rounding allowance

  // `out` at element out_offset of its buffer, then one guard row: both margins stay poisoned.
  const size_t guard = static_cast<size_t>(c.heads) * kVHeadDim;
  DeviceBuffer<uint16_t> d_latent(latent_bits.size()), d_w_uv(layer.w_uv.size()), d_projected(step.projected.size()),
      d_out(c.out_offset + expected.size() + guard);
  DeviceBuffer<int32_t> d_lengths(std::max<size_t>(1, step.lengths.size()));
  d_latent.upload(latent_bits);
  d_w_uv.upload(layer.w_uv);
  d_projected.upload(step.projected);
  if (!step.lengths.empty()) d_lengths.upload(step.lengths);

  value::ValueParams p{};
  p.latent = reinterpret_cast<const __nv_bfloat16*>(d_latent.get());
  p.stride_latent_row = stride_latent_row;
  p.w_uv = reinterpret_cast<const __nv_bfloat16*>(d_w_uv.get());
  p.projected = reinterpret_cast<const __nv_bfloat16*>(d_projected.get());
  p.stride_projected_row = step.pitch;
  p.lengths = d_lengths.get();
  p.totals = nullptr;
  p.num_requests = step.num_requests;
  p.q = c.q;
  p.out = reinterpret_cast<__nv_bfloat16*>(d_out.get() + c.out_offset);
  p.rows = static_cast<int>(rows);
  p.num_heads = c.heads;

  for (const ValueKernel kernel : kAllKernels) {
    SCOPED_TRACE(::testing::Message() << "kernel " << value::value_kernel_name(kernel));
    const value::ValuePlan plan = value::plan_value(p.rows, c.heads, /*num_partials=*/1, kernel);
    ASSERT_EQ(plan.kernel, kernel);
    d_out.poison(0xff);
    value::launch_value(p, plan, nullptr, /*pdl=*/true);
    MLA_CUDA_CHECK(cudaDeviceSynchronize());

    const std::vector<uint16_t> all = d_out.download();
    int64_t outside = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      const bool inside = i >= size_t(c.out_offset) && i < c.out_offset + expected.size();
      outside += !inside && all[i] != 0xffff;
    }
    EXPECT_EQ(outside, 0) << "elements written outside out (before it, or in the row after the last)";
    const std::vector<uint16_t> got(all.begin() + c.out_offset, all.begin() + c.out_offset + expected.size());
    int64_t mismatches = 0, off_by_one = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const int64_t row = static_cast<int64_t>(i) / (c.heads * kVHeadDim);
      if (zero_rows[row]) {
        if (got[i] != 0 && ++mismatches <= 5) {  // exactly +0
          ADD_FAILURE() << "element " << i << " (zero row " << row << "): got bits 0x" << std::hex << got[i];
        }
        continue;
      }
      const int steps = bf16_steps(got[i], expected[i]);
      const double difference = std::abs(double(synth::bf16_value(got[i])) - synth::bf16_value(expected[i]));
      if (steps > 1 && !(difference <= 1e-4 * slice_rms[i / kVHeadDim])) {
        if (++mismatches <= 5) {
          ADD_FAILURE() << "element " << i << " (row " << row << ", head " << (i / kVHeadDim) % c.heads
                        << ", column " << i % kVHeadDim << "): got " << synth::bf16_value(got[i]) << " expected "
                        << synth::bf16_value(expected[i]);
        }
      }
      off_by_one += steps == 1;
    }
    EXPECT_EQ(mismatches, 0);
    // One-step differences come only from rounding boundaries: rare, never systematic.
    EXPECT_LE(off_by_one, static_cast<int64_t>(got.size() / 50 + 1));
  }
}

// ---- Every case through both kernels ----------------------------------------------------------------

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

// ---- The tensor-core kernel's row tiles (64 rows): partial last tiles, tile boundaries, empty requests
// in every tile, padded rows, a latent pitch larger than the row, an unaligned `out` ------------------

TEST(ValueKernel, TensorCoreRowTiles) {
  MLA_REQUIRE_GPU();
  // 65 rows (a full tile + 1 row) for every head count: 61 requests, 1 in 4 empty, 4 padded.
  uint64_t seed = 500;
  for (int heads : {1, 8, 12, 16, 64, 96, 128}) {
    ++seed;
    run_case({heads, 1, 65, lengths_with_empty(61, 1, seed), heads == 12 ? 64 : 0}, seed);
  }
  // 63 rows (one partial tile), q = 1.
  run_case({8, 1, 63, lengths_with_empty(60, 1, 511)}, 511);
  run_case({96, 1, 63, lengths_with_empty(63, 1, 512), 8}, 512);
  // 64 rows (exactly one tile), q = 4; the second with an unaligned `out`.
  run_case({16, 4, 16, lengths_with_empty(15, 1, 513)}, 513);
  run_case({128, 4, 16, lengths_with_empty(16, 1, 514), 0, 1}, 514);
  // 127 rows (a full and a 63-row tile), q = 1; and 68 / 124 rows at q = 4.
  run_case({1, 1, 127, lengths_with_empty(120, 1, 515), 64}, 515);
  run_case({12, 1, 127, lengths_with_empty(127, 1, 516), 0, 1}, 516);
  run_case({64, 1, 127, lengths_with_empty(125, 2, 517)}, 517);
  run_case({8, 4, 17, lengths_with_empty(17, 1, 518)}, 518);
  run_case({96, 4, 31, lengths_with_empty(29, 2, 519), 64}, 519);
  // 512 rows (8 tiles), 3 in 4 requests empty (so every tile has real and zero rows), some padding.
  run_case({8, 1, 512, lengths_with_empty(500, 3, 520)}, 520);
  run_case({96, 4, 128, lengths_with_empty(124, 3, 521), 64, 1}, 521);
}

// ---- Planning and launch checks ------------------------------------------------------------------------

TEST(ValueKernel, PlanPicksTheKernel) {
  MLA_REQUIRE_GPU();
  using value::plan_value;
  // One pass of rows at 12 heads: CUDA cores; a second pass the split tensor-core kernel (a 12-head grid of few row
  // tiles); the full-width one once its grid has kFullWidthMinCtas CTAs.
  EXPECT_EQ(plan_value(value::kRowsPerPass, 12, 1).kernel, ValueKernel::kCudaCore);
  EXPECT_EQ(plan_value(value::kRowsPerPass + 1, 12, 1).kernel, ValueKernel::kTensorCoreSplit);
  EXPECT_EQ(plan_value(value::kRowsPerPass + 1, 12, 0).kernel, ValueKernel::kTensorCoreSplit);
  const int full_tiles_h96 = (value::kFullWidthMinCtas + 95) / 96;
  EXPECT_EQ(plan_value(value::kMmaRowTile * full_tiles_h96, 96, 1).kernel, ValueKernel::kTensorCore);
  EXPECT_EQ(plan_value(value::kMmaRowTile * (full_tiles_h96 - 1), 96, 1).kernel, ValueKernel::kTensorCoreSplit);
  // The DCP merge keeps its fp32 merged latent on the CUDA-core kernel at every batch size.
  for (int partials : {2, 8}) {
    EXPECT_EQ(plan_value(512, 12, partials).kernel, ValueKernel::kCudaCore);
    EXPECT_THROW(plan_value(512, 12, partials, ValueKernel::kTensorCore), Error);
    EXPECT_THROW(plan_value(512, 12, partials, ValueKernel::kTensorCoreSplit), Error);
    EXPECT_THROW(plan_value(512, 12, partials, ValueKernel::kCudaCorePacked), Error);
  }
  EXPECT_EQ(plan_value(1, 96, 0).kernel, ValueKernel::kCudaCorePacked);
  EXPECT_THROW(plan_value(0, 12, 1), Error);
  EXPECT_THROW(plan_value(64, 0, 1), Error);
  EXPECT_THROW(plan_value(64, kMaxHeads + 1, 1), Error);
  EXPECT_THROW(plan_value(64, 12, value::kMaxPartials + 1), Error);
}

TEST(ValueKernel, LaunchRejectsMismatchedPlansAndUnalignedInputs) {
  MLA_REQUIRE_GPU();
  // Every check throws before a launch, so the (fake, aligned) pointers are never dereferenced.
  const auto fake = [](uintptr_t address) { return reinterpret_cast<__nv_bfloat16*>(address); };
  value::ValueParams p{};
  p.latent = fake(0x10000);
  p.stride_latent_row = 12 * kKvLoraRank;
  p.w_uv = fake(0x20000);
  p.projected = fake(0x30000);
  p.stride_projected_row = projected_width(12);
  p.lengths = reinterpret_cast<const int32_t*>(0x40000);
  p.num_requests = 128;
  p.q = 1;
  p.out = fake(0x50000);
  p.rows = 128;
  p.num_heads = 12;
  const value::ValuePlan tensor = value::plan_value(128, 12, 1, ValueKernel::kTensorCore);

  value::ValueParams merge = p;  // a tensor-core plan for a DCP merge
  merge.num_partials = 2;
  for (int r = 0; r < 2; ++r) {
    merge.partial_latent[r] = fake(0x60000);
    merge.partial_lse[r] = reinterpret_cast<const float*>(0x70000);
  }
  EXPECT_THROW(value::launch_value(merge, tensor, nullptr, false), Error);
  merge.num_partials = value::kMaxPartials + 1;  // still rejected first, as before
  EXPECT_THROW(value::launch_value(merge, tensor, nullptr, false), Error);

  value::ValueParams other_rows = p;  // a plan made for another shape
  other_rows.rows = 64;
  EXPECT_THROW(value::launch_value(other_rows, tensor, nullptr, false), Error);
  value::ValuePlan edited = tensor;  // the enum changed without the grid
  edited.kernel = ValueKernel::kCudaCore;
  EXPECT_THROW(value::launch_value(p, edited, nullptr, false), Error);

  value::ValueParams bad = p;
  bad.latent = fake(0x10002);
  EXPECT_THROW(value::launch_value(bad, tensor, nullptr, false), Error);
  bad = p;
  bad.latent = nullptr;
  EXPECT_THROW(value::launch_value(bad, tensor, nullptr, false), Error);
  bad = p;
  bad.stride_latent_row += 4;
  EXPECT_THROW(value::launch_value(bad, tensor, nullptr, false), Error);
  bad = p;
  bad.stride_projected_row += 2;
  EXPECT_THROW(value::launch_value(bad, tensor, nullptr, false), Error);
  bad = p;
  bad.w_uv = fake(0x20008);
  EXPECT_THROW(value::launch_value(bad, tensor, nullptr, false), Error);

  // The CUDA-core kernels load W_UV and the latent (or each partial latent) in 16-byte vectors too.
  const value::ValuePlan cuda_core = value::plan_value(128, 12, 1, ValueKernel::kCudaCore);
  bad = p;
  bad.w_uv = fake(0x20008);
  EXPECT_ERROR_HAS(value::launch_value(bad, cuda_core, nullptr, false), "ValueParams.w_uv");
  bad = p;
  bad.latent = fake(0x10002);
  EXPECT_ERROR_HAS(value::launch_value(bad, cuda_core, nullptr, false), "ValueParams.latent");
  bad = p;
  bad.stride_latent_row += 4;
  EXPECT_ERROR_HAS(value::launch_value(bad, cuda_core, nullptr, false), "ValueParams.stride_latent_row");
  const value::ValuePlan merging = value::plan_value(128, 12, 2, ValueKernel::kCudaCore);
  bad = p;
  bad.num_partials = 2;
  bad.stride_lse_row = 24;
  bad.partial_latent[0] = fake(0x60000);
  bad.partial_latent[1] = fake(0x70004);
  bad.partial_lse[0] = bad.partial_lse[1] = reinterpret_cast<const float*>(0x80000);
  EXPECT_ERROR_HAS(value::launch_value(bad, merging, nullptr, false), "ValueParams.partial_latent[1]");
}

}  // namespace
}  // namespace mla
