// The value kernel: out[r, h*128 + c] = bf16((latent[r, h] . W_UV[h][:, c]) * sigmoid(gate[r, h*128 + c])).
// With kMergeDcp the latent is first merged from the D ranks' partials by LSE (ValueParams).
#pragma once

#include <cuda_bf16.h>

#include "common/lse_merge.cuh"
#include "common/timeline.cuh"
#include "value/config.h"
#include "value/params.h"

namespace mla::value {

// NOTE: callers load `packed` into a local first: a reference bound straight to a global uint4 let ptxas read it as
// four 32-bit loads (LDG.E) instead of one LDG.E.128 (cuobjdump -sass, 2026-12-06).
__device__ __forceinline__ void bf16x8_to_float(const uint4& packed, float (&out)[8]) {
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// The tokens of row's request (globally, under DCP), 0 for graph padding: a row is exactly zero where this is <= 0.
__device__ __forceinline__ int row_tokens(const ValueParams& p, int row) {
  const int request = row / p.q;
  if (request >= p.num_requests) return 0;
  return p.totals != nullptr ? p.totals[request] : p.lengths[request];
}
__device__ __forceinline__ bool is_zero_row(const ValueParams& p, int row) { return row_tokens(p, row) <= 0; }

// This thread's 8 latent elements [k_begin, k_begin + 8) of (row, head), merged in fp32 from the D
// partials: weights exp(lse_p - max) / sum, the same as exp(lse_p - lse). NOTE: a partial of weight exactly 0
// (an empty shard, lse_p = -inf) adds nothing, whatever it holds (a select, not a product); all empty
// (max = -inf) gives 0 without any exp(-inf - -inf); a NaN lse_p (a NaN logit on that shard) makes the row NaN.
// NOTE: every LSE is asked for at once, then the latents kMergeBatch partials at a time, all before the first is
// weighed: in runtime-length loops, with the latent's load behind the weight's test, ptxas put one round trip a
// partial in series (a peer GPU's memory under DCP), D of them after the PDL wait. The sums keep the partials' order.
__device__ __forceinline__ void merged_latent(const ValueParams& p, int row, int head, int k_begin,
                                              float (&latent)[kKPerThread]) {
  constexpr int kMergeBatch = 2;  // latents in flight: 4 registers each (4 of them spilled at the kernel's 128)
  static_assert(kMaxPartials % kMergeBatch == 0, "batches tile the partials");
#pragma unroll
  for (int i = 0; i < kKPerThread; ++i) latent[i] = 0.0f;
  const int64_t lse_index = static_cast<int64_t>(row) * p.stride_lse_row + head;
  float lse[kMaxPartials];
  float lse_max = -INFINITY;
#pragma unroll
  for (int r = 0; r < kMaxPartials; ++r) {
    lse[r] = r < p.num_partials ? p.partial_lse[r][lse_index] : -INFINITY;
    lse_max = max_keep_nan(lse_max, lse[r]);  // a NaN partial (a NaN logit on its shard) makes the row NaN
  }
  if (lse_max == -INFINITY) return;
  const int64_t latent_index = static_cast<int64_t>(row) * p.stride_latent_row + head * kKvLoraRank + k_begin;
  float weight_sum = 0.0f;
#pragma unroll
  for (int r0 = 0; r0 < kMaxPartials; r0 += kMergeBatch) {
    if (r0 >= p.num_partials) break;
    uint4 packed[kMergeBatch];
#pragma unroll
    for (int u = 0; u < kMergeBatch; ++u) {
      const int r = r0 + u;
      packed[u] = r < p.num_partials ? *reinterpret_cast<const uint4*>(p.partial_latent[r] + latent_index)
                                     : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kMergeBatch; ++u) {
      const float weight = expf(lse[r0 + u] - lse_max);  // -inf (empty, or past D): 0
      if (weight == 0.0f) continue;
      weight_sum += weight;
      float partial[kKPerThread];
      bf16x8_to_float(packed[u], partial);
#pragma unroll
      for (int i = 0; i < kKPerThread; ++i) latent[i] = fmaf(weight, partial[i], latent[i]);
    }
  }
  const float inv_sum = 1.0f / weight_sum;  // weight_sum >= 1: the largest partial has weight exp(0)
#pragma unroll
  for (int i = 0; i < kKPerThread; ++i) latent[i] *= inv_sum;
}

// kPackedSlice (ValueKernel::kCudaCorePacked): the W_UV slice stays packed bf16 in 32 registers and each k row is
// widened where it is used (80 registers a thread instead of 128), so that 3 CTAs fit an SM: H = 96's 384 one-row CTAs
// run in one wave instead of 1.45. It costs the widening in the row loop, so only the plan's one-row rule uses it.
// NOTE: the unpacked kernel's bound of 2 CTAs an SM keeps it at 128 registers: with a bound of 1 ptxas took 140, one
// CTA an SM, and the H = 64 one-row step measured 0.966x (2026-12-06 ~07:40 UTC).
template <bool kMergeDcp, bool kPackedSlice>
__global__ void __launch_bounds__(kThreads, kPackedSlice ? kPackedCtasPerSm : kUnpackedCtasPerSm)
    value_kernel(const __grid_constant__ ValueParams p) {
  // ---- 1. Grid mapping: CTA = (32-column slice, head, 16-row tile); thread = (column group, k slice).
  const int column_slice = blockIdx.x;
  const int head = blockIdx.y;
  const int row_begin = blockIdx.z * kRowsPerCta;
  const int row_end = min(p.rows, row_begin + kRowsPerCta);
  const int column_group = threadIdx.x % kColumnGroups;
  const int k_slice = threadIdx.x / kColumnGroups;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int k_begin = k_slice * kKPerThread;
  const int column_begin = column_slice * kColumnsPerCta + column_group * kColumnsPerThread;

  __shared__ SharedPlan smem;
  MLA_TIMELINE_MARK(p.timeline, kValueMarkStart);

  // ---- 2. This thread's 8 x 8 block of W_UV into registers. The weights do not depend on the
  // previous kernel, so this runs before the PDL wait, overlapping the producer's tail.
  // NOTE: plain loads, not __ldg: ptxas hoisted the wait (ACQBULK) above the ld.global.nc loads, to the
  // kernel's 7th SASS instruction, so the weights were fetched after it (cuobjdump -sass, 2026-12-05);
  // with plain loads all 8 are issued before it (tests/sass/kernel_sass.py fails if that changes).
  uint4 w_packed[kKPerThread];
  const __nv_bfloat16* w_head = p.w_uv + static_cast<int64_t>(head) * kKvLoraRank * kVHeadDim;
#pragma unroll
  for (int i = 0; i < kKPerThread; ++i) {
    w_packed[i] = *reinterpret_cast<const uint4*>(w_head + (k_begin + i) * kVHeadDim + column_begin);
  }
  float w[kPackedSlice ? 1 : kKPerThread][kColumnsPerThread];
  if constexpr (!kPackedSlice) {
#pragma unroll
    for (int i = 0; i < kKPerThread; ++i) bf16x8_to_float(w_packed[i], w[i]);
  }

  // ---- 3. Wait for the core's latent, or under DCP every rank's partials (and everything before).
  cudaGridDependencySynchronize();
  MLA_TIMELINE_MARK(p.timeline, kValueMarkWaited);

  // ---- 4. Passes of 4 rows: partial dot products, reduced over the warp's 8 k slices by shuffles and
  // over the 8 warps through shared memory.
  for (int pass_begin = row_begin; pass_begin < row_end; pass_begin += kRowsPerPass) {
    // The epilogue's inputs for this thread's (row, column) of step 5, asked for before the latent so that their round
    // trips overlap its loads instead of following the reduction: the gate logit and the row's token count.
    // NOTE: the count is compared only in the epilogue. Compared here (is_zero_row), ptxas waited for its load right
    // there, before issuing the latent's: two round trips in series after the PDL wait (cuobjdump -sass, 2026-12-06).
    const int epilogue_row = pass_begin + static_cast<int>(threadIdx.x) / kColumnsPerCta;
    const int out_column = head * kVHeadDim + column_slice * kColumnsPerCta + threadIdx.x % kColumnsPerCta;
    const bool stores = threadIdx.x < kRowsPerPass * kColumnsPerCta && epilogue_row < row_end;
    int tokens = 0;
    __nv_bfloat16 gate_bf16 = __float2bfloat16_rn(0.0f);
    if (stores) {
      tokens = row_tokens(p, epilogue_row);
      gate_bf16 = p.projected[epilogue_row * p.stride_projected_row + kProjectedGateOffset + out_column];
    }

    // Every row's latent slice is asked for before the first row's products: one round trip for the pass, where a
    // load in front of each row's products put the rows' round trips in series. Not in the packed-slice kernel (one
    // row by plan): within its 80 registers the four slices spilled.
    constexpr bool kLatentAhead = !kMergeDcp && !kPackedSlice;
    uint4 latent_packed[kLatentAhead ? kRowsPerPass : 1];
    if constexpr (kLatentAhead) {
#pragma unroll
      for (int rr = 0; rr < kRowsPerPass; ++rr) {
        const int row = pass_begin + rr;
        if (row < row_end) {
          latent_packed[rr] = *reinterpret_cast<const uint4*>(p.latent + row * p.stride_latent_row +
                                                              head * kKvLoraRank + k_begin);
        }
      }
    }
    float acc[kRowsPerPass][kColumnsPerThread] = {};
#pragma unroll
    for (int rr = 0; rr < kRowsPerPass; ++rr) {
      const int row = pass_begin + rr;
      if (row >= row_end) continue;
      float latent[kKPerThread];
      if constexpr (kMergeDcp) {
        merged_latent(p, row, head, k_begin, latent);
      } else if constexpr (kLatentAhead) {
        bf16x8_to_float(latent_packed[rr], latent);
      } else {
        const uint4 packed = *reinterpret_cast<const uint4*>(p.latent + row * p.stride_latent_row +
                                                             head * kKvLoraRank + k_begin);
        bf16x8_to_float(packed, latent);
      }
#pragma unroll
      for (int i = 0; i < kKPerThread; ++i) {
        const float* w_row = w[kPackedSlice ? 0 : i];
        if constexpr (kPackedSlice) bf16x8_to_float(w_packed[i], w[0]);
#pragma unroll
        for (int c = 0; c < kColumnsPerThread; ++c) acc[rr][c] = fmaf(latent[i], w_row[c], acc[rr][c]);
      }
    }
    // Lanes 4 apart hold the same columns for neighbouring k slices.
#pragma unroll
    for (int rr = 0; rr < kRowsPerPass; ++rr) {
#pragma unroll
      for (int c = 0; c < kColumnsPerThread; ++c) {
#pragma unroll
        for (int offset = kColumnGroups; offset < 32; offset *= 2) {
          acc[rr][c] += __shfl_xor_sync(0xffffffffu, acc[rr][c], offset);
        }
        if (lane < kColumnGroups) smem.partial[rr][warp][column_group * kColumnsPerThread + c] = acc[rr][c];
      }
    }
    __syncthreads();

    // ---- 5. Epilogue: one thread per (row, column): sum the warps, gate, store (64 B per warp).
    if (stores) {
      const int rr = threadIdx.x / kColumnsPerCta;
      const int column = threadIdx.x % kColumnsPerCta;
      float result = 0.0f;
      if (tokens > 0) {
        float v = 0.0f;
#pragma unroll
        for (int w_idx = 0; w_idx < kWarps; ++w_idx) v += smem.partial[rr][w_idx][column];
        result = v / (1.0f + expf(-__bfloat162float(gate_bf16)));
      }
      p.out[static_cast<int64_t>(epilogue_row) * p.num_heads * kVHeadDim + out_column] = __float2bfloat16_rn(result);
    }
    __syncthreads();
  }

  // ---- 6. Only after this CTA's last store may the next kernel start reading.
  MLA_TIMELINE_MARK(p.timeline, kValueMarkEnd);
  cudaTriggerProgrammaticLaunchCompletion();
}

}  // namespace mla::value
