// The layout of the opt-in kernel timeline (common/timeline.cuh records it, bench/timeline_report.h
// reads it): per launch, [CTAs][kMaxMarks] %globaltimer stamps in ns, CTA = the linear block index.
#pragma once

namespace mla::timeline {

inline constexpr int kMaxMarks = 16;  // marks a kernel may record per CTA

}  // namespace mla::timeline
