// Every cuBLAS call of the tools and benchmarks is checked: a failure throws mla::Error with the
// status, the call, file and line (the cuBLAS counterpart of MLA_CUDA_CHECK, common/cuda_check.h).
#pragma once

#include <cublas_api.h>

#include <string>

#include "mla/error.h"

#define MLA_CUBLAS_CHECK(call)                                                                          \
  do {                                                                                                  \
    const cublasStatus_t mla_cublas_status_ = (call);                                                   \
    if (mla_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                                  \
      throw ::mla::Error(std::string("cuBLAS error ") + std::to_string(int(mla_cublas_status_)) +       \
                         " from " #call " at " + __FILE__ + ":" + std::to_string(__LINE__));            \
    }                                                                                                   \
  } while (0)
