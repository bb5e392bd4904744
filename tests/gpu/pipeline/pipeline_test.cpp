// The prepared pipeline end to end (query kernel -> core -> value kernel, PDL-chained) against
// mla::ref::run_layer on the same synthetic inputs: the written cache rows within one e4m3 step, the
// rest of the cache untouched, `out` within a stated per-(row, head) bound, zero rows exactly +0;
// fixed and randomly drawn shapes; and CUDA-graph replays with changing lengths, block tables and slots.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_compare.h"
#include "gpu_test_util.h"
#include "mla/mla.h"
#include "reference.h"
#include "synthetic.h"

namespace mla {
namespace {

using test::DeviceBuffer;

using test::kOutSameBytesBound;
using test::kOutWholeChainBound;

// One step's tensors on the device, with room for the metadata of later steps of the same shape.
using DeviceStep = test::DeviceStep<synth::SyntheticStep>;

// Worst per-(row, head) relative L2 error of `out`; rows of empty and padding requests exactly +0.
double worst_relative_error(const synth::SyntheticStep& step, int heads, const std::vector<uint16_t>& got,
                            const std::vector<uint16_t>& expected, int64_t* worst_row) {
  auto zero_row = [&](int64_t r) {
    const int64_t request = r / step.q;
    return request >= step.num_requests || step.lengths[request] == 0;
  };
  return test::worst_out_error(step.rows, heads, zero_row, got, expected, worst_row);
}

// Compares the GPU's results with (1) the reference core and value stage run on the GPU's own query
// bytes and cache, and (2) the whole reference run on a copy of the same host step.
void expect_matches_reference(const synth::SyntheticLayer& layer, synth::SyntheticStep step_before,
                              const std::vector<uint16_t>& got_out, const std::vector<uint8_t>& got_cache,
                              const std::vector<uint8_t>& got_query) {
  synth::SyntheticStep ref_step = step_before;
  ref::run_layer(layer.weights(), layer.dims, ref_step.inputs());
  const int heads = layer.num_heads;

  // (1) The same bytes: the core and value stage of the reference on what the GPU's query stage wrote.
  {
    synth::SyntheticStep gpu_step = step_before;
    gpu_step.cache = got_cache;
    ref::CoreInputs in;
    in.query = got_query.data();
    in.rows = gpu_step.rows;
    in.heads = heads;
    in.q = gpu_step.q;
    in.cache = gpu_step.cache_view();
    in.block_table = gpu_step.block_table_view();
    in.lengths = gpu_step.lengths_view();
    in.softmax_scale = double(layer.q_scale) * layer.k_scale / std::sqrt(double(kQkHeadDim));
    in.k_scale = layer.k_scale;
    const std::vector<double> latent = ref::round_latent(ref::attention_core(in));
    std::vector<bool> zero_rows(gpu_step.rows);
    for (int64_t r = 0; r < gpu_step.rows; ++r) {
      const int64_t request = r / gpu_step.q;
      zero_rows[r] = request >= gpu_step.num_requests || gpu_step.lengths[request] == 0;
    }
    std::vector<uint16_t> expected(got_out.size());
    ref::value_stage(latent, layer.weights(), layer.dims, gpu_step.projected_view(), zero_rows, expected.data());
    int64_t worst_row = -1;
    const double worst = worst_relative_error(step_before, heads, got_out, expected, &worst_row);
    EXPECT_LE(worst, kOutSameBytesBound) << "same query bytes: worst (row, head) at row " << worst_row;
    std::printf("    H=%d q=%d rows=%lld: worst per-(row, head) relative L2 error of out: %.2e on the GPU's query "
                "bytes, ",
                heads, step_before.q, static_cast<long long>(step_before.rows), worst);
  }

  // Cache: rows written within one e4m3 step, every other byte untouched.
  int64_t cache_far = 0;
  for (size_t i = 0; i < got_cache.size(); ++i) {
    if (got_cache[i] == ref_step.cache[i]) continue;
    if (ref_step.cache[i] == step_before.cache[i] || test::e4m3_steps(got_cache[i], ref_step.cache[i]) > 1) ++cache_far;
  }
  EXPECT_EQ(cache_far, 0) << "cache bytes wrong or written outside this step's slots";

  // (2) The whole chain from the bf16 inputs.
  int64_t worst_row = -1;
  const double worst = worst_relative_error(step_before, heads, got_out, ref_step.out, &worst_row);
  EXPECT_LE(worst, kOutWholeChainBound) << "whole chain: worst (row, head) at row " << worst_row;
  std::printf("%.2e against the whole reference\n", worst);
}

struct PipelineCase {
  int heads;
  int q;
  std::vector<int> lengths;
  int padded_requests = 0;                  // rows = max(padded_requests, requests) * q (StepSpec)
  int64_t max_context = int64_t{1} << 17;   // >= every length; bounds the core's split count
  int pitch_padding = 64;                   // elements past the row: a multiple of 8 (16-byte aligned rows)
};

void run_case(const PipelineCase& c, uint64_t seed) {
  const int64_t pitch = projected_width(c.heads) + c.pitch_padding;
  std::ostringstream description;
  description << "H=" << c.heads << " q=" << c.q << " lengths={";
  for (size_t b = 0; b < c.lengths.size(); ++b) description << (b ? "," : "") << c.lengths[b];
  description << "} padded_requests=" << c.padded_requests << " max_context=" << c.max_context << " pitch=" << pitch
              << " (row + " << c.pitch_padding << ") seed=" << seed;
  SCOPED_TRACE(description.str());
  // Flushed: if the step hangs or crashes, the log still names the case.
  std::printf("    case %s\n", description.str().c_str());
  std::fflush(stdout);
  const synth::SyntheticLayer layer = synth::make_layer(c.heads, seed);
  synth::StepSpec spec;
  spec.q = c.q;
  spec.lengths = c.lengths;
  spec.padded_requests = c.padded_requests;
  spec.pitch = pitch;
  spec.extra_pages = 2;
  spec.seed = seed;
  synth::SyntheticStep step = synth::make_step(layer, spec);
  const synth::SyntheticStep before = step;

  const test::DeviceWeights device_layer(layer.weights());
  DeviceStep device_step(step);
  device_step.upload(step);
  DeviceBuffer<uint8_t> scratch(step.rows * c.heads * kKeyDim);
  PreparedMla mla(device_layer.weights, layer.dims, {{step.rows, step.pitch}},
                  make_view(scratch.get(), DType::kFP8E4M3, Memory::kDevice, {step.rows, c.heads, kKeyDim}),
                  {.max_context = c.max_context, .queries = {c.q}});
  StepInputs inputs = device_step.inputs(step);
  EXPECT_EQ(mla.device_bytes(), 0u);
  mla.prepare(inputs.cache);
  // At least the stage buffers: the latent [rows, H, 512] bf16 and the LSE [rows, H] fp32.
  EXPECT_GE(mla.device_bytes(), size_t(step.rows) * c.heads * (kKvLoraRank * 2 + sizeof(float)));
  device_step.upload(step);  // prepare's warm-up must not have touched anything, but start clean anyway
  mla.check_step(inputs);
  mla.run(inputs, nullptr);
  MLA_CUDA_CHECK(cudaDeviceSynchronize());
  expect_matches_reference(layer, before, device_step.out.download(), device_step.cache.download(),
                           scratch.download());
}

TEST(Pipeline, HeadsAndQueries) {
  MLA_REQUIRE_GPU();
  uint64_t seed = 500;
  for (int heads : {8, 12, 16, 64, 96, 128}) {
    for (int q : {1, 2, 4, 8}) {
      if (heads >= 64 && (q == 2 || q == 8)) continue;  // keeps the CPU reference time bounded
      run_case({heads, q, {q, 63 + q, 64, 300}}, ++seed);
    }
  }
}

TEST(Pipeline, EdgeLengthsAndPadding) {
  MLA_REQUIRE_GPU();
  run_case({12, 1, {0, 1, 63, 64, 65}, 8}, 601);   // an empty request and three padding requests
  run_case({16, 4, {2, 0, 4097}, 4}, 602);         // L < q: the first rows see nothing
  run_case({12, 1, {20000}}, 603);                 // long context: split-KV
}

// Bounds sum(lengths) * H * q of a random case: the reference's core visits each (row, head, token) twice
// (run_layer, then on the GPU's query bytes) at 0.5-1 us of one core (an EPYC core, measured), so at most
// ~2 s a case on 16 cores, ~25 s for 12 cases that all reach it.
constexpr int64_t kMaxReferenceWork = int64_t{1} << 24;
// Bounds a random case's tokens (its synthetic cache: 2^18 tokens are 151 MB) and rows x heads (the reference's query
// stage, ~0.4 M multiply-adds a (row, head)).
constexpr int64_t kMaxRandomTokens = int64_t{1} << 18;
constexpr int kMaxRandomRows = 512;
constexpr int kMaxRandomRowHeads = 1 << 14;

// A random case: heads (K3's per-GPU counts and the core's tile edges most often), q, 1-8 requests (one case in six a
// large batch: up to 512 rows, the query stage's GEMM path from 33 rows) and up to 3 padding requests, lengths at the
// page and q edges or random, max_context (hence the core's split count and its deal of the pages) from the longest
// length up, and the pitch.
PipelineCase random_case(synth::Rng& rng) {
  // rng() % n, not std::uniform_int_distribution (its algorithm differs between standard libraries), so that a seed
  // names the same cases everywhere; the modulo bias does not matter here.
  auto uniform = [&](int lo, int hi) { return lo + static_cast<int>(rng() % static_cast<uint64_t>(hi - lo + 1)); };
  auto pick = [&](std::initializer_list<int> values) { return values.begin()[uniform(0, int(values.size()) - 1)]; };
  PipelineCase c;
  c.heads = uniform(0, 3) == 0 ? uniform(1, kMaxHeads) : pick({1, 3, 8, 12, 16, 24, 40, 48, 64, 80, 96, 128});
  c.q = uniform(0, 1) == 0 ? 1 : uniform(1, kMaxQueries);  // plain decode (no draft tokens) half the time
  const int max_requests = std::max(9, std::min(kMaxRandomRows / c.q, kMaxRandomRowHeads / (c.q * c.heads)) - 3);
  const int requests = uniform(0, 5) == 0 ? uniform(9, max_requests) : uniform(1, 8);
  const int64_t token_budget = std::min(kMaxRandomTokens, kMaxReferenceWork / (int64_t{c.heads} * c.q));
  const int longest_random = static_cast<int>(std::min<int64_t>(20000, token_budget / requests));
  int64_t tokens = 0;
  for (int b = 0; b < requests; ++b) {
    const int drawn = uniform(0, 1) == 0 ? pick({0, 1, c.q - 1, c.q, 63, 64, 65, 127, 128, 4097})
                                         : uniform(0, longest_random);
    c.lengths.push_back(static_cast<int>(std::min<int64_t>(drawn, token_budget - tokens)));
    tokens += c.lengths.back();
  }
  const int padding = uniform(0, 3);
  c.padded_requests = padding > 0 ? requests + padding : 0;
  // The library takes no length above max_context; max_context = 1 (all lengths 0) is its smallest.
  const int64_t longest = std::max(1, *std::max_element(c.lengths.begin(), c.lengths.end()));
  std::vector<int64_t> contexts;
  for (int64_t context : {longest, int64_t{1} << 13, int64_t{1} << 15, int64_t{1} << 17}) {
    if (context >= longest) contexts.push_back(context);
  }
  c.max_context = contexts[uniform(0, int(contexts.size()) - 1)];
  c.pitch_padding = 8 * uniform(1, 64);
  return c;
}

// An unsigned integer from the environment, or `fallback` where `name` is unset.
uint64_t env_or(const char* name, uint64_t fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::stoull(value) : fallback;
}

// A fresh seed each run (MLA_FUZZ_SEED=S replays run S; with a larger MLA_FUZZ_CASES its first cases are the same).
TEST(Pipeline, RandomShapes) {
  MLA_REQUIRE_GPU();
  const uint64_t seed = env_or("MLA_FUZZ_SEED", std::random_device{}());
  const uint64_t num_cases = env_or("MLA_FUZZ_CASES", 12);
  std::printf("    fuzz seed %llu, %llu cases (MLA_FUZZ_SEED=%llu reproduces)\n", static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(num_cases), static_cast<unsigned long long>(seed));
  std::fflush(stdout);  // a hang or crash must still leave the seed in the log
  SCOPED_TRACE(::testing::Message() << "MLA_FUZZ_SEED=" << seed);
  synth::Rng rng(seed);
  for (uint64_t i = 0; i < num_cases; ++i) {
    const PipelineCase c = random_case(rng);
    run_case(c, rng());
  }
}

// One graph captured, then replayed over steps of the same shapes (rows, max_pages, pages) with new lengths, block
// tables and slots, each checked against the reference.
void replay_with_changing_metadata(int heads, int q, int requests, uint64_t seed0) {
  SCOPED_TRACE(::testing::Message() << "H=" << heads << " q=" << q << " requests=" << requests);
  const synth::SyntheticLayer layer = synth::make_layer(heads, seed0);
  auto make = [&](uint64_t seed) {
    synth::StepSpec spec;
    spec.q = q;
    spec.lengths = synth::random_lengths(requests, 0, 1000, seed);
    spec.max_pages = 16;
    int used_pages = 0;
    for (int length : spec.lengths) used_pages += (length + kPageSize - 1) / kPageSize;
    spec.extra_pages = requests * spec.max_pages - used_pages;  // always 64 pages in all
    spec.seed = seed;
    return synth::make_step(layer, spec);
  };
  synth::SyntheticStep step = make(seed0 + 1);
  const test::DeviceWeights device_layer(layer.weights());
  DeviceStep device_step(step);
  device_step.upload(step);
  DeviceBuffer<uint8_t> scratch(step.rows * heads * kKeyDim);
  PreparedMla mla(device_layer.weights, layer.dims, {{step.rows, step.pitch}},
                  make_view(scratch.get(), DType::kFP8E4M3, Memory::kDevice, {step.rows, heads, kKeyDim}),
                  {.queries = {q}});
  StepInputs inputs = device_step.inputs(step);
  mla.prepare(inputs.cache);

  cudaStream_t stream;
  MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  MLA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  mla.run(inputs, stream);
  MLA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (uint64_t replay = 0; replay < 4; ++replay) {
    synth::SyntheticStep next = make(seed0 + 10 + replay);
    ASSERT_EQ(next.rows, step.rows);
    ASSERT_EQ(next.num_pages, step.num_pages);
    ASSERT_EQ(next.max_pages, step.max_pages);
    device_step.upload(next);  // same buffers, new contents (out re-poisoned)
    const synth::SyntheticStep before = next;
    MLA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_matches_reference(layer, before, device_step.out.download(), device_step.cache.download(),
                             scratch.download());
  }
  MLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MLA_CUDA_CHECK(cudaGraphDestroy(graph));
  MLA_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(Pipeline, GraphReplaysWithChangingMetadata) {
  MLA_REQUIRE_GPU();
  replay_with_changing_metadata(12, 2, 4, 700);
  // One request: all of the plan's splits (264 at 1 << 17 context) for 0-16 pages, which change from replay to replay.
  replay_with_changing_metadata(12, 1, 1, 720);
}

// One request (the step an engine runs at batch 1): its splits fill the machine, and the combine merges them.
TEST(Pipeline, OneRequest) {
  MLA_REQUIRE_GPU();
  run_case({12, 1, {4097}}, 801);
  run_case({64, 1, {30000}}, 802);
  run_case({48, 1, {65}}, 803);
  run_case({8, 4, {700}}, 804);   // 32 rows x heads: the ping-pong core under it
  run_case({16, 2, {1}}, 805);    // one nonempty split
  run_case({12, 1, {0}}, 806);    // an empty request: zero rows
  run_case({12, 3, {2}}, 807);    // L < q: the first row sees nothing
}

// Two layers (a 4-row fused-query shape and a 128-row GEMM-path shape, whose cuBLAS workspace then
// lives in the shared buffer) prepared on one caller workspace and run in turn: each stays exact,
// neither holds device memory of its own, and a workspace below workspace_bytes() is rejected.
TEST(Pipeline, LayersShareOneWorkspace) {
  MLA_REQUIRE_GPU();
  const int heads = 12;
  struct Layer {
    synth::SyntheticLayer layer;
    synth::SyntheticStep step;
    std::unique_ptr<test::DeviceWeights> weights;
    std::unique_ptr<DeviceStep> device_step;
    std::unique_ptr<DeviceBuffer<uint8_t>> scratch;
    std::unique_ptr<PreparedMla> mla;
  };
  auto make = [&](uint64_t seed, std::vector<int> lengths) {
    Layer l;
    l.layer = synth::make_layer(heads, seed);
    synth::StepSpec spec;
    spec.lengths = std::move(lengths);
    spec.seed = seed;
    l.step = synth::make_step(l.layer, spec);
    l.weights = std::make_unique<test::DeviceWeights>(l.layer.weights());
    l.device_step = std::make_unique<DeviceStep>(l.step);
    l.scratch = std::make_unique<DeviceBuffer<uint8_t>>(l.step.rows * heads * kKeyDim);
    l.mla = std::make_unique<PreparedMla>(
        l.weights->weights, l.layer.dims, std::map<int64_t, int64_t>{{l.step.rows, l.step.pitch}},
        make_view(l.scratch->get(), DType::kFP8E4M3, Memory::kDevice, {l.step.rows, heads, kKeyDim}));
    return l;
  };
  Layer a = make(910, {100, 3000, 64, 1});
  Layer b = make(911, synth::random_lengths(128, 1, 200, 912));
  const size_t bytes = std::max(a.mla->workspace_bytes(), b.mla->workspace_bytes());
  std::printf("    workspace_bytes: 4 rows %zu, 128 rows %zu\n", a.mla->workspace_bytes(), b.mla->workspace_bytes());
  DeviceBuffer<uint8_t> workspace(bytes);
  const TensorView shared = make_view(workspace.get(), DType::kU8, Memory::kDevice, {int64_t(bytes)});
  const TensorView small =
      make_view(workspace.get(), DType::kU8, Memory::kDevice, {int64_t(b.mla->workspace_bytes()) - 256});
  StepInputs b_inputs = b.device_step->inputs(b.step);
  try {
    b.mla->prepare(b_inputs.cache, small);
    ADD_FAILURE() << "a workspace below workspace_bytes() was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace: expected at least"), std::string::npos) << e.what();
  }
  for (Layer* l : {&a, &b}) {
    l->mla->prepare(l->device_step->inputs(l->step).cache, shared);
    // Only the core's tile counters, if any: one int per request and M-tile (<= 16 M-tiles).
    EXPECT_LE(l->mla->device_bytes(), size_t(l->step.rows) * 16 * sizeof(int));
  }
  for (Layer* l : {&a, &b, &a}) {
    l->device_step->upload(l->step);
    const synth::SyntheticStep before = l->step;
    l->mla->run(l->device_step->inputs(l->step), nullptr);
    MLA_CUDA_CHECK(cudaDeviceSynchronize());
    expect_matches_reference(l->layer, before, l->device_step->out.download(), l->device_step->cache.download(),
                             l->scratch->download());
  }
}

TEST(Pipeline, BadStepIsRejectedBeforeAnyLaunch) {
  MLA_REQUIRE_GPU();
  const synth::SyntheticLayer layer = synth::make_layer(8, 800);
  synth::SyntheticStep step = synth::make_step(layer, 2, 1, {100});
  const test::DeviceWeights device_layer(layer.weights());
  DeviceStep device_step(step);
  device_step.upload(step);
  DeviceBuffer<uint8_t> scratch(step.rows * 8 * kKeyDim);
  PreparedMla mla(device_layer.weights, layer.dims, {{step.rows, step.pitch}},
                  make_view(scratch.get(), DType::kFP8E4M3, Memory::kDevice, {step.rows, 8, kKeyDim}));
  StepInputs inputs = device_step.inputs(step);
  EXPECT_THROW(mla.run(inputs, nullptr), Error);  // before prepare()
  mla.prepare(inputs.cache);
  // A page index out of range: check_step sees it (device values), and nothing was written.
  step.block_table[0] = static_cast<int32_t>(step.num_pages);
  device_step.upload(step);
  EXPECT_THROW(mla.check_step(inputs), Error);
  StepInputs wrong = inputs;
  wrong.out.dtype = DType::kF32;
  EXPECT_THROW(mla.run(wrong, nullptr), Error);
#if !(defined(MLA_TIMELINE) && MLA_TIMELINE)
  // The per-CTA timeline exists only in builds configured for it (step_bench --timeline); elsewhere it says so.
  try {
    mla.run_timeline(inputs, nullptr, {});
    ADD_FAILURE() << "run_timeline ran in a build without the timeline";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MLA_TIMELINE"), std::string::npos) << e.what();
  }
#endif
  MLA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> out = device_step.out.download();
  for (uint16_t v : out) ASSERT_EQ(v, 0xffff) << "out was written by a rejected step";
}

}  // namespace
}  // namespace mla
