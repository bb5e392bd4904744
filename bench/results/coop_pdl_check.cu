// Does a cooperative launch (every CTA resident at once, or no launch) combine with programmatic dependent launch and
// with CUDA graph capture? src/core/README.md next step 13(a) needs both for a grid-wide merge inside the split
// kernel. A chain of kernels, each launched by cudaLaunchKernelEx with cudaLaunchAttributeCooperative and
// cudaLaunchAttributeProgrammaticStreamSerialization, waits for its predecessor (griddepcontrol.wait), passes a
// sense-reversing grid barrier (atomic count + generation flag) and checks that every CTA arrived; run directly and
// through a captured graph, then once with more CTAs than fit (must fail to launch, not hang). The graph chains are
// timed with and without the barrier and the cooperative attribute, at the grid that fits and at 2 x SMs CTAs.
// Run 2026-12-08 ~01:32 UTC in its first form (the barrier at the full grid only; bench/results/core.md).
//   nvcc -arch=sm_90a -o coop_pdl_check coop_pdl_check.cu && ./coop_pdl_check
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

struct Barrier {
  unsigned count;       // arrivals of the current generation
  unsigned generation;  // bumped by the last arrival: the number of barriers passed
  unsigned arrived;     // every arrival ever (never reset)
  unsigned errors;      // CTAs that passed a barrier before the whole grid had arrived at it
  unsigned passes;      // grid barriers passed (counted by CTA 0)
};

// barrier = false: the same launch without the grid barrier (what the barrier costs is the difference).
__global__ void grid_barrier_kernel(Barrier* b, bool barrier) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (barrier && threadIdx.x == 0) {
    const unsigned gen = *reinterpret_cast<volatile unsigned*>(&b->generation);
    atomicAdd(&b->arrived, 1u);
    __threadfence();
    if (atomicAdd(&b->count, 1u) == gridDim.x - 1) {
      b->count = 0;
      __threadfence();
      atomicAdd(&b->generation, 1u);
    } else {
      while (*reinterpret_cast<volatile unsigned*>(&b->generation) == gen) __nanosleep(32);
    }
    __threadfence();
    // Every launch has the same grid, and generation gen + 1 means gen + 1 barriers passed: all their arrivals are in.
    if (*reinterpret_cast<volatile unsigned*>(&b->arrived) < (gen + 1) * gridDim.x) atomicAdd(&b->errors, 1u);
    if (blockIdx.x == 0) atomicAdd(&b->passes, 1u);
  }
  __syncthreads();
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

cudaError_t launch(int ctas, Barrier* b, cudaStream_t stream, bool cooperative, bool barrier) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(256);
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeCooperative;
  attributes[0].val.cooperative = cooperative ? 1 : 0;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attributes;
  config.numAttrs = 2;
  return cudaLaunchKernelEx(&config, grid_barrier_kernel, b, barrier);
}

int main() {
  int sms = 0, per_sm = 0, coop = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, 0));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, grid_barrier_kernel, 256, 0));
  const int fit = sms * per_sm;
  std::printf("SMs %d, CTAs an SM %d, cooperative launch supported %d\n", sms, per_sm, coop);
  Barrier* b;
  CHECK(cudaMalloc(&b, sizeof(Barrier)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  constexpr int kChain = 50;
  CHECK(cudaMemset(b, 0, sizeof(Barrier)));
  for (int i = 0; i < kChain; ++i) CHECK(launch(fit, b, stream, true, true));
  CHECK(cudaStreamSynchronize(stream));
  Barrier h;
  CHECK(cudaMemcpy(&h, b, sizeof h, cudaMemcpyDeviceToHost));
  std::printf("direct: %d PDL-chained cooperative launches of %d CTAs: passes %u, errors %u\n", kChain, fit, h.passes,
              h.errors);

  // The chain captured in a graph: with and without the cooperative attribute and the barrier, at the grid that fits
  // and at the split kernel's 2 x SMs (the barrier holds without the attribute here, where nothing else runs: the
  // launch overhead is what differs).
  for (const int ctas : {fit, 2 * sms}) {
    for (const bool barrier : {true, false}) {
      for (const bool cooperative : {true, false}) {
        CHECK(cudaMemset(b, 0, sizeof(Barrier)));
        cudaGraph_t graph;
        CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < kChain; ++i) CHECK(launch(ctas, b, stream, cooperative, barrier));
        CHECK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec;
        CHECK(cudaGraphInstantiate(&exec, graph, 0));
        cudaEvent_t start, stop;
        CHECK(cudaEventCreate(&start));
        CHECK(cudaEventCreate(&stop));
        CHECK(cudaGraphLaunch(exec, stream));  // warm-up
        CHECK(cudaEventRecord(start, stream));
        for (int r = 0; r < 10; ++r) CHECK(cudaGraphLaunch(exec, stream));
        CHECK(cudaEventRecord(stop, stream));
        CHECK(cudaStreamSynchronize(stream));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        CHECK(cudaMemcpy(&h, b, sizeof h, cudaMemcpyDeviceToHost));
        std::printf("graph, %4d CTAs, %-15s, %-10s: %.2f us a launch; passes %u (expect %d), errors %u\n", ctas,
                    cooperative ? "cooperative" : "not cooperative", barrier ? "barrier" : "no barrier",
                    ms * 1e3 / (10 * kChain), h.passes, barrier ? kChain * 11 : 0, h.errors);
        CHECK(cudaGraphExecDestroy(exec));
        CHECK(cudaGraphDestroy(graph));
      }
    }
  }

  const cudaError_t too_many = launch(fit + 1, b, stream, true, true);
  std::printf("%d CTAs (one more than fit): %s\n", fit + 1, cudaGetErrorString(too_many));
  (void)cudaGetLastError();
  CHECK(cudaStreamSynchronize(stream));
  return 0;
}
