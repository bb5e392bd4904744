// The FP8 attention core, split-KV decode kernel (DESIGN.md §4), sm_90a, mma.sync f16 tensor cores
// over the FP8 operands converted exactly to f16.
//
// Grid: x = M-tile of the request (16 rows of the folded (q row, head) M side; fastest so that the
// M-tiles of one request read the same pages from L2 at about the same time), y = split, z = request.
// Block: 8 warps. Per page of 64 tokens:
//   1. wait for the page's mbarrier (the page was copied kStages-1 pages ahead by every thread's
//      16-byte cp.async into 592-byte shared rows);
//   2. S = Q·K^T: warp w computes 16 rows x its 8 tokens (m16n8k16 f16, fp32 accumulate, two
//      accumulator chains), Q from an f16 tile in shared memory, K converted e4m3 -> f16 per page;
//   3. online softmax in base 2: page row max across the 8 warps through shared memory, then
//      p = exp2(s·scale·log2e − m) as fp16 into the shared P tile (sums kept in fp32);
//   4. O += P·V in fp16 (m16n8k16, fp32 accumulate): warp w computes 16 rows x its 64 latent dims
//      over all 64 tokens; V fragments come from 32-bit shared loads of the FP8 bytes, byte-permuted
//      and converted e4m3 -> f16x2 (exact). NOTE: FP8 P would halve the P·V MMAs but costs ~3 % relative
//      error on zero-mean latents (e4m3 keeps 3 mantissa bits of each weight); fp16 P costs ~3e-4.
// The end writes bf16 latent + LSE (one split) or fp32 partials for the combine kernel.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/config.h"
#include "core/params.h"

namespace mla::core {
namespace detail {

// ---- PTX wrappers ----------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// 1-D bulk copy global -> shared completing on an mbarrier (the copy engine; no tensor map needed).
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// 16-byte async copy global -> shared; src_bytes = 0 writes 16 zero bytes (tail rows of a page).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}

// The mbarrier receives one arrival from this thread once all its prior cp.async have landed.
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(ptr)));
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

// Two floats -> two e4m3 bytes (lo in byte 0), round to nearest even, saturating.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

// The two e4m3 values of the low 16 bits as f16x2 (exact: f16 holds every e4m3 value).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(pair)));
  return h2;
}

// D = A·B + D, m16n8k16, A/B f16, fp32 accumulate.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// A CTA's pages of its request: whole pages, pages_per_split = ceil(pages / num_splits) (the
// reference's rule). Reads host-written metadata only (lengths, totals), so it runs before the PDL wait.
struct SplitPages {
  int length = 0;      // the request's (local) length; 0 for padded requests
  int64_t total = 0;   // its global length (DCP), = length without DCP
  int page_begin = 0;  // first page of this split
  int num_pages = 0;   // pages of this split (0 for an empty split)
};
__device__ __forceinline__ SplitPages split_pages(const CoreParams& p, int request, int split) {
  SplitPages s;
  if (request < p.num_requests) {
    s.length = p.lengths[request];
    s.total = p.totals != nullptr ? p.totals[request] : s.length;
  }
  const int pages = (s.length + kPageSize - 1) / kPageSize;
  const int pages_per_split = (pages + p.num_splits - 1) / p.num_splits;
  s.page_begin = min(split * pages_per_split, pages);
  s.num_pages = min(s.page_begin + pages_per_split, pages) - s.page_begin;
  return s;
}

// The 16 e4m3 bytes of one k16 step of the query as f16, in the permuted k order both kernels use:
// lo = logical k 0..7 (k 2c + e holds byte 4c + e: the low halves of the 4 words), hi = k 8..15
// (k 8 + 2c + e holds byte 4c + 2 + e). e4m3 -> f16 is exact.
__device__ __forceinline__ void e4m3x16_to_f16_permuted(const uint4& v, uint4& lo, uint4& hi) {
  lo = make_uint4(e4m3x2_to_f16x2(v.x), e4m3x2_to_f16x2(v.y), e4m3x2_to_f16x2(v.z), e4m3x2_to_f16x2(v.w));
  hi = make_uint4(e4m3x2_to_f16x2(v.x >> 16), e4m3x2_to_f16x2(v.y >> 16), e4m3x2_to_f16x2(v.z >> 16),
                  e4m3x2_to_f16x2(v.w >> 16));
}

// Page `page` of a request (block-table row `pages`, `length` tokens) as 2304 16-byte cp.async by
// kThreads threads, consecutive threads on consecutive chunks of a row: chunk `chunk` of row r lands at
// dst(r, chunk). Rows past the length are zero-filled (src size 0), never read: the cache may hold
// anything there (NaN bytes included) and p = 0 times NaN would poison the accumulators.
template <int kThreads, class Dst>
__device__ __forceinline__ void copy_page_async(const CoreParams& p, const int32_t* pages, int page, int length,
                                                Dst dst) {
  const int valid = static_cast<int>(min(int64_t{kPageSize}, length - int64_t{page} * kPageSize));
  const uint8_t* src = p.cache + int64_t{pages[page]} * p.stride_cache_page;
  constexpr int kChunksPerRow = kKeyDim / 16;  // 36
  static_assert(kPageSize * kChunksPerRow % kThreads == 0, "whole cp.async chunks per thread");
#pragma unroll
  for (int i = 0; i < kPageSize * kChunksPerRow / kThreads; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int r = idx / kChunksPerRow;
    const int chunk = idx % kChunksPerRow;
    cp_async_16(dst(r, chunk), src + r * kKeyDim + chunk * 16, r < valid ? 16u : 0u);
  }
}

// Global position of local token j (DESIGN.md §4, DCP).
__device__ __forceinline__ int64_t global_position(int64_t j, const CoreParams& p) {
  if (p.dcp_size == 1) return j;
  return ((j / p.dcp_interleave) * p.dcp_size + p.dcp_rank) * p.dcp_interleave + j % p.dcp_interleave;
}

}  // namespace detail

// kStages: page ring depth (2: two CTAs per SM; 3, 4: one).
template <int kStages, int kMinBlocksPerSm>
__global__ void __launch_bounds__(kNumThreads, kMinBlocksPerSm)
    core_split_kernel(const __grid_constant__ CoreParams p) {
  using namespace detail;
  using Smem = SharedMemoryPlan<kStages>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_raw);

  // ---- Phase 0: grid mapping ---------------------------------------------------------------------
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;  // fragment row group
  const int c = lane % 4;  // fragment column group
  const int m_tile = blockIdx.x;
  const int split = blockIdx.y;
  const int request = blockIdx.z;
  const int rows_m = p.q * p.num_heads;                     // M rows of one request
  const int64_t num_entries = int64_t{gridDim.z} * rows_m;  // rows * heads
  const int64_t entry0 = int64_t{request} * rows_m;         // (b*q + i)*H + h = entry0 + mi
  const int row0 = m_tile * kBlockM + g;                    // this thread's two M rows
  const int row1 = row0 + 8;

  // ---- Phase 1: metadata (host-written, not produced upstream: read before the PDL wait) -------
  const SplitPages range = split_pages(p, request, split);
  const int length = range.length;
  const int64_t total = range.total;
  const int page_begin = range.page_begin;
  const int my_pages = range.num_pages;
  const int32_t* pages = p.block_table + int64_t{request} * p.stride_block_table;
  // Causal bounds of this thread's rows: visible iff global(j) <= total - q + i.
  const int64_t bound0 = total - p.q + min(row0, rows_m - 1) / p.num_heads;
  const int64_t bound1 = total - p.q + min(row1, rows_m - 1) / p.num_heads;
  const int64_t bound_min = total - p.q + (m_tile * kBlockM) / p.num_heads;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&smem.full[s], kNumThreads);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  // PDL: the query and this step's cache rows come from the query kernel.
  griddep_wait();

  // Producer (every thread): page `k` of this split into its stage (9 16-byte cp.async per thread),
  // then one arrival per thread on the stage's mbarrier. NOTE: the first version issued 64 row-wise
  // cp.async.bulk copies per page from warp 0; measured 39-42 % of copy bandwidth at 128x4k x16 whatever
  // the warp count (4 or 8) or ring depth, and 1 CTA/SM ran 1.5x slower than 2. This spread issue gave
  // 48 % and 1 CTA/SM ~ 2 CTAs/SM.
  auto issue_page = [&](int k) {
    const int stage = k % kStages;
    copy_page_async<kNumThreads>(p, pages, page_begin + k, length,
                                 [&](int r, int chunk) { return &smem.kv[stage][r][16 * chunk]; });
    cp_async_mbar_arrive(&smem.full[stage]);
  };
  for (int k = 0; k < min(kStages, my_pages); ++k) issue_page(k);

  // ---- Phase 2: the query tile as f16 into shared memory (rows past rows_m zero) -------------------
  // One thread per (row r, 16-byte group G) = one k16 step of 3a, its k order permuted to match the
  // K fragments there (e4m3x16_to_f16_permuted; one permutation on both operands leaves the dot
  // product unchanged).
  for (int idx = threadIdx.x; idx < kBlockM * (kKeyDim / 16); idx += kNumThreads) {
    const int r = idx / (kKeyDim / 16);
    const int group = idx % (kKeyDim / 16);
    const int row = m_tile * kBlockM + r;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (row < rows_m) v = __ldg(reinterpret_cast<const uint4*>(p.query + (entry0 + row) * kKeyDim + group * 16));
    uint4 lo, hi;
    e4m3x16_to_f16_permuted(v, lo, hi);
    *reinterpret_cast<uint4*>(&smem.q[r][16 * group]) = lo;
    *reinterpret_cast<uint4*>(&smem.q[r][16 * group + 8]) = hi;
  }
  __syncthreads();
  // Q·K^T roles (3a): tokens [16 token_group, +16) of each page, k16 steps [18 k_half, +18).
  const int token_group = warp % kQkTokenGroups;
  const int k_half = warp / kQkTokenGroups;
  // ldmatrix.x4 lane address of the query tile (A of m16n8k16): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15),
  // at the warp's first k16 step.
  const __half* q_lane =
      &smem.q[(lane % 8) + 8 * ((lane / 8) % 2)][8 * (lane / 16)] + 16 * kQkStepsPerWarp * k_half;
  // ... and of K in a page: matrices (tokens 0-7 | 8-15 of the group) x (16-byte group s | s + 1).
  const int k_lane_offset = (kQkTokensPerWarp * token_group + lane % 8 + 8 * (lane / 16)) * kKvRowBytes +
                            16 * (kQkStepsPerWarp * k_half + (lane / 8) % 2);

  float acc[kDimsPerWarp / 32][4][4];  // [32-dim chunk][n8 tile][fragment]: 64 fp32 registers
#pragma unroll
  for (int ch = 0; ch < kDimsPerWarp / 32; ++ch)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[ch][j][e] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running row max of base-2 logits (rows g, g+8)
  float l_run[2] = {0.0f, 0.0f};            // this thread's share of the softmax sums
  const float scale_log2 = p.softmax_scale_log2;

  // ---- Phase 3: the page loop ------------------------------------------------------------------
  for (int it = 0; it < my_pages; ++it) {
    const int stage = it % kStages;
    mbar_wait(&smem.full[stage], (it / kStages) & 1);
    const uint8_t* kv = &smem.kv[stage][0][0];

    // 3a. S = Q·K^T for this warp's 16 tokens (two n8 tiles) over its half of the 36 k16 steps: f16
    // mma.sync m16n8k16 (fp32 accumulate, exact products), one accumulator chain per tile. B = K: one
    // ldmatrix.x4 gives (tile 0, step s), (tile 0, s + 1), (tile 1, s), (tile 1, s + 1); each FP8
    // register (bytes 4c.. of token g of 16-byte group s) gives b0 (its low half: k 2c, 2c + 1) and b1
    // (its high half: k 2c + 8, 2c + 9), the order the query tile was permuted to. A = the query
    // fragment of step s, read once for both tiles.
    // NOTE: not FP8 mma.sync m16n8k32: sm_90 has no native FP8 mma.sync; ptxas emulates it by
    // converting both operands to f16 on every instruction (the query fragments once per page).
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // [n8 tile][fragment]
#pragma unroll
    for (int pair = 0; pair < kQkStepsPerWarp / 2; ++pair) {
      uint32_t b[4];
      ldmatrix_x4(b, kv + k_lane_offset + 32 * pair);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        uint32_t a[4];
        ldmatrix_x4(a, q_lane + 16 * (2 * pair + e));
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) {
          const uint32_t r = b[2 * tile + e];
          mma_f16(s[tile], a, e4m3x2_to_f16x2(r), e4m3x2_to_f16x2(r >> 16));
        }
      }
    }
    // The second k half hands its partial sums to the first (lane-contiguous float4s: conflict-free).
    if (k_half == 1) {
      smem.s_part[token_group][0][lane] = make_float4(s[0][0], s[0][1], s[0][2], s[0][3]);
      smem.s_part[token_group][1][lane] = make_float4(s[1][0], s[1][1], s[1][2], s[1][3]);
    }
    __syncthreads();  // (A0) partial sums visible; every warp is done with the previous page

    // The previous page's stage is free now: refill it kStages - 1 pages ahead.
    if (it >= 1 && it - 1 + kStages < my_pages) issue_page(it - 1 + kStages);

    // 3b. (first k half) Add the partials, scale to base-2 logits, mask (only pages that reach past a
    // causal bound or the length), page row max over the group's 16 tokens.
    const int64_t page_token0 = int64_t{page_begin + it} * kPageSize;
    if (k_half == 0) {
      const bool full_page = page_token0 + kPageSize <= length &&
                             global_position(page_token0 + kPageSize - 1, p) <= bound_min;
#pragma unroll
      for (int tile = 0; tile < 2; ++tile) {
        const float4 other = smem.s_part[token_group][tile][lane];
        s[tile][0] += other.x;
        s[tile][1] += other.y;
        s[tile][2] += other.z;
        s[tile][3] += other.w;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x0 = s[tile][e] * scale_log2;
          float x1 = s[tile][2 + e] * scale_log2;
          if (!full_page) {
            const int64_t j = page_token0 + kQkTokensPerWarp * token_group + 8 * tile + 2 * c + e;
            const int64_t gpos = global_position(j, p);
            const bool in_range = j < length;
            if (!in_range || gpos > bound0) x0 = -INFINITY;
            if (!in_range || gpos > bound1) x1 = -INFINITY;
          }
          s[tile][e] = x0;
          s[tile][2 + e] = x1;
        }
      }
      float mx0 = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
      float mx1 = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
      }
      if (c == 0) {
        smem.row_max[token_group][g] = mx0;
        smem.row_max[token_group][g + 8] = mx1;
      }
    }
    __syncthreads();  // (A) row maxima visible

    // 3c. Online softmax (every warp: the row max and the rescale of its accumulators; the first k
    // half: P = exp2(x - m) in fp16 for its 16 tokens, and the softmax sums).
    float page_max0 = smem.row_max[0][g], page_max1 = smem.row_max[0][g + 8];
#pragma unroll
    for (int w = 1; w < kQkTokenGroups; ++w) {
      page_max0 = fmaxf(page_max0, smem.row_max[w][g]);
      page_max1 = fmaxf(page_max1, smem.row_max[w][g + 8]);
    }
    const float m_new0 = fmaxf(m_run[0], page_max0);
    const float m_new1 = fmaxf(m_run[1], page_max1);
    // NOTE: a row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
    const float m_use0 = m_new0 == -INFINITY ? 0.0f : m_new0;
    const float m_use1 = m_new1 == -INFINITY ? 0.0f : m_new1;
    const float alpha0 = exp2f(m_run[0] - m_use0);
    const float alpha1 = exp2f(m_run[1] - m_use1);
    m_run[0] = m_new0;
    m_run[1] = m_new1;
    if (k_half == 0) {
      float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
      for (int tile = 0; tile < 2; ++tile) {
        const float p00 = exp2f(s[tile][0] - m_use0), p01 = exp2f(s[tile][1] - m_use0);
        const float p10 = exp2f(s[tile][2] - m_use1), p11 = exp2f(s[tile][3] - m_use1);
        sum0 += p00 + p01;
        sum1 += p10 + p11;
        // P[row][token] in fp16; this tile's tokens are columns [16 group + 8 tile, +8).
        const int p_col = kQkTokensPerWarp * token_group + 8 * tile + 2 * c;
        *reinterpret_cast<uint32_t*>(&smem.p[g][p_col]) = half2_bits(p00, p01);
        *reinterpret_cast<uint32_t*>(&smem.p[g + 8][p_col]) = half2_bits(p10, p11);
      }
      l_run[0] = l_run[0] * alpha0 + sum0;
      l_run[1] = l_run[1] * alpha1 + sum1;
    }
#pragma unroll
    for (int ch = 0; ch < kDimsPerWarp / 32; ++ch)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[ch][j][0] *= alpha0;
        acc[ch][j][1] *= alpha0;
        acc[ch][j][2] *= alpha1;
        acc[ch][j][3] *= alpha1;
      }
    __syncthreads();  // (B) P complete

    // 3d. O += P·V over the page's 64 tokens (4 k16 steps) for this warp's 128 dims.
#pragma unroll
    for (int kk = 0; kk < kPageSize / 16; ++kk) {
      uint32_t a[4];
      a[0] = *reinterpret_cast<const uint32_t*>(&smem.p[g][16 * kk + 2 * c]);
      a[1] = *reinterpret_cast<const uint32_t*>(&smem.p[g + 8][16 * kk + 2 * c]);
      a[2] = *reinterpret_cast<const uint32_t*>(&smem.p[g][16 * kk + 8 + 2 * c]);
      a[3] = *reinterpret_cast<const uint32_t*>(&smem.p[g + 8][16 * kk + 8 + 2 * c]);
#pragma unroll
      for (int ch = 0; ch < kDimsPerWarp / 32; ++ch) {
        // NOTE: B of n8 tile j takes dim 4n + j of the 32-dim chunk at column n, so that one 32-bit
        // load per token row (dims 4g..4g+3) feeds four tiles, and the thread ends up holding the
        // 8 contiguous dims 8c..8c+7 of the output. Rows 2c + const sit 8 banks apart (592-B rows).
        const uint8_t* v = kv + (16 * kk + 2 * c) * kKvRowBytes + warp * kDimsPerWarp + ch * 32 + 4 * g;
        const uint32_t w0 = *reinterpret_cast<const uint32_t*>(v);                    // token 2c
        const uint32_t w1 = *reinterpret_cast<const uint32_t*>(v + kKvRowBytes);      // token 2c + 1
        const uint32_t w2 = *reinterpret_cast<const uint32_t*>(v + 8 * kKvRowBytes);  // token 2c + 8
        const uint32_t w3 = *reinterpret_cast<const uint32_t*>(v + 9 * kKvRowBytes);  // token 2c + 9
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t selector = j | ((4 + j) << 4);  // bytes j of the two words, low one first
          const uint32_t b0 = e4m3x2_to_f16x2(prmt(w0, w1, selector));
          const uint32_t b1 = e4m3x2_to_f16x2(prmt(w2, w3, selector));
          mma_f16(acc[ch][j], a, b0, b1);
        }
      }
    }
  }

  // ---- Phase 4: finalize: softmax sums across the quad and the warps -----------------------------
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_run[0] += __shfl_xor_sync(0xffffffffu, l_run[0], off);
    l_run[1] += __shfl_xor_sync(0xffffffffu, l_run[1], off);
  }
  if (k_half == 0 && c == 0) {  // the second k half holds no sums
    smem.row_sum[token_group][g] = l_run[0];
    smem.row_sum[token_group][g + 8] = l_run[1];
  }
  __syncthreads();
  float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
  for (int w = 0; w < kQkTokenGroups; ++w) {
    sum0 += smem.row_sum[w][g];
    sum1 += smem.row_sum[w][g + 8];
  }
  // Nothing visible: sum 0 -> latent 0, lse -inf (never NaN).
  const float inv0 = sum0 > 0.0f ? 1.0f / sum0 : 0.0f;
  const float inv1 = sum1 > 0.0f ? 1.0f / sum1 : 0.0f;
  constexpr float kLn2 = 0.69314718055994531f;
  const float lse0 = sum0 > 0.0f ? (m_run[0] + log2f(sum0)) * kLn2 : -INFINITY;
  const float lse1 = sum1 > 0.0f ? (m_run[1] + log2f(sum1)) * kLn2 : -INFINITY;

  // ---- Phase 5: stores: thread holds dims chunk*32 + 8c + [0, 8) of rows g, g+8 ---------------------
  const bool direct = p.num_splits == 1;
  const float out_scale0 = direct ? inv0 * p.k_scale : inv0;
  const float out_scale1 = direct ? inv1 * p.k_scale : inv1;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = half == 0 ? row0 : row1;
    if (row >= rows_m) continue;
    const float scale = half == 0 ? out_scale0 : out_scale1;
    const int64_t entry = entry0 + row;
#pragma unroll
    for (int ch = 0; ch < kDimsPerWarp / 32; ++ch) {
      float v[8];
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int j = 0; j < 4; ++j) v[4 * e + j] = acc[ch][j][2 * half + e] * scale;
      const int dim = warp * kDimsPerWarp + ch * 32 + 8 * c;
      if (direct) {
        uint4 packed;
        __nv_bfloat162 b01 = __floats2bfloat162_rn(v[0], v[1]);
        __nv_bfloat162 b23 = __floats2bfloat162_rn(v[2], v[3]);
        __nv_bfloat162 b45 = __floats2bfloat162_rn(v[4], v[5]);
        __nv_bfloat162 b67 = __floats2bfloat162_rn(v[6], v[7]);
        packed.x = *reinterpret_cast<uint32_t*>(&b01);
        packed.y = *reinterpret_cast<uint32_t*>(&b23);
        packed.z = *reinterpret_cast<uint32_t*>(&b45);
        packed.w = *reinterpret_cast<uint32_t*>(&b67);
        *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.latent) + entry * kKvLoraRank + dim) = packed;
      } else {
        float* dst = p.partial_latent + (int64_t{split} * num_entries + entry) * kKvLoraRank + dim;
        *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(v[4], v[5], v[6], v[7]);
      }
    }
    if (warp == 0 && c == 0) {
      const float lse = half == 0 ? lse0 : lse1;
      if (direct) {
        p.lse[entry] = lse;
      } else {
        p.partial_lse[int64_t{split} * num_entries + entry] = lse;
      }
    }
  }
  // PDL: this CTA's last store is done; the combine (or the value stage) may start launching.
  griddep_launch_dependents();
}

// ---- Combine: merge the splits' partials by LSE (DESIGN.md §4, split-KV) -------------------------
// Grid: x = entry (row, head), y = 128-dim chunk. Block: kCombineWarps warps; warp w takes splits
// w, w + kCombineWarps, ...; lane holds 4 dims. An empty split (lse = -inf) weighs exactly 0.
__global__ void __launch_bounds__(kCombineWarps * 32) core_combine_kernel(const __grid_constant__ CombineParams p) {
  __shared__ float4 partial_sums[kCombineWarps][32];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t entry = blockIdx.x;
  const int dim = blockIdx.y * kCombineDims + lane * 4;

  detail::griddep_wait();  // the partials come from the split kernel

  // Phase 1: max and sum of exp over the splits' LSEs (every warp redundantly: no block barrier).
  float max_lse = -INFINITY;
  for (int s = lane; s < p.num_splits; s += 32) max_lse = fmaxf(max_lse, p.partial_lse[s * p.num_entries + entry]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, off));
  const float base = max_lse == -INFINITY ? 0.0f : max_lse;
  float sum = 0.0f;
  for (int s = lane; s < p.num_splits; s += 32) sum += __expf(p.partial_lse[s * p.num_entries + entry] - base);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);

  // Phase 2: this warp's splits, weighted.
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = warp; s < p.num_splits; s += kCombineWarps) {
    const float weight = __expf(p.partial_lse[s * p.num_entries + entry] - base);  // -inf -> 0
    const float4 v = *reinterpret_cast<const float4*>(p.partial_latent + (s * p.num_entries + entry) * kKvLoraRank + dim);
    acc.x += weight * v.x;
    acc.y += weight * v.y;
    acc.z += weight * v.z;
    acc.w += weight * v.w;
  }
  partial_sums[warp][lane] = acc;
  __syncthreads();

  // Phase 3: reduce across warps, scale, store.
  if (warp == 0) {
    float4 total = partial_sums[0][lane];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) {
      const float4 v = partial_sums[w][lane];
      total.x += v.x;
      total.y += v.y;
      total.z += v.z;
      total.w += v.w;
    }
    const float scale = sum > 0.0f ? p.k_scale / sum : 0.0f;
    __nv_bfloat162 lo = __floats2bfloat162_rn(total.x * scale, total.y * scale);
    __nv_bfloat162 hi = __floats2bfloat162_rn(total.z * scale, total.w * scale);
    uint2 packed;
    packed.x = *reinterpret_cast<uint32_t*>(&lo);
    packed.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.latent) + entry * kKvLoraRank + dim) = packed;
    if (blockIdx.y == 0 && lane == 0) p.lse[entry] = sum > 0.0f ? base + logf(sum) : -INFINITY;
  }
  detail::griddep_launch_dependents();
}

}  // namespace mla::core
