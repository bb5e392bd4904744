// Helpers shared by the GPU tests: skip visibly without a device, device buffers that poison
// themselves, copies with checked CUDA calls.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/cuda_check.h"

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

}  // namespace mla::test
