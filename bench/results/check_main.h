// The one error check of the standalone device checks in bench/results (coop_pdl_check.cu, cvt_rate_check.cu: single
// files built with `nvcc -arch=sm_90a`, outside the library): a failed CUDA call prints where and why, and the enclosing
// int function returns 1.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#define CHECK(call)                                                                                  \
  do {                                                                                               \
    const cudaError_t e = (call);                                                                    \
    if (e != cudaSuccess) {                                                                          \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e));               \
      return 1;                                                                                      \
    }                                                                                                \
  } while (0)
