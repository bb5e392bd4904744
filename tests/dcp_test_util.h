// DCP test inputs: rank steps cut from one synthetic global step of D*H heads (the same tokens
// sharded by ownership (g / I) % D == k into each rank's own pages, local lengths, global totals, slots
// -1 for tokens a rank does not own) and rank k's weights = heads [k*H, (k+1)*H) of the layer. Shared
// by the GPU DCP tests and the CPU test that checks this sharding against the one-GPU reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "mla/mla.h"
#include "reference.h"
#include "synthetic.h"

namespace mla::test {

inline constexpr uint16_t kBf16NaN = 0xffff;
inline constexpr uint8_t kE4m3NaN = 0x7f;

// Heads [first, first + count) of a layer, owning (host).
struct RankWeights {
  int heads = 0;
  std::vector<uint16_t> q_a_norm, kv_a_norm, q_b_proj, w_uk_t, w_uv;
  float q_scale = 1, k_scale = 1;

  RankWeights(const synth::SyntheticLayer& layer, int first, int count) : heads(count) {
    auto slice = [&](const std::vector<uint16_t>& all, int64_t per_head) {
      return std::vector<uint16_t>(all.begin() + first * per_head, all.begin() + (first + count) * per_head);
    };
    q_a_norm = layer.q_a_norm;
    kv_a_norm = layer.kv_a_norm;
    q_b_proj = slice(layer.q_b_proj, int64_t{kQkHeadDim} * kQLoraRank);
    w_uk_t = slice(layer.w_uk_t, int64_t{kNopeDim} * kKvLoraRank);
    w_uv = slice(layer.w_uv, int64_t{kKvLoraRank} * kVHeadDim);
    q_scale = layer.q_scale;  // one scale pair for the group: a query is read against every shard
    k_scale = layer.k_scale;
  }
  // Views of `q_a_norm`, ... or of device copies with the same shapes.
  Weights views(const void* qa, const void* kva, const void* qb, const void* uk, const void* uv, Memory memory) const {
    const int64_t h = heads;
    Weights w;
    w.q_a_norm = make_view(const_cast<void*>(qa), DType::kBF16, memory, {kQLoraRank});
    w.kv_a_norm = make_view(const_cast<void*>(kva), DType::kBF16, memory, {kKvLoraRank});
    w.q_b_proj = make_view(const_cast<void*>(qb), DType::kBF16, memory, {h * kQkHeadDim, kQLoraRank});
    w.w_uk_t = make_view(const_cast<void*>(uk), DType::kBF16, memory, {h, kNopeDim, kKvLoraRank});
    w.w_uv = make_view(const_cast<void*>(uv), DType::kBF16, memory, {h, kKvLoraRank, kVHeadDim});
    w.q_scale = q_scale;
    w.k_scale = k_scale;
    return w;
  }
  Weights host() const {
    return views(q_a_norm.data(), kv_a_norm.data(), q_b_proj.data(), w_uk_t.data(), w_uv.data(), Memory::kHost);
  }
};

// One rank's step (host, owning).
struct RankStep {
  int heads = 0, q = 1, num_requests = 0, max_pages = 0;
  int64_t rows = 0, pitch = 0, num_pages = 0, page_stride = int64_t{kPageSize} * kKeyDim;
  std::vector<uint16_t> projected, out;
  std::vector<uint8_t> cache;
  std::vector<int64_t> slots;
  std::vector<int32_t> block_table, lengths, totals;

  StepInputs inputs() {
    StepInputs s;
    s.projected = make_strided_view(projected.data(), DType::kBF16, Memory::kHost, {rows, projected_width(heads)},
                                    {pitch, 1});
    s.out = make_view(out.data(), DType::kBF16, Memory::kHost, {rows, int64_t{heads} * kVHeadDim});
    s.cache = make_strided_view(cache.data(), DType::kFP8E4M3, Memory::kHost, {num_pages, kPageSize, kKeyDim},
                                {page_stride, kKeyDim, 1});
    s.slots = make_view(slots.data(), DType::kI64, Memory::kHost, {rows});
    s.block_table = make_view(block_table.data(), DType::kI32, Memory::kHost, {num_requests, max_pages});
    s.lengths = make_view(lengths.data(), DType::kI32, Memory::kHost, {num_requests});
    s.totals = make_view(totals.data(), DType::kI32, Memory::kHost, {num_requests});
    s.q = q;
    return s;
  }
  bool zero_row(int64_t r) const { return r / q >= num_requests || totals[r / q] == 0; }
  bool empty_shard() const {
    return std::all_of(lengths.begin(), lengths.end(), [](int32_t l) { return l == 0; });
  }
};

// Rank `dcp.rank`'s step of a global step of D*H heads whose lengths are the totals. Its pages are
// handed out in reverse request order from page 1 (local page indices differ from the global ones);
// `num_pages` = 0 gives the pages used + 2, else a fixed capacity (graph replays, long runs).
inline RankStep shard_step(const synth::SyntheticStep& global, const DcpLayout& dcp, int heads, int64_t num_pages = 0) {
  RankStep s;
  s.heads = heads;
  s.q = global.q;
  s.rows = global.rows;
  s.num_requests = global.num_requests;
  s.max_pages = global.max_pages;
  s.pitch = (projected_width(heads) + 64 + 7) / 8 * 8;  // past the row, 16-byte aligned
  s.totals = global.lengths;
  for (int32_t total : s.totals) s.lengths.push_back(static_cast<int32_t>(ref::dcp_local_length(total, dcp)));

  s.block_table.assign(size_t(s.num_requests) * s.max_pages, 0);
  int32_t next_page = 1;
  for (int b = s.num_requests - 1; b >= 0; --b) {
    for (int p = 0; p < (s.lengths[b] + kPageSize - 1) / kPageSize; ++p) s.block_table[b * s.max_pages + p] = next_page++;
  }
  s.num_pages = num_pages > 0 ? num_pages : next_page + 1;
  if (next_page > s.num_pages) throw Error("shard_step: the rank needs more pages than num_pages");

  // Every byte no live token holds is an e4m3 NaN: a masked or unwritten token in a sum shows.
  s.cache.assign(s.num_pages * s.page_stride, kE4m3NaN);
  for (int b = 0; b < s.num_requests; ++b) {
    for (int64_t j = 0; j < s.lengths[b]; ++j) {
      const uint8_t* from = global.token_row(b, ref::dcp_global_position(j, dcp));
      std::copy(from, from + kKeyDim,
                s.cache.begin() + s.block_table[b * s.max_pages + j / kPageSize] * s.page_stride +
                    (j % kPageSize) * kKeyDim);
    }
  }
  s.slots.assign(s.rows, -1);
  for (int b = 0; b < s.num_requests; ++b) {
    for (int i = 0; i < s.q; ++i) {
      const int64_t position = int64_t{s.totals[b]} - s.q + i;
      if (position < 0 || ref::dcp_owner(position, dcp) != dcp.rank) continue;
      const int64_t j = ref::dcp_local_index(position, dcp);
      s.slots[b * s.q + i] = int64_t{s.block_table[b * s.max_pages + j / kPageSize]} * kPageSize + j % kPageSize;
    }
  }

  // The shared q_a | kv_a | k_pe columns and this rank's heads of the gate; NaN past the row.
  s.projected.assign(s.rows * s.pitch, kBf16NaN);
  for (int64_t r = 0; r < s.rows; ++r) {
    const uint16_t* from = global.projected.data() + r * global.pitch;
    std::copy(from, from + kProjectedGateOffset, s.projected.begin() + r * s.pitch);
    const uint16_t* gate = from + kProjectedGateOffset + int64_t{dcp.rank} * heads * kVHeadDim;
    std::copy(gate, gate + heads * kVHeadDim, s.projected.begin() + r * s.pitch + kProjectedGateOffset);
  }
  s.out.assign(s.rows * heads * kVHeadDim, kBf16NaN);
  return s;
}

inline std::vector<RankStep> shard_all(const synth::SyntheticStep& global, int size, int interleave, int heads,
                                int64_t num_pages = 0) {
  std::vector<RankStep> steps;
  for (int k = 0; k < size; ++k) steps.push_back(shard_step(global, {k, size, interleave}, heads, num_pages));
  return steps;
}

// Heads [first, first + count) of a core result.
inline ref::CoreResult head_slice(const ref::CoreResult& all, int first, int count) {
  ref::CoreResult slice;
  slice.rows = all.rows;
  slice.heads = count;
  slice.latent.resize(all.rows * count * kKvLoraRank);
  slice.lse.resize(all.rows * count);
  for (int64_t r = 0; r < all.rows; ++r) {
    for (int h = 0; h < count; ++h) {
      const int64_t from = r * all.heads + first + h, to = r * count + h;
      slice.lse[to] = all.lse[from];
      std::copy_n(all.latent.begin() + from * kKvLoraRank, kKvLoraRank, slice.latent.begin() + to * kKvLoraRank);
    }
  }
  return slice;
}

// What every rank's `out` must be for given query bytes and caches: the reference core over all D*H
// heads of rank k's mailbox [rows, D*H, 576] and rank k's cache (as `ranks[k]` holds it: after the
// step's writes), the DCP merge of each rank's heads, the bf16 latent and the value stage.
inline std::vector<std::vector<uint16_t>> reference_from_bytes(const std::vector<RankWeights>& weights,
                                                               std::vector<RankStep> ranks,
                                                               const std::vector<std::vector<uint8_t>>& mailboxes,
                                                               int interleave) {
  const int size = static_cast<int>(ranks.size());
  const int heads = ranks[0].heads;
  const int64_t rows = ranks[0].rows;
  const double softmax_scale = double{weights[0].q_scale} * weights[0].k_scale / std::sqrt(double{kQkHeadDim});
  std::vector<ref::CoreResult> partial;
  for (int k = 0; k < size; ++k) {
    const StepInputs v = ranks[k].inputs();
    ref::CoreInputs in;
    in.query = mailboxes[k].data();
    in.rows = rows;
    in.heads = size * heads;
    in.q = ranks[k].q;
    in.cache = v.cache;
    in.block_table = v.block_table;
    in.lengths = v.lengths;
    in.totals = v.totals;
    in.softmax_scale = softmax_scale;
    in.k_scale = weights[0].k_scale;
    in.dcp = {k, size, interleave};
    partial.push_back(ref::attention_core(in));
  }
  std::vector<std::vector<uint16_t>> out(size);
  for (int k = 0; k < size; ++k) {
    std::vector<ref::CoreResult> own;
    for (const ref::CoreResult& p : partial) own.push_back(head_slice(p, k * heads, heads));
    std::vector<bool> zero_rows(rows);
    for (int64_t r = 0; r < rows; ++r) zero_rows[r] = ranks[k].zero_row(r);
    out[k].resize(rows * heads * kVHeadDim);
    ref::value_stage(ref::round_latent(ref::dcp_merge(own)), weights[k].host(), LayerDims{heads, 1e-5f},
                     ranks[k].inputs().projected, zero_rows, out[k].data());
  }
  return out;
}

}  // namespace mla::test
