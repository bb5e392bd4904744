// DCP benchmark (DESIGN.md §4 DCP, §6): what one rank of a D-rank group spends on a decode step,
// against the one-GPU step at the same global context. Ranks are simulated on one GPU with the
// in-process group: only rank 0's phases are launched (its query + the publish copies into the D-1
// peer mailboxes, its core over all D*H heads of its 1/D shard of the context, its value stage
// merging D partials), so the time is one rank's work without the NVLink traffic and without
// waiting for peers. The two epoch signal-and-wait kernels a signalling group (IpcDcp) adds per
// step are timed on their own (waits satisfied at once: their launch + fence cost).
//
//   dcp_bench [--quick]        (--quick: batch 1 x 1M only)
//
// Shapes: batch 1 x 1M tokens and batch 8 x 256k tokens, H = 12 heads per rank, q = 1,
// interleave 64, D in {2, 4, 8}. CUDA events over graph replays (20 steps a graph, median of 30);
// L2-cold: each rank setup rotates over replicas (cache, weights, step) totalling >= 150 MB; the
// one-GPU step's KV alone (>= 576 MB) is far past the 50 MB L2. Floors from ceilings measured here.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "bench_inputs.cuh"
#include "dcp/signal.h"
#include "device_timing.h"
#include "mla/dcp.h"
#include "mla/mla.h"
#include "reference.h"
#include "synthetic.h"

namespace mla::bench {
namespace {

constexpr int kHeads = 12, kInterleave = 64;

// One GPU's step inputs: `requests` requests of `local` cached tokens each (of `total` global), the
// new token at the last global position (its slot only where `owner`), weights of H heads.
struct Setup {
  DeviceArena arena;  // declared first: freed last, after the PreparedMla that uses it
  Weights weights;
  StepInputs step;
  std::unique_ptr<PreparedMla> mla;
  double bytes = 0;  // weights + KV, for the replica count
};

std::unique_ptr<Setup> make_setup(const synth::SyntheticLayer& layer, int requests, int64_t local, int64_t total,
                                  bool owner, uint64_t seed, cudaStream_t stream) {
  auto s = std::make_unique<Setup>();
  DeviceArena& a = s->arena;
  const int64_t rows = requests, heads = kHeads;
  const int64_t pages_per_request = (local + kPageSize - 1) / kPageSize + 1;
  const int64_t num_pages = requests * pages_per_request;
  const int64_t pitch = (projected_width(kHeads) + 7) / 8 * 8;
  s->weights = device_weights(layer, a);

  synth::Rng rng(synth::stream_seed(seed, 1));
  std::vector<uint16_t> projected(rows * pitch);
  synth::fill_random_bf16(projected, 0.0, 1.0, rng);
  const std::vector<int32_t> pages = shuffled_pages(num_pages, rng);
  std::vector<int32_t> lengths(requests, static_cast<int32_t>(local)), totals(requests, static_cast<int32_t>(total));
  std::vector<int64_t> slots(rows, -1);
  for (int b = 0; b < requests; ++b) {
    const int64_t j = local - 1;  // the new token is this GPU's last cached one where it owns it
    if (owner) slots[b] = int64_t{pages[b * pages_per_request + j / kPageSize]} * kPageSize + j % kPageSize;
  }
  const int64_t cache_bytes = num_pages * kPageSize * kKeyDim;
  uint8_t* cache = a.alloc<uint8_t>(cache_bytes);
  fill_cache_kernel<<<2048, 256, 0, stream>>>(cache, cache_bytes, seed);
  MLA_CUDA_CHECK_LAUNCH();

  StepInputs& st = s->step;
  st.projected = make_strided_view(a.copy(projected), DType::kBF16, Memory::kDevice, {rows, projected_width(kHeads)},
                                   {pitch, 1});
  st.out = make_view(a.alloc<uint16_t>(rows * heads * kVHeadDim), DType::kBF16, Memory::kDevice, {rows, heads * kVHeadDim});
  st.cache = make_view(cache, DType::kFP8E4M3, Memory::kDevice, {num_pages, kPageSize, kKeyDim});
  st.slots = make_view(a.copy(slots), DType::kI64, Memory::kDevice, {rows});
  st.block_table = make_view(a.copy(pages), DType::kI32, Memory::kDevice, {requests, pages_per_request});
  st.lengths = make_view(a.copy(lengths), DType::kI32, Memory::kDevice, {requests});
  if (local != total) st.totals = make_view(a.copy(totals), DType::kI32, Memory::kDevice, {requests});
  st.q = 1;
  s->bytes = double(cache_bytes) + 2.0 * heads * (kQkHeadDim * kQLoraRank + kNopeDim * kKvLoraRank + kKvLoraRank * kVHeadDim);
  return s;
}

int replicas_for(double bytes) { return static_cast<int>(std::clamp(std::ceil(150e6 / bytes), 1.0, 4.0)); }

// The cost a rank's step must pay: its weights, its shard of the KV, activations, the D partial
// latents + LSEs it merges and the mailbox copies; the core's FP8 FLOPs over D*H heads.
timing::StepCost rank_cost(int size, int requests, double local_tokens) {
  timing::StepCost c = timing::step_cost(kHeads, requests, requests * local_tokens, requests * local_tokens);
  c.fp8_flops *= size;  // the core serves D*H heads
  c.activation_bytes += double(requests) * size * kHeads * (kKvLoraRank * 2 + 4);  // partials read
  c.activation_bytes += double(requests) * (size - 1) * kHeads * kKeyDim;           // queries published
  return c;
}

struct Row {
  int requests;
  int64_t context;
};

}  // namespace
}  // namespace mla::bench

int main(int argc, char** argv) {
  using namespace mla;
  using namespace mla::bench;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else {
      std::fprintf(stderr, "usage: dcp_bench [--quick]\n");
      return 2;
    }
  }
  try {
    cudaStream_t stream;
    MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const timing::Ceilings ceilings = timing::measure_ceilings(stream);
    cudaDeviceProp prop{};
    MLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs; ceilings: %s\n\n", prop.name, prop.multiProcessorCount, ceilings.describe().c_str());

    // ---- The signal-and-wait kernel (2 per step under IpcDcp), waits satisfied at once.
    double signal_us = 0;
    {
      DeviceArena a;
      uint32_t* words = a.alloc<uint32_t>(2 * kMaxDcpRanks + 1);
      MLA_CUDA_CHECK(cudaMemset(words, 0, (2 * kMaxDcpRanks + 1) * sizeof(uint32_t)));
      dcp::SignalArgs args;
      args.epoch = words + 2 * kMaxDcpRanks;
      args.advance = true;
      args.size = kMaxDcpRanks;
      args.wait = words;
      for (int p = 0; p < kMaxDcpRanks; ++p) args.targets[p] = words + p;  // each thread satisfies its own wait
      args.timeout_ns = 1000000000;
      signal_us = timing::time_graph_us(stream, [&](int) { dcp::launch_signal_wait(args, stream); });
      std::printf("epoch signal-and-wait kernel (D = 8, satisfied at once): %.2f µs a launch in a graph; a step "
                  "under IpcDcp adds 2\n\n",
                  signal_us);
    }

    std::printf("| batch | context | D | one-GPU µs | rank query µs | rank core µs | rank value µs | rank step µs | "
                "+ 2 signals µs | speedup (bound) | efficiency (bound) | rank floor µs | rank step/floor | rank GB/s | rank TFLOP/s |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    std::vector<std::string> one_gpu_lines;  // printed after the table
    const synth::SyntheticLayer layer = synth::make_layer(kHeads, 1);
    std::vector<Row> rows = {{1, int64_t{1} << 20}};
    if (!quick) rows.push_back({8, int64_t{1} << 18});
    for (const Row& row : rows) {
      // The one-GPU step: the whole context, H heads, no group.
      double one_gpu = 0;
      {
        std::unique_ptr<Setup> s = make_setup(layer, row.requests, row.context, row.context, true, 7, stream);
        DeviceArena scratch_arena;
        const TensorView scratch = make_view(scratch_arena.alloc<uint8_t>(size_t(row.requests) * kHeads * kKeyDim),
                                             DType::kFP8E4M3, Memory::kDevice, {row.requests, kHeads, kKeyDim});
        s->mla = std::make_unique<PreparedMla>(
            s->weights, LayerDims{kHeads, 1e-5f}, std::map<int64_t, int64_t>{{row.requests, s->step.projected.stride[0]}},
            scratch, PrepareOptions{.max_context = row.context, .queries = {1}});
        s->mla->prepare(s->step.cache);
        MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
        one_gpu = timing::time_graph_us(stream, [&](int) { s->mla->run(s->step, stream); }, 10, 20);
        const double tokens = double(row.requests) * row.context;
        const timing::StepCost cost = timing::step_cost(kHeads, row.requests, tokens, tokens);
        const double floor = timing::floor_us(ceilings, cost.bytes(), cost.bf16_flops, cost.fp8_flops);
        char line[200];
        std::snprintf(line, sizeof line, "| %d | %lld | %.1f | %.1f | %.2f | %.0f | %.1f |", row.requests,
                      static_cast<long long>(row.context), one_gpu, floor, one_gpu / floor,
                      cost.bytes() / (one_gpu * 1e3), cost.flops() / (one_gpu * 1e6));
        one_gpu_lines.push_back(line);
      }
      for (int size : {2, 4, 8}) {
        const DcpLayout rank0{0, size, kInterleave};
        const int64_t local = ref::dcp_local_length(row.context, rank0);
        InProcessDcp group(size, kInterleave, kHeads, row.requests);
        std::vector<std::unique_ptr<Setup>> replicas;
        const bool owner = ((row.context - 1) / kInterleave) % size == 0;
        replicas.push_back(make_setup(layer, row.requests, local, row.context, owner, 11, stream));
        const int count = replicas_for(replicas[0]->bytes);
        for (int i = 1; i < count; ++i) replicas.push_back(make_setup(layer, row.requests, local, row.context, owner, 11 + i, stream));
        for (auto& r : replicas) {
          r->mla = std::make_unique<PreparedMla>(
              r->weights, LayerDims{kHeads, 1e-5f}, std::map<int64_t, int64_t>{{row.requests, r->step.projected.stride[0]}},
              TensorView{}, PrepareOptions{.max_context = row.context, .dcp = &group.rank(0), .queries = {1}});
          r->mla->prepare(r->step.cache);
        }
        MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
        auto phases = [&](std::initializer_list<DcpPhase> list) {
          return timing::time_graph_us(stream, [&](int i) {
            Setup& r = *replicas[i % replicas.size()];
            for (DcpPhase phase : list) r.mla->run_phase(phase, r.step, stream);
          });
        };
        const double query = phases({DcpPhase::kQuery});
        const double core = phases({DcpPhase::kCore});
        const double value = phases({DcpPhase::kValue});
        const double step = phases({DcpPhase::kQuery, DcpPhase::kCore, DcpPhase::kValue});
        const double with_signals = step + 2 * signal_us;
        const timing::StepCost cost = rank_cost(size, row.requests, double(local));
        const double floor = timing::floor_us(ceilings, cost.bytes(), cost.bf16_flops, cost.fp8_flops);
        std::printf("| %d | %lld | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f | %.0f %% | %.1f | %.2f | %.0f | %.1f |\n",
                    row.requests, static_cast<long long>(row.context), size, one_gpu, query, core, value, step,
                    with_signals, one_gpu / with_signals, 100.0 * one_gpu / with_signals / size, floor, step / floor,
                    cost.bytes() / (step * 1e3), cost.flops() / (step * 1e6));
        std::fflush(stdout);
      }
    }
    std::printf("\nThe one-GPU steps (H = %d, the whole context):\n\n", kHeads);
    std::printf("| batch | context | µs | floor µs | step/floor | GB/s | TFLOP/s |\n|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const std::string& line : one_gpu_lines) std::printf("%s\n", line.c_str());
    MLA_CUDA_CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcp_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
