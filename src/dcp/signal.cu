// The epoch signal-and-wait kernel (dcp/signal.h).
#include <cstdio>

#include "common/cuda_check.h"
#include "dcp/signal.h"

namespace mla::dcp {
namespace {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void store_release_system(uint32_t* address, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_system(const uint32_t* address) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

// Thread p < D: writes the epoch into rank p's signal word, then waits for the own word p. The
// stage before this kernel (its kernels and publish copies) completed by stream order; the fence
// makes those writes visible system-wide before any peer can see the epoch (release), and the
// acquire loads + fence order the stage after this kernel behind what the peers published.
__global__ void __launch_bounds__(32) signal_wait_kernel(SignalArgs a) {
  __shared__ uint32_t epoch;
  const int t = threadIdx.x;
  if (t == 0) {
    uint32_t e = *a.epoch;
    if (a.advance) *a.epoch = ++e;
    epoch = e;
  }
  __syncthreads();
  const uint32_t e = epoch;
  if (t < a.size) {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    store_release_system(a.targets[t], e);
    const uint64_t start = global_timer_ns();
    // Wrap-safe "reached": epochs count up from 0 and peers are at most one epoch apart here.
    while (static_cast<int32_t>(load_acquire_system(a.wait + t) - e) < 0) {
      if (a.timeout_ns > 0 && global_timer_ns() - start > static_cast<uint64_t>(a.timeout_ns)) {
        printf("mla dcp: rank %d timed out after %lld ns waiting for signal word %d to reach epoch %u (it is %u)\n",
               a.rank, static_cast<long long>(a.timeout_ns), t, e, load_acquire_system(a.wait + t));
        __trap();
      }
      __nanosleep(200);
    }
  }
  __syncthreads();
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

}  // namespace

void launch_signal_wait(const SignalArgs& args, cudaStream_t stream) {
  signal_wait_kernel<<<1, 32, 0, stream>>>(args);
  MLA_CUDA_CHECK_LAUNCH();
}

}  // namespace mla::dcp
