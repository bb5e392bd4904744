// Device inputs shared by the benchmarks: an arena of device allocations, a synthetic layer's weights on
// the device, a random page permutation, random FP8 cache bytes and varlen batches' lengths.
// (The tests build exact inputs through tools/synthetic.h; benchmarks only need plausible bytes fast.)
#pragma once

#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "common/cuda_check.h"
#include "mla/mla.h"
#include "synthetic.h"

namespace mla::bench {

// Random FP8 cache bytes: e4m3 of N(0, 32) (the spread of kv_normed / k_scale), from a hash.
__global__ void fill_cache_kernel(uint8_t* cache, int64_t bytes, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < bytes; i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t x = (i + seed) * 0x9e3779b97f4a7c15ull;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    const float u1 = (static_cast<float>(x & 0xffffff) + 1.0f) / 16777217.0f;
    const float u2 = static_cast<float>((x >> 24) & 0xffffff) / 16777216.0f;
    const float normal = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    cache[i] = __nv_cvt_float_to_fp8(32.0f * normal, __NV_SATFINITE, __NV_E4M3);
  }
}

// Device allocations freed together (at least 16 bytes each, so an empty vector still gets a
// non-null, aligned pointer).
class DeviceArena {
 public:
  DeviceArena() = default;
  ~DeviceArena() {
    for (void* p : blocks_) cudaFree(p);
  }
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  template <class T>
  T* alloc(size_t count) {
    void* p = nullptr;
    MLA_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(16, count * sizeof(T))));
    blocks_.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  T* copy(const T* host, size_t count) {
    T* p = alloc<T>(count);
    MLA_CUDA_CHECK(cudaMemcpy(p, host, count * sizeof(T), cudaMemcpyHostToDevice));
    return p;
  }
  template <class T>
  T* copy(const std::vector<T>& host) {
    return copy(host.data(), host.size());
  }

 private:
  std::vector<void*> blocks_;
};

// The layer's weights (shapes and scales of SyntheticLayer::weights()) copied into `arena`.
inline Weights device_weights(const synth::SyntheticLayer& layer, DeviceArena& arena) {
  Weights w = layer.weights();
  for (TensorView* view : {&w.q_a_norm, &w.kv_a_norm, &w.q_b_proj, &w.w_uk_t, &w.w_uv}) {
    view->data = arena.copy(static_cast<const uint16_t*>(view->data), static_cast<size_t>(view->numel()));
    view->memory = Memory::kDevice;
  }
  return w;
}

// Request b's length in a varlen batch: uniform in context * [1 - spread, 1 + spread] by a hash of b (the
// same every run, in every benchmark), at least 1; spread 0 gives the context.
inline int varlen_length(int context, double spread, int b) {
  if (spread == 0) return context;
  uint64_t h = (static_cast<uint64_t>(b) + 1) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  const double u = static_cast<double>(h >> 11) / static_cast<double>(uint64_t{1} << 53);
  return std::max(1, static_cast<int>(context * (1.0 - spread + 2.0 * spread * u)));
}

// A random permutation of the pages [0, n) (Fisher-Yates), so requests read scattered pages.
inline std::vector<int32_t> shuffled_pages(int64_t n, synth::Rng& rng) {
  std::vector<int32_t> pages(n);
  std::iota(pages.begin(), pages.end(), 0);
  for (int64_t i = n - 1; i > 0; --i) std::swap(pages[i], pages[rng() % (i + 1)]);
  return pages;
}

}  // namespace mla::bench
