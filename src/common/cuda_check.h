// Every CUDA call is checked: a failure throws mla::Error with the call, file and line.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "mla/error.h"

namespace mla::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  throw Error(std::string("CUDA error ") + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) +
              ") from " + call + " at " + file + ":" + std::to_string(line));
}

}  // namespace mla::detail

#define MLA_CUDA_CHECK(call)                                                            \
  do {                                                                                  \
    cudaError_t mla_cuda_status_ = (call);                                              \
    if (mla_cuda_status_ != cudaSuccess) {                                              \
      ::mla::detail::throw_cuda_error(mla_cuda_status_, #call, __FILE__, __LINE__);     \
    }                                                                                   \
  } while (0)

// After a kernel launch: the launch itself (configuration errors) must have succeeded.
#define MLA_CUDA_CHECK_LAUNCH() MLA_CUDA_CHECK(cudaGetLastError())
