// The host report of the opt-in kernel timeline (bench/timeline_report.h) on hand-made stamps.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "timeline_report.h"

namespace mla {
namespace {

TEST(TimelineReport, GapSpanAndPerMarkMedians) {
  // Two launches of 2 CTAs, marks start / mid / end (ns); the rest of each CTA's 16 slots unused.
  const int ctas = 2, launches = 2;
  std::vector<uint64_t> stamps(size_t(launches) * ctas * timeline::kMaxMarks, 0);
  auto set = [&](int launch, int cta, std::vector<uint64_t> marks) {
    for (size_t m = 0; m < marks.size(); ++m) stamps[(size_t(launch) * ctas + cta) * timeline::kMaxMarks + m] = marks[m];
  };
  set(0, 0, {1000, 2000, 3000});
  set(0, 1, {1500, 2500, 4000});   // launch 0 ends at 4000
  set(1, 0, {6000, 8000, 9000});   // launch 1 starts at 6000: a 2 µs gap
  set(1, 1, {7000, 7500, 12000});  // and ends at 12000: a 6 µs span
  const std::string report = bench::timeline_report(stamps, launches, ctas, {"start", "mid", "end"});
  EXPECT_NE(report.find("launch 1: 2.00 us after the previous launch's last CTA, span 6.00 us"), std::string::npos)
      << report;
  EXPECT_EQ(report.find("launch 0"), std::string::npos) << report;  // the first launch has no predecessor
  // Per CTA since its previous mark: start {0, 1.0}, mid {2.0, 0.5}, end {1.0, 4.5} µs.
  // The slowest CTA of each phase is named (the first of equal ones).
  EXPECT_NE(report.find("start            +  1.00 us median, +  1.00 max at CTA 1"), std::string::npos) << report;
  EXPECT_NE(report.find("mid              +  2.00 us median, +  2.00 max at CTA 0"), std::string::npos) << report;
  EXPECT_NE(report.find("end              +  4.50 us median, +  4.50 max at CTA 1"), std::string::npos) << report;
}

TEST(TimelineReport, MarksACtaDidNotRecordAreLeftOut) {
  // One launch of 3 CTAs, marks start / page / end; CTA 2 has no page (stamp 0: not recorded), so its end counts
  // from its start and the page line says how many CTAs it covers.
  const int ctas = 3;
  std::vector<uint64_t> stamps(size_t(ctas) * timeline::kMaxMarks, 0);
  auto set = [&](int cta, std::vector<uint64_t> marks) {
    for (size_t m = 0; m < marks.size(); ++m) stamps[size_t(cta) * timeline::kMaxMarks + m] = marks[m];
  };
  set(0, {1000, 3000, 4000});
  set(1, {1000, 5000, 6000});
  set(2, {2000, 0, 2500});
  const std::vector<std::string> names = {"start", "page", "end"};
  const bench::LaunchStamps launch{stamps.data(), ctas, &names};
  EXPECT_EQ(launch.first_start(), 1000.0);
  EXPECT_EQ(launch.last_end(), 6000.0);
  const std::string report = bench::phase_report(launch);
  // page: CTAs 0 and 1 only, 2.0 and 4.0 µs (median = the upper of two); end: {1.0, 1.0, 0.5} µs.
  EXPECT_NE(report.find("page             +  4.00 us median, +  4.00 max at CTA 1 (2 of 3 CTAs)"), std::string::npos)
      << report;
  EXPECT_NE(report.find("end              +  1.00 us median, +  1.00 max at CTA 0\n"), std::string::npos) << report;
}

}  // namespace
}  // namespace mla
