#include "query/testing.h"

#include <cstdint>

#include "common/cuda_check.h"

namespace mla::query {
namespace {

__global__ void delayed_copy_kernel(uint4* dst, const uint4* src, size_t count, uint4* dst2, const uint4* src2,
                                    size_t count2, unsigned delay_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // let the dependent start early
  const uint64_t start = clock64();
  // ~2 GHz: spin delay_ns * 2 cycles (nanosleep alone may return early).
  while (clock64() - start < uint64_t(delay_ns) * 2) __nanosleep(100);
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += stride) dst[i] = src[i];
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count2; i += stride) dst2[i] = src2[i];
}

}  // namespace

void launch_delayed_copy(void* dst, const void* src, size_t bytes, unsigned delay_ns, cudaStream_t stream, void* dst2,
                         const void* src2, size_t bytes2) {
  delayed_copy_kernel<<<64, 256, 0, stream>>>(static_cast<uint4*>(dst), static_cast<const uint4*>(src), bytes / 16,
                                              static_cast<uint4*>(dst2), static_cast<const uint4*>(src2), bytes2 / 16,
                                              delay_ns);
  MLA_CUDA_CHECK_LAUNCH();
}

}  // namespace mla::query
