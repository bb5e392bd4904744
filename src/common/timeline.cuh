// Opt-in per-CTA phase timestamps for latency work on a kernel (configure with -DMLA_TIMELINE=ON;
// compiled out otherwise, so a default build's kernels are unchanged). Thread 0 of each CTA stores
// %globaltimer (ns) at each mark into stamps[cta * kMaxMarks + mark], cta = the linear block index;
// bench/timeline_report.h turns a buffer of launches into per-phase medians. The stores and timer
// reads cost a little: compare timings only within timeline builds.
#pragma once

#include <cstdint>

#include "common/timeline.h"

namespace mla::timeline {

// A null `stamps` records nothing: a timeline build still runs (and times) launches without a buffer.
__device__ __forceinline__ void record(uint64_t* stamps, int mark) {
  if (stamps != nullptr && threadIdx.x == 0) {
    const unsigned cta = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    stamps[uint64_t(cta) * kMaxMarks + mark] = now;
  }
}

}  // namespace mla::timeline

#if defined(MLA_TIMELINE) && MLA_TIMELINE
#define MLA_TIMELINE_MARK(stamps, mark) ::mla::timeline::record((stamps), (mark))
#else
#define MLA_TIMELINE_MARK(stamps, mark) \
  do {                                  \
  } while (0)
#endif
