// Seeded synthetic Kimi K3 MLA layers and decode steps, shared by the CLI, the tests and the
// benchmarks. Everything lives in owning host vectors (bf16 as its 16 bits, FP8 as bytes); the
// accessors return the non-owning host views the library and the reference take (mla::Weights,
// mla::StepInputs). Tests and benchmarks upload those vectors to the device themselves.
//
//   auto layer = mla::synth::make_layer(/*num_heads=*/12, /*seed=*/1);
//   auto step = mla::synth::make_step(layer, /*num_requests=*/4, /*q=*/1, {4096}, 0, 0, /*seed=*/2);
//   mla::ref::run_layer(layer.weights(), layer.dims, step.inputs());
//
// Determinism: the same arguments give the same bytes on every platform. Random numbers come from
// std::mt19937_64 (fully specified by the standard) through our own samplers, not
// std::normal_distribution / std::shuffle (whose algorithms differ between standard libraries). Every tensor (and
// every head of a per-head weight) draws from its own stream, so head h of a layer is the same for
// every num_heads > h: a 12-head layer is the first 12 heads of the 96-head one with the same seed.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "mla/mla.h"

namespace mla::synth {

// ---- Random numbers -----------------------------------------------------------------------------

using Rng = std::mt19937_64;

// A 64-bit seed for stream (`seed`, `stream`, `index`): splitmix64 of the three mixed, so neighbouring
// seeds and streams give unrelated generators.
uint64_t stream_seed(uint64_t seed, uint64_t stream, uint64_t index = 0);

// float -> bf16 bits, round to nearest even (NaN stays NaN): the same rounding as mla::ref.
uint16_t bf16_bits(float x);
float bf16_value(uint16_t bits);

// Fills `count` bf16 values with N(mean, stddev): 16 random bits per value index a table of the
// N(0,1) quantiles (i + 0.5) / 65536 (finer than bf16 resolves; tails end at +-4.3 sigma), which is
// ~5x faster than a normal sampler and what every tensor here is drawn with.
void fill_random_bf16(uint16_t* data, int64_t count, double mean, double stddev, Rng& rng);
void fill_random_bf16(std::vector<uint16_t>& data, double mean, double stddev, Rng& rng);

// 64-bit FNV-1a of `bytes` bytes: a checksum of bit patterns (e.g. of an output tensor).
uint64_t fnv1a64(const void* data, size_t bytes, uint64_t hash = 0xcbf29ce484222325ull);

// ---- The layer ----------------------------------------------------------------------------------

// One K3 layer's weights on this GPU (H heads), owning. Scales (all drawn with stddev below):
//   q_a_norm, kv_a_norm  1 + N(0, 0.1)
//   q_b_proj             N(0, 1/sqrt(1536))   so q[h] ~ N(0, 1) for a normed q_a
//   w_uk_t               N(0, 1/sqrt(128))    so ql[h] ~ N(0, 1)
//   w_uv                 N(0, 1/sqrt(512))    so v ~ latent magnitude
// q_scale / k_scale are powers of two calibrated on sample rows (see make_layer), so that x / scale
// and x * (1 / scale) are the same number: the kernels (multiply by the reciprocal) and the reference
// (divide) quantize identically.
struct SyntheticLayer {
  int num_heads = 0;
  LayerDims dims;                    // {num_heads, rms_eps = 1e-5}
  uint64_t seed = 0;
  std::vector<uint16_t> q_a_norm;    // [1536]
  std::vector<uint16_t> kv_a_norm;   // [512]
  std::vector<uint16_t> q_b_proj;    // [H*192, 1536]
  std::vector<uint16_t> w_uk_t;      // [H, 128, 512]
  std::vector<uint16_t> w_uv;        // [H, 512, 128]
  float q_scale = 1.0f;              // dequant multiplier of the FP8 query (power of two)
  float k_scale = 1.0f;              // dequant multiplier of the FP8 cache (power of two)

  // Host views of the storage above (read-only in practice; the views are non-const by API).
  Weights weights() const;
};

// Builds the layer. q_scale = 2^ceil(log2(amax / 448)) over the query values [ql | q_rope] of 8
// calibration rows on the first min(H, 8) heads; k_scale likewise over the cache values
// [kv_normed | k_pe] of 256 calibration tokens. The largest FP8 magnitudes then land in (224, 448].
SyntheticLayer make_layer(int num_heads, uint64_t seed);

// ---- The step -----------------------------------------------------------------------------------

// How the cache rows of previous tokens (positions [0, L - q) of each request) are made.
enum class CacheFill : uint8_t {
  kExact,  // per token: a random projected row -> mla::ref::rms_norms -> mla::ref::cache_row
  kFast,   // per element: an FP8 byte drawn from that column's distribution under kExact (a 1024-entry
           // quantile table of N(0,1), times the column's norm weight, bf16, / k_scale, e4m3)
  kAuto,   // kExact up to kExactFillMaxTokens previous tokens in the step, kFast above
};
inline constexpr int64_t kExactFillMaxTokens = 4096;  // ~60 us per token: 0.25 s

// What the cache holds where no live token is: after each request's length in its last page, in the
// pages no request uses, and (unless prewrite_new_tokens) at this step's new-token slots.
enum class StaleFill : uint8_t {
  kNaN,     // 0x7f (e4m3 NaN): a kernel that lets a masked or unwritten token into its sums shows NaN
  kRandom,  // finite FP8 bytes like live ones (stale data of a finished request)
  kZero,
};

struct StepSpec {
  int q = 1;                      // rows per request, 1..8
  std::vector<int> lengths;       // [requests] tokens in the cache incl. this step's q new ones;
                                  // one value = the same for every request of num_requests
  int num_requests = 0;           // requests in block_table / lengths; 0 = lengths.size()
  int padded_requests = 0;        // rows = max(padded_requests, num_requests) * q; the requests past
                                  // num_requests are graph padding (random projected rows, slot -1)
  int64_t pitch = 0;              // row stride of projected; 0 = projected_width(H)
  int extra_pages = 0;            // cache pages no request uses (filled per stale_fill)
  int max_pages = 0;              // block-table width; 0 = the longest request's pages (at least 1)
  int64_t page_stride = 0;        // bytes from page to page; 0 = 64*576 (a larger one pads pages)
  CacheFill cache_fill = CacheFill::kAuto;
  StaleFill stale_fill = StaleFill::kNaN;
  bool prewrite_new_tokens = false;  // the new tokens' slots already hold what the query stage writes
                                     // (for core-only tests); else they hold stale_fill
  uint64_t seed = 1;
};

// One decode step over a paged FP8 cache, owning. Rows are grouped by request (q per request).
//   projected   random rows: q_a and kv_a N(0,1) times a per-row scale in [1/4, 4] (log-uniform;
//               the RMSNorms remove it), k_pe N(0,1) times a per-row scale in [1/2, 2] (8 log-spaced
//               steps; not normed), gate logits N(0, 2); columns past projected_width(H) are NaN.
//   cache       pages handed out to requests in a random permutation (never the identity when
//               there are 2+ pages); previous tokens per `cache_fill`; the rest per `stale_fill`.
//   block_table [num_requests, max_pages]; entries past a request's pages are 0 (a valid page).
//   slots       row b*q + i writes position L_b - q + i of request b; -1 if that is negative
//               (L_b < q) and for padding rows.
//   out         [rows, H*128] filled with bf16 NaN (0xffff) so an unwritten element shows.
struct SyntheticStep {
  int num_heads = 0;
  int q = 1;
  int num_requests = 0;           // requests in block_table / lengths
  int64_t rows = 0;               // rows of projected / out / slots (padded_requests * q)
  int64_t pitch = 0;
  int64_t num_pages = 0;
  int max_pages = 0;
  int64_t page_stride = 0;        // bytes
  bool exact_cache = false;       // which CacheFill made the previous tokens
  std::vector<uint16_t> projected;     // [rows, pitch] bf16
  std::vector<uint16_t> out;           // [rows, H*128] bf16
  std::vector<uint8_t> cache;          // num_pages * page_stride bytes
  std::vector<int64_t> slots;          // [rows]
  std::vector<int32_t> block_table;    // [num_requests, max_pages]
  std::vector<int32_t> lengths;        // [num_requests]

  // Host views of the storage (totals absent: no DCP).
  StepInputs inputs();
  TensorView projected_view();
  TensorView out_view();
  TensorView cache_view();             // fp8_e4m3 [num_pages, 64, 576], strides [page_stride, 576, 1]
  TensorView slots_view();
  TensorView block_table_view();
  TensorView lengths_view();

  // Cache slot (page * 64 + offset) of position `position` of request `request`.
  int64_t slot_of(int request, int64_t position) const;
  // Tokens row `row` sees (bottom-right causal): clamp(L - q + i + 1, 0, L); 0 for padding rows.
  int64_t visible_tokens(int64_t row) const;
  int64_t total_visible_tokens() const;
  // Pointer to the 576 bytes of position `position` of request `request`.
  const uint8_t* token_row(int request, int64_t position) const;
};

SyntheticStep make_step(const SyntheticLayer& layer, const StepSpec& spec);

// The common case: `num_requests` requests of `lengths` (one value, or one per request), no padding.
SyntheticStep make_step(const SyntheticLayer& layer, int num_requests, int q, std::vector<int> lengths,
                        int64_t pitch = 0, int extra_pages = 0, uint64_t seed = 1);

// Graph padding: rows = padded_requests * q, but block_table / lengths hold only lengths.size()
// requests (the missing requests are empty; their rows must come out exactly 0).
SyntheticStep make_padded_step(const SyntheticLayer& layer, int padded_requests, int q,
                               std::vector<int> lengths, int64_t pitch = 0, int extra_pages = 0,
                               uint64_t seed = 1);

// `count` lengths drawn uniformly from [min_length, max_length].
std::vector<int> random_lengths(int count, int min_length, int max_length, uint64_t seed);

}  // namespace mla::synth
