// Helpers shared by the GPU tests: skip visibly without a device, device buffers that poison
// themselves, copies with checked CUDA calls.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common/cuda_check.h"
#include "mla/mla.h"

namespace mla::test {

inline bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// Skips the current test, visibly, where no CUDA device exists.
#define MLA_REQUIRE_GPU()                                                        \
  do {                                                                           \
    if (!::mla::test::have_gpu()) {                                              \
      (void)cudaGetLastError();                                                  \
      GTEST_SKIP() << "no CUDA device on this machine: GPU test not run";        \
    }                                                                            \
  } while (0)

// A device buffer of T that frees itself.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    MLA_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), count * sizeof(T) + 1));
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  void upload(const std::vector<T>& host) {
    MLA_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    MLA_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // Fills every byte with `byte` (e.g. 0xff: NaN for bf16/fp32/fp8) so unwritten elements fail.
  void poison(uint8_t byte = 0xff) { MLA_CUDA_CHECK(cudaMemset(ptr_, byte, count_ * sizeof(T))); }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// Device copies of a layer's weights, given as host views (SyntheticLayer::weights(), a rank's slice):
// `weights` has the same shapes and scales, on the device.
struct DeviceWeights {
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> buffers;
  Weights weights;

  explicit DeviceWeights(const Weights& host) : weights(host) {
    for (TensorView* view : {&weights.q_a_norm, &weights.kv_a_norm, &weights.q_b_proj, &weights.w_uk_t, &weights.w_uv}) {
      buffers.push_back(std::make_unique<DeviceBuffer<uint16_t>>(static_cast<size_t>(view->numel())));
      MLA_CUDA_CHECK(cudaMemcpy(buffers.back()->get(), view->data, view->numel() * sizeof(uint16_t),
                                cudaMemcpyHostToDevice));
      view->data = buffers.back()->get();
      view->memory = Memory::kDevice;
      view->device_index = 0;
    }
  }
};

// A host step's tensors on the device (synth::SyntheticStep, or a DCP rank's step, which also has
// `totals`), with room for later steps of the same sizes (changing lengths, block tables, slots):
// upload(host) copies a step and poisons `out`; inputs(host) gives the step's views on the device.
template <class HostStep>
struct DeviceStep {
  static constexpr bool kHasTotals = requires(const HostStep& h) { h.totals; };
  DeviceBuffer<uint16_t> projected, out;
  DeviceBuffer<uint8_t> cache;
  DeviceBuffer<int64_t> slots;
  DeviceBuffer<int32_t> block_table, lengths, totals;

  explicit DeviceStep(const HostStep& s)
      : projected(s.projected.size()), out(s.out.size()), cache(s.cache.size()), slots(s.slots.size()),
        block_table(std::max<size_t>(1, s.block_table.size())), lengths(std::max<size_t>(1, s.lengths.size())),
        totals(std::max<size_t>(1, totals_size(s))) {}
  void upload(const HostStep& s) {
    ASSERT_EQ(s.cache.size(), cache.size());
    ASSERT_EQ(std::max<size_t>(1, s.block_table.size()), block_table.size());
    projected.upload(s.projected);
    cache.upload(s.cache);
    slots.upload(s.slots);
    if (!s.block_table.empty()) block_table.upload(s.block_table);
    if (!s.lengths.empty()) lengths.upload(s.lengths);
    if constexpr (kHasTotals) {
      if (!s.totals.empty()) totals.upload(s.totals);
    }
    out.poison(0xff);
  }
  StepInputs inputs(HostStep& host) {
    StepInputs s = host.inputs();  // host views: same shapes and strides
    s.projected.data = projected.get();
    s.out.data = out.get();
    s.cache.data = cache.get();
    s.slots.data = slots.get();
    s.block_table.data = block_table.get();
    s.lengths.data = lengths.get();
    std::vector<TensorView*> views = {&s.projected, &s.out, &s.cache, &s.slots, &s.block_table, &s.lengths};
    if constexpr (kHasTotals) {
      s.totals.data = totals.get();
      views.push_back(&s.totals);
    }
    for (TensorView* v : views) v->memory = Memory::kDevice;
    return s;
  }

 private:
  static size_t totals_size(const HostStep& s) {
    if constexpr (kHasTotals) return s.totals.size();
    return 0;
  }
};

}  // namespace mla::test
