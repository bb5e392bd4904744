// Device buffers and random bytes for the stage benchmarks (query_bench, value_bench): plausible
// values fast, not the exact inputs of the tests (tools/synthetic.h); and the benchmarks' flag and --out helpers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/cuda_check.h"
#include "mla/error.h"

namespace mla::bench {

// Random finite bf16, uniform in [-scale / 2, scale / 2), from a hash of (index, seed) (never all
// zeros: zero operands run faster than real data).
__global__ void fill_random_bf16(__nv_bfloat16* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    const float u = float(x >> 40) / float(1 << 24) - 0.5f;
    p[i] = __float2bfloat16_rn(u * scale);
  }
}

// cudaMalloc of `count` elements (at least 16 bytes: an empty buffer still gets an aligned pointer);
// the caller frees it.
template <class T>
T* device_alloc(size_t count) {
  T* p = nullptr;
  MLA_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(16, count * sizeof(T))));
  return p;
}

// The value of a count flag (`--heads H`, `--rows R`): an integer in [1, most], or a message naming the flag and what
// came, and false. Checked before any CUDA call, so that a device plan's bad line fails on a machine without a GPU
// too (scripts/device_plan.sh --check: exit code 2).
inline bool parse_count(const char* program, const char* flag, const char* text, long most, int& value) {
  char* end = nullptr;
  const long parsed = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || parsed < 1 || parsed > most) {
    std::fprintf(stderr, "%s: %s expects an integer in [1, %ld], got '%s'\n", program, flag, most, text);
    return false;
  }
  value = static_cast<int>(parsed);
  return true;
}

// A benchmark's table into its --out file; throws Error naming the path where it cannot be written whole.
inline void write_out_file(const char* path, const std::string& text) {
  std::FILE* f = std::fopen(path, "w");
  const bool written = f != nullptr && std::fputs(text.c_str(), f) >= 0;
  const bool closed = f != nullptr && std::fclose(f) == 0;
  if (!written || !closed) throw Error(std::string("cannot write --out ") + path);
}

}  // namespace mla::bench
