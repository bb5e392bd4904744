// Kernel parameters of the FP8 attention core (DESIGN.md §4). Plain structs passed by value as
// __grid_constant__ kernel parameters; the host fills them in launch.cu.
#pragma once

#include <cstdint>

namespace mla::core {

struct CoreParams {
  // ---- Inputs (device pointers) ----------------------------------------------------------------
  const uint8_t* query = nullptr;        // [rows, heads, 576] FP8 e4m3, contiguous
  const uint8_t* cache = nullptr;        // [num_pages, 64, 576] FP8 e4m3; rows of 576 B contiguous
  int64_t stride_cache_page = 0;         // bytes between pages (>= 64*576, multiple of 16)
  const int32_t* block_table = nullptr;  // [num_requests, max_pages] int32
  int64_t stride_block_table = 0;        // elements between block-table rows
  const int32_t* lengths = nullptr;      // [num_requests] local tokens in the cache
  const int32_t* totals = nullptr;       // [num_requests] global lengths (DCP); null = lengths

  // ---- Shape ---------------------------------------------------------------------------------------
  int num_requests = 0;   // requests present in block_table/lengths; rows/q - num_requests are padding
  int num_heads = 0;      // H_core (heads of the query / latent)
  int q = 1;              // rows per request (1..8); M side of a request = q * num_heads rows
  int num_splits = 1;     // planned split-KV count per request; 1 = write latent/lse directly, no combine
  int grid_requests = 1;  // rows / q (padded requests included): num_splits * grid_requests CTA slots per
                          // M-tile: num_splits each, or the batch's pages dealt over them (flat slots)
  int dcp_rank = 0;       // local token j has global position ((j / I) * D + k) * I + j % I
  int dcp_size = 1;       //   D (1 = no DCP: g = j)
  int dcp_interleave = 1; //   I

  // ---- Scales ---------------------------------------------------------------------------------------
  float softmax_scale_log2 = 0;  // softmax_scale * log2(e): multiplies the raw FP8 dot product
  float k_scale = 1;             // multiplies the output latent

  // ---- Outputs -------------------------------------------------------------------------------------
  void* latent = nullptr;         // [rows, heads, 512] bf16 (written here when num_splits == 1, or under flat
                                  // slots for a request one CTA holds whole: writes_directly; else by the combine)
  float* lse = nullptr;           // [rows, heads] fp32 natural log (written likewise)
  float* partial_latent = nullptr;  // [slots, q * heads, 512] fp32, normalized per split: split s of request r
                                    // at rows (r * num_splits + s) * q * heads + mi; flat slots: CTA c's segment
                                    // of request r at slot r + c (CorePlan.partial_slots slots)
  float* partial_lse = nullptr;     // [slots, q * heads] fp32 natural log, -inf = nothing visible
  int* request_slots = nullptr;     // flat slots: [grid_requests] x (first slot, count) of each request with pages,
                                    // written by the CTA holding its first page, for the combine (no page scan);
                                    // null where the split kernel merges itself (tile_counters)
  int* tile_counters = nullptr;     // flat slots merged in the split kernel (CorePlan::merge_in_split), else null:
                                    // [grid_requests][m_tiles][2]: mma.sync: segments arrived, partials stored;
                                    // ping-pong: [grid_requests][m_tiles] segments arrived (the first half);
                                    // zero before and after each launch
  // ---- Profiling only (MLA_TIMELINE builds; common/timeline.cuh) ----
  uint64_t* timeline = nullptr;     // [grid CTAs, timeline::kMaxMarks] %globaltimer stamps (CoreMark), or null
};

struct CombineParams {
  const float* partial_latent = nullptr;  // [slots, q * heads, 512] (CoreParams); only nonempty splits written
  const float* partial_lse = nullptr;     // [slots, q * heads]; likewise
  const int* request_slots = nullptr;     // flat slots: [grid_requests] x (first slot, count) (CoreParams)
  const int32_t* lengths = nullptr;       // [num_requests] local tokens: which splits hold pages
  int num_requests = 0;                   // requests present in lengths; the others are padding (empty)
  int entries_per_request = 1;            // q * heads
  int64_t num_entries = 0;                // rows * heads
  int num_splits = 1;                     // planned per request (CoreParams)
  int grid_requests = 1;                  // rows / q (CoreParams)
  int warps_per_entry = 1;                // warps merging one (entry, 128-dim chunk): 1..kCombineMaxWarps, a power of 2
  float k_scale = 1;                      // multiplies the merged latent
  void* latent = nullptr;                 // [rows, heads, 512] bf16
  float* lse = nullptr;                   // [rows, heads] fp32 natural log
  const uint8_t* l2_prefetch = nullptr;   // the next stage's weights, dealt over the CTAs into L2 before the PDL wait
  int64_t l2_prefetch_bytes = 0;          //   (CoreArgs.l2_prefetch: a hint; null = none)
  uint64_t* timeline = nullptr;           // profiling only (MLA_TIMELINE builds): [grid CTAs, timeline::kMaxMarks]
                                          // stamps (CombineMark), or null
};

}  // namespace mla::core
