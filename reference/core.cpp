// Attention core of the reference (DESIGN.md §4): FP8 query x FP8 paged cache, bottom-right causal
// mask on global positions, split-KV partials and their LSE merge, DCP merge.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "internal.h"
#include "parallel_for.h"
#include "reference.h"

namespace mla::ref {
namespace {

constexpr double kMinusInf = -std::numeric_limits<double>::infinity();

// The larger of two values, NaN if either is (std::max drops a NaN in its second argument, which made a visible
// token with a NaN logit look like no visible token: 0 and -inf where DESIGN.md §4 keeps NaN).
double nan_max(double a, double b) {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b);
}

const std::array<double, 256>& e4m3_table() {
  static const std::array<double, 256> table = [] {
    std::array<double, 256> values{};
    for (int code = 0; code < 256; ++code) values[code] = e4m3_to_double(static_cast<uint8_t>(code));
    return values;
  }();
  return table;
}

CoreResult empty_result(int64_t rows, int heads) {
  CoreResult result;
  result.rows = rows;
  result.heads = heads;
  result.latent.assign(rows * heads * kKvLoraRank, 0.0);
  result.lse.assign(rows * heads, kMinusInf);
  return result;
}

// LSE merge of results over the same rows and heads. Shared by split-KV and DCP: both combine
// softmaxes over disjoint token sets, each normalized by its own sum.
CoreResult lse_merge(const std::vector<CoreResult>& parts) {
  if (parts.empty()) throw_bad_argument("merge: parts", "at least one", "none");
  const int64_t rows = parts[0].rows;
  const int heads = parts[0].heads;
  for (const CoreResult& part : parts) {
    if (part.rows != rows || part.heads != heads) {
      throw_bad_argument("merge: part shape", std::to_string(rows) + " x " + std::to_string(heads),
                         std::to_string(part.rows) + " x " + std::to_string(part.heads));
    }
  }
  CoreResult merged = empty_result(rows, heads);
  for (int64_t rh = 0; rh < rows * heads; ++rh) {
    double max_lse = kMinusInf;
    for (const CoreResult& part : parts) max_lse = nan_max(max_lse, part.lse[rh]);
    if (max_lse == kMinusInf) continue;  // nothing visible anywhere: 0 and -inf, never NaN
    double sum = 0;
    for (const CoreResult& part : parts) sum += std::exp(part.lse[rh] - max_lse);  // exp(-inf) = 0
    const double lse = max_lse + std::log(sum);
    merged.lse[rh] = lse;
    double* latent = merged.latent.data() + rh * kKvLoraRank;
    for (const CoreResult& part : parts) {
      // An empty part weighs exactly 0; skipping it also keeps whatever it stored out of the sum.
      if (part.lse[rh] == kMinusInf) continue;
      const double weight = std::exp(part.lse[rh] - lse);
      const double* part_latent = part.latent.data() + rh * kKvLoraRank;
      for (int c = 0; c < kKvLoraRank; ++c) latent[c] += weight * part_latent[c];
    }
  }
  return merged;
}

}  // namespace

int64_t dcp_global_position(int64_t local_index, const DcpLayout& dcp) {
  const int64_t interleave = dcp.interleave;
  return ((local_index / interleave) * dcp.size + dcp.rank) * interleave + local_index % interleave;
}

int dcp_owner(int64_t global_position, const DcpLayout& dcp) {
  return static_cast<int>((global_position / dcp.interleave) % dcp.size);
}

int64_t dcp_local_index(int64_t global_position, const DcpLayout& dcp) {
  const int64_t interleave = dcp.interleave;
  return (global_position / (interleave * dcp.size)) * interleave + global_position % interleave;
}

int64_t dcp_local_length(int64_t total, const DcpLayout& dcp) {
  const int64_t cycle = int64_t{dcp.interleave} * dcp.size;
  const int64_t in_last_cycle = total % cycle - int64_t{dcp.rank} * dcp.interleave;
  return (total / cycle) * dcp.interleave + std::clamp<int64_t>(in_last_cycle, 0, dcp.interleave);
}

SplitPartials core_partials(const CoreInputs& in, int num_splits) {
  if (num_splits < 1) throw_bad_argument("num_splits", ">= 1", std::to_string(num_splits));
  if (in.q < 1 || in.rows % in.q != 0) {
    throw_bad_argument("q", "a divisor of rows " + std::to_string(in.rows), std::to_string(in.q));
  }
  const std::array<double, 256>& fp8 = e4m3_table();
  const int64_t num_requests = in.block_table.present() ? in.block_table.shape[0] : 0;
  const int64_t rows_per_request = in.q;

  SplitPartials partials;
  partials.num_splits = num_splits;
  partials.splits.assign(num_splits, empty_result(in.rows, in.heads));

  std::vector<double> keys;  // [local tokens, 576] of one request, decoded once
  for (int64_t b = 0; b < in.rows / rows_per_request && b < num_requests; ++b) {
    const int64_t length = internal::read_index(in.lengths, b);
    const int64_t total = in.totals.present() ? internal::read_index(in.totals, b) : length;
    keys.resize(length * kKeyDim);
    parallel_for(length, kKeyDim, [&](int64_t j) {
      const int64_t page = internal::read_index(in.block_table, b, j / kPageSize);
      for (int d = 0; d < kKeyDim; ++d) {
        keys[j * kKeyDim + d] = fp8[*internal::cache_byte(in.cache, page, j % kPageSize, d)];
      }
    });
    // Splits own whole pages so that a kernel's split never shares a page with its neighbour.
    const int64_t num_pages = (length + kPageSize - 1) / kPageSize;
    const int64_t pages_per_split = (num_pages + num_splits - 1) / num_splits;

    // Each (row of the request, head) on its own, over every split.
    parallel_for(rows_per_request * in.heads, length * (kKeyDim + kKvLoraRank), [&](int64_t row_head) {
      const int64_t i = row_head / in.heads;
      const int64_t r = b * rows_per_request + i;
      const int64_t rh = r * in.heads + row_head % in.heads;
      const int64_t last_visible = total - rows_per_request + i;  // global positions <= this are seen
      std::array<double, kKeyDim> query;
      for (int d = 0; d < kKeyDim; ++d) query[d] = fp8[in.query[rh * kKeyDim + d]];
      std::vector<double> logits;  // [tokens of one split]
      for (int s = 0; s < num_splits; ++s) {
        const int64_t begin = std::min(length, s * pages_per_split * kPageSize);
        const int64_t end = std::min(length, (s + 1) * pages_per_split * kPageSize);
        logits.clear();
        double max_logit = kMinusInf;
        bool any_visible = false;
        for (int64_t j = begin; j < end; ++j) {
          if (dcp_global_position(j, in.dcp) > last_visible) {
            logits.push_back(kMinusInf);
            continue;
          }
          double dot = 0;
          for (int d = 0; d < kKeyDim; ++d) dot += query[d] * keys[j * kKeyDim + d];
          logits.push_back(in.softmax_scale * dot);
          max_logit = nan_max(max_logit, logits.back());
          any_visible = true;
        }
        if (!any_visible) continue;  // nothing visible in this split: 0 and -inf

        CoreResult& split = partials.splits[s];
        double* latent = split.latent.data() + rh * kKvLoraRank;
        double sum = 0;
        for (int64_t j = begin; j < end; ++j) {
          const double p = std::exp(logits[j - begin] - max_logit);
          if (p == 0) continue;
          sum += p;
          for (int c = 0; c < kKvLoraRank; ++c) latent[c] += p * keys[j * kKeyDim + c];
        }
        for (int c = 0; c < kKvLoraRank; ++c) latent[c] *= in.k_scale / sum;
        split.lse[rh] = max_logit + std::log(sum);
      }
    });
  }
  return partials;
}

CoreResult merge_partials(const SplitPartials& partials) { return lse_merge(partials.splits); }

CoreResult attention_core(const CoreInputs& in) { return merge_partials(core_partials(in, 1)); }

CoreResult dcp_merge(const std::vector<CoreResult>& per_rank) { return lse_merge(per_rank); }

std::vector<double> round_latent(const CoreResult& core) {
  std::vector<double> rounded(core.latent.size());
  for (size_t e = 0; e < core.latent.size(); ++e) rounded[e] = bf16_round(core.latent[e]);
  return rounded;
}

}  // namespace mla::ref
