// The whole decode step of the reference: validation, query stage (with cache writes), core, value
// stage; and the same step on D simulated DCP ranks, run phase by phase as the GPUs do.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "host/validate.h"
#include "internal.h"
#include "reference.h"

namespace mla::ref {
namespace {

// The reference accepts every shape the library could be prepared for: any pitch, any q in 1..8,
// no context bound beyond the block table's capacity.
detail::StepContract host_contract(int num_heads, const DcpLayout& dcp) {
  detail::StepContract contract;
  contract.num_heads = num_heads;
  contract.dcp = dcp;
  contract.memory = Memory::kHost;
  contract.check_values = true;
  return contract;
}

double softmax_scale(const Weights& weights) {
  return static_cast<double>(weights.q_scale) * weights.k_scale / std::sqrt(double{kQkHeadDim});
}

// Rows whose request has no tokens at all (`counts` = local lengths, or global totals under DCP) or
// is padding beyond the block table: their output is exactly zero.
std::vector<bool> empty_request_rows(const StepInputs& step, const TensorView& counts) {
  const int64_t rows = step.projected.shape[0];
  const int64_t num_requests = step.block_table.shape[0];
  std::vector<bool> zero_rows(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / step.q;
    zero_rows[r] = b >= num_requests || internal::read_index(counts, b) == 0;
  }
  return zero_rows;
}

// Heads [first, first + count) of `result`.
CoreResult head_slice(const CoreResult& result, int first, int count) {
  CoreResult slice;
  slice.rows = result.rows;
  slice.heads = count;
  slice.latent.resize(result.rows * count * kKvLoraRank);
  slice.lse.resize(result.rows * count);
  for (int64_t r = 0; r < result.rows; ++r) {
    for (int h = 0; h < count; ++h) {
      const int64_t from = r * result.heads + first + h;
      const int64_t to = r * count + h;
      slice.lse[to] = result.lse[from];
      std::copy_n(result.latent.begin() + from * kKvLoraRank, kKvLoraRank,
                  slice.latent.begin() + to * kKvLoraRank);
    }
  }
  return slice;
}

}  // namespace

void run_layer(const Weights& weights, const LayerDims& dims, const StepInputs& step,
               const LayerOptions& options, LayerTrace* trace) {
  detail::validate_weights(weights, dims, Memory::kHost, 0);
  detail::validate_step(step, host_contract(dims.num_heads, DcpLayout{}));
  if (options.num_splits < 1) throw_bad_argument("num_splits", ">= 1", std::to_string(options.num_splits));

  const int num_heads = dims.num_heads;
  const int64_t rows = step.projected.shape[0];
  std::vector<uint8_t> query(rows * num_heads * kKeyDim);
  internal::query_stage_unchecked(weights, dims, step, query.data());

  const CoreInputs core_inputs{.query = query.data(),
                               .rows = rows,
                               .heads = num_heads,
                               .q = step.q,
                               .cache = step.cache,
                               .block_table = step.block_table,
                               .lengths = step.lengths,
                               .totals = {},
                               .softmax_scale = softmax_scale(weights),
                               .k_scale = weights.k_scale,
                               .dcp = {}};
  CoreResult core = merge_partials(core_partials(core_inputs, options.num_splits));
  value_stage(round_latent(core), weights, dims, step.projected, empty_request_rows(step, step.lengths),
              step.out.as<uint16_t>());
  if (trace) {
    trace->query = std::move(query);
    trace->core = std::move(core);
  }
}

void run_layer_dcp(const std::vector<Weights>& weights, const LayerDims& dims,
                   const std::vector<StepInputs>& steps, int interleave, const LayerOptions& options) {
  const int num_ranks = static_cast<int>(steps.size());
  if (num_ranks < 1) throw_bad_argument("run_layer_dcp: steps", "one per rank", "none");
  if (static_cast<int>(weights.size()) != num_ranks) {
    throw_bad_argument("run_layer_dcp: weights", std::to_string(num_ranks) + " (one per rank)",
                       std::to_string(weights.size()));
  }
  if (options.num_splits < 1) throw_bad_argument("num_splits", ">= 1", std::to_string(options.num_splits));
  // Every check of every rank runs before any rank writes, as one launch would on the GPUs.
  for (int k = 0; k < num_ranks; ++k) {
    const std::string rank = "rank " + std::to_string(k) + " ";
    detail::validate_weights(weights[k], dims, Memory::kHost, 0);
    detail::validate_step(steps[k], host_contract(dims.num_heads, {k, num_ranks, interleave}));
    if (steps[k].projected.shape[0] != steps[0].projected.shape[0] || steps[k].q != steps[0].q) {
      throw_bad_argument(rank + "rows x q", std::to_string(steps[0].projected.shape[0]) + " x " +
                                                std::to_string(steps[0].q),
                         std::to_string(steps[k].projected.shape[0]) + " x " + std::to_string(steps[k].q));
    }
    // The query is quantized by its publisher and read against every rank's cache: one scale pair.
    if (weights[k].q_scale != weights[0].q_scale || weights[k].k_scale != weights[0].k_scale) {
      throw_bad_argument(rank + "q_scale, k_scale",
                         std::to_string(weights[0].q_scale) + ", " + std::to_string(weights[0].k_scale),
                         std::to_string(weights[k].q_scale) + ", " + std::to_string(weights[k].k_scale));
    }
  }

  const int num_heads = dims.num_heads;
  const int core_heads = num_ranks * num_heads;
  const int64_t rows = steps[0].projected.shape[0];

  // Phase 1: every rank's query stage publishes its heads into the mailbox at [k*H, (k+1)*H). Every
  // rank's mailbox holds the same bytes, so one copy serves all cores.
  std::vector<uint8_t> mailbox(rows * core_heads * kKeyDim);
  std::vector<uint8_t> own_query(rows * num_heads * kKeyDim);
  for (int k = 0; k < num_ranks; ++k) {
    internal::query_stage_unchecked(weights[k], dims, steps[k], own_query.data());
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(own_query.begin() + r * num_heads * kKeyDim, num_heads * kKeyDim,
                  mailbox.begin() + (r * core_heads + int64_t{k} * num_heads) * kKeyDim);
    }
  }

  // Phase 2: every rank's core over all D*H heads and its own shard, with global causal bounds.
  std::vector<CoreResult> partial(num_ranks);
  for (int k = 0; k < num_ranks; ++k) {
    const CoreInputs core_inputs{.query = mailbox.data(),
                                 .rows = rows,
                                 .heads = core_heads,
                                 .q = steps[k].q,
                                 .cache = steps[k].cache,
                                 .block_table = steps[k].block_table,
                                 .lengths = steps[k].lengths,
                                 .totals = steps[k].totals,
                                 .softmax_scale = softmax_scale(weights[k]),
                                 .k_scale = weights[k].k_scale,
                                 .dcp = {k, num_ranks, interleave}};
    partial[k] = merge_partials(core_partials(core_inputs, options.num_splits));
  }

  // Phase 3: rank k merges the D partials of its own heads, then applies W_UV and its gate.
  for (int k = 0; k < num_ranks; ++k) {
    std::vector<CoreResult> own_heads;
    for (const CoreResult& rank_partial : partial) {
      own_heads.push_back(head_slice(rank_partial, k * num_heads, num_heads));
    }
    value_stage(round_latent(dcp_merge(own_heads)), weights[k], dims, steps[k].projected,
                empty_request_rows(steps[k], steps[k].totals), steps[k].out.as<uint16_t>());
  }
}

}  // namespace mla::ref
