// CPU reference of the whole MLA decode layer: DESIGN.md §4 in double precision, one function per
// stage and one for the whole layer. It is the executable form of the specification: every kernel is
// tested against it. It quantizes exactly where the kernels do (bf16 after the norms and q_b_proj,
// e4m3 for the query and the cache, bf16 for the latent and the output) and nowhere else.
//
// Host data: bf16 values are their 16 bits (uint16_t), FP8 values one byte (uint8_t).
#pragma once

#include <bit>
#include <cstdint>
#include <vector>

#include "mla/mla.h"

namespace mla::ref {

// ---- Scalar conversions -------------------------------------------------------------------------

// OCP FP8 E4M3 ("e4m3fn"): round to nearest even, saturate to +-448, NaN stays NaN (0x7f / 0xff).
uint8_t e4m3_from_double(double x);
double e4m3_to_double(uint8_t code);
// bfloat16: round to nearest even; NaN stays NaN.
uint16_t bf16_from_double(double x);
// Inline: the reference's projections decode a weight per multiply-add.
inline double bf16_to_double(uint16_t bits) {
  return static_cast<double>(std::bit_cast<float>(static_cast<uint32_t>(bits) << 16));
}
inline double bf16_round(double x) { return bf16_to_double(bf16_from_double(x)); }

// ---- Query stage (per row) ----------------------------------------------------------------------

struct NormedRow {
  std::vector<double> q_normed;   // [1536] bf16 values: bf16(q_a * rsqrt(mean(q_a^2) + eps) * q_a_norm)
  std::vector<double> kv_normed;  // [512]  bf16 values: bf16(kv_a * rsqrt(mean(kv_a^2) + eps) * kv_a_norm)
};
// `projected_row` points at one row of `projected` (its first 2112 columns are read).
NormedRow rms_norms(const uint16_t* projected_row, const uint16_t* q_a_norm, const uint16_t* kv_a_norm,
                    double eps);

// q[h, 0:192] = bf16(q_b_proj[h*192 : h*192+192] . q_normed); returns [H, 192].
std::vector<double> q_b_projection(const std::vector<double>& q_normed, const uint16_t* q_b_proj,
                                   int num_heads);

// ql[h, 0:512] = q[h, 0:128] . W_UK_T[h] (exact, not rounded); `q` is [H, 192]; returns [H, 512].
std::vector<double> absorb_w_uk(const std::vector<double>& q, const uint16_t* w_uk_t, int num_heads);

// query[h] = e4m3([ql[h] | q[h, 128:192]] / q_scale); writes [H, 576] bytes.
void quantize_query(const std::vector<double>& q_latent, const std::vector<double>& q, double q_scale,
                    int num_heads, uint8_t* query_out);

// The cache row of this token: e4m3([kv_normed | k_pe] / k_scale); writes 576 bytes.
// `projected_row` supplies k_pe (columns [2048, 2112), not normed).
void cache_row(const std::vector<double>& kv_normed, const uint16_t* projected_row, double k_scale,
               uint8_t* row_out);

// The whole query stage over all rows: writes `query_out` [rows, H, 576] and, for each row whose slot
// is >= 0, the cache row at page slot / 64, offset slot % 64. Validates its inputs first.
// Under DCP the caller passes -1 for the tokens this rank does not own (DESIGN.md §4).
void query_stage(const Weights& weights, const LayerDims& dims, const StepInputs& step,
                 uint8_t* query_out);
// The same for rank `dcp.rank` of a DCP group: validates `step` with that layout (totals required).
void query_stage(const Weights& weights, const LayerDims& dims, const StepInputs& step, const DcpLayout& dcp,
                 uint8_t* query_out);

// ---- Attention core -----------------------------------------------------------------------------

// Global position of local token j on rank `dcp.rank`: ((j / I) * D + k) * I + j % I.
int64_t dcp_global_position(int64_t local_index, const DcpLayout& dcp);
// Rank that owns global position g: (g / I) % D.
int dcp_owner(int64_t global_position, const DcpLayout& dcp);
// Local index of global position g on its owner: (g / (I*D)) * I + g % I (inverse of the above).
int64_t dcp_local_index(int64_t global_position, const DcpLayout& dcp);
// Tokens of a global sequence of `total` tokens that rank `dcp.rank` holds.
int64_t dcp_local_length(int64_t total, const DcpLayout& dcp);

// Result of the core for [rows, heads]: latent and LSE before any rounding.
struct CoreResult {
  int64_t rows = 0;
  int heads = 0;
  std::vector<double> latent;  // [rows, heads, 512]: k_scale * sum_j softmax_j * cache_j[0:512]
  std::vector<double> lse;     // [rows, heads]: natural log of sum_j exp(logit_j); -inf if nothing visible
};

// Split-KV partials: each split s covers a contiguous run of local tokens (whole pages) of every
// request; its latent is normalized by its own softmax sum and its LSE is over its tokens only.
struct SplitPartials {
  int num_splits = 1;
  std::vector<CoreResult> splits;  // [num_splits]
};

struct CoreInputs {
  const uint8_t* query = nullptr;     // [rows, heads, 576] FP8 bytes
  int64_t rows = 0;
  int heads = 0;                      // H_core: H, or D*H under DCP
  int q = 1;                          // rows per request
  TensorView cache;                   // [num_pages, 64, 576] host bytes
  TensorView block_table;             // [reqs, max_pages] int32 host; reqs <= rows / q
  TensorView lengths;                 // [reqs] int32 host: local tokens
  TensorView totals;                  // [reqs] int32 host: global lengths (DCP); absent = lengths
  double softmax_scale = 0;           // q_scale * k_scale / sqrt(192)
  double k_scale = 1;
  DcpLayout dcp;                      // local -> global positions for the causal bound
};

// Bottom-right causal visibility: local token j of request b is visible to row i iff
// global(j) <= T_b - q + i. Missing (padded) requests have no tokens.
SplitPartials core_partials(const CoreInputs& in, int num_splits);
// lse = ln sum_s exp(lse_s); latent = sum_s exp(lse_s - lse) * latent_s; all-empty => 0 and -inf.
CoreResult merge_partials(const SplitPartials& partials);
// core_partials with one split, merged.
CoreResult attention_core(const CoreInputs& in);

// DCP merge of the D ranks' results for the same rows and heads: weights exp(lse_k - lse), an empty
// shard (lse = -inf) weighs exactly 0, all empty => latent 0 and lse -inf.
CoreResult dcp_merge(const std::vector<CoreResult>& per_rank);

// Latent as the core stores it: bf16 of each element, [rows, heads, 512] values.
std::vector<double> round_latent(const CoreResult& core);

// ---- Value stage --------------------------------------------------------------------------------

// out[r, h*128 : h*128+128] = bf16((latent[r,h] . W_UV[h]) * sigmoid(gate[r, h*128 : ...])), where
// `latent` is [rows, H, 512] (already bf16-rounded), `gate` comes from `projected` columns
// [2112, 2112+H*128), and rows in `zero_rows` (requests with no tokens, padding) are exactly 0.
void value_stage(const std::vector<double>& latent, const Weights& weights, const LayerDims& dims,
                 const TensorView& projected, const std::vector<bool>& zero_rows, uint16_t* out);

// ---- Whole layer --------------------------------------------------------------------------------

struct LayerOptions {
  int num_splits = 1;   // split-KV count of the core (any count gives the same result)
};

// Everything the reference computed for one step, for tests that look inside.
struct LayerTrace {
  std::vector<uint8_t> query;  // [rows, H, 576]
  CoreResult core;             // [rows, H]
};

// The whole decode step on host tensors: validates `step` like PreparedMla::run, writes the cache
// slots and step.out. `trace` (optional) receives the intermediates.
void run_layer(const Weights& weights, const LayerDims& dims, const StepInputs& step,
               const LayerOptions& options = {}, LayerTrace* trace = nullptr);

// DCP: the same step on D simulated ranks. Rank k has its own weights (its H heads), projected rows
// (the same q_a/kv_a/k_pe, its own gate), cache shard, block table, local lengths and global totals;
// slots of tokens it does not own are -1. Phases run as on GPUs: every rank's query stage (publishing
// its heads into every rank's mailbox at heads [k*H, (k+1)*H)), every rank's core over all D*H heads,
// then every rank's value stage merging the D partials of its heads by LSE.
void run_layer_dcp(const std::vector<Weights>& weights, const LayerDims& dims,
                   const std::vector<StepInputs>& steps, int interleave, const LayerOptions& options = {});

}  // namespace mla::ref
