// Host side of the opt-in kernel timeline (common/timeline.cuh): a report of `launches` back-to-back
// launches of one kernel, `ctas` CTAs each, stamps laid out [launch][cta][timeline::kMaxMarks] (ns).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/timeline.h"

namespace mla::bench {

// For every launch after the first (its predecessor is then one of the same kernel): the gap from
// the previous launch's last end mark to this launch's first start mark, the span from its first start
// to its last end, and per mark the median and the maximum over CTAs of the time since that CTA's
// previous mark (mark 0: since the launch's first start). names[i] names mark i; the last is the end.
inline std::string timeline_report(const std::vector<uint64_t>& stamps, int launches, int ctas,
                                   const std::vector<std::string>& names) {
  const int marks = int(names.size());
  auto at = [&](int launch, int cta, int mark) {
    return double(stamps[(size_t(launch) * ctas + cta) * timeline::kMaxMarks + mark]);
  };
  auto first_start = [&](int launch) {
    double t = at(launch, 0, 0);
    for (int c = 1; c < ctas; ++c) t = std::min(t, at(launch, c, 0));
    return t;
  };
  auto last_end = [&](int launch) {
    double t = at(launch, 0, marks - 1);
    for (int c = 1; c < ctas; ++c) t = std::max(t, at(launch, c, marks - 1));
    return t;
  };
  std::string out;
  char line[160];
  for (int l = 1; l < launches; ++l) {
    const double start = first_start(l);
    std::snprintf(line, sizeof line, "  launch %d: %.2f us after the previous launch's last CTA, span %.2f us\n", l,
                  (start - last_end(l - 1)) / 1e3, (last_end(l) - start) / 1e3);
    out += line;
    for (int m = 0; m < marks; ++m) {
      std::vector<double> step(ctas);
      for (int c = 0; c < ctas; ++c) step[c] = (at(l, c, m) - (m == 0 ? start : at(l, c, m - 1))) / 1e3;
      std::sort(step.begin(), step.end());
      std::snprintf(line, sizeof line, "    %-16s +%6.2f us median, +%6.2f max\n", names[m].c_str(), step[ctas / 2],
                    step.back());
      out += line;
    }
  }
  return out;
}

}  // namespace mla::bench
