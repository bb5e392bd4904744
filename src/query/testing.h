// Test and benchmark support of the query family: a stand-in producer kernel for PDL chains.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace mla::query {

// A kernel that first spins for `delay_ns` and then copies `bytes` (a multiple of 16) from `src` to
// `dst`, and `bytes2` from `src2` to `dst2` where given; it triggers its dependents at its start, so a PDL-launched
// kernel that read what it copies before griddepcontrol.wait would see the old bytes. Launched normally on `stream`.
void launch_delayed_copy(void* dst, const void* src, size_t bytes, unsigned delay_ns, cudaStream_t stream,
                         void* dst2 = nullptr, const void* src2 = nullptr, size_t bytes2 = 0);

}  // namespace mla::query
