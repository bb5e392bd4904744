// DCP on one GPU (the in-process group): D ranks' PreparedMla objects launched phase by phase on one
// stream (every rank's query, then every core, then every value stage) against mla::ref::run_layer_dcp
// on the same per-rank inputs. A global step of D*H heads is cut into rank steps: the same tokens
// sharded by ownership (g / I) % D == k into each rank's own pages, local lengths, global totals,
// slots -1 for tokens a rank does not own, and rank k's weights = heads [k*H, (k+1)*H) of the layer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <vector>

#include "dcp_test_util.h"
#include "gpu/dcp/dcp_gpu_util.h"
#include "gpu_compare.h"
#include "gpu_test_util.h"
#include "mla/dcp.h"
#include "mla/mla.h"
#include "reference.h"
#include "synthetic.h"

namespace mla {
namespace {

using test::DeviceRankStep;
using test::RankStep;
using test::StepSequence;
using test::RankWeights;
using test::shard_all;

using test::kOutSameBytesBound;
using test::kOutWholeChainBound;
using test::worse;

// ---- Comparison -----------------------------------------------------------------------------------

// Worst per-(row, head) relative L2 error of `got` against `expected`; zero rows must be exactly +0.
double worst_relative_error(const RankStep& step, const std::vector<uint16_t>& got,
                            const std::vector<uint16_t>& expected) {
  return test::worst_out_error(step.rows, step.heads, [&](int64_t r) { return step.zero_row(r); }, got, expected);
}

// ---- The group ------------------------------------------------------------------------------------

struct RankOutputs {
  std::vector<std::vector<uint16_t>> out;
  std::vector<std::vector<uint8_t>> cache;
};

// D ranks on one GPU: weights, device step buffers and one PreparedMla per (parity, rank).
class InProcessRanks {
 public:
  InProcessRanks(const synth::SyntheticLayer& layer, int size, int interleave, int heads,
                 const std::vector<RankStep>& first_steps)
      : size_(size), interleave_(interleave), heads_(heads), steps_(first_steps),
        group_(size, interleave, heads, first_steps[0].rows) {
    for (int k = 0; k < size; ++k) {
      weights_.emplace_back(layer, k * heads, heads);
      device_weights_.push_back(std::make_unique<test::DeviceWeights>(weights_[k].host()));
      device_steps_.push_back(std::make_unique<DeviceRankStep>(steps_[k]));
    }
    const RankStep& s = steps_[0];
    for (int parity = 0; parity < 2; ++parity) {
      for (int k = 0; k < size; ++k) {
        objects_.push_back(std::make_unique<PreparedMla>(
            device_weights_[k]->weights, LayerDims{heads, 1e-5f}, std::map<int64_t, int64_t>{{s.rows, s.pitch}},
            TensorView{}, PrepareOptions{.dcp = &group_.rank(k), .parity = parity, .queries = {s.q}}));
        objects_.back()->prepare(device_steps_[k]->inputs(steps_[k]).cache);
      }
    }
    upload(first_steps);
  }

  // New step contents (same sizes); outputs poisoned.
  void upload(const std::vector<RankStep>& steps) {
    steps_ = steps;
    for (int k = 0; k < size_; ++k) device_steps_[k]->upload(steps_[k]);
    // The copies and memsets run on the legacy stream; the graph test launches on a non-blocking one.
    MLA_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // Every rank's check_step (synchronizing), for the first step of a case.
  void check_steps(int parity) {
    for (int k = 0; k < size_; ++k) object(parity, k).check_step(device_steps_[k]->inputs(steps_[k]));
  }

  // The in-process order: every rank's query, then every core, then every value stage.
  void launch(int parity, cudaStream_t stream) {
    for (DcpPhase phase : {DcpPhase::kQuery, DcpPhase::kCore, DcpPhase::kValue}) {
      for (int k = 0; k < size_; ++k) object(parity, k).run_phase(phase, device_steps_[k]->inputs(steps_[k]), stream);
    }
  }

  // Compares what the GPU wrote (after a synchronization) with the reference on the uploaded steps.
  void expect_matches_reference(int parity, bool same_bytes_check = true) {
    MLA_CUDA_CHECK(cudaDeviceSynchronize());
    const int64_t rows = steps_[0].rows;
    const int core_heads = size_ * heads_;
    std::vector<std::vector<uint16_t>> got_out;
    std::vector<std::vector<uint8_t>> got_cache, got_mailbox;
    for (int k = 0; k < size_; ++k) {
      got_out.push_back(device_steps_[k]->out.download());
      got_cache.push_back(device_steps_[k]->cache.download());
      std::vector<uint8_t> mailbox(rows * core_heads * kKeyDim);
      MLA_CUDA_CHECK(cudaMemcpy(mailbox.data(), group_.rank(k).peers(parity).mailbox[k], mailbox.size(),
                                cudaMemcpyDeviceToHost));
      got_mailbox.push_back(std::move(mailbox));
    }
    // Every rank published its heads into every mailbox: all mailboxes hold the same bytes.
    for (int k = 1; k < size_; ++k) EXPECT_TRUE(got_mailbox[k] == got_mailbox[0]) << "mailbox of rank " << k;

    // The whole reference from the bf16 inputs.
    std::vector<RankStep> ref_steps = steps_;
    std::vector<Weights> ref_weights;
    std::vector<StepInputs> ref_views;
    for (int k = 0; k < size_; ++k) {
      ref_weights.push_back(weights_[k].host());
      ref_views.push_back(ref_steps[k].inputs());
    }
    ref::run_layer_dcp(ref_weights, LayerDims{heads_, 1e-5f}, ref_views, interleave_);
    double worst_chain = 0;
    for (int k = 0; k < size_; ++k) {
      worst_chain = worse(worst_chain, worst_relative_error(steps_[k], got_out[k], ref_steps[k].out));
      int64_t cache_far = 0;
      for (size_t i = 0; i < got_cache[k].size(); ++i) {
        if (got_cache[k][i] == ref_steps[k].cache[i]) continue;
        if (ref_steps[k].cache[i] == steps_[k].cache[i] || test::e4m3_steps(got_cache[k][i], ref_steps[k].cache[i]) > 1) {
          ++cache_far;
        }
      }
      EXPECT_EQ(cache_far, 0) << "rank " << k << ": cache bytes wrong or written outside its slots";
    }
    EXPECT_LE(worst_chain, kOutWholeChainBound) << "whole chain";

    // The reference core, merge and value stage on the GPU's own mailbox bytes and caches.
    double worst_same = 0;
    if (same_bytes_check) {
      std::vector<RankStep> gpu_steps = steps_;
      for (int k = 0; k < size_; ++k) gpu_steps[k].cache = got_cache[k];
      const std::vector<std::vector<uint16_t>> expected =
          test::reference_from_bytes(weights_, gpu_steps, got_mailbox, interleave_);
      for (int k = 0; k < size_; ++k) {
        worst_same = worse(worst_same, worst_relative_error(steps_[k], got_out[k], expected[k]));
      }
      EXPECT_LE(worst_same, kOutSameBytesBound) << "same mailbox bytes and caches";
    }
    last_errors_ = {worst_same, worst_chain};
  }

  std::pair<double, double> last_errors() const { return last_errors_; }

  // Every rank's out and cache after a synchronization.
  RankOutputs outputs() const {
    MLA_CUDA_CHECK(cudaDeviceSynchronize());
    RankOutputs o;
    for (const auto& d : device_steps_) {
      o.out.push_back(d->out.download());
      o.cache.push_back(d->cache.download());
    }
    return o;
  }

 private:
  PreparedMla& object(int parity, int k) { return *objects_[parity * size_ + k]; }

  int size_, interleave_, heads_;
  std::vector<RankStep> steps_;
  InProcessDcp group_;
  std::vector<RankWeights> weights_;
  std::vector<std::unique_ptr<test::DeviceWeights>> device_weights_;
  std::vector<std::unique_ptr<DeviceRankStep>> device_steps_;
  std::vector<std::unique_ptr<PreparedMla>> objects_;  // [parity * D + k]
  std::pair<double, double> last_errors_{0, 0};
};

struct DcpCase {
  int size, interleave, heads, q;
  std::vector<int> totals;
  int padded_requests = 0;
};

// One step of one case; returns the rank steps it ran (for the callers' extra checks).
std::vector<RankStep> run_case(const DcpCase& c, int parity, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "D=" << c.size << " I=" << c.interleave << " H=" << c.heads << " q=" << c.q
                                    << " parity=" << parity);
  const synth::SyntheticLayer layer = synth::make_layer(c.size * c.heads, seed);
  synth::StepSpec spec;
  spec.q = c.q;
  spec.lengths = c.totals;
  spec.padded_requests = c.padded_requests;
  spec.seed = seed;
  const synth::SyntheticStep global = synth::make_step(layer, spec);
  const std::vector<RankStep> steps = shard_all(global, c.size, c.interleave, c.heads);
  InProcessRanks ranks(layer, c.size, c.interleave, c.heads, steps);
  ranks.check_steps(parity);
  ranks.launch(parity, nullptr);
  ranks.expect_matches_reference(parity);
  std::printf("    D=%d I=%d H=%d q=%d: worst per-(row, head) relative L2 error of out %.2e on the GPU's bytes, "
              "%.2e against the whole reference\n",
              c.size, c.interleave, c.heads, c.q, ranks.last_errors().first, ranks.last_errors().second);
  return steps;
}

TEST(DcpPipeline, RanksInterleavesQueriesHeads) {
  MLA_REQUIRE_GPU();
  uint64_t seed = 900;
  for (int size : {2, 4, 8}) {
    for (int interleave : {1, 64}) {
      for (int q : {1, 4}) {
        for (int heads : {12, 16}) {
          ++seed;
          run_case({size, interleave, heads, q, {q, 63 + q, 300, 1000}, /*padded_requests=*/5}, int(seed % 2), seed);
        }
      }
    }
  }
}

TEST(DcpPipeline, RanksWithEmptyShards) {
  MLA_REQUIRE_GPU();
  // 100 tokens in pages of 64 owned by 8 ranks: ranks 2..7 hold nothing at all.
  std::vector<RankStep> steps = run_case({8, 64, 12, 1, {5, 100}}, 0, 950);
  for (int k = 0; k < 8; ++k) EXPECT_EQ(steps[k].empty_shard(), k >= 2) << "rank " << k;
  // L < q: the first rows of the request see nothing; ranks 2 and 3 hold nothing.
  steps = run_case({4, 1, 16, 4, {2}}, 1, 951);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(steps[k].empty_shard(), k >= 2) << "rank " << k;
}

TEST(DcpPipeline, AllRanksEmptyGiveExactZeros) {
  MLA_REQUIRE_GPU();
  const std::vector<RankStep> steps = run_case({4, 64, 12, 2, {0, 0}, /*padded_requests=*/3}, 0, 960);
  for (const RankStep& s : steps) EXPECT_TRUE(s.empty_shard());
}

TEST(DcpPipeline, ConsecutiveStepsAlternateParityWithoutStaleData) {
  MLA_REQUIRE_GPU();
  // 1000 consecutive steps (layers) alternating parity, drawn from a pool of 16 steps of different
  // lengths (all empty and one empty shard included) in an order where neither the previous step nor
  // the previous one of the same parity is the same, and each pool step runs on both parities. A pool
  // step's first run is checked against the reference; every later run must reproduce its outputs and
  // caches bit for bit (the kernels are deterministic: no atomics), so a query, partial or LSE left
  // from an earlier step would show. (A fresh reference per step would cost ~90 ms of CPU each.)
  constexpr int kSteps = 1000, kPool = 16;
  const int size = 2, interleave = 64, heads = 12;
  const synth::SyntheticLayer layer = synth::make_layer(size * heads, 970);
  const StepSequence sequence{layer, size, interleave, heads, /*q=*/1, /*requests=*/2, /*max_length=*/400};
  std::vector<std::vector<RankStep>> pool;
  pool.push_back(sequence.make(971, {0, 0}));
  pool.push_back(sequence.make(972, {5, 40}));  // rank 1 holds nothing
  for (int i = 2; i < kPool; ++i) pool.push_back(sequence.make(971 + i));
  InProcessRanks ranks(layer, size, interleave, heads, pool[0]);
  std::vector<RankOutputs> first(kPool);
  std::vector<bool> seen(kPool, false);
  double worst = 0;
  for (int step = 0; step < kSteps; ++step) {
    const int entry = (5 * step + step / kPool) % kPool;
    const int parity = step % 2;
    SCOPED_TRACE(::testing::Message() << "step " << step << " (pool entry " << entry << ", parity " << parity << ")");
    ranks.upload(pool[entry]);
    ranks.launch(parity, nullptr);
    if (!seen[entry]) {
      ranks.expect_matches_reference(parity, /*same_bytes_check=*/false);
      worst = worse(worst, ranks.last_errors().second);
      first[entry] = ranks.outputs();
      seen[entry] = true;
    } else {
      const RankOutputs now = ranks.outputs();
      EXPECT_TRUE(now.out == first[entry].out) << "outputs differ from this step's first run";
      EXPECT_TRUE(now.cache == first[entry].cache) << "caches differ from this step's first run";
    }
    if (::testing::Test::HasFailure()) break;
  }
  std::printf("    %d steps: worst per-(row, head) relative L2 error of out %.2e against the whole reference\n", kSteps,
              worst);
}

TEST(DcpPipeline, GraphOfThePhasesReplaysWithChangingMetadata) {
  MLA_REQUIRE_GPU();
  const int size = 4, interleave = 1, heads = 16;
  const synth::SyntheticLayer layer = synth::make_layer(size * heads, 980);
  const StepSequence sequence{layer, size, interleave, heads, /*q=*/2, /*requests=*/3, /*max_length=*/1000};
  InProcessRanks ranks(layer, size, interleave, heads, sequence.make(981));

  cudaStream_t stream;
  MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  MLA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  ranks.launch(/*parity=*/1, stream);
  MLA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (uint64_t replay = 0; replay < 4; ++replay) {
    SCOPED_TRACE(::testing::Message() << "replay " << replay);
    ranks.upload(sequence.make(990 + replay));  // same buffers, new contents (outputs re-poisoned)
    MLA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
    ranks.expect_matches_reference(/*parity=*/1);
  }
  MLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MLA_CUDA_CHECK(cudaGraphDestroy(graph));
  MLA_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace mla
