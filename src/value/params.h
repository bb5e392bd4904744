// Parameters of the value kernel: out = bf16((latent . W_UV) * sigmoid(gate)), zero rows for empty
// and padded requests (DESIGN.md §4, value stage).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mla::value {

struct ValueParams {
  // ---- Inputs ----
  const __nv_bfloat16* latent;     // [rows, num_heads, 512] bf16 (the core's merged output)
  int64_t stride_latent_row;       // elements between rows of latent (>= num_heads * 512)
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
};

}  // namespace mla::value
