// NcclBootstrap: the group's all-gather over an NCCL communicator (include/mla/dcp.h). Its own library
// (mla_dcp_nccl), so `mla` links no NCCL. NVLink multicast (NVLS) is neither needed nor used here.
#include <nccl.h>

#include <string>

#include "common/cuda_check.h"
#include "mla/dcp.h"

namespace mla {
namespace {

void check_nccl(ncclResult_t result, const char* call) {
  if (result != ncclSuccess) throw Error(std::string("NCCL error from ") + call + ": " + ncclGetErrorString(result));
}

}  // namespace

NcclBootstrap::NcclBootstrap(ncclComm* comm, int device_index) : comm_(comm), device_index_(device_index) {
  if (comm == nullptr) throw_bad_argument("NcclBootstrap comm", "an initialized ncclComm_t", "null");
  check_nccl(ncclCommUserRank(comm, &rank_), "ncclCommUserRank");
  check_nccl(ncclCommCount(comm, &size_), "ncclCommCount");
}

void NcclBootstrap::all_gather(const void* mine, size_t bytes, void* gathered) {
  int previous = 0;
  MLA_CUDA_CHECK(cudaGetDevice(&previous));
  MLA_CUDA_CHECK(cudaSetDevice(device_index_));
  void* device = nullptr;
  cudaStream_t stream = nullptr;
  try {
    MLA_CUDA_CHECK(cudaMalloc(&device, bytes * (size_ + 1)));
    MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto* send = static_cast<uint8_t*>(device) + bytes * size_;
    MLA_CUDA_CHECK(cudaMemcpyAsync(send, mine, bytes, cudaMemcpyHostToDevice, stream));
    check_nccl(ncclAllGather(send, device, bytes, ncclUint8, comm_, stream), "ncclAllGather");
    MLA_CUDA_CHECK(cudaMemcpyAsync(gathered, device, bytes * size_, cudaMemcpyDeviceToHost, stream));
    MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  } catch (...) {
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (device != nullptr) cudaFree(device);
    cudaSetDevice(previous);
    throw;
  }
  MLA_CUDA_CHECK(cudaStreamDestroy(stream));
  MLA_CUDA_CHECK(cudaFree(device));
  MLA_CUDA_CHECK(cudaSetDevice(previous));
}

}  // namespace mla
