// Tile plan of the value kernel. One CTA owns one head, a 32-column slice of that head's 128 outputs
// and up to 16 rows: the CTA keeps its W_UV slice (512 x 32 bf16 = 32 KB) in registers, so the weight
// bytes are read from memory once per row tile, and before the PDL wait, under the previous kernel.
#pragma once

#include "mla/dims.h"

namespace mla::value {

inline constexpr int kThreads = 256;
inline constexpr int kColumnsPerCta = 32;              // output columns of one head per CTA
inline constexpr int kColumnsPerThread = 8;            // one 16-byte W_UV load per k row
inline constexpr int kColumnGroups = kColumnsPerCta / kColumnsPerThread;  // 4 threads span the slice
inline constexpr int kKSlices = kThreads / kColumnGroups;                 // 64 slices of the reduction
inline constexpr int kKPerThread = kKvLoraRank / kKSlices;                // 8 latent elements each
inline constexpr int kRowsPerCta = 16;                 // rows whose outputs share the registers' W slice
inline constexpr int kRowsPerPass = 4;                 // rows reduced together (bounds accumulators)
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kColumnSlices = kVHeadDim / kColumnsPerCta;

static_assert(kColumnsPerCta % kColumnsPerThread == 0, "a thread covers whole 16-byte column groups");
static_assert(kThreads % kColumnGroups == 0 && kKvLoraRank % kKSlices == 0, "the reduction splits evenly");
static_assert(kKPerThread == 8, "a thread's latent elements are one 16-byte load");
static_assert(kVHeadDim % kColumnsPerCta == 0, "column slices tile a head");
static_assert(kRowsPerCta % kRowsPerPass == 0, "passes tile the row tile");

// Shared memory: per pass, each warp's partial sums for its rows and the CTA's columns.
struct SharedPlan {
  float partial[kRowsPerPass][kWarps][kColumnsPerCta];
};

}  // namespace mla::value
