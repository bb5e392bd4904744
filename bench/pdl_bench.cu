// What a kernel boundary costs under programmatic dependent launch, and what the trigger's place
// changes: chains of identical kernels (132 CTAs x 256 threads, or clusters of 2 / 8) that each wait
// for their predecessor (griddepcontrol.wait) and then spin for a fixed time, timed like every other
// benchmark (CUDA events over graph replays of 20 launches, median). Per-launch µs minus the spin is
// the boundary's cost. Variants: no PDL; PDL with the trigger after the work (the rule every
// kernel here follows today); PDL with the trigger at the kernel's start (the dependent grid is
// launched while this one runs and waits in griddepcontrol.wait, which still waits for this whole
// grid to finish and flush).
//
//   pdl_bench            the table
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/cuda_check.h"
#include "device_timing.h"

namespace {

enum class Trigger { kNone, kAtEnd, kAtStart };

// Spins for `spin_ns` (globaltimer) after the wait; thread 0 of CTA 0 bumps a counter so the work is
// observable.
__global__ void chain_kernel(int trigger, uint64_t spin_ns, unsigned* counter) {
  if (trigger == int(Trigger::kAtStart)) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < spin_ns);
  if (threadIdx.x == 0 && blockIdx.x == 0) atomicAdd(counter, 1u);
  if (trigger == int(Trigger::kAtEnd)) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

double time_chain(cudaStream_t stream, Trigger trigger, int cluster, uint64_t spin_ns, unsigned* counter,
                  int ctas) {
  return mla::timing::time_graph_us(stream, [&](int) {
    cudaLaunchAttribute attrs[2];
    int n = 0;
    if (trigger != Trigger::kNone) {
      attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attrs[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    if (cluster > 1) {
      attrs[n].id = cudaLaunchAttributeClusterDimension;
      attrs[n].val.clusterDim.x = unsigned(cluster);
      attrs[n].val.clusterDim.y = 1;
      attrs[n].val.clusterDim.z = 1;
      ++n;
    }
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(unsigned(ctas));
    config.blockDim = dim3(256);
    config.stream = stream;
    config.attrs = attrs;
    config.numAttrs = n;
    MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, chain_kernel, int(trigger), spin_ns, counter));
  });
}

}  // namespace

int main() {
  try {
    cudaDeviceProp prop;
    MLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t stream;
    MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    unsigned* counter = nullptr;
    MLA_CUDA_CHECK(cudaMalloc(&counter, sizeof(unsigned)));
    const int ctas = prop.multiProcessorCount / 8 * 8;  // a multiple of every cluster size below
    std::printf("device %s, %d SMs; chains of %d-CTA kernels, 20 launches per graph, median of 30 replays\n\n",
                prop.name, prop.multiProcessorCount, ctas);
    std::printf("| cluster | spin µs | no PDL µs | PDL, trigger at end µs | PDL, trigger at start µs |\n");
    std::printf("|---|---|---|---|---|\n");
    for (int cluster : {1, 2, 8}) {
      for (uint64_t spin_ns : {uint64_t{0}, uint64_t{2000}, uint64_t{10000}}) {
        const double none = time_chain(stream, Trigger::kNone, cluster, spin_ns, counter, ctas);
        const double end = time_chain(stream, Trigger::kAtEnd, cluster, spin_ns, counter, ctas);
        const double start = time_chain(stream, Trigger::kAtStart, cluster, spin_ns, counter, ctas);
        std::printf("| %d | %.1f | %.2f | %.2f | %.2f |\n", cluster, spin_ns / 1e3, none, end, start);
        std::fflush(stdout);
      }
    }
    MLA_CUDA_CHECK(cudaFree(counter));
    MLA_CUDA_CHECK(cudaStreamDestroy(stream));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pdl_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
