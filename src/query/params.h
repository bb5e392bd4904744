// Kernel parameters of the fused query stage (DESIGN.md §4, query stage). Plain struct, passed by
// value as a __grid_constant__ kernel parameter.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mla::query {

struct QueryParams {
  // ---- Inputs (device, bf16 unless noted) ----
  const __nv_bfloat16* projected = nullptr;  // [num_rows, stride_projected_row]: q_a | kv_a | k_pe | gate
  int64_t stride_projected_row = 0;          // elements, >= 2112 + H*128
  const __nv_bfloat16* q_a_norm = nullptr;   // [1536]
  const __nv_bfloat16* kv_a_norm = nullptr;  // [512]
  const __nv_bfloat16* q_b_proj = nullptr;   // [H*192, 1536], contiguous
  const __nv_bfloat16* w_uk_t = nullptr;     // [H, 128, 512], contiguous
  const int64_t* slots = nullptr;            // [num_rows]: cache slot page*64+offset, -1 = no write
  float rms_eps = 1e-5f;
  float inv_q_scale = 1.0f;                  // multiplies the query before e4m3 (1 / q_scale)
  float inv_k_scale = 1.0f;                  // multiplies the cache row before e4m3 (1 / k_scale)
  int num_rows = 0;
  int num_heads = 0;                         // H: heads computed here
  int rope_tiles_per_cta = 0;                // rope CTAs (QueryPlan.rope_ctas): 16-feature rope tiles each

  // ---- Outputs ----
  uint8_t* query = nullptr;                  // [num_rows, num_heads_out, 576] e4m3 bytes, contiguous
  int num_heads_out = 0;                     // H_out >= head_offset + H (H without DCP; D*H mailbox)
  int head_offset = 0;                       // first head of this rank in `query`
  uint8_t* cache = nullptr;                  // [num_pages, 64, 576] e4m3 bytes; pages stride_cache_page apart
  int64_t stride_cache_page = 0;             // bytes between pages, >= 64*576, multiple of 16
  int64_t num_cache_pages = 0;               // a slot on a page >= this is skipped (defence; validated upstream)

  // ---- Tests only ----
  float* workspace = nullptr;                // [num_rows, H*192] fp32 q before its bf16 rounding, or null

  // ---- Profiling only (MLA_TIMELINE builds; common/timeline.cuh) ----
  uint64_t* timeline = nullptr;              // [grid CTAs, timeline::kMaxMarks] %globaltimer stamps, or null
};

}  // namespace mla::query
