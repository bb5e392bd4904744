// parallel_for: the reference's and the synthetic generator's loops over independent outputs, on
// every core. The GPU tests check large shapes against the double-precision reference; on the device
// (16 cores) its loops, not the GPU, bound their time.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace mla::ref {

// Runs body(i) for every i in [0, count) on up to hardware_concurrency() threads. Each i writes only
// its own outputs, in the serial loop's order, so the results are that loop's bit for bit.
// `work_per_item` (multiply-adds, roughly) keeps small loops on the calling thread; the first
// exception a body throws is rethrown here.
template <typename Body>
void parallel_for(int64_t count, int64_t work_per_item, const Body& body) {
  constexpr int64_t kMinWorkPerThread = int64_t{1} << 20;
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads =
      std::min({hardware, count, std::max<int64_t>(1, count * work_per_item / kMinWorkPerThread)});
  if (threads <= 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    try {
      for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) body(i);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next = count;  // the other threads stop at their next item
    }
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& thread : pool) thread.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace mla::ref
