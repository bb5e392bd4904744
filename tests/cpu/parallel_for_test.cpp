// parallel_for, which the reference and the synthetic generator run their loops on: every index runs
// exactly once on several threads, small loops stay on the caller, a body's exception reaches the
// caller.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <vector>

#include "parallel_for.h"

namespace mla::ref {
namespace {

TEST(ParallelFor, RunsEveryIndexOnce) {
  for (int64_t count : {0, 1, 2, 7, 1000}) {
    std::vector<std::atomic<int>> runs(count);
    parallel_for(count, int64_t{1} << 30, [&](int64_t i) { runs[i].fetch_add(1); });
    for (int64_t i = 0; i < count; ++i) EXPECT_EQ(runs[i].load(), 1) << "count " << count << " index " << i;
  }
}

TEST(ParallelFor, SmallLoopsStayOnTheCallingThread) {
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<int> elsewhere{0};
  parallel_for(100, 1, [&](int64_t) { elsewhere += std::this_thread::get_id() != caller; });
  EXPECT_EQ(elsewhere.load(), 0);
}

TEST(ParallelFor, UsesSeveralThreadsForLargeLoops) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one hardware thread";
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<int> elsewhere{0};
  // Each item waits a little so that one thread cannot take them all before the others start.
  parallel_for(64, int64_t{1} << 30, [&](int64_t) {
    elsewhere += std::this_thread::get_id() != caller;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  EXPECT_GT(elsewhere.load(), 0);
}

TEST(ParallelFor, RethrowsABodysException) {
  EXPECT_THROW(parallel_for(1000, int64_t{1} << 30,
                            [&](int64_t i) {
                              if (i == 3) throw std::runtime_error("item 3");
                            }),
               std::runtime_error);
  EXPECT_THROW(parallel_for(10, 1, [&](int64_t i) { if (i == 3) throw std::runtime_error("item 3"); }),
               std::runtime_error);
}

}  // namespace
}  // namespace mla::ref
