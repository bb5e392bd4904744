// Fixed dimensions of a Kimi K3 MLA layer (DESIGN.md §2) and the column map of a projected row (§3).
// Everything here is constexpr so host code, kernels and tests share one source of truth.
#pragma once

#include <cstdint>

namespace mla {

inline constexpr int kQLoraRank = 1536;   // width of q_a
inline constexpr int kKvLoraRank = 512;   // latent width: keys' first 512 dims and the values
inline constexpr int kRopeDim = 64;       // second part of the keys (no rotary embedding: K3 is NoPE)
inline constexpr int kNopeDim = 128;      // per-head q_nope width
inline constexpr int kQkHeadDim = kNopeDim + kRopeDim;  // 192: per-head rows of q_b_proj
inline constexpr int kVHeadDim = 128;     // per-head output width
inline constexpr int kKeyDim = kKvLoraRank + kRopeDim;  // 576 FP8 bytes per cached token
inline constexpr int kPageSize = 64;      // tokens per KV-cache page
inline constexpr int kMaxHeads = 128;     // H on one GPU is 1..128
inline constexpr int kMaxQueries = 8;     // q = 1 + draft length, 1..8 rows per request

// Columns of one projected row [rows, pitch] (bf16).
inline constexpr int kProjectedQaOffset = 0;       // [0, 1536)     q_a
inline constexpr int kProjectedKvaOffset = 1536;   // [1536, 2048)  kv_a
inline constexpr int kProjectedKpeOffset = 2048;   // [2048, 2112)  k_pe (not normed)
inline constexpr int kProjectedGateOffset = 2112;  // [2112, 2112 + H*128) gate logits

// Width a projected row must have at least for H heads.
constexpr int64_t projected_width(int num_heads) {
  return kProjectedGateOffset + int64_t{num_heads} * kVHeadDim;
}

// Largest float an e4m3fn byte can hold; the encoder saturates to it.
inline constexpr float kE4m3Max = 448.0f;

}  // namespace mla
