// Parameters of the value kernel: out = bf16((latent . W_UV) * sigmoid(gate)), zero rows for empty
// and padded requests (DESIGN.md §4, value stage); under DCP the latent is first merged from the D
// ranks' partials by their LSE (DESIGN.md §4, DCP).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mla::value {

inline constexpr int kMaxPartials = 8;  // D of a DCP group (mla::kMaxDcpRanks)

struct ValueParams {
  // ---- Inputs ----
  const __nv_bfloat16* latent;     // [rows, num_heads, 512] bf16 (the core's merged output); unused
                                   // when num_partials > 1
  int64_t stride_latent_row;       // elements between rows of latent, and of each partial latent
  const __nv_bfloat16* w_uv;       // [num_heads, 512, 128] bf16, contiguous
  const __nv_bfloat16* projected;  // [rows, pitch] bf16: gate logits at columns [2112, 2112 + H*128)
  int64_t stride_projected_row;    // the pitch (elements)
  // ---- Which rows are exactly zero ----
  const int32_t* lengths;          // [num_requests] tokens of each request (local)
  const int32_t* totals;           // [num_requests] global lengths under DCP, or nullptr
  int num_requests;                // requests present; rows of requests >= num_requests are padding
  int q;                           // rows per request
  // ---- Output ----
  __nv_bfloat16* out;              // [rows, num_heads * 128] bf16, contiguous
  int rows;
  int num_heads;
  // ---- DCP merge (num_partials > 1; 0 or 1 = no merge, `latent` is final) ----
  // latent[r, h] = sum_p exp(lse_p[r, h] - lse[r, h]) * latent_p[r, h] with lse = ln sum_p exp(lse_p),
  // in fp32 and not rounded to bf16 before W_UV; an empty shard (lse_p = -inf) weighs exactly 0 and
  // all empty gives 0.
  int num_partials;                                  // D
  const __nv_bfloat16* partial_latent[kMaxPartials]; // [p]: rank p's core latent, offset to this rank's
                                                     // first head: element (r, h) at r * stride_latent_row + h * 512
  const float* partial_lse[kMaxPartials];            // [p]: rank p's core LSE (natural log), offset likewise:
                                                     // element (r, h) at r * stride_lse_row + h
  int64_t stride_lse_row;                            // elements between rows of each partial LSE (D*H)
  // ---- Profiling only (MLA_TIMELINE builds; common/timeline.cuh) ----
  uint64_t* timeline = nullptr;  // [grid CTAs, timeline::kMaxMarks] %globaltimer stamps (ValueMark), or null
};

}  // namespace mla::value
