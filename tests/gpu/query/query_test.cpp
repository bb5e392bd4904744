// GPU tests of the fused query kernel (src/query) against the CPU reference (DESIGN.md §4).
//
// Every FP8 byte must be within one e4m3 step of the reference computed in double from the same bf16
// inputs, and identical unless the reference value lies within an error bound of an e4m3 rounding
// midpoint. The bound is tracked per element (see Sensitivity below): it is what fp32 arithmetic and
// the bf16 roundings whose inputs sit near a bf16 midpoint can move the value, and nothing more.
#include <cuda_runtime.h>  // before gpu_test_util.h: its cudaMalloc(T**) needs the template overload
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "mla/dims.h"
#include <cublas_v2.h>

#include "query/launch.h"
#include "query/testing.h"
#include "reference.h"

namespace mla::test {
namespace {

using query::QueryArgs;
using query::QueryPlan;

constexpr uint8_t kCacheSentinel = 0xa5;  // -0.078125 in e4m3: a real value, so "untouched" is checkable
constexpr uint8_t kQueryPoison = 0x7f;    // e4m3 NaN: any unwritten query byte fails

// ---- Error model ---------------------------------------------------------------------------------
// fp32 error bounds of the kernel's steps:
// - RMSNorm: the sum of squares is 48 (q_a) or 16 (kv_a) fp32 adds of positive terms per lane and a
//   5-level warp tree (<= 53 * 2^-24 relative, rigorous), halved by the square root, plus rsqrtf
//   (2 ulp) and two multiplies: < 2^-18 relative on x * inv_rms * w before the bf16 rounding.
// - x * (1/scale) in fp32 against x / scale in double: 1/scale and the product each round once: 2^-22.
// - q_b_proj on mma.sync: the tensor-core fp32 accumulation is not IEEE round-to-nearest (it
//   truncates when aligning the addends of each k-group); measured on an H200 up to 2^-18.3 of
//   S = sum |w * qn| (1536 terms). The bound is 2^-16 S (4x that). It is checked directly on the
//   kernel's fp32 partial sums (stage check below), so a kernel outside it fails visibly.
// - absorption: 128 terms: 2^-19 of sum |q * w| (the same model scaled by 128/1536, with margin).
constexpr double kNormRel = 0x1p-18;
constexpr double kScalarRel = 0x1p-22;
constexpr double kQbAccumRel = 0x1p-16;
constexpr double kAbsorbAccumRel = 0x1p-19;

// Distance from x to the nearest bf16 rounding midpoint, and the gap to the other neighbour
// (how far a flipped rounding moves the value).
struct Bf16Rounding {
  double value;     // bf16(x)
  double distance;  // to the nearest midpoint
  double flip;      // |alternative rounding - value|
};
Bf16Rounding bf16_rounding(double x) {
  const uint16_t bits = ref::bf16_from_double(x);
  const double r = ref::bf16_to_double(bits);
  // Neighbours in magnitude (bits +- 1 on the magnitude; zero's lower neighbour is the smallest
  // subnormal of the other sign: treat it as symmetric).
  const uint16_t mag = bits & 0x7fff, sign = bits & 0x8000;
  const double up = ref::bf16_to_double(uint16_t(sign | (mag + 1)));
  const double down = mag ? ref::bf16_to_double(uint16_t(sign | (mag - 1))) : -up;
  const double mid_up = 0.5 * (r + up), mid_down = 0.5 * (r + down);
  const double d_up = std::fabs(x - mid_up), d_down = std::fabs(x - mid_down);
  return d_up < d_down ? Bf16Rounding{r, d_up, std::fabs(up - r)} : Bf16Rounding{r, d_down, std::fabs(down - r)};
}

// Distance from x to the nearest e4m3 rounding midpoint (infinite beyond the saturation point).
std::vector<double> e4m3_positive_values() {
  std::vector<double> v;
  for (int c = 0; c <= 0x7e; ++c) v.push_back(ref::e4m3_to_double(uint8_t(c)));
  return v;
}
double e4m3_boundary_distance(double x) {
  static const std::vector<double> values = e4m3_positive_values();
  const double a = std::fabs(x);
  double best = INFINITY;
  for (size_t c = 0; c + 1 < values.size(); ++c) best = std::min(best, std::fabs(a - 0.5 * (values[c] + values[c + 1])));
  return best;
}
// Signed ordinal of an e4m3 code (+0 and -0 coincide); NaN has none.
int e4m3_ordinal(uint8_t code) { return (code & 0x80) ? -int(code & 0x7f) : int(code); }
bool e4m3_is_nan(uint8_t code) { return (code & 0x7f) == 0x7f; }

// ---- Random bf16 data ----------------------------------------------------------------------------
uint16_t to_bf16(double x) { return ref::bf16_from_double(x); }
std::vector<uint16_t> random_bf16(size_t n, double mean, double stddev, std::mt19937_64& rng) {
  std::normal_distribution<double> dist(mean, stddev);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = to_bf16(dist(rng));
  return v;
}

// Weights of the largest case; a smaller H uses the first H heads (per-head layouts are contiguous).
struct HostWeights {
  std::vector<uint16_t> q_a_norm, kv_a_norm, q_b_proj, w_uk_t;
  double q_scale = 0.02, k_scale = 0.01;
};
const HostWeights& host_weights() {
  static const HostWeights w = [] {
    std::mt19937_64 rng(1234);
    HostWeights w;
    w.q_a_norm = random_bf16(kQLoraRank, 1.0, 0.2, rng);
    w.kv_a_norm = random_bf16(kKvLoraRank, 1.0, 0.2, rng);
    // q ~ N(0, 1), ql ~ N(0, 1): with q_scale 0.02 the bytes span the e4m3 range and saturate in the
    // far tail (|ql| > 8.96).
    w.q_b_proj = random_bf16(size_t(kMaxHeads) * kQkHeadDim * kQLoraRank, 0.0, 1.0 / std::sqrt(1536.0), rng);
    w.w_uk_t = random_bf16(size_t(kMaxHeads) * kNopeDim * kKvLoraRank, 0.0, 1.0 / std::sqrt(128.0), rng);
    return w;
  }();
  return w;
}

struct DeviceWeights {
  DeviceBuffer<uint16_t> q_a_norm{kQLoraRank}, kv_a_norm{kKvLoraRank};
  DeviceBuffer<uint16_t> q_b_proj{size_t(kMaxHeads) * kQkHeadDim * kQLoraRank};
  DeviceBuffer<uint16_t> w_uk_t{size_t(kMaxHeads) * kNopeDim * kKvLoraRank};
  DeviceWeights() {
    const HostWeights& w = host_weights();
    q_a_norm.upload(w.q_a_norm);
    kv_a_norm.upload(w.kv_a_norm);
    q_b_proj.upload(w.q_b_proj);
    w_uk_t.upload(w.w_uk_t);
  }
};
DeviceWeights& device_weights() {
  static DeviceWeights* w = new DeviceWeights();  // lives for the process (freed by the driver)
  return *w;
}

// The GEMM path's cuBLAS handle (one for the process, as an engine would keep one).
cublasHandle_t cublas_handle() {
  static cublasHandle_t handle = [] {
    cublasHandle_t h = nullptr;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) throw Error("cublasCreate failed");
    return h;
  }();
  return handle;
}

// ---- One case -------------------------------------------------------------------------------------
struct Case {
  int num_heads;
  int rows;
  int head_offset = 0;   // > 0: write into a wider query buffer (DCP mailbox layout)
  int extra_heads = 0;   // num_heads_out = head_offset + H + extra_heads
  int pitch_pad = 40;    // columns of the projected row beyond 2112 + H*128 (NaN filled)
  int max_checked_rows = 0;  // 0 = all rows; else a random subset of the query rows (cache: all rows)
  query::QueryPlanOverrides overrides{};
};

struct Outcome {
  int64_t bytes_checked = 0;
  int64_t near_boundary_diffs = 0;
};

// Checks one e4m3 byte against the reference value x (already divided by the scale) and its bound.
// Returns false and records a message on failure.
bool check_byte(uint8_t got, double x, double bound, Outcome& outcome, std::string& failure, const std::string& where) {
  const uint8_t want = ref::e4m3_from_double(x);
  ++outcome.bytes_checked;
  if (got == want || (e4m3_ordinal(got) == 0 && e4m3_ordinal(want) == 0)) return true;
  const bool near = e4m3_boundary_distance(x) <= bound;
  if (!e4m3_is_nan(got) && std::abs(e4m3_ordinal(got) - e4m3_ordinal(want)) == 1 && near) {
    ++outcome.near_boundary_diffs;
    return true;
  }
  if (failure.empty()) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s: got 0x%02x (%g) want 0x%02x (%g), reference %.9g, bound %.3g, boundary distance %.3g",
             where.c_str(), got, ref::e4m3_to_double(got), want, ref::e4m3_to_double(want), x, bound,
             e4m3_boundary_distance(x));
    failure = buf;
  }
  return false;
}

// The spec-level check against the pure double reference: `got` must be the e4m3 of some value
// within `bound` of x (ordinals are monotonic in value), so it is identical to e4m3(x) wherever x is
// farther than `bound` from every rounding midpoint.
bool check_interval(uint8_t got, double x, double bound, int64_t& differing, std::string& failure,
                    const std::string& where) {
  const uint8_t want = ref::e4m3_from_double(x);
  if (got == want || (e4m3_ordinal(got) == 0 && e4m3_ordinal(want) == 0)) return true;
  const int lo = e4m3_ordinal(ref::e4m3_from_double(x - bound)), hi = e4m3_ordinal(ref::e4m3_from_double(x + bound));
  if (!e4m3_is_nan(got) && e4m3_ordinal(got) >= lo && e4m3_ordinal(got) <= hi) {
    ++differing;
    return true;
  }
  if (failure.empty()) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s: got 0x%02x (%g) want 0x%02x (%g), reference %.9g, bound %.3g (spec-level check)",
             where.c_str(), got, ref::e4m3_to_double(got), want, ref::e4m3_to_double(want), x, bound);
    failure = buf;
  }
  return false;
}

// Runs the query stage for `c` on the GPU and compares every checked byte. `pdl_producer`: the
// projected rows are written by a delayed producer kernel right before the PDL launch.
void run_case(const Case& c, bool pdl_producer = false, bool graph = false) {
  SCOPED_TRACE("H=" + std::to_string(c.num_heads) + " rows=" + std::to_string(c.rows) +
               " head_offset=" + std::to_string(c.head_offset));
  const HostWeights& w = host_weights();
  DeviceWeights& dw = device_weights();
  const int H = c.num_heads, rows = c.rows;
  const int H_out = c.head_offset + H + c.extra_heads;
  const int64_t pitch = projected_width(H) + c.pitch_pad;
  std::mt19937_64 rng(uint64_t(H) * 1000 + rows);

  // Projected rows: q_a, kv_a ~ N(0.1, 1.5), k_pe ~ N(0, 0.3); gate random; padding NaN.
  std::vector<uint16_t> projected(size_t(rows) * pitch, 0x7fc0);
  {
    std::normal_distribution<double> act(0.1, 1.5), pe(0.0, 0.3);
    for (int r = 0; r < rows; ++r) {
      uint16_t* row = projected.data() + size_t(r) * pitch;
      for (int k = 0; k < kKvLoraRank + kQLoraRank; ++k) row[k] = to_bf16(act(rng));
      for (int k = kProjectedKpeOffset; k < kProjectedGateOffset; ++k) row[k] = to_bf16(pe(rng));
      for (int64_t k = kProjectedGateOffset; k < projected_width(H); ++k) row[k] = to_bf16(act(rng));
    }
  }
  // Slots: distinct, random pages, about one in five rows -1.
  const int64_t num_pages = (rows + 63) / 64 * 2 + 1;
  const int64_t page_stride = int64_t(kPageSize) * kKeyDim + 80;  // larger than a page: tail must stay untouched
  std::vector<int64_t> slots(rows);
  {
    std::vector<int64_t> all(num_pages * kPageSize);
    for (size_t i = 0; i < all.size(); ++i) all[i] = int64_t(i);
    std::shuffle(all.begin(), all.end(), rng);
    for (int r = 0; r < rows; ++r) slots[r] = (rng() % 5 == 0) ? -1 : all[r];
  }

  DeviceBuffer<uint16_t> d_projected(projected.size()), d_staging(projected.size());
  DeviceBuffer<int64_t> d_slots(rows);
  DeviceBuffer<uint8_t> d_query(size_t(rows) * H_out * kKeyDim);
  DeviceBuffer<uint8_t> d_cache(size_t(num_pages) * page_stride);
  // The fused kernel stores its fp32 q (before the bf16 rounding) only on request: the checked plan
  // asks for it, and the production plan (without) must then write the same bytes (checked below).
  // The GEMM path always leaves its bf16 q in the workspace (and runs the same plan twice).
  const bool gemm = query::make_query_plan(rows, H, c.overrides).path == query::QueryPath::kGemm;
  query::QueryPlanOverrides checked_overrides = c.overrides;
  if (!gemm) checked_overrides.store_q = 1;
  const QueryPlan plan = query::make_query_plan(rows, H, checked_overrides);
  DeviceBuffer<uint8_t> d_workspace(plan.workspace_bytes);
  d_slots.upload(slots);
  d_workspace.poison(0xff);  // NaN q: a q that is read but never written fails
  // With a producer, launch() poisons the projected rows (what a read before griddepcontrol.wait
  // would see: NaN rows) and the delayed copy writes them.
  if (pdl_producer) d_staging.upload(projected);
  else d_projected.upload(projected);

  QueryArgs args;
  args.projected = d_projected.get();
  args.pitch = pitch;
  args.q_a_norm = dw.q_a_norm.get();
  args.kv_a_norm = dw.kv_a_norm.get();
  args.q_b_proj = dw.q_b_proj.get();
  args.w_uk_t = dw.w_uk_t.get();
  args.slots = d_slots.get();
  args.rms_eps = 1e-5f;
  args.q_scale = float(w.q_scale);
  args.k_scale = float(w.k_scale);
  args.query = d_query.get();
  args.num_heads_out = H_out;
  args.head_offset = c.head_offset;
  args.cache = d_cache.get();
  args.stride_cache_page = page_stride;
  args.num_cache_pages = num_pages;
  args.workspace = d_workspace.get();
  args.cublas = cublas_handle();

  // One launch of `run_plan` (after the delayed producer when asked), into freshly poisoned outputs.
  auto launch = [&](const QueryPlan& run_plan) {
    d_query.poison(kQueryPoison);
    d_cache.poison(kCacheSentinel);
    if (pdl_producer) d_projected.poison(0xff);
    MLA_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets run on the legacy stream, ours does not wait
    cudaStream_t stream;
    MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    if (graph) {
      cudaGraph_t g;
      cudaGraphExec_t exec;
      MLA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      if (pdl_producer) query::launch_delayed_copy(d_projected.get(), d_staging.get(), projected.size() * 2, 20000, stream);
      query::launch_query(run_plan, args, stream, /*pdl=*/true);
      MLA_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
      MLA_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
      MLA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
      MLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
      MLA_CUDA_CHECK(cudaGraphDestroy(g));
    } else {
      if (pdl_producer) query::launch_delayed_copy(d_projected.get(), d_staging.get(), projected.size() * 2, 20000, stream);
      query::launch_query(run_plan, args, stream, /*pdl=*/true);
      MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    MLA_CUDA_CHECK(cudaStreamDestroy(stream));
  };
  // The production plan first (no workspace): its bytes must equal the checked plan's.
  const QueryPlan production = query::make_query_plan(rows, H, c.overrides);
  if (!gemm) {
    EXPECT_EQ(production.workspace_bytes, 0u);
    args.workspace = nullptr;
  }
  launch(production);
  args.workspace = d_workspace.get();
  const std::vector<uint8_t> production_query = d_query.download();
  const std::vector<uint8_t> production_cache = d_cache.download();
  launch(plan);
  const std::vector<uint8_t> query = d_query.download();
  const std::vector<uint8_t> cache = d_cache.download();
  // The q the query bytes were computed from: the fused kernel's fp32 q, or the GEMM path's bf16 q.
  std::vector<float> workspace(size_t(rows) * H * kQkHeadDim);
  if (gemm) {
    std::vector<uint16_t> q_bf16(workspace.size());
    MLA_CUDA_CHECK(cudaMemcpy(q_bf16.data(), static_cast<uint8_t*>(d_workspace.get()) + plan.gemm_q_offset,
                              q_bf16.size() * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < q_bf16.size(); ++i) workspace[i] = float(ref::bf16_to_double(q_bf16[i]));
  } else {
    MLA_CUDA_CHECK(cudaMemcpy(workspace.data(), d_workspace.get(), workspace.size() * 4, cudaMemcpyDeviceToHost));
  }
  int64_t spec_differing = 0;

  Outcome outcome;
  std::string failure;
  int64_t failures = 0;
  EXPECT_TRUE(production_query == query) << "the plan without a stored q wrote other query bytes";
  EXPECT_TRUE(production_cache == cache) << "the plan without a stored q wrote other cache bytes";

  // Rows whose query is checked.
  std::vector<int> checked_rows(rows);
  for (int r = 0; r < rows; ++r) checked_rows[r] = r;
  if (c.max_checked_rows && rows > c.max_checked_rows) {
    std::shuffle(checked_rows.begin(), checked_rows.end(), rng);
    checked_rows.resize(c.max_checked_rows);
    checked_rows.push_back(rows - 1);  // always the last (possibly partial) tile
  }

  // Query bytes outside [head_offset, head_offset + H) must stay poisoned, in every row.
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < H_out; ++h) {
      if (h >= c.head_offset && h < c.head_offset + H) continue;
      for (int d = 0; d < kKeyDim; ++d)
        if (query[(size_t(r) * H_out + h) * kKeyDim + d] != kQueryPoison) {
          ++failures;
          if (failure.empty()) failure = "query byte outside this rank's heads was written: row " + std::to_string(r) + " head " + std::to_string(h);
        }
    }

  for (int r : checked_rows) {
    const uint16_t* row = projected.data() + size_t(r) * pitch;
    // Stage 1: qn (bf16) and which of its roundings could flip under fp32 math.
    double ss = 0;
    for (int k = 0; k < kQLoraRank; ++k) ss += ref::bf16_to_double(row[k]) * ref::bf16_to_double(row[k]);
    const double inv_rms = 1.0 / std::sqrt(ss / kQLoraRank + 1e-5f);
    std::vector<double> qn(kQLoraRank), qn_flip(kQLoraRank, 0.0);
    for (int k = 0; k < kQLoraRank; ++k) {
      const double x = ref::bf16_to_double(row[k]) * inv_rms * ref::bf16_to_double(w.q_a_norm[k]);
      const Bf16Rounding b = bf16_rounding(x);
      qn[k] = b.value;
      if (b.distance <= kNormRel * std::fabs(x)) qn_flip[k] = b.flip;
    }
    // Stage 2: q = bf16(q_b_proj . qn). Per element: the double value, the kernel's bf16 q (its
    // fp32 partials summed in the kernel's order), and how far the kernel's q may be from the
    // reference's (q_dev). Stage 3: ql from both, checked at two levels:
    //  - stage level (tight): bytes from the kernel's own q must be identical to e4m3 of the double
    //    ql computed from it, except within the absorption bound of a midpoint (then one step);
    //  - spec level: bytes within the e4m3 image of [x - bound, x + bound] of the pure reference.
    std::vector<double> q(kQkHeadDim), q_dev(kQkHeadDim), q_kernel(kQkHeadDim);
    for (int h = 0; h < H; ++h) {
      for (int d = 0; d < kQkHeadDim; ++d) {
        const uint16_t* wr = w.q_b_proj.data() + (size_t(h) * kQkHeadDim + d) * kQLoraRank;
        double sum = 0, abs_sum = 0, moved = 0;
        for (int k = 0; k < kQLoraRank; ++k) {
          const double wk = ref::bf16_to_double(wr[k]);
          sum += wk * qn[k];
          abs_sum += std::fabs(wk * qn[k]);
          moved += std::fabs(wk) * qn_flip[k];
        }
        const double eps = kQbAccumRel * abs_sum + moved;
        const float stored_q = workspace[int64_t(r) * H * kQkHeadDim + h * kQkHeadDim + d];
        const Bf16Rounding b = bf16_rounding(sum);
        // The kernel's bf16 q is bf16 of a value within eps of the sum: bf16 rounding is monotonic, so
        // it lies in [lo, hi] (one value unless a midpoint is within eps; many where |sum| << eps).
        const double lo = ref::bf16_round(sum - eps), hi = ref::bf16_round(sum + eps);
        // fp32 q: within the accumulation bound of the sum; bf16 q (GEMM path): in [lo, hi].
        const bool q_ok = gemm ? (double(stored_q) >= lo && double(stored_q) <= hi)
                               : std::fabs(double(stored_q) - sum) <= eps;
        if (!q_ok) {
          ++failures;
          if (failure.empty()) {
            char buf[200];
            snprintf(buf, sizeof buf, "%s q row %d head %d dim %d: %.9g vs %.9g, bound %.3g", gemm ? "bf16" : "fp32", r, h, d,
                     double(stored_q), sum, eps);
            failure = buf;
          }
        }
        q_kernel[d] = ref::bf16_to_double(ref::bf16_from_double(double(stored_q)));
        q[d] = b.value;
        q_dev[d] = std::max(std::fabs(lo - b.value), std::fabs(hi - b.value));  // 0 unless a midpoint is near
      }
      const uint8_t* got = query.data() + (size_t(r) * H_out + c.head_offset + h) * kKeyDim;
      const std::string where = "query row " + std::to_string(r) + " head " + std::to_string(h);
      std::vector<double> ql(kKvLoraRank, 0.0), ql_k(kKvLoraRank, 0.0), ql_abs(kKvLoraRank, 0.0),
          ql_moved(kKvLoraRank, 0.0);
      for (int d = 0; d < kNopeDim; ++d) {
        const uint16_t* wr = w.w_uk_t.data() + (size_t(h) * kNopeDim + d) * kKvLoraRank;
        for (int col = 0; col < kKvLoraRank; ++col) {
          const double wc = ref::bf16_to_double(wr[col]);
          ql[col] += q[d] * wc;
          ql_k[col] += q_kernel[d] * wc;
          ql_abs[col] += std::fabs(q_kernel[d] * wc);
          ql_moved[col] += q_dev[d] * std::fabs(wc);
        }
      }
      for (int col = 0; col < kKvLoraRank; ++col) {
        const std::string at = where + " col " + std::to_string(col);
        const double xk = ql_k[col] / w.q_scale;
        const double tight = kAbsorbAccumRel * ql_abs[col] / w.q_scale + kScalarRel * std::fabs(xk);
        if (!check_byte(got[col], xk, tight, outcome, failure, at + " (stage level)")) ++failures;
        const double x = ql[col] / w.q_scale;
        const double bound = tight + ql_moved[col] / w.q_scale + kScalarRel * std::fabs(x);
        if (!check_interval(got[col], x, bound, spec_differing, failure, at)) ++failures;
      }
      for (int d = 0; d < kRopeDim; ++d) {
        const std::string at = where + " rope " + std::to_string(d);
        const double xk = q_kernel[kNopeDim + d] / w.q_scale;
        if (!check_byte(got[kKvLoraRank + d], xk, kScalarRel * std::fabs(xk), outcome, failure, at + " (stage level)"))
          ++failures;
        const double x = q[kNopeDim + d] / w.q_scale;
        const double bound = q_dev[kNopeDim + d] / w.q_scale + kScalarRel * std::fabs(x);
        if (!check_interval(got[kKvLoraRank + d], x, bound, spec_differing, failure, at)) ++failures;
      }
    }
    // Cross-check the first checked row against the reference library (the spec's own code).
    if (r == checked_rows.front()) {
      const ref::NormedRow normed = ref::rms_norms(row, w.q_a_norm.data(), w.kv_a_norm.data(), 1e-5f);
      const std::vector<double> rq = ref::q_b_projection(normed.q_normed, w.q_b_proj.data(), H);
      const std::vector<double> rql = ref::absorb_w_uk(rq, w.w_uk_t.data(), H);
      std::vector<uint8_t> rbytes(size_t(H) * kKeyDim);
      ref::quantize_query(rql, rq, w.q_scale, H, rbytes.data());
      int64_t far = 0;
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < kKeyDim; ++d) {
          const uint8_t a = rbytes[size_t(h) * kKeyDim + d], b = query[(size_t(r) * H_out + c.head_offset + h) * kKeyDim + d];
          if (e4m3_is_nan(b) || std::abs(e4m3_ordinal(a) - e4m3_ordinal(b)) > 1) ++far;
        }
      // Near zero one flipped bf16 q element moves ql by several (tiny) e4m3 steps: allow a few.
      EXPECT_LE(far, int64_t(H) * kKeyDim / 1000 + 4) << "bytes more than one e4m3 step from mla::ref::quantize_query in row " << r;
    }
  }

  // Cache: every written slot against the reference; every other byte still the sentinel.
  std::vector<int> slot_row(num_pages * kPageSize, -1);
  for (int r = 0; r < rows; ++r)
    if (slots[r] >= 0) slot_row[slots[r]] = r;
  for (int64_t page = 0; page < num_pages; ++page) {
    for (int64_t off = 0; off < page_stride; ++off) {
      const uint8_t got = cache[page * page_stride + off];
      const int64_t token = off / kKeyDim;
      const int r = (token < kPageSize) ? slot_row[page * kPageSize + token] : -1;
      if (r < 0) {
        if (got != kCacheSentinel) {
          ++failures;
          if (failure.empty()) failure = "cache byte written outside a slot: page " + std::to_string(page) + " offset " + std::to_string(off);
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    if (slots[r] < 0) continue;
    const uint16_t* row = projected.data() + size_t(r) * pitch;
    const uint8_t* got = cache.data() + (slots[r] / kPageSize) * page_stride + (slots[r] % kPageSize) * kKeyDim;
    double ss = 0;
    for (int k = 0; k < kKvLoraRank; ++k) ss += ref::bf16_to_double(row[kProjectedKvaOffset + k]) * ref::bf16_to_double(row[kProjectedKvaOffset + k]);
    const double inv_rms = 1.0 / std::sqrt(ss / kKvLoraRank + 1e-5f);
    const std::string where = "cache row " + std::to_string(r);
    for (int k = 0; k < kKvLoraRank; ++k) {
      const double v = ref::bf16_to_double(row[kProjectedKvaOffset + k]) * inv_rms * ref::bf16_to_double(w.kv_a_norm[k]);
      const Bf16Rounding b = bf16_rounding(v);
      const double x = b.value / w.k_scale;
      const double bound = (b.distance <= kNormRel * std::fabs(v) ? b.flip / w.k_scale : 0.0) + kScalarRel * std::fabs(x);
      if (!check_byte(got[k], x, bound, outcome, failure, where + " col " + std::to_string(k))) ++failures;
    }
    for (int k = 0; k < kRopeDim; ++k) {
      const double x = ref::bf16_to_double(row[kProjectedKpeOffset + k]) / w.k_scale;
      if (!check_byte(got[kKvLoraRank + k], x, kScalarRel * std::fabs(x), outcome, failure, where + " k_pe " + std::to_string(k)))
        ++failures;
    }
  }

  EXPECT_EQ(failures, 0) << "first failure: " << failure << " (plan " << plan.describe() << ")";
  // Near-boundary differences are legitimate but must stay rare; a systematic error would flood them.
  EXPECT_LE(outcome.near_boundary_diffs, std::max<int64_t>(8, outcome.bytes_checked / 2000))
      << "of " << outcome.bytes_checked << " bytes checked";
  std::printf("[query] H=%d rows=%d: %lld bytes checked, %lld near-boundary differences (stage level), %lld bytes "
              "differ from the pure reference within the bound; %s\n", H, rows, (long long)outcome.bytes_checked,
              (long long)outcome.near_boundary_diffs, (long long)spec_differing, plan.describe().c_str());
}

// ---- Tests ---------------------------------------------------------------------------------------

class QueryShapes : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(QueryShapes, MatchesReference) {
  MLA_REQUIRE_GPU();
  const auto [H, rows] = GetParam();
  Case c{H, rows};
  // The double reference costs ~0.7 MFLOP per (row, head): check every row of small cases and a
  // random subset (plus the last row) of big ones; the cache rows are always all checked.
  c.max_checked_rows = std::max(2, 768 / H);
  run_case(c);
}

INSTANTIATE_TEST_SUITE_P(All, QueryShapes,
                         ::testing::Combine(::testing::Values(1, 8, 12, 16, 64, 96, 128),
                                            ::testing::Values(1, 2, 7, 64, 512)),
                         [](const auto& info) {
                           return "H" + std::to_string(std::get<0>(info.param)) + "_rows" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(Query, DcpHeadOffsetLeavesOtherHeadsUntouched) {
  MLA_REQUIRE_GPU();
  Case c{12, 7, /*head_offset=*/24, /*extra_heads=*/12};
  run_case(c);
}

TEST(Query, PdlAfterProducerKernel) {
  MLA_REQUIRE_GPU();
  for (int path : {1, 2}) {
    Case c{16, 7};
    c.pitch_pad = 8;
    c.overrides.path = path;
    run_case(c, /*pdl_producer=*/true);
  }
}

TEST(Query, PdlAfterProducerInCudaGraph) {
  MLA_REQUIRE_GPU();
  for (int path : {1, 2}) {
    Case c{12, 64};
    c.overrides.path = path;
    run_case(c, /*pdl_producer=*/true, /*graph=*/true);
  }
}

// Both paths on either side of the planner's crossover, and the GEMM path into a DCP mailbox.
TEST(Query, BothPathsGiveTheSameBytesAtTheCrossover) {
  MLA_REQUIRE_GPU();
  for (const auto& [H, rows] : {std::pair{16, 16}, std::pair{16, 17}, std::pair{12, 25}, std::pair{8, 33},
                                std::pair{64, 32}, std::pair{96, 33}, std::pair{1, 512}}) {
    for (int path : {1, 2}) {
      Case c{H, rows};
      c.max_checked_rows = std::max(2, 768 / H);
      c.overrides.path = path;
      run_case(c);
    }
  }
  Case c{12, 70, /*head_offset=*/12, /*extra_heads=*/24};
  c.overrides.path = 2;
  run_case(c);
}

// Every instantiation of the kernel: row tiles (with a partial last tile) x cluster sizes.
TEST(Query, EveryRowTileAndClusterSizeGivesTheSameBytes) {
  MLA_REQUIRE_GPU();
  for (int row_tile : {8, 16, 32, 64}) {
    for (int cluster : {1, 2, 3, 4, 6, 8}) {
      // Shared memory holds at most 16 rows at C = 1; C = 3 and 6 are built for row tiles 8 and 16 only.
      if ((cluster == 1 || cluster == 3 || cluster == 6) && row_tile > 16) continue;
      Case c{8, 33};
      c.overrides.path = 1;
      c.overrides.row_tile = row_tile;
      c.overrides.cluster_size = cluster;
      run_case(c);
    }
  }
  // The planned uneven clusters (on a 132-SM GPU): H = 32 x 5 rows takes C = 3, H = 16 x 12 rows C = 6.
  run_case(Case{32, 5});
  run_case(Case{16, 12});
}

// The GEMM path's absorb kernel at each row tile (QueryPlan.absorb_row_tile: 32, 64, 128 rows, wgmma N): partial
// last tiles, one row, and a head offset into a wider query.
TEST(Query, EveryAbsorbRowTileGivesTheSameBytes) {
  MLA_REQUIRE_GPU();
  for (int tile : {32, 64, 128}) {
    for (const auto& [H, rows] : {std::pair{8, 161}, std::pair{16, 1}}) {
      Case c{H, rows};
      c.max_checked_rows = std::max(2, 768 / H);
      c.overrides.path = 2;
      c.overrides.absorb_row_tile = tile;
      run_case(c);
    }
    Case c{12, 70, /*head_offset=*/12, /*extra_heads=*/24};
    c.overrides.path = 2;
    c.overrides.absorb_row_tile = tile;
    run_case(c);
  }
}

// Rope CTAs (C = 1, one row tile, spare SMs: QueryPlan.rope_ctas): both row tiles, a partial last rope CTA,
// against the reference and with the rope CTAs turned off.
TEST(Query, RopeCtasGiveTheSameBytes) {
  MLA_REQUIRE_GPU();
  for (const auto& [H, rows] : {std::pair{96, 16}, std::pair{96, 5}, std::pair{80, 9}, std::pair{70, 1}}) {
    const QueryPlan plan = query::make_query_plan(rows, H);
    EXPECT_GT(plan.rope_ctas, 0) << "H=" << H << " rows=" << rows << " planned no rope CTAs (" << plan.describe()
                                 << "): this test expects >= 114 SMs (H100, H200)";
    for (int no_rope_ctas : {0, 1}) {
      Case c{H, rows};
      c.overrides.no_rope_ctas = no_rope_ctas;
      run_case(c);
    }
  }
}

TEST(Query, RejectsBadShapes) {
  EXPECT_THROW(query::make_query_plan(0, 12), Error);
  EXPECT_THROW(query::make_query_plan(513, 12), Error);
  EXPECT_THROW(query::make_query_plan(4, 0), Error);
  EXPECT_THROW(query::make_query_plan(4, 129), Error);
  EXPECT_THROW(query::make_query_plan(4, 12, {.cluster_size = 5}), Error);
  EXPECT_THROW(query::make_query_plan(40, 12, {.cluster_size = 6, .row_tile = 32}), Error);  // tiles <= 16 only
  EXPECT_THROW(query::make_query_plan(4, 12, {.cluster_size = 1, .row_tile = 64}), Error);  // smem
  EXPECT_THROW(query::make_query_plan(4, 12, {.row_tile = 24}), Error);
  EXPECT_THROW(query::make_query_plan(4, 12, {.cluster_size = 16}), Error);
  EXPECT_THROW(query::make_query_plan(4, 12, {.path = 3}), Error);
  EXPECT_THROW(query::make_query_plan(128, 12, {.path = 2, .cluster_size = 2}), Error);  // a fused option
  EXPECT_THROW(query::make_query_plan(128, 12, {.path = 2, .no_rope_ctas = 1}), Error);   // likewise
  EXPECT_THROW(query::make_query_plan(4, 96, {.no_rope_ctas = 2}), Error);
  EXPECT_THROW(query::make_query_plan(128, 12, {.path = 2, .absorb_row_tile = 16}), Error);
  EXPECT_THROW(query::make_query_plan(4, 12, {.path = 1, .absorb_row_tile = 64}), Error);  // a GEMM option
}

TEST(Query, GemmPathWithoutCublasHandleThrows) {
  MLA_REQUIRE_GPU();
  const QueryPlan plan = query::make_query_plan(128, 16);
  ASSERT_EQ(plan.path, query::QueryPath::kGemm);
  DeviceBuffer<uint8_t> scratch(1 << 20);
  QueryArgs args;
  args.projected = args.q_a_norm = args.kv_a_norm = args.q_b_proj = args.w_uk_t = scratch.get();
  args.slots = reinterpret_cast<const int64_t*>(scratch.get());
  args.pitch = projected_width(16);
  args.query = args.cache = args.workspace = scratch.get();
  try {
    query::launch_query(plan, args, nullptr);
    ADD_FAILURE() << "no error without a cuBLAS handle";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cublas"), std::string::npos) << e.what();
  }
}

// The planner's measured rule (src/query/launch.cu): row tile by rows, the largest cluster whose CTAs fit one wave
// (clusters of 3 and more within 3/4 of the SMs; 4 only above 16-row tiles, 8 not at 16-row tiles), else the smallest
// that holds the tile; at 8-row tiles from 48 heads one CTA a head (with rope CTAs) instead of pairs; two 8-row tiles
// at 13-16 rows where they get clusters; at 17-32 rows 8-row tiles with clusters of 3 or more, or one 32-row tile of
// pairs from 48 heads up to one wave, else the GEMM path, which takes every plan from 33 rows; its absorb row tile.
TEST(Query, PlanFollowsTheMeasuredRule) {
  MLA_REQUIRE_GPU();
  int sms = 0;
  MLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (sms != 132) GTEST_SKIP() << "the expected plans are those of a 132-SM H200; this GPU has " << sms << " SMs";
  struct Want { int rows, heads, path, row_tile, cluster; };  // path: 0 planned, 1 forced fused
  for (const Want& w : {Want{1, 12, 0, 8, 8}, Want{4, 16, 0, 8, 6}, Want{1, 32, 0, 8, 3}, Want{16, 64, 0, 16, 2},
                        Want{1, 40, 0, 8, 2}, Want{1, 47, 0, 8, 2}, Want{1, 48, 0, 8, 1}, Want{8, 64, 0, 8, 1},
                        Want{4, 66, 0, 8, 1}, Want{12, 48, 0, 16, 2}, Want{1, 96, 0, 8, 1},
                        Want{1, 20, 0, 8, 3}, Want{12, 24, 0, 16, 3}, Want{12, 12, 0, 16, 6}, Want{13, 12, 0, 8, 3},
                        Want{16, 8, 0, 8, 6}, Want{16, 16, 0, 8, 3}, Want{16, 32, 0, 8, 2}, Want{16, 48, 0, 16, 2},
                        Want{16, 128, 0, 16, 1}, Want{17, 8, 0, 8, 3}, Want{32, 8, 0, 8, 3},
                        Want{24, 11, 0, 8, 3}, Want{17, 48, 0, 32, 2}, Want{32, 64, 0, 32, 2},
                        Want{64, 12, 1, 32, 4}, Want{64, 16, 1, 32, 2}, Want{64, 128, 1, 32, 2},
                        Want{256, 12, 1, 64, 2}, Want{512, 128, 1, 64, 2}}) {
    const QueryPlan plan = query::make_query_plan(w.rows, w.heads, {.path = w.path});
    EXPECT_EQ(plan.path, query::QueryPath::kFused) << plan.describe();
    EXPECT_EQ(plan.row_tile, w.row_tile) << plan.describe();
    EXPECT_EQ(plan.cluster_size, w.cluster) << plan.describe();
  }
  // The GEMM path from 33 rows up, and at 17-32 rows where the fused kernel's CTAs do not fill the SMs: 8-row tiles
  // without clusters of 3 (H 12 from 25 rows), H 12-47, past one wave of pairs (H 67 on 132 SMs).
  for (const auto& [rows, heads] : {std::pair{33, 8}, std::pair{64, 12}, std::pair{17, 16}, std::pair{25, 12},
                                    std::pair{32, 47}, std::pair{17, 67}, std::pair{32, 128}, std::pair{256, 12},
                                    std::pair{512, 128}}) {
    EXPECT_EQ(query::make_query_plan(rows, heads).path, query::QueryPath::kGemm) << rows << " rows, H=" << heads;
  }
  // The GEMM path's absorb row tile: the fewest waves of one CTA an SM, the smaller tile on a tie.
  struct WantTile { int rows, heads, tile; };
  for (const WantTile& w : {WantTile{33, 12, 32}, WantTile{64, 16, 32}, WantTile{128, 12, 64}, WantTile{128, 16, 64},
                            WantTile{256, 12, 128}, WantTile{512, 16, 128}, WantTile{33, 64, 64}, WantTile{64, 128, 64},
                            WantTile{128, 64, 128}, WantTile{128, 96, 128}, WantTile{512, 128, 128}}) {
    const QueryPlan plan = query::make_query_plan(w.rows, w.heads);
    EXPECT_EQ(plan.path, query::QueryPath::kGemm) << plan.describe();
    EXPECT_EQ(plan.absorb_row_tile, w.tile) << plan.describe();
  }
}

}  // namespace
}  // namespace mla::test
