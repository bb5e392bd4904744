// GPU tests of the FP8 attention core (src/core) against the double-precision reference
// (mla::ref::attention_core): every (row, head) of the latent within a relative L2 bound, the LSE
// within an absolute bound, non-finite positions (-inf LSE, exact-zero latent) matching exactly,
// outputs poisoned before each launch. Inputs are random FP8 bytes, pages permuted, the cache's
// unused rows NaN bytes (0x7f) so a masked or unwritten token shows up as NaN.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/launch.h"
#include "cpu/error_of.h"
#include "gpu_test_util.h"
#include "query/testing.h"
#include "mla/dims.h"
#include "reference.h"

namespace mla {
namespace {

// Relative L2 error of the bf16 latent per (row, head) against the unrounded reference. The bf16
// rounding of the output alone is ~1.1e-3 (RMS); fp16 P and fp32 accumulation add ~3e-4.
constexpr double kLatentRelL2Bound = 2.5e-3;
constexpr double kLseAbsBound = 1e-3;

struct CoreCase {
  std::string name;
  int heads = 16;
  int q = 1;
  std::vector<int> lengths;      // per request: global length T_b (local = dcp_local_length under DCP)
  int padding_requests = 0;      // rows / q - num_requests
  int num_splits = 0;            // 0 = planned
  DcpLayout dcp;                 // size 1 = none
  int64_t page_pad_bytes = 0;    // page stride = 64*576 + this
  double logit_std = 2.0;        // spread of the natural-log logits
  int64_t max_context = int64_t{1} << 17;
  // The checked launch's query and this step's cache rows (each request's newest q) come from a PDL producer that lets
  // its dependents start at once and writes them ~20 µs later (query::launch_delayed_copy): a split kernel that reads
  // either before its PDL wait sees NaN bytes. Older rows are complete before the producer starts, as an earlier
  // step's are (bench/results/patches/core-first-page-before-wait.patch read them before the wait; not merged).
  bool late_query_producer = false;
  // Request 0's tokens of these indices get a NaN byte (e4m3 0x7f) in their keys: the rows that see one must come out
  // NaN (latent and LSE), the others finite (DESIGN.md §4: only rows with nothing visible are 0 and -inf).
  std::vector<int> nan_key_tokens;
  uint64_t seed = 1;
};

std::ostream& operator<<(std::ostream& os, const CoreCase& c) { return os << c.name; }

// e4m3 codes of N(0, stddev) samples, drawn through a table (fast for millions of bytes).
struct Fp8Sampler {
  std::vector<uint8_t> table;
  Fp8Sampler(double stddev, std::mt19937_64& rng) : table(4096) {
    std::normal_distribution<double> normal(0.0, stddev);
    for (auto& code : table) code = ref::e4m3_from_double(normal(rng));
  }
  uint8_t operator()(std::mt19937_64& rng) const { return table[rng() & 4095]; }
};

struct CoreOutputs {
  std::vector<uint16_t> latent;  // [rows, heads, 512] bf16 bits
  std::vector<float> lse;        // [rows, heads]
  int num_splits = 0;
};

class CoreTest : public ::testing::TestWithParam<CoreCase> {};

TEST_P(CoreTest, MatchesReference) {
  MLA_REQUIRE_GPU();
  const CoreCase& spec = GetParam();
  std::mt19937_64 rng(spec.seed * 7919 + 17);
  const int num_requests = static_cast<int>(spec.lengths.size());
  const int num_total_requests = num_requests + spec.padding_requests;
  const int64_t rows = int64_t{num_total_requests} * spec.q;
  const int heads = spec.heads;

  // ---- Metadata: local lengths, permuted pages, a block table with a wider row stride ----------
  std::vector<int32_t> totals(num_requests), lengths(num_requests);
  int max_pages = 1;
  int64_t used_pages = 0;
  for (int b = 0; b < num_requests; ++b) {
    totals[b] = spec.lengths[b];
    lengths[b] = spec.dcp.size > 1 ? static_cast<int32_t>(ref::dcp_local_length(totals[b], spec.dcp)) : totals[b];
    const int pages = (lengths[b] + kPageSize - 1) / kPageSize;
    max_pages = std::max(max_pages, pages);
    used_pages += pages;
  }
  const int64_t num_pages = used_pages + 3;
  const int64_t page_stride = int64_t{kPageSize} * kKeyDim + spec.page_pad_bytes;
  const int64_t stride_table = max_pages + 3;
  std::vector<int32_t> permutation(num_pages);
  std::iota(permutation.begin(), permutation.end(), 0);
  std::shuffle(permutation.begin(), permutation.end(), rng);
  std::vector<int32_t> block_table(int64_t{std::max(num_requests, 1)} * stride_table, 0);
  std::vector<uint8_t> cache(num_pages * page_stride, 0x7f);  // NaN wherever no live token is
  const double sigma = 32.0;
  Fp8Sampler sampler(sigma, rng);
  int64_t next_page = 0;
  for (int b = 0; b < num_requests; ++b) {
    for (int k = 0; k * kPageSize < lengths[b]; ++k) {
      const int32_t page = permutation[next_page++];
      block_table[b * stride_table + k] = page;
      for (int t = 0; t < kPageSize && k * kPageSize + t < lengths[b]; ++t) {
        uint8_t* row = cache.data() + page * page_stride + int64_t{t} * kKeyDim;
        for (int d = 0; d < kKeyDim; ++d) row[d] = sampler(rng);
      }
    }
  }
  for (const int token : spec.nan_key_tokens) {
    cache[block_table[token / kPageSize] * page_stride + int64_t{token % kPageSize} * kKeyDim + 5] = 0x7f;
  }
  std::vector<uint8_t> query(rows * heads * kKeyDim);
  for (auto& byte : query) byte = sampler(rng);
  // Dot products of two N(0, sigma) vectors of 576 have stddev 24 sigma^2.
  const float softmax_scale = static_cast<float>(spec.logit_std / (24.0 * sigma * sigma));
  const float k_scale = 0.0625f;

  // ---- Reference ------------------------------------------------------------------------------------
  ref::CoreInputs in;
  in.query = query.data();
  in.rows = rows;
  in.heads = heads;
  in.q = spec.q;
  in.cache = make_strided_view(cache.data(), DType::kFP8E4M3, Memory::kHost, {num_pages, kPageSize, kKeyDim},
                               {page_stride, kKeyDim, 1});
  in.block_table = make_strided_view(block_table.data(), DType::kI32, Memory::kHost,
                                     {num_requests, max_pages}, {stride_table, 1});
  in.lengths = make_view(lengths.data(), DType::kI32, Memory::kHost, {num_requests});
  if (spec.dcp.size > 1) in.totals = make_view(totals.data(), DType::kI32, Memory::kHost, {num_requests});
  in.softmax_scale = softmax_scale;
  in.k_scale = k_scale;
  in.dcp = spec.dcp;
  const ref::CoreResult expected = ref::attention_core(in);

  // ---- GPU ----------------------------------------------------------------------------------------------
  test::DeviceBuffer<uint8_t> d_query(query.size()), d_cache(cache.size());
  test::DeviceBuffer<int32_t> d_table(block_table.size()), d_lengths(std::max(num_requests, 1)),
      d_totals(std::max(num_requests, 1));
  test::DeviceBuffer<uint16_t> d_latent(rows * heads * kKvLoraRank);
  test::DeviceBuffer<float> d_lse(rows * heads);
  d_query.upload(query);
  test::DeviceBuffer<uint8_t> d_query_source(spec.late_query_producer ? query.size() : 1);
  test::DeviceBuffer<uint8_t> d_cache_source(spec.late_query_producer ? cache.size() : 1);
  std::vector<uint8_t> cache_before_step;  // the cache with this step's rows NaN until the producer writes them
  if (spec.late_query_producer) {
    d_query_source.upload(query);
    d_cache_source.upload(cache);
    cache_before_step = cache;
    for (int b = 0; b < num_requests; ++b) {
      for (int t = std::max(0, lengths[b] - spec.q); t < lengths[b]; ++t) {
        std::fill_n(cache_before_step.begin() + block_table[b * stride_table + t / kPageSize] * page_stride +
                        int64_t{t % kPageSize} * kKeyDim,
                    kKeyDim, uint8_t{0x7f});
      }
    }
  }
  d_cache.upload(cache);
  d_table.upload(block_table);
  if (num_requests > 0) {
    d_lengths.upload(lengths);
    d_totals.upload(totals);
  }
  core::CoreShape base_shape;
  base_shape.rows = rows;
  base_shape.heads = heads;
  base_shape.q = spec.q;
  base_shape.max_context = spec.max_context;
  base_shape.num_splits = spec.num_splits;

  // Every split-kernel variant that can run this shape: the mma.sync version, the ping-pong wgmma one at each
  // N-tile but the planned one (padding rows of a large tile; several small tiles per request), then at the planned
  // tile with 2 and 3 stages.
  std::vector<core::CoreShape> variants;
  {
    core::CoreShape v = base_shape;
    v.kernel = core::kKernelMmaSync;
    variants.push_back(v);
    v.kernel = core::kKernelWgmmaPp;
    const int planned_tile = core::plan_core(v).tile_rows;
    for (int tile : {16, 32, 48, 64}) {
      if (tile == planned_tile) continue;
      v.tile_rows = tile;
      variants.push_back(v);
    }
    v.tile_rows = 0;
    for (int stages : {2, 3}) {
      v.stages = stages;
      variants.push_back(v);
    }
  }
  for (const core::CoreShape& shape : variants) {
    const core::CorePlan plan = core::plan_core(shape);
    const std::string variant = std::string(core::kernel_name(plan.kernel)) +
                                " tile " + std::to_string(plan.tile_rows) + " stages " + std::to_string(plan.stages);
    SCOPED_TRACE(variant);
    test::DeviceBuffer<uint8_t> d_workspace(std::max<size_t>(plan.workspace_bytes, 16));
    d_workspace.poison();
    core::CoreArgs args;
    args.query = d_query.get();
    args.cache = d_cache.get();
    args.stride_cache_page = page_stride;
    args.block_table = d_table.get();
    args.stride_block_table = stride_table;
    args.lengths = d_lengths.get();
    args.totals = spec.dcp.size > 1 ? d_totals.get() : nullptr;
    args.num_requests = num_requests;
    args.dcp = spec.dcp;
    args.softmax_scale = softmax_scale;
    args.k_scale = k_scale;
    args.latent = d_latent.get();
    args.lse = d_lse.get();
    args.workspace = d_workspace.get();
    // Merged in the split kernel (flat slots, few splits): zeroed counters, left zero by every launch. Two launches
    // with the outputs and the workspace re-poisoned between them, the second one checked: a counter left nonzero
    // by the first would skip the second's merges and leave poison behind.
    test::DeviceBuffer<int> d_counters(std::max<int64_t>(plan.tile_counters, 1));
    d_counters.poison(0);
    args.tile_counters = plan.merge_in_split ? d_counters.get() : nullptr;

    for (int launch = 0; launch < 2; ++launch) {
      d_workspace.poison();
      d_latent.poison();
      d_lse.poison();
      // The checked launch also deals an L2 prefetch of "next-stage weights" over the combine kernel's CTAs, where
      // the plan has one (here the query's bytes, rarely a multiple of 16 x the CTA count): a hint that must change
      // nothing.
      args.l2_prefetch = launch == 1 ? d_query.get() : nullptr;
      args.l2_prefetch_bytes = launch == 1 ? rows * heads * int64_t{kKeyDim} : 0;
      if (spec.late_query_producer && launch == 1) {
        d_query.poison(0x7f);  // e4m3 NaN until the producer's copy lands
        d_cache.upload(cache_before_step);
        MLA_CUDA_CHECK(cudaDeviceSynchronize());  // the memset runs on the legacy stream, ours does not wait
        cudaStream_t stream;
        MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        query::launch_delayed_copy(d_query.get(), d_query_source.get(), query.size(), 20000, stream, d_cache.get(),
                                   d_cache_source.get(), cache.size());
        core::launch_core(plan, args, stream);
        MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
        MLA_CUDA_CHECK(cudaStreamDestroy(stream));
      } else {
        core::launch_core(plan, args, nullptr);
      }
      MLA_CUDA_CHECK(cudaDeviceSynchronize());
    }
    const CoreOutputs got{d_latent.download(), d_lse.download(), plan.num_splits};
    for (int counter : d_counters.download()) ASSERT_EQ(counter, 0) << "a tile counter left nonzero";

    // ---- Compare ------------------------------------------------------------------------------------
    double worst_rel = 0, worst_lse = 0;
    int64_t worst_entry = -1, failures = 0, empty = 0, nan_entries = 0;
    for (int64_t e = 0; e < rows * heads; ++e) {
      const double ref_lse = expected.lse[e];
      const float gpu_lse = got.lse[e];
      const uint16_t* lat = got.latent.data() + e * kKvLoraRank;
      const double* ref_lat = expected.latent.data() + e * kKvLoraRank;
      if (std::isnan(ref_lse)) {  // a NaN logit among the visible tokens: NaN everywhere (a NaN key byte)
        ++nan_entries;
        bool nan = std::isnan(gpu_lse);
        for (int d = 0; d < kKvLoraRank; ++d) nan = nan && std::isnan(ref::bf16_to_double(lat[d]));
        if (!nan && failures++ < 5) {
          ADD_FAILURE() << spec.name << ": entry " << e << " (row " << e / heads << ", head " << e % heads
                        << ") sees a NaN key but lse " << gpu_lse << ", latent[0] " << ref::bf16_to_double(lat[0]);
        }
        continue;
      }
      if (std::isinf(ref_lse)) {
        ++empty;
        bool zero = gpu_lse == -std::numeric_limits<float>::infinity();
        for (int d = 0; d < kKvLoraRank; ++d) zero = zero && ref::bf16_to_double(lat[d]) == 0.0;
        if (!zero && failures++ < 5) {
          ADD_FAILURE() << spec.name << ": entry " << e << " (row " << e / heads << ", head " << e % heads
                        << ") has no visible token but lse " << gpu_lse << ", latent[0] "
                        << ref::bf16_to_double(lat[0]);
        }
        continue;
      }
      double err2 = 0, ref2 = 0;
      bool finite = std::isfinite(gpu_lse);
      for (int d = 0; d < kKvLoraRank; ++d) {
        const double v = ref::bf16_to_double(lat[d]);
        finite = finite && std::isfinite(v);
        err2 += (v - ref_lat[d]) * (v - ref_lat[d]);
        ref2 += ref_lat[d] * ref_lat[d];
      }
      const double rel = finite ? std::sqrt(err2 / std::max(ref2, 1e-300)) : INFINITY;
      const double lse_err = finite ? std::fabs(gpu_lse - ref_lse) : INFINITY;
      if (rel > worst_rel) {
        worst_rel = rel;
        worst_entry = e;
      }
      worst_lse = std::max(worst_lse, lse_err);
      if ((rel > kLatentRelL2Bound || lse_err > kLseAbsBound) && failures++ < 5) {
        ADD_FAILURE() << spec.name << ": entry " << e << " (row " << e / heads << ", head " << e % heads
                      << "): latent rel L2 " << rel << " (bound " << kLatentRelL2Bound << "), lse " << gpu_lse
                      << " vs " << ref_lse << " (bound " << kLseAbsBound << ")";
      }
    }
    std::printf("[core] %-26s %-26s H=%3d q=%d rows=%4lld splits=%4d  worst latent rel L2 %.3e (entry %lld)  worst |dlse| %.3e  empty %lld  NaN %lld\n",
                spec.name.c_str(), variant.c_str(), heads, spec.q, static_cast<long long>(rows), plan.num_splits,
                worst_rel, static_cast<long long>(worst_entry), worst_lse, static_cast<long long>(empty),
                static_cast<long long>(nan_entries));
    EXPECT_EQ(failures, 0);

    // ---- The same launch captured in a CUDA graph gives the same bits ------------------------------
    cudaStream_t stream;
    MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    d_latent.poison();
    d_lse.poison();
    MLA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    core::launch_core(plan, args, stream);
    MLA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    MLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    MLA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<uint16_t> graph_latent = d_latent.download();
    const std::vector<float> graph_lse = d_lse.download();
    MLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MLA_CUDA_CHECK(cudaGraphDestroy(graph));
    MLA_CUDA_CHECK(cudaStreamDestroy(stream));
    EXPECT_TRUE(graph_latent == got.latent) << spec.name << ": graph replay latent differs from direct launch";
    EXPECT_EQ(0, std::memcmp(graph_lse.data(), got.lse.data(), graph_lse.size() * sizeof(float)))
        << spec.name << ": graph replay lse differs from direct launch";
  }
}

DcpLayout dcp(int rank, int size, int interleave) { return DcpLayout{rank, size, interleave}; }

CoreCase make(std::string name, int heads, int q, std::vector<int> lengths) {
  CoreCase c;
  c.name = std::move(name);
  c.heads = heads;
  c.q = q;
  c.lengths = std::move(lengths);
  return c;
}
CoreCase with(CoreCase c, int num_splits, int padding = 0, DcpLayout layout = {}) {
  c.num_splits = num_splits;
  c.padding_requests = padding;
  c.dcp = layout;
  return c;
}

std::vector<CoreCase> cases() {
  std::vector<CoreCase> v;
  const std::vector<int> edge = {0, 1, 63, 64, 65, 4097};
  v.push_back(with(make("h16_q1_edges_auto", 16, 1, edge), 0, 2));
  v.push_back(with(make("h16_q1_edges_one_split", 16, 1, edge), 1, 1));
  v.push_back(with(make("h16_q1_splits_gt_pages", 16, 1, {1, 65, 4097}), 100));
  v.push_back(with(make("h8_q4_short", 8, 4, {1, 3, 4, 64, 65, 700}), 7, 1));
  v.push_back(with(make("h12_q1_long_70000", 12, 1, {70000}), 0));
  v.push_back(with(make("h12_q8_m96", 12, 8, {5, 8, 300, 129}), 3));
  v.push_back(with(make("h64_q2", 64, 2, {4097, 65, 0}), 0));
  v.push_back(with(make("h96_q1", 96, 1, {2000, 1, 130}), 5, 1));
  v.push_back(with(make("h128_q1", 128, 1, {4097, 64}), 0));
  v.push_back(with(make("h1_q1", 1, 1, {500, 2}), 2));
  {
    CoreCase c = make("h16_q1_page_stride", 16, 1, {3000, 200});
    c.page_pad_bytes = 256;
    v.push_back(c);
  }
  {
    CoreCase c = make("h16_q1_peaky", 16, 1, {4097, 100});
    c.logit_std = 6.0;
    v.push_back(c);
  }
  {
    // Logits so spread (log2 std ~17) that later pages still raise the running max by more than the
    // lazy-max slack (config.h): version 1's exact path runs mid-split, not only on the first page.
    CoreCase c = make("h16_q1_rising_max_one_split", 16, 1, {4097, 300});
    c.logit_std = 12.0;
    c.num_splits = 1;
    v.push_back(c);
  }
  v.push_back(with(make("dcp2_i1_h16_q2", 16, 2, {5000, 3, 130, 1}), 0, 1, dcp(1, 2, 1)));
  v.push_back(with(make("dcp4_i64_h32_q1", 32, 1, {10000, 64 * 4 * 3 + 10, 100, 64 * 2 + 5}), 5, 0, dcp(2, 4, 64)));
  v.push_back(with(make("dcp4_i1_h8_q4", 8, 4, {4097, 7, 2}), 1, 0, dcp(3, 4, 1)));
  v.push_back(with(make("dcp2_i64_h24_q8", 24, 8, {1000, 70}), 0, 0, dcp(0, 2, 64)));
  // The combine's warps per (entry, chunk) follow the split count (launch.cu): 2, 4 and 8 here (the cases
  // above give 1 and 16); short requests leave most splits empty and never written (the NaN-poisoned
  // workspace fails a merge that weighs one: the combine's first round loads them and must drop them).
  v.push_back(with(make("h16_q1_splits_12", 16, 1, {4097, 65, 1}), 12, 1));
  v.push_back(with(make("h8_q2_splits_30", 8, 2, {3000, 640, 0}), 30));
  v.push_back(with(make("h12_q1_splits_64", 12, 1, {4097, 2000, 63}), 64));
  // More splits than a combine group's warps take in one round (16 warps x 8 rows): one request, whose combine warps
  // fold two or three rounds each into a running max; three requests under flat slots, ~550 CTA slots of one-page
  // segments.
  v.push_back(with(make("h12_q1_splits_300", 12, 1, {70000}), 300));
  v.push_back(with(make("h8_q1_flat_slots_550", 8, 1, {70000, 5000, 1}), 300));
  // Flat slots merged in the split kernel (CorePlan::merge_in_split): at one split, 48/64-row ping-pong tiles in two
  // M-tiles (H 96), a long request over many CTAs next to short ones, an empty and a padded request; at two splits
  // (merged at 16-row tiles, by the combine at wider ones), q = 2 causal rows.
  v.push_back(with(make("h96_q1_merged_in_split", 96, 1, {6000, 65, 0, 300, 1}), 1, 1));
  v.push_back(with(make("h64_q2_merged_in_split_two_splits", 64, 2, {4097, 63, 2000}), 2));
  // The same with fewer than 8 rows in the last 16-row M-tile (H·q % 16 in 1..7), the longest request last so its
  // split slots end the workspace: the merging lanes of padded rows once read past it (compute-sanitizer sees that;
  // bench/results/patches/*next.plan runs these cases under it).
  v.push_back(with(make("h4_q1_short_tile_merged_in_split", 4, 1, {0, 65, 1, 4097}), 2));
  v.push_back(with(make("h12_q3_short_tile_merged_in_split", 12, 3, {3, 700, 5000}), 2));
  {
    // Flat slots over more than 32 requests, so each lane of the page scans takes several; lengths from 0 to ~4k, so
    // the long ones get many more CTAs than the short ones, and two padded requests.
    std::vector<int> lengths;
    for (int b = 0; b < 45; ++b) lengths.push_back(b % 9 == 0 ? 0 : (b * 977) % 4200);
    v.push_back(with(make("h8_q1_45_requests_flat", 8, 1, lengths), 6, 2));
  }
  {
    // Flat slots (planned for the ping-pong kernel with > 1 request and >= 2 splits): CTAs whose pages span several
    // requests, with empty, one-token, page-edge and padded requests between them and q = 4 causal rows.
    std::vector<int> lengths;
    for (int b = 0; b < 23; ++b) lengths.push_back(b % 7 == 3 ? 0 : b % 5 == 1 ? 64 * (b % 4) + 1 : (b * 1733) % 3000);
    v.push_back(with(make("h12_q4_23_requests_flat", 12, 4, lengths), 3, 2));
    v.push_back(with(make("h16_q1_23_requests_flat", 16, 1, lengths), 2, 1));  // the mma.sync kernel's
  }
  {
    // The query from a late PDL producer: one request (the uniform deal, whose split kernels' query loads ptxas once
    // hoisted above the PDL wait) and a batch (flat slots), every kernel variant of each.
    CoreCase one = make("h16_q1_late_query_producer", 16, 1, {4097});
    one.late_query_producer = true;
    v.push_back(one);
    CoreCase batch = make("h64_q2_late_query_producer", 64, 2, {3000, 65, 1});
    batch.late_query_producer = true;
    v.push_back(batch);
    // One-page splits, q = 4 at length 4098: the splits of pages 63 and 64 begin on a page that holds this step's rows
    // (4094-4097), page 63 a full one, so only the rule's "- q" keeps it after the wait; page 62's split may go before.
    CoreCase new_rows = with(make("h16_q4_late_producer_split_on_new_rows", 16, 4, {4098}), 100);
    new_rows.late_query_producer = true;
    v.push_back(new_rows);
  }
  {
    // A NaN byte in request 0's last key: with q = 2 only its second row sees it (NaN), the first and request 1's
    // rows stay finite; split across several CTAs, so the NaN reaches the merge.
    // The same at H 8 (16 rows: the mma.sync kernel) and H 16 (32 rows: the ping-pong kernel).
    for (const int heads : {8, 16}) {
      CoreCase c = with(make("h" + std::to_string(heads) + "_q2_nan_key", heads, 2, {300, 4097}), 3);
      c.nan_key_tokens = {299};
      v.push_back(c);
    }
    // A NaN key in every page of request 0, so that every split of its rows is NaN: a merge whose maximum dropped
    // NaN LSEs (fmaxf) or whose sums tested > 0 gave these rows 0 and -inf. One request (the uniform combine) at 17
    // splits, and a batch (flat slots) at H 64 (the ping-pong kernel).
    CoreCase one = with(make("h16_q1_nan_every_split", 16, 1, {4097}), 17);
    CoreCase batch = with(make("h64_q1_nan_every_split", 64, 1, {4097, 130}), 3);
    for (int token = 0; token < 4097; token += kPageSize) {  // the first token of each of the 65 pages
      one.nan_key_tokens.push_back(token);
      batch.nan_key_tokens.push_back(token);
    }
    v.push_back(one);
    v.push_back(batch);
  }
  for (size_t i = 0; i < v.size(); ++i) v[i].seed = 100 + i;
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, CoreTest, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<CoreCase>& info) { return info.param.name; });

// The L2 prefetch hint (CoreArgs.l2_prefetch) is checked before anything launches: aligned, a multiple of 16 bytes.
TEST(CoreArgs, RejectsABadL2Prefetch) {
  MLA_REQUIRE_GPU();
  const core::CorePlan plan = core::plan_core({.rows = 4, .heads = 16, .q = 1, .max_context = 4096});
  test::DeviceBuffer<uint8_t> scratch(1 << 20);
  core::CoreArgs args;
  args.query = args.cache = args.latent = args.workspace = scratch.get();
  args.block_table = args.lengths = reinterpret_cast<const int32_t*>(scratch.get());
  args.lse = reinterpret_cast<float*>(scratch.get());
  args.num_requests = 4;
  args.tile_counters = reinterpret_cast<int*>(scratch.get());
  for (const auto& [offset, bytes] : {std::pair{8, 4096}, std::pair{0, 4088}, std::pair{0, 0}}) {
    args.l2_prefetch = scratch.get() + offset;
    args.l2_prefetch_bytes = bytes;
    try {
      core::launch_core(plan, args, nullptr);
      ADD_FAILURE() << "no error for l2_prefetch at offset " << offset << ", " << bytes << " bytes";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("l2_prefetch"), std::string::npos) << e.what();
    }
  }
  MLA_CUDA_CHECK(cudaDeviceSynchronize());
}

// The plan fills the machine: batch 1 at 1M context uses every SM, and the split count never exceeds
// the pages of max_context.
TEST(CorePlan, FillsTheMachine) {
  MLA_REQUIRE_GPU();
  const core::CorePlan one = core::plan_core({.rows = 1, .heads = 12, .q = 1, .max_context = 1 << 20});
  EXPECT_GE(int64_t{one.num_splits} * one.m_tiles, one.num_sms);
  const core::CorePlan short_ctx = core::plan_core({.rows = 1, .heads = 12, .q = 1, .max_context = 256});
  EXPECT_LE(short_ctx.num_splits, 2);  // at least two pages a split
  EXPECT_LE(core::plan_core({.rows = 4, .heads = 12, .q = 1, .max_context = 4096}).num_splits, 32);
  const core::CorePlan big = core::plan_core({.rows = 128, .heads = 16, .q = 1, .max_context = 4096});
  EXPECT_GE(int64_t{big.num_splits} * big.m_tiles * 128, big.num_sms);
  EXPECT_THROW(core::plan_core({.rows = 6, .heads = 16, .q = 4}), Error);
  EXPECT_THROW(core::plan_core({.rows = 8, .heads = 16, .q = 9}), Error);
  EXPECT_THROW(core::plan_core({.rows = 8, .heads = 16, .q = 1, .kernel = 4}), Error);
  // 2 was the lockstep wgmma kernel (removed): rejected, naming the field and the kernels that remain.
  EXPECT_ERROR_HAS(core::plan_core({.rows = 8, .heads = 16, .q = 1, .kernel = 2}), "CoreShape.kernel");
  EXPECT_ERROR_HAS(core::plan_core({.rows = 8, .heads = 16, .q = 1, .kernel = 2}),
                   "0 (planned), 1 (mma.sync) or 3 (wgmma-pp)");
  EXPECT_THROW(core::plan_core({.rows = 524280, .heads = 4097, .q = 8}), Error);  // rows * heads >= 2^31
  // The combine's 32-bit partial-row index: 2048 requests x 1024 splits x q·H 1024 = 2^31 rows is one too many;
  // 1023 splits fit.
  const core::CoreShape too_many_partials{.rows = 16384, .heads = 128, .q = 8, .num_splits = 1024};
  EXPECT_ERROR_HAS(core::plan_core(too_many_partials), "<= 2^31 - 1 partial rows");
  EXPECT_ERROR_HAS(core::plan_core(too_many_partials), "2147483648");
  EXPECT_EQ(core::plan_core({.rows = 16384, .heads = 128, .q = 8, .num_splits = 1023}).num_splits, 1023);
  EXPECT_THROW(core::plan_core({.rows = 8, .heads = 16, .q = 1, .kernel = core::kKernelWgmmaPp, .stages = 4}), Error);
  EXPECT_THROW(core::plan_core({.rows = 8, .heads = 16, .q = 1, .kernel = core::kKernelWgmmaPp, .tile_rows = 8}), Error);
  EXPECT_THROW(core::plan_core({.rows = 8, .heads = 16, .q = 1, .kernel = core::kKernelMmaSync, .tile_rows = 64}), Error);
  // The planned kernel: mma.sync up to 16 folded rows (H·q), then the ping-pong wgmma kernel at 3 stages, long
  // or short splits alike.
  EXPECT_EQ(core::plan_core({.rows = 8, .heads = 16, .q = 1}).kernel, core::kKernelMmaSync);
  EXPECT_EQ(core::plan_core({.rows = 8, .heads = 12, .q = 1}).kernel, core::kKernelMmaSync);
  for (const core::CoreShape& shape : {core::CoreShape{.rows = 8, .heads = 12, .q = 2},
                                       core::CoreShape{.rows = 8, .heads = 96, .q = 1},
                                       core::CoreShape{.rows = 8, .heads = 64, .q = 1},
                                       core::CoreShape{.rows = 8, .heads = 128, .q = 1},
                                       core::CoreShape{.rows = 16, .heads = 12, .q = 4, .max_context = 4096},
                                       core::CoreShape{.rows = 16, .heads = 12, .q = 4, .max_context = 1 << 16}}) {
    const core::CorePlan plan = core::plan_core(shape);
    EXPECT_EQ(plan.kernel, core::kKernelWgmmaPp) << shape.heads << " heads x q " << shape.q;
    EXPECT_EQ(plan.stages, 3) << shape.heads << " heads x q " << shape.q;
  }
  // The ping-pong kernel forced at 16 folded rows: 3 stages there too.
  EXPECT_EQ(core::plan_core({.rows = 8, .heads = 16, .q = 1, .kernel = core::kKernelWgmmaPp}).stages, 3);
  // The planned wgmma tile (choose_wgmma_tile; its rule is tested on the CPU).
  EXPECT_EQ(core::plan_core({.rows = 8, .heads = 16, .q = 1, .kernel = core::kKernelWgmmaPp}).tile_rows, 16);
  EXPECT_EQ(core::plan_core({.rows = 8, .heads = 8, .q = 4, .kernel = core::kKernelWgmmaPp}).tile_rows, 32);
  EXPECT_EQ(core::plan_core({.rows = 8, .heads = 128, .q = 1, .kernel = core::kKernelWgmmaPp}).m_tiles, 2);
  EXPECT_EQ(core::plan_core({.rows = 8, .heads = 12, .q = 4}).tile_rows, 48);
  const core::CorePlan h96 = core::plan_core({.rows = 8, .heads = 96, .q = 1});
  EXPECT_EQ(h96.tile_rows, 48);
  EXPECT_EQ(h96.m_tiles, 2);
  // Flat slots: the mma.sync and ping-pong kernels with more than one request; S x R CTAs and S x R + R - 1 partial
  // slots.
  for (const core::CoreShape& shape : {core::CoreShape{.rows = 8, .heads = 12, .q = 4, .num_splits = 3},
                                       core::CoreShape{.rows = 8, .heads = 12, .q = 1, .num_splits = 3}}) {
    const core::CorePlan flat = core::plan_core(shape);
    EXPECT_TRUE(flat.flat_slots) << shape.q;
    EXPECT_EQ(flat.grid.y, 3u * shape.rows / shape.q) << shape.q;
    EXPECT_EQ(flat.partial_slots, 4 * shape.rows / shape.q - 1) << shape.q;
  }
  EXPECT_FALSE(core::plan_core({.rows = 4, .heads = 12, .q = 4, .num_splits = 3}).flat_slots);  // one request
  EXPECT_TRUE(core::plan_core({.rows = 8, .heads = 12, .q = 4, .num_splits = 1}).flat_slots);  // one split a request too
  // Merged in the split kernel (a counter per request and M-tile) at one split, and at two where M-tiles have at most
  // kMaxRowsMergedAtTwoSplits rows; by the combine elsewhere.
  for (int heads : {16, 96}) {
    for (int splits : {1, 2, 3}) {
      const core::CorePlan plan = core::plan_core({.rows = 8, .heads = heads, .q = 1, .num_splits = splits});
      const bool merged = splits == 1 || (splits == 2 && plan.tile_rows <= core::kMaxRowsMergedAtTwoSplits);
      EXPECT_EQ(plan.merge_in_split, merged) << heads << " heads, " << splits << " splits";
      EXPECT_EQ(plan.tile_counters, merged ? 2 * 8 * plan.m_tiles : 0) << heads << " heads, " << splits << " splits";
    }
  }
  EXPECT_TRUE(core::plan_core({.rows = 8, .heads = 16, .q = 1, .num_splits = 2}).merge_in_split);   // mma.sync, 16 rows
  EXPECT_FALSE(core::plan_core({.rows = 8, .heads = 96, .q = 1, .num_splits = 2}).merge_in_split);  // 48-row tiles
  EXPECT_FALSE(core::plan_core({.rows = 4, .heads = 12, .q = 4, .num_splits = 1}).merge_in_split);  // one request
  {
    // A merging plan refuses to launch without its counters (state between launches), naming them, before any launch.
    const core::CorePlan merging = core::plan_core({.rows = 8, .heads = 16, .q = 1, .num_splits = 1});
    ASSERT_TRUE(merging.merge_in_split);
    core::CoreArgs args;  // tile_counters null
    args.num_requests = 8;
    try {
      core::launch_core(merging, args, nullptr);
      ADD_FAILURE() << "launch_core accepted a merging plan without tile counters";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("CoreArgs.tile_counters"), std::string::npos) << e.what();
    }
  }
  // Flat slots' S x R CTAs are the grid's y: at most 65535 (the uniform grid is (M-tiles, S, R)).
  const core::CorePlan wide = core::plan_core({.rows = 256, .heads = 12, .q = 1, .num_splits = 255});
  EXPECT_TRUE(wide.flat_slots);
  EXPECT_EQ(wide.grid.y, 255u * 256u);
  const core::CorePlan too_wide = core::plan_core({.rows = 256, .heads = 12, .q = 1, .num_splits = 256});
  EXPECT_FALSE(too_wide.flat_slots);
  EXPECT_EQ(too_wide.grid.y, 256u);
  EXPECT_EQ(too_wide.grid.z, 256u);
}

}  // namespace
}  // namespace mla
