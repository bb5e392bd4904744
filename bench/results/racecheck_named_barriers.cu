// A race-free kernel that mirrors the ping-pong core's barrier pattern, for compute-sanitizer racecheck: two
// warpgroups each run their own named barrier (bar.sync 1 + wg, 128) a different number of times, then thread 0
// writes a shared word, __syncthreads(), and every thread reads it. Nothing races: __syncthreads() orders the write
// before every read. If racecheck still reports a RAW hazard here, its report on core_wgmma_pp_kernel<32, 3, 3>
// (row_sum written before (E2), read after it) is the tool's, not the kernel's (bench/results/core.md).
//   nvcc -arch=sm_90a -lineinfo -o racecheck_named_barriers racecheck_named_barriers.cu
//   compute-sanitizer --tool racecheck --racecheck-report hazard ./racecheck_named_barriers
#include <cstdio>

// vote: the named barrier as bar.red.or (the core's vote, named_barrier_or) instead of bar.sync.
__global__ void named_then_block_barrier(int wg0_rounds, int wg1_rounds, bool vote, int* out) {
  __shared__ float value[32];
  const int wg = threadIdx.x / 128;
  const int rounds = wg == 0 ? wg0_rounds : wg1_rounds;
  for (int r = 0; r < rounds; ++r) {
    if (vote) {
      int any;
      asm volatile(
          "{ .reg .pred p, q;\n setp.ne.u32 p, %3, 0;\n bar.red.or.pred q, %1, %2, p;\n selp.u32 %0, 1, 0, q; }"
          : "=r"(any)
          : "r"(1 + wg), "r"(128), "r"(threadIdx.x == 5 ? 1u : 0u)
          : "memory");
      if (!any) out[0] = 2;  // never: thread 5 votes yes
    } else {
      asm volatile("bar.sync %0, %1;" ::"r"(1 + wg), "r"(128) : "memory");
    }
  }
  for (int step = 0; step < 2; ++step) {  // two "segments", as the flat-merged kernel runs
    if (threadIdx.x < 32) value[threadIdx.x] = float(step + threadIdx.x);
    __syncthreads();
    const float v = value[threadIdx.x % 32];
    if (v < 0) out[0] = 1;  // never: keeps the read
    __syncthreads();
  }
}

int main() {
  int* out;
  cudaMalloc(&out, sizeof(int));
  const int cases[][2] = {{1, 1}, {3, 1}, {1, 3}};
  for (bool vote : {false, true}) {
    for (const auto& c : cases) {
      named_then_block_barrier<<<1, 256>>>(c[0], c[1], vote, out);
      const cudaError_t e = cudaDeviceSynchronize();
      std::printf("warpgroup named-barrier (%s) rounds %d / %d: %s\n", vote ? "bar.red.or" : "bar.sync", c[0], c[1],
                  cudaGetErrorString(e));
    }
  }
  return 0;
}
