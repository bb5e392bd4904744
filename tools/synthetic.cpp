#include "synthetic.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>

#include "parallel_for.h"
#include "reference.h"

namespace mla::synth {
namespace {

// Stream ids: each tensor (and each head, row or request within it) draws from its own generator.
enum Stream : uint64_t {
  kStreamQaNorm = 1,
  kStreamKvaNorm,
  kStreamQbProj,
  kStreamWukT,
  kStreamWuv,
  kStreamQueryCalibration,
  kStreamCacheCalibration,
  kStreamStepRows,
  kStreamPagePermutation,
  kStreamCacheTokens,
  kStreamStaleTokens,
  kStreamLengths,
};

constexpr int64_t kTokenBytes = kKeyDim;                       // 576
constexpr int64_t kDensePageBytes = int64_t{kPageSize} * kKeyDim;
constexpr uint8_t kE4m3NaN = 0x7f;
constexpr uint16_t kBf16NaN = 0xffff;
constexpr uint16_t kBf16One = 0x3f80;

// k_pe is not normed, so its per-row scale survives into the cache: 8 log-spaced steps in [1/2, 2].
constexpr int kNumKpeScales = 8;
double kpe_scale(int bucket) { return std::exp2(-1.0 + 2.0 * bucket / (kNumKpeScales - 1)); }

// Quantile tables of the fast cache fill: kQuantileBits bits of randomness per FP8 element.
constexpr int kQuantileBits = 10;
constexpr int kNumQuantiles = 1 << kQuantileBits;

double uniform01(Rng& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Smallest power of two >= x (x > 0); 1 for x <= 0 or non-finite x.
double pow2_at_least(double x) {
  if (!(x > 0) || !std::isfinite(x)) return 1.0;
  int exponent = 0;
  const double mantissa = std::frexp(x, &exponent);  // x = mantissa * 2^exponent, mantissa in [0.5, 1)
  return mantissa == 0.5 ? std::ldexp(1.0, exponent - 1) : std::ldexp(1.0, exponent);
}

// The key/value part of a projected row: kv_a (per-row scale, log-uniform in [1/4, 4]) and k_pe
// (per-row scale from kpe_scale). The q_a part and the gate are drawn by fill_projected_row.
void fill_kv_part(uint16_t* row, Rng& rng) {
  const double kv_scale = std::exp2(-2.0 + 4.0 * uniform01(rng));
  fill_random_bf16(row + kProjectedKvaOffset, kKvLoraRank, 0.0, kv_scale, rng);
  const double pe_scale = kpe_scale(static_cast<int>(rng() % kNumKpeScales));
  fill_random_bf16(row + kProjectedKpeOffset, kRopeDim, 0.0, pe_scale, rng);
}

void fill_q_part(uint16_t* row, Rng& rng) {
  const double qa_scale = std::exp2(-2.0 + 4.0 * uniform01(rng));
  fill_random_bf16(row + kProjectedQaOffset, kQLoraRank, 0.0, qa_scale, rng);
}

// One whole projected row: q_a, kv_a, k_pe, gate logits N(0, 2), NaN past the used width.
void fill_projected_row(uint16_t* row, int num_heads, int64_t pitch, Rng& rng) {
  fill_q_part(row, rng);
  fill_kv_part(row, rng);
  const int64_t width = projected_width(num_heads);
  fill_random_bf16(row + kProjectedGateOffset, width - kProjectedGateOffset, 0.0, 2.0, rng);
  std::fill(row + width, row + pitch, kBf16NaN);
}

// A scratch row for cache tokens: q_a = 1 (rms_norms also norms q_a; its value does not matter).
std::vector<uint16_t> kv_scratch_row() {
  std::vector<uint16_t> row(kProjectedGateOffset, 0);
  std::fill(row.begin(), row.begin() + kQLoraRank, kBf16One);
  return row;
}

// Exact previous token: a fresh kv part, normed and quantized like the query stage does it.
void exact_cache_row(const SyntheticLayer& layer, uint16_t* scratch, Rng& rng, uint8_t* dst) {
  fill_kv_part(scratch, rng);
  const ref::NormedRow normed =
      ref::rms_norms(scratch, layer.q_a_norm.data(), layer.kv_a_norm.data(), layer.dims.rms_eps);
  ref::cache_row(normed.kv_normed, scratch, layer.k_scale, dst);
}

// Phi^-1(p) by bisection on erfc: only used to build 1024-entry tables.
double normal_quantile(double p) {
  double lo = -10, hi = 10;
  for (int it = 0; it < 100; ++it) {
    const double mid = 0.5 * (lo + hi);
    (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

// Fast previous tokens: per column, a table of the FP8 bytes of the exact fill's distribution at
// the quantiles (i + 0.5) / 1024 of N(0, 1). The normed kv columns are z * kv_a_norm[c] (the RMSNorm
// makes each row unit-RMS); the k_pe columns are z * kpe_scale(bucket), one bucket per token.
class FastCacheFiller {
 public:
  explicit FastCacheFiller(const SyntheticLayer& layer)
      : kv_(size_t{kKvLoraRank} * kNumQuantiles), pe_(size_t{kNumKpeScales} * kRopeDim * kNumQuantiles) {
    std::vector<double> z(kNumQuantiles);
    for (int i = 0; i < kNumQuantiles; ++i) z[i] = normal_quantile((i + 0.5) / kNumQuantiles);
    const double k_scale = layer.k_scale;
    for (int c = 0; c < kKvLoraRank; ++c) {
      const double w = bf16_value(layer.kv_a_norm[c]);
      for (int i = 0; i < kNumQuantiles; ++i) {
        kv_[size_t(c) * kNumQuantiles + i] = ref::e4m3_from_double(ref::bf16_round(z[i] * w) / k_scale);
      }
    }
    for (int b = 0; b < kNumKpeScales; ++b) {
      const double s = kpe_scale(b);
      for (int i = 0; i < kNumQuantiles; ++i) {
        const uint8_t byte = ref::e4m3_from_double(ref::bf16_round(z[i] * s) / k_scale);
        for (int c = 0; c < kRopeDim; ++c) pe_[(size_t(b) * kRopeDim + c) * kNumQuantiles + i] = byte;
      }
    }
  }

  // 576 bytes: 6 table indices (10 bits each) per 64-bit draw.
  void fill(Rng& rng, uint8_t* dst) const {
    const uint8_t* pe = pe_.data() + size_t(rng() % kNumKpeScales) * kRopeDim * kNumQuantiles;
    int c = 0;
    while (c < kKeyDim) {
      uint64_t bits = rng();
      for (int k = 0; k < 6 && c < kKeyDim; ++k, ++c, bits >>= kQuantileBits) {
        const size_t idx = bits & (kNumQuantiles - 1);
        dst[c] = c < kKvLoraRank ? kv_[size_t(c) * kNumQuantiles + idx]
                                 : pe[size_t(c - kKvLoraRank) * kNumQuantiles + idx];
      }
    }
  }

 private:
  std::vector<uint8_t> kv_;  // [512, 1024]
  std::vector<uint8_t> pe_;  // [8, 64, 1024]
};

[[noreturn]] void bad(const std::string& argument, const std::string& expected, int64_t got) {
  throw_bad_argument(argument, expected, std::to_string(got));
}

}  // namespace

// ---- Random numbers -----------------------------------------------------------------------------

uint64_t stream_seed(uint64_t seed, uint64_t stream, uint64_t index) {
  auto splitmix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  return splitmix(splitmix(splitmix(seed) ^ stream) ^ index);
}

uint16_t bf16_bits(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float bf16_value(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }

namespace {

// N(0, 1) at the quantiles (i + 0.5) / 65536: 16 random bits make one normal value. 65536 equally
// likely levels are finer than bf16 resolves; the tails end at +-4.3 sigma.
const std::vector<float>& normal_table_16bit() {
  static const std::vector<float> table = [] {
    std::vector<float> t(1 << 16);
    for (int i = 0; i < (1 << 15); ++i) {
      const float z = static_cast<float>(normal_quantile((i + 0.5) / (1 << 16)));
      t[i] = z;
      t[(1 << 16) - 1 - i] = -z;  // symmetric: exact zero mean
    }
    return t;
  }();
  return table;
}

}  // namespace

void fill_random_bf16(uint16_t* data, int64_t count, double mean, double stddev, Rng& rng) {
  // NOTE: table lookups, 4 values per 64-bit draw: a 128-head layer (54M values) in ~0.2 s where a
  // polar-method normal per value takes ~1 s.
  const float* table = normal_table_16bit().data();
  const float m = static_cast<float>(mean), s = static_cast<float>(stddev);
  int64_t i = 0;
  while (i < count) {
    uint64_t bits = rng();
    for (int k = 0; k < 4 && i < count; ++k, ++i, bits >>= 16) data[i] = bf16_bits(m + s * table[bits & 0xffff]);
  }
}

void fill_random_bf16(std::vector<uint16_t>& data, double mean, double stddev, Rng& rng) {
  fill_random_bf16(data.data(), static_cast<int64_t>(data.size()), mean, stddev, rng);
}

uint64_t fnv1a64(const void* data, size_t bytes, uint64_t hash) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 0x100000001b3ull;
  return hash;
}

// ---- The layer ----------------------------------------------------------------------------------

Weights SyntheticLayer::weights() const {
  auto ptr = [](const std::vector<uint16_t>& v) { return const_cast<uint16_t*>(v.data()); };
  const int64_t h = num_heads;
  Weights w;
  w.q_a_norm = make_view(ptr(q_a_norm), DType::kBF16, Memory::kHost, {kQLoraRank});
  w.kv_a_norm = make_view(ptr(kv_a_norm), DType::kBF16, Memory::kHost, {kKvLoraRank});
  w.q_b_proj = make_view(ptr(q_b_proj), DType::kBF16, Memory::kHost, {h * kQkHeadDim, kQLoraRank});
  w.w_uk_t = make_view(ptr(w_uk_t), DType::kBF16, Memory::kHost, {h, kNopeDim, kKvLoraRank});
  w.w_uv = make_view(ptr(w_uv), DType::kBF16, Memory::kHost, {h, kKvLoraRank, kVHeadDim});
  w.q_scale = q_scale;
  w.k_scale = k_scale;
  return w;
}

SyntheticLayer make_layer(int num_heads, uint64_t seed) {
  if (num_heads < 1 || num_heads > kMaxHeads) bad("make_layer: num_heads", "1..128", num_heads);
  SyntheticLayer layer;
  layer.num_heads = num_heads;
  layer.dims = LayerDims{num_heads, 1e-5f};
  layer.seed = seed;

  // 1. Norm weights around 1.
  layer.q_a_norm.resize(kQLoraRank);
  layer.kv_a_norm.resize(kKvLoraRank);
  Rng qa_rng(stream_seed(seed, kStreamQaNorm));
  fill_random_bf16(layer.q_a_norm, 1.0, 0.1, qa_rng);
  Rng kva_rng(stream_seed(seed, kStreamKvaNorm));
  fill_random_bf16(layer.kv_a_norm, 1.0, 0.1, kva_rng);

  // 2. Per-head projections, each head from its own stream (so the heads fill in parallel).
  const int64_t qb_head = int64_t{kQkHeadDim} * kQLoraRank;
  const int64_t uk_head = int64_t{kNopeDim} * kKvLoraRank;
  const int64_t uv_head = int64_t{kKvLoraRank} * kVHeadDim;
  layer.q_b_proj.resize(num_heads * qb_head);
  layer.w_uk_t.resize(num_heads * uk_head);
  layer.w_uv.resize(num_heads * uv_head);
  ref::parallel_for(num_heads, qb_head + uk_head + uv_head, [&](int64_t h) {
    Rng qb(stream_seed(seed, kStreamQbProj, h));
    fill_random_bf16(layer.q_b_proj.data() + h * qb_head, qb_head, 0.0, 1.0 / std::sqrt(1536.0), qb);
    Rng uk(stream_seed(seed, kStreamWukT, h));
    fill_random_bf16(layer.w_uk_t.data() + h * uk_head, uk_head, 0.0, 1.0 / std::sqrt(128.0), uk);
    Rng uv(stream_seed(seed, kStreamWuv, h));
    fill_random_bf16(layer.w_uv.data() + h * uv_head, uv_head, 0.0, 1.0 / std::sqrt(512.0), uv);
  });

  // 3. q_scale: amax of the query values of 8 calibration rows on the first min(H, 8) heads.
  {
    const int heads = std::min(num_heads, 8);
    Rng rng(stream_seed(seed, kStreamQueryCalibration));
    std::vector<uint16_t> row(projected_width(num_heads));
    double amax = 0;
    for (int r = 0; r < 8; ++r) {
      fill_projected_row(row.data(), num_heads, static_cast<int64_t>(row.size()), rng);
      const ref::NormedRow normed =
          ref::rms_norms(row.data(), layer.q_a_norm.data(), layer.kv_a_norm.data(), layer.dims.rms_eps);
      const std::vector<double> q = ref::q_b_projection(normed.q_normed, layer.q_b_proj.data(), heads);
      const std::vector<double> ql = ref::absorb_w_uk(q, layer.w_uk_t.data(), heads);
      for (double x : ql) amax = std::max(amax, std::abs(x));
      for (int h = 0; h < heads; ++h) {
        for (int d = kNopeDim; d < kQkHeadDim; ++d) amax = std::max(amax, std::abs(q[h * kQkHeadDim + d]));
      }
    }
    layer.q_scale = static_cast<float>(pow2_at_least(amax / kE4m3Max));
  }

  // 4. k_scale: amax of the cache values [kv_normed | k_pe] of 256 calibration tokens.
  {
    Rng rng(stream_seed(seed, kStreamCacheCalibration));
    std::vector<uint16_t> row = kv_scratch_row();
    double amax = 0;
    for (int t = 0; t < 256; ++t) {
      fill_kv_part(row.data(), rng);
      const ref::NormedRow normed =
          ref::rms_norms(row.data(), layer.q_a_norm.data(), layer.kv_a_norm.data(), layer.dims.rms_eps);
      for (double x : normed.kv_normed) amax = std::max(amax, std::abs(x));
      for (int c = 0; c < kRopeDim; ++c) {
        amax = std::max(amax, std::abs(static_cast<double>(bf16_value(row[kProjectedKpeOffset + c]))));
      }
    }
    layer.k_scale = static_cast<float>(pow2_at_least(amax / kE4m3Max));
  }
  return layer;
}

// ---- The step -----------------------------------------------------------------------------------

StepInputs SyntheticStep::inputs() {
  StepInputs step;
  step.projected = projected_view();
  step.out = out_view();
  step.cache = cache_view();
  step.slots = slots_view();
  step.block_table = block_table_view();
  step.lengths = lengths_view();
  step.q = q;
  return step;
}

TensorView SyntheticStep::projected_view() {
  return make_strided_view(projected.data(), DType::kBF16, Memory::kHost, {rows, projected_width(num_heads)},
                           {pitch, 1});
}
TensorView SyntheticStep::out_view() {
  return make_view(out.data(), DType::kBF16, Memory::kHost, {rows, int64_t{num_heads} * kVHeadDim});
}
TensorView SyntheticStep::cache_view() {
  return make_strided_view(cache.data(), DType::kFP8E4M3, Memory::kHost, {num_pages, kPageSize, kKeyDim},
                           {page_stride, kKeyDim, 1});
}
TensorView SyntheticStep::slots_view() {
  return make_view(slots.data(), DType::kI64, Memory::kHost, {rows});
}
TensorView SyntheticStep::block_table_view() {
  return make_view(block_table.data(), DType::kI32, Memory::kHost, {num_requests, max_pages});
}
TensorView SyntheticStep::lengths_view() {
  return make_view(lengths.data(), DType::kI32, Memory::kHost, {num_requests});
}

int64_t SyntheticStep::slot_of(int request, int64_t position) const {
  const int32_t page = block_table[size_t(request) * max_pages + position / kPageSize];
  return int64_t{page} * kPageSize + position % kPageSize;
}

int64_t SyntheticStep::visible_tokens(int64_t row) const {
  const int64_t request = row / q;
  if (request >= num_requests) return 0;
  const int64_t length = lengths[request];
  return std::clamp<int64_t>(length - q + row % q + 1, 0, length);
}

int64_t SyntheticStep::total_visible_tokens() const {
  int64_t total = 0;
  for (int64_t r = 0; r < rows; ++r) total += visible_tokens(r);
  return total;
}

const uint8_t* SyntheticStep::token_row(int request, int64_t position) const {
  const int64_t slot = slot_of(request, position);
  return cache.data() + (slot / kPageSize) * page_stride + (slot % kPageSize) * kTokenBytes;
}

SyntheticStep make_step(const SyntheticLayer& layer, const StepSpec& spec) {
  // 1. Check the spec and fix the shapes.
  if (spec.q < 1 || spec.q > kMaxQueries) bad("make_step: q", "1..8", spec.q);
  const int num_requests = spec.num_requests > 0 ? spec.num_requests : static_cast<int>(spec.lengths.size());
  if (spec.num_requests < 0) bad("make_step: num_requests", ">= 0", spec.num_requests);
  std::vector<int32_t> lengths(num_requests);
  if (spec.lengths.size() == 1) {
    std::fill(lengths.begin(), lengths.end(), spec.lengths[0]);
  } else if (static_cast<int>(spec.lengths.size()) == num_requests) {
    std::copy(spec.lengths.begin(), spec.lengths.end(), lengths.begin());
  } else {
    throw_bad_argument("make_step: lengths", "1 or " + std::to_string(num_requests) + " values",
                       std::to_string(spec.lengths.size()) + " values");
  }
  int needed_pages = 1;
  int64_t total_pages = 0;
  int64_t previous_tokens = 0;
  for (int32_t length : lengths) {
    if (length < 0) bad("make_step: lengths[]", ">= 0", length);
    needed_pages = std::max<int>(needed_pages, static_cast<int>(ceil_div(length, kPageSize)));
    total_pages += ceil_div(length, kPageSize);
    previous_tokens += std::max(0, length - spec.q);
  }
  if (spec.padded_requests < 0) bad("make_step: padded_requests", ">= 0", spec.padded_requests);
  if (spec.extra_pages < 0) bad("make_step: extra_pages", ">= 0", spec.extra_pages);
  const int64_t width = projected_width(layer.num_heads);
  if (spec.pitch != 0 && spec.pitch < width) {
    bad("make_step: pitch", "0 or >= " + std::to_string(width), spec.pitch);
  }
  if (spec.max_pages != 0 && spec.max_pages < needed_pages) {
    bad("make_step: max_pages", "0 or >= " + std::to_string(needed_pages), spec.max_pages);
  }
  if (spec.page_stride != 0 && spec.page_stride < kDensePageBytes) {
    bad("make_step: page_stride", "0 or >= " + std::to_string(kDensePageBytes), spec.page_stride);
  }

  SyntheticStep step;
  step.num_heads = layer.num_heads;
  step.q = spec.q;
  step.num_requests = num_requests;
  step.rows = int64_t{std::max(spec.padded_requests, num_requests)} * spec.q;
  step.pitch = spec.pitch ? spec.pitch : width;
  step.num_pages = std::max<int64_t>(1, total_pages + spec.extra_pages);
  step.max_pages = spec.max_pages ? spec.max_pages : needed_pages;
  step.page_stride = spec.page_stride ? spec.page_stride : kDensePageBytes;
  step.exact_cache = spec.cache_fill == CacheFill::kExact ||
                     (spec.cache_fill == CacheFill::kAuto && previous_tokens <= kExactFillMaxTokens);
  step.lengths = std::move(lengths);
  // NOTE: reserve(1) so that views of zero requests still carry a (valid, non-null) pointer.
  step.lengths.reserve(1);

  // 2. Projected rows, one stream per row; the output poisoned.
  step.projected.resize(step.rows * step.pitch);
  for (int64_t r = 0; r < step.rows; ++r) {
    Rng rng(stream_seed(spec.seed, kStreamStepRows, r));
    fill_projected_row(step.projected.data() + r * step.pitch, layer.num_heads, step.pitch, rng);
  }
  step.out.assign(step.rows * layer.num_heads * kVHeadDim, kBf16NaN);

  // 3. Pages: a random permutation (Fisher-Yates on the raw draws: std::shuffle is not portable),
  //    never the identity, handed out to the requests in order.
  std::vector<int32_t> pages(step.num_pages);
  std::iota(pages.begin(), pages.end(), 0);
  {
    Rng rng(stream_seed(spec.seed, kStreamPagePermutation));
    for (int64_t i = step.num_pages - 1; i > 0; --i) {
      std::swap(pages[i], pages[rng() % uint64_t(i + 1)]);
    }
    bool identity = true;
    for (int64_t i = 0; i < step.num_pages && identity; ++i) identity = pages[i] == i;
    if (identity && step.num_pages > 1) std::rotate(pages.begin(), pages.begin() + 1, pages.end());
  }
  step.block_table.assign(size_t(num_requests) * step.max_pages, 0);
  step.block_table.reserve(1);
  std::vector<bool> page_used(step.num_pages, false);
  int64_t cursor = 0;
  for (int b = 0; b < num_requests; ++b) {
    const int64_t request_pages = ceil_div(step.lengths[b], kPageSize);
    for (int64_t p = 0; p < request_pages; ++p) {
      step.block_table[size_t(b) * step.max_pages + p] = pages[cursor];
      page_used[pages[cursor++]] = true;
    }
  }

  // 4. Slots: the last q positions of each request.
  step.slots.assign(step.rows, -1);
  for (int b = 0; b < num_requests; ++b) {
    for (int i = 0; i < spec.q; ++i) {
      const int64_t position = int64_t{step.lengths[b]} - spec.q + i;
      if (position >= 0) step.slots[int64_t{b} * spec.q + i] = step.slot_of(b, position);
    }
  }

  // 5. The cache. Start from NaN everywhere (page-stride padding stays NaN), then write live tokens,
  //    then the stale positions per stale_fill.
  step.cache.assign(step.num_pages * step.page_stride, kE4m3NaN);
  auto token_ptr = [&](int64_t slot) {
    return step.cache.data() + (slot / kPageSize) * step.page_stride + (slot % kPageSize) * kTokenBytes;
  };
  const bool need_fast = !step.exact_cache || spec.stale_fill == StaleFill::kRandom;
  std::unique_ptr<FastCacheFiller> fast;
  if (need_fast) fast = std::make_unique<FastCacheFiller>(layer);
  std::vector<uint16_t> scratch = kv_scratch_row();
  for (int b = 0; b < num_requests; ++b) {
    Rng rng(stream_seed(spec.seed, kStreamCacheTokens, b));
    const int64_t num_previous = std::max(0, step.lengths[b] - spec.q);
    for (int64_t j = 0; j < num_previous; ++j) {
      uint8_t* dst = token_ptr(step.slot_of(b, j));
      if (step.exact_cache) {
        exact_cache_row(layer, scratch.data(), rng, dst);
      } else {
        fast->fill(rng, dst);
      }
    }
  }
  if (spec.stale_fill != StaleFill::kNaN) {
    Rng rng(stream_seed(spec.seed, kStreamStaleTokens));
    auto stale = [&](uint8_t* dst) {
      if (spec.stale_fill == StaleFill::kZero) {
        std::memset(dst, 0, kTokenBytes);
      } else {
        fast->fill(rng, dst);
      }
    };
    for (int b = 0; b < num_requests; ++b) {
      const int64_t begin = std::max(0, step.lengths[b] - spec.q);
      const int64_t end = ceil_div(step.lengths[b], kPageSize) * kPageSize;
      for (int64_t j = begin; j < end; ++j) stale(token_ptr(step.slot_of(b, j)));
    }
    for (int64_t page = 0; page < step.num_pages; ++page) {
      if (page_used[page]) continue;
      for (int t = 0; t < kPageSize; ++t) stale(token_ptr(page * kPageSize + t));
    }
  }
  if (spec.prewrite_new_tokens) {
    for (int64_t r = 0; r < step.rows; ++r) {
      if (step.slots[r] < 0) continue;
      const uint16_t* row = step.projected.data() + r * step.pitch;
      const ref::NormedRow normed =
          ref::rms_norms(row, layer.q_a_norm.data(), layer.kv_a_norm.data(), layer.dims.rms_eps);
      ref::cache_row(normed.kv_normed, row, layer.k_scale, token_ptr(step.slots[r]));
    }
  }
  return step;
}

SyntheticStep make_step(const SyntheticLayer& layer, int num_requests, int q, std::vector<int> lengths,
                        int64_t pitch, int extra_pages, uint64_t seed) {
  StepSpec spec;
  spec.q = q;
  spec.lengths = std::move(lengths);
  spec.num_requests = num_requests;
  spec.pitch = pitch;
  spec.extra_pages = extra_pages;
  spec.seed = seed;
  if (num_requests < 1) bad("make_step: num_requests", ">= 1", num_requests);
  return make_step(layer, spec);
}

SyntheticStep make_padded_step(const SyntheticLayer& layer, int padded_requests, int q,
                               std::vector<int> lengths, int64_t pitch, int extra_pages, uint64_t seed) {
  const int num_requests = static_cast<int>(lengths.size());
  if (padded_requests < num_requests) {
    bad("make_padded_step: padded_requests", ">= lengths.size() = " + std::to_string(num_requests),
        padded_requests);
  }
  StepSpec spec;
  spec.q = q;
  spec.lengths = std::move(lengths);
  spec.num_requests = num_requests;
  spec.padded_requests = padded_requests;
  spec.pitch = pitch;
  spec.extra_pages = extra_pages;
  spec.seed = seed;
  return make_step(layer, spec);
}

std::vector<int> random_lengths(int count, int min_length, int max_length, uint64_t seed) {
  if (count < 0) bad("random_lengths: count", ">= 0", count);
  if (min_length < 0 || max_length < min_length) {
    throw_bad_argument("random_lengths: [min_length, max_length]", "0 <= min <= max",
                       "[" + std::to_string(min_length) + ", " + std::to_string(max_length) + "]");
  }
  Rng rng(stream_seed(seed, kStreamLengths));
  std::vector<int> lengths(count);
  const uint64_t span = uint64_t(max_length - min_length) + 1;
  for (int& length : lengths) length = min_length + static_cast<int>(rng() % span);
  return lengths;
}

}  // namespace mla::synth
