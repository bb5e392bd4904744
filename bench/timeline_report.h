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

// A bench's --timeline flag: true in a build configured with -DMLA_TIMELINE=ON; elsewhere false, after saying so.
inline bool timeline_build(const char* bench) {
#if defined(MLA_TIMELINE) && MLA_TIMELINE
  (void)bench;
  return true;
#else
  std::fprintf(stderr, "%s --timeline needs a build configured with -DMLA_TIMELINE=ON\n", bench);
  return false;
#endif
}

// The stamps of one launch of one kernel: `ctas` CTAs, laid out [cta][timeline::kMaxMarks] (ns); marks[i] names mark i,
// the last is the end. A stamp of 0 is a mark the CTA did not record (a phase it has not got).
struct LaunchStamps {
  const uint64_t* stamps;
  int ctas;
  const std::vector<std::string>* names;
  double at(int cta, int mark) const { return double(stamps[size_t(cta) * timeline::kMaxMarks + mark]); }
  int marks() const { return int(names->size()); }
  double first_start() const {
    double t = at(0, 0);
    for (int c = 1; c < ctas; ++c) t = std::min(t, at(c, 0));
    return t;
  }
  double last_end() const {
    double t = at(0, marks() - 1);
    for (int c = 1; c < ctas; ++c) t = std::max(t, at(c, marks() - 1));
    return t;
  }
};

// Per mark the median and the maximum over CTAs of the time since that CTA's previous recorded mark (mark 0: since
// the launch's first start), and which CTA (linear block index) took the maximum, so that a straggler can be named;
// CTAs that did not record the mark are left out (and counted, if any).
inline std::string phase_report(const LaunchStamps& launch) {
  std::string out;
  char line[200];
  const double start = launch.first_start();
  for (int m = 0; m < launch.marks(); ++m) {
    std::vector<double> step;
    int slowest = -1;
    double slowest_step = -1.0;
    for (int c = 0; c < launch.ctas; ++c) {
      if (launch.at(c, m) == 0) continue;
      double previous = start;
      for (int k = m - 1; k >= 0; --k) {
        if (launch.at(c, k) != 0) {
          previous = launch.at(c, k);
          break;
        }
      }
      step.push_back((launch.at(c, m) - previous) / 1e3);
      if (step.back() > slowest_step) {
        slowest_step = step.back();
        slowest = c;
      }
    }
    if (step.empty()) continue;
    std::sort(step.begin(), step.end());
    std::snprintf(line, sizeof line, "    %-16s +%6.2f us median, +%6.2f max at CTA %d", (*launch.names)[m].c_str(),
                  step[step.size() / 2], step.back(), slowest);
    out += line;
    if (int(step.size()) < launch.ctas) {
      std::snprintf(line, sizeof line, " (%d of %d CTAs)", int(step.size()), launch.ctas);
      out += line;
    }
    out += "\n";
  }
  return out;
}

// For every launch after the first (its predecessor is then one of the same kernel): the gap from
// the previous launch's last end mark to this launch's first start mark, the span from its first start
// to its last end, and the phases of phase_report. names[i] names mark i; the last is the end.
inline std::string timeline_report(const std::vector<uint64_t>& stamps, int launches, int ctas,
                                   const std::vector<std::string>& names) {
  auto launch_at = [&](int l) {
    return LaunchStamps{stamps.data() + size_t(l) * ctas * timeline::kMaxMarks, ctas, &names};
  };
  std::string out;
  char line[160];
  for (int l = 1; l < launches; ++l) {
    const LaunchStamps launch = launch_at(l);
    const double start = launch.first_start();
    std::snprintf(line, sizeof line, "  launch %d: %.2f us after the previous launch's last CTA, span %.2f us\n", l,
                  (start - launch_at(l - 1).last_end()) / 1e3, (launch.last_end() - start) / 1e3);
    out += line;
    out += phase_report(launch);
  }
  return out;
}

}  // namespace mla::bench
