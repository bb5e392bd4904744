// The FP8 attention core, ping-pong wgmma version (sm_90a), DESIGN.md §4.
//
// Grid: x = N-tile of the request (kTileN rows of the folded (q row, head) M side), y and z = the split and the
// request (flat slots: y = the CTA, z = 1). Block: two warpgroups that take the split's pages in turns, not in
// lockstep phases. Warpgroup w owns the pages k with k % 2 == w: it computes their S^T = K·Q^T over the whole
// 576-long reduction (swap AB, f16 wgmma m64nNk16, A = K from registers: wgmma.cuh, so each K byte is
// converted once) and their softmax for all kTileN rows, and publishes P^T;
// both warpgroups run O^T += V^T·P^T of every page for their own 256 latent dims (A = V^T from registers,
// each V byte converted once). Per own page k, in this order:
//   1. S^T(k) = K(k)·Q^T                      (while the other warpgroup runs its P·V and softmax)
//   2. O^T += V^T(k - 1)·P^T(k - 1)           (the other warpgroup's page: waits for its P^T)
//   3. softmax(k) against the running max after page k - 1, P^T(k) into this warpgroup's P^T buffer
//   4. O^T += V^T(k)·P^T(k)
// so the tensor pipe runs one warpgroup's Q·K^T while the other does its softmax, and there is no CTA
// barrier in the page loop: the handover is one mbarrier per P^T buffer (p_full), the running max lives
// in shared memory (m_cur) and is raised lazily as in version 1 (a vote of the owner's 128 threads).
// NOTE: why no "P^T empty" barrier: buffer w is rewritten for page k + 2 only after its owner waited
// for page k + 1's P^T, which the other warpgroup publishes after its P·V of page k. Likewise the page
// ring needs no "empty" barrier: each warpgroup refills only the column blocks its own P·V read
// (copy_page_part_async), and its P·V of a page follows the owner's Q·K^T of it.
#pragma once

#include <type_traits>

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/config.h"
#include "core/kernel.cuh"
#include "core/wgmma.cuh"
#include "core/params.h"

namespace mla::core {
namespace wgmma_pp_detail {

// A named barrier of `threads` threads that also returns whether any of them passed `value`.
__device__ __forceinline__ bool named_barrier_or(uint32_t id, uint32_t threads, bool value) {
  uint32_t any;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 q, %1, 0;\nbar.red.or.pred p, %2, %3, q;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(value)), "r"(id), "r"(threads)
      : "memory");
  return any != 0;
}

// Named barriers (0 is __syncthreads): warpgroup w's vote, its row max exchange and its page refill.
__device__ __forceinline__ uint32_t vote_barrier(int wg) { return 1 + wg; }
__device__ __forceinline__ uint32_t row_barrier(int wg) { return 3 + wg; }
__device__ __forceinline__ uint32_t refill_barrier(int wg) { return 5 + wg; }

}  // namespace wgmma_pp_detail

// kTileN: rows of the N-tile (16, 32, 48, 64). kStages: page ring depth. kSlots: the CTA slots' deal (config.h):
// uniform as core_split_kernel's, or flat, where a CTA's pages may span several requests and it runs
// one segment (query tile, softmax state, partial) per request, its ring and P^T buffers counting pages across them.
template <int kTileN, int kStages, int kSlots>
__global__ void __launch_bounds__(kWgThreads, 1) core_wgmma_pp_kernel(const __grid_constant__ CoreParams p) {
  using namespace detail;
  using namespace wgmma_detail;
  using namespace wgmma_pp_detail;
  using Smem = WgmmaPpSharedMemoryPlan<kTileN, kStages>;
  constexpr int kGroups = kTileN / 8;  // n8 groups of an m64 x kTileN accumulator
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_raw);
  // NOTE: the swizzle atoms assume a 1024-byte aligned base (the dynamic window starts after the 1 KB reserved
  // block on sm_90); a misaligned base would compute garbage, so it traps instead.
  if ((smem_addr(smem_raw) & 1023u) != 0) __trap();

  // ---- Phase 0: grid mapping ---------------------------------------------------------------------
  const int tile = blockIdx.x;
  const int rows_m = p.q * p.num_heads;
  const int tile_row0 = tile * kTileN;

  MLA_TIMELINE_MARK(p.timeline, kCoreMarkStart);
  // ---- Phase 1: metadata (host-written: read before the PDL wait) ------------------------------
  CtaSplit segment;  // which pages of which request (the first of the CTA's segments under flat slots)
  FlatCursor cursor;
  if (!first_segment<kSlots>(p, rows_m, cursor, segment)) {
    write_empty_request_tile<kSlots, kWgThreads, kTileN>(p, rows_m, tile);
    for (int mark = kCoreMarkWaited; mark < kNumCoreMarks; ++mark) MLA_TIMELINE_MARK(p.timeline, mark);
    return;
  }

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&smem.full[s], kWgThreads);
    for (int b = 0; b < 2; ++b) mbar_init(&smem.p_full[b], 128);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (threadIdx.x < kTileN) smem.m_cur[threadIdx.x] = -INFINITY;
  __syncthreads();

  griddep_wait();  // PDL: the query and this step's cache rows come from the query kernel
  MLA_TIMELINE_MARK(p.timeline, kCoreMarkWaited);

  // The CTA's pages before this segment: page k of a segment is the CTA's page g0 + k, whose parity picks the
  // warpgroup that owns it and its P^T buffer, and which sets the ring slot and the mbarrier phases.
  int g0 = 0;
  for (;;) {
  const auto [request, entry0, partial_row0, length, total, page_begin, my_pages, writes_nothing, pages] = segment;
  record_request_slots<kSlots>(p, cursor, segment);
  // Accumulator fragments (m64nN, fp32): warp wi of a warpgroup holds M rows 16·wi + g and
  // 16·wi + g + 8, N columns 8j + 2c and 8j + 2c + 1 (registers 4j + {0, 1} and 4j + {2, 3}).
  // NOTE: opaque per segment under flat slots, so that ptxas derives the per-thread addressing (page copies, K and V
  // fragments) inside each segment instead of hoisting it across them, where it spilled (64-row tiles: 88 B of stack).
  const uint32_t tid = is_flat(kSlots) ? opaque(threadIdx.x) : threadIdx.x;
  const int wg = tid / 128;
  const int wt = tid % 128;  // thread within the warpgroup
  const int wi = wt / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int c = lane % 4;
  const int64_t bound_min = causal_bound(p, total, tile_row0);  // the tile's smallest causal bound
  // A later segment's running max starts afresh (after the previous segment's (E2): its LSE stores read m_cur).
  if (g0 != 0 && threadIdx.x < kTileN) smem.m_cur[threadIdx.x] = -INFINITY;

  // Warpgroup w copies its part of page k (copy_page_part_async: w = 0 column blocks 0-3 and 8, w = 1 blocks
  // 4-7) into the page's ring slot.
  auto issue_own_part = [&](int k) {
    const int stage = (g0 + k) % kStages;
    if (wg == 0) {
      copy_page_part_async<0>(p, pages, page_begin + k, length, smem.kv[stage], &smem.full[stage], wt);
    } else {
      copy_page_part_async<1>(p, pages, page_begin + k, length, smem.kv[stage], &smem.full[stage], wt);
    }
  };
  // ---- Phase 2: the query tile as f16 into shared memory (rows past rows_m zero) -------------------
  // NOTE: the tile before the ring's first copies: asked for after them, its loads waited behind every CTA's page burst
  // (core_bench --timeline, H100 2026-12-06: 2.8-9.0 µs from the PDL wait to the tile at 48 / 64 rows, 5.4-6.1 after).
  load_query_tile<kTileN, kWgThreads>(smem.q, p, entry0, tile_row0, rows_m);
  for (int k = 0; k < min(kStages, my_pages); ++k) issue_own_part(k);
  fence_proxy_async();  // the query tile is read by wgmma (the async proxy)
  __syncthreads();
  if (g0 == 0) MLA_TIMELINE_MARK(p.timeline, kCoreMarkQuery);

  const KLaneOffsets k_off = k_lane_offsets(wi, lane);  // ldmatrix.x4 addresses of K
  const uint32_t q_addr = smem_addr(&smem.q[0][0][0]);
  const VtLaneOffsets v_off = vt_lane_offsets(wg, wi, g, c);  // V^T fragments of this warpgroup's dims
  const int token_a = 16 * wi + g;  // this thread's two tokens of a page (accumulator M rows)
  const int token_b = token_a + 8;
  const float scale_log2 = p.softmax_scale_log2;
  float o[4][kGroups * 4];  // O^T: [m64 dim tile][fragment]: dims 256·wg + 4·(16·wi + 8h + g) + tile
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int e = 0; e < kGroups * 4; ++e) o[mt][e] = 0.0f;
  // This thread's share (its two tokens of each own page) of the softmax sums of rows 8j + 2c + e, against
  // the running max of the last page whose P·V this warpgroup ran.
  float l_run[kGroups][2];
#pragma unroll
  for (int j = 0; j < kGroups; ++j) l_run[j][0] = l_run[j][1] = 0.0f;

  // O^T += V^T·P^T of page k (P^T buffer k % 2, from warpgroup k % 2): waits for its P^T; rescales O^T (and,
  // for the other warpgroup's pages, l_run: an own page's softmax rescaled it) when the page raised a max;
  // then refills this warpgroup's part of the page's ring slot with page k + kStages.
  auto pv_page = [&](int k) {
    const int stage = (g0 + k) % kStages;
    const int buf = (g0 + k) % 2;
    mbar_wait(&smem.full[stage], ((g0 + k) / kStages) & 1);  // this warpgroup's copies of the page are visible
    if (g0 + k == 0) MLA_TIMELINE_MARK(p.timeline, kCoreMarkFirstPage);  // thread 0: warpgroup 0, page 0
    mbar_wait(&smem.p_full[buf], ((g0 + k) / 2) & 1);
    if (smem.raised[buf] != 0) {
      rescale_rows<kTileN>(o, smem.alpha[buf], c);
      if (buf != wg) {
#pragma unroll
        for (int j = 0; j < kGroups; ++j) {
          const float2 alpha = *reinterpret_cast<const float2*>(&smem.alpha[buf][8 * j + 2 * c]);
          l_run[j][0] *= alpha.x;
          l_run[j][1] *= alpha.y;
        }
      }
    }
    fence_accumulators<kTileN>(o);
    const uint32_t p_addr = smem_addr(&smem.p[buf][0][0]);
#pragma unroll
    for (int kk = 0; kk < kPageSize / 16; ++kk) {
      issue_pv_step<kTileN>(o, smem.kv[stage], v_off, p_addr, kk);
      // NOTE: one group per k16 step, at most two in flight: the A registers of a group stay live until it
      // completes, and four steps' worth (64) beside O^T (128 at 64 rows) make ptxas serialize every wgmma.
      wgmma_commit();
      wgmma_wait<1>();
    }
    // NOTE: waited in the page's own step (P·V in flight across the loop's back edge serializes every wgmma:
    // ptxas C7515, as the loop-skipped path defines the accumulators).
    wgmma_wait<0>();
    fence_accumulators<kTileN>(o);
    // Refill this warpgroup's part of the slot only once all four of its warps have read their V fragments of the
    // page: a named barrier of the warpgroup. Its wgmma completing orders nothing between one warp's shared loads and
    // another warp's copies (each warp's MMAs may complete on its own sub-partition), and after wgmma_wait<1> not even
    // this warp's fourth k16 step was known read.
    if (k + kStages < my_pages) {
      named_barrier_sync(refill_barrier(wg), 128);
      issue_own_part(k + kStages);
    }
  };

  // ---- Phase 3: the page loop: this warpgroup's own pages k (g0 + k = wg, wg + 2, ...) -------------------
  for (int k = (wg + g0) & 1; k < my_pages; k += 2) {
    const int stage = (g0 + k) % kStages;
    const int buf = wg;  // == (g0 + k) % 2
    mbar_wait(&smem.full[stage], ((g0 + k) / kStages) & 1);
    // 1. S^T = K·Q^T over all 36 k16 steps: one commit group per two 32-byte half blocks (four k16 steps), at most
    // two groups in flight.
    float s[kTileN / 2];  // rows 16wi + g (+ 8) = tokens, columns 8j + 2c (+ 1) = tile rows
#pragma unroll
    for (int e = 0; e < kTileN / 2; ++e) {
      s[e] = 0.0f;
      fence_operand(s[e]);
    }
    {
      // NOTE: opaque per page, or the compiler hoists the 64-bit descriptors out of the loop (registers).
      const uint64_t desc_q = gmma_desc(opaque(q_addr), 8 * kSw128Halves * 2, kSwizzle128);
#pragma unroll
      for (int hb = 0; hb < 2 * kKeyBlocks; hb += 2) {
        issue_qk_half_block<kTileN>(s, smem.kv[stage], k_off, desc_q, hb);
        issue_qk_half_block<kTileN>(s, smem.kv[stage], k_off, desc_q, hb + 1);
        wgmma_commit();
        wgmma_wait<1>();
      }
      wgmma_wait<0>();
#pragma unroll
      for (int e = 0; e < kTileN / 2; ++e) fence_operand(s[e]);
    }

    // 2. The other warpgroup's previous page: its P^T also carries the running max this page's softmax needs.
    if (k >= 1) pv_page(k - 1);

    // 3. Base-2 logits, masked only on pages reaching past a causal bound or the length; the softmax against
    // the running max after page k - 1 (m_cur, read before the vote: the exact path rewrites it after).
    const int64_t page_token0 = int64_t{page_begin + k} * kPageSize;
    const bool full_page = page_token0 + kPageSize <= length &&
                           global_position(page_token0 + kPageSize - 1, p) <= bound_min;
#pragma unroll
    for (int e = 0; e < kTileN / 2; ++e) s[e] *= scale_log2;
    if (!full_page) {
      mask_page_logits<kGroups>(s, p, page_token0, token_a, token_b, length, total, tile_row0, c, rows_m);
    }
    float m_old[kGroups][2];
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const float2 m = *reinterpret_cast<const float2*>(&smem.m_cur[8 * j + 2 * c]);
      m_old[j][0] = m.x;
      m_old[j][1] = m.y;
    }
    uint8_t* p_tile = reinterpret_cast<uint8_t*>(&smem.p[buf][0][0]);
    auto store_p = [&](int n, float pa, float pb) {  // row n of the tile, this thread's two tokens
      uint8_t* row = p_tile + n * (kPageSize * 2);
      *reinterpret_cast<__half*>(row + (((token_a >> 3) ^ (n & 7)) << 4) + (token_a & 7) * 2) = __float2half_rn(pa);
      *reinterpret_cast<__half*>(row + (((token_b >> 3) ^ (n & 7)) << 4) + (token_b & 7) * 2) = __float2half_rn(pb);
    };
    // P^T against the running max; only when a logit passes it by more than kLazyMaxSlack (a vote of the
    // warpgroup's 128 threads, before any exponential) is the max raised exactly (version 1, kernel.cuh 3c).
    bool raise = false;
#pragma unroll
    for (int j = 0; j < kGroups; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) raise |= fmaxf(s[4 * j + e], s[4 * j + 2 + e]) > m_old[j][e] + kLazyMaxSlack;
    const bool raised = named_barrier_or(vote_barrier(wg), 128, raise);
    if (!raised) {
#pragma unroll
      for (int j = 0; j < kGroups; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // NOTE: a row with nothing visible yet keeps m = -inf and subtracts 0 (never inf - inf).
          const float m_use = m_old[j][e] == -INFINITY ? 0.0f : m_old[j][e];
          const float pa = ex2_ftz(s[4 * j + e] - m_use);
          const float pb = ex2_ftz(s[4 * j + 2 + e] - m_use);
          l_run[j][e] += pa + pb;
          store_p(8 * j + 2 * c + e, pa, pb);
        }
    } else {
      // Page row max: the thread's two tokens, the 8 lanes g of the quad column, the 4 warps.
      publish_page_row_max<kGroups>(s, smem.red[wg], wi, g, c);
      named_barrier_sync(row_barrier(wg), 128);
#pragma unroll
      for (int j = 0; j < kGroups; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = 8 * j + 2 * c + e;
          const float m_new = fmaxf(m_old[j][e], page_row_max(smem.red[wg], n));
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;
          const float alpha = ex2_ftz(m_old[j][e] - m_use);
          const float pa = ex2_ftz(s[4 * j + e] - m_use);
          const float pb = ex2_ftz(s[4 * j + 2 + e] - m_use);
          l_run[j][e] = l_run[j][e] * alpha + (pa + pb);
          store_p(n, pa, pb);
          if (wi == 0 && g == 0) {
            smem.alpha[buf][n] = alpha;
            smem.m_cur[n] = m_new;
          }
        }
    }
    if (wt == 0) smem.raised[buf] = raised ? 1u : 0u;
    // NaN bytes out of the V rows of tokens some row cannot see (zero_hidden_v_nans): every warp of this warpgroup was
    // done with the page's K at the vote; both warpgroups read its V after p_full.
    if (!full_page && page_hides_tokens(p, page_token0, length, bound_min)) {
      zero_hidden_v_nans(p, page_token0, length, bound_min, wt, 128, [&](int row, int i) {
        return reinterpret_cast<uint4*>(smem.kv[stage] + (i / 4) * kPageBlockBytes + row * kSw64Bytes) + i % 4;
      });
    }
    fence_proxy_async();  // P^T is read by both warpgroups' wgmma (the async proxy)
    mbar_arrive(&smem.p_full[buf]);

    // 4. This page's P·V (waits for the rest of the warpgroup's P^T).
    pv_page(k);
  }
  // The segment's last page, if the other warpgroup owns it (also a one-page segment's only page for its non-owner).
  if (my_pages >= 1 && (g0 + my_pages - 1) % 2 != wg) pv_page(my_pages - 1);

  MLA_TIMELINE_MARK(p.timeline, kCoreMarkPages);  // each segment's: the last one stays
  // ---- Phase 4: the softmax sums (lanes g, the 4 warps, both warpgroups) and the LSE --------------------
  publish_row_sums<kGroups>(l_run, smem.sum_red[wg], wi, g, c);
  __syncthreads();  // (E1) both warpgroups' sums and the final running max are in shared memory
  const bool direct = writes_directly<kSlots>(p, page_begin, my_pages, length);
  if (threadIdx.x < kTileN) {
    const int n = threadIdx.x;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < 2; ++w)
#pragma unroll
      for (int i = 0; i < 4; ++i) sum += smem.sum_red[w][i][n];
    smem.row_sum[n] = sum;
    const int row = tile_row0 + n;
    if (row < rows_m) store_row_lse(p, direct, entry0, partial_row0, row, smem.m_cur[n], sum);
  }
  __syncthreads();  // (E2) the row sums are in shared memory

  // ---- Phase 5: stores ---------------------------------------------------------------------------
  store_ot<kTileN>(p, o, smem.row_sum, wg, wi, g, c, tile_row0, rows_m, entry0, partial_row0, direct);
  if constexpr (kSlots == kSlotsFlatMerged) {  // red: free once the segment's pages are done
    merge_if_last_segment<kWgThreads, kTileN, 8>(p, cursor, segment, tile, rows_m, &smem.red[0][0][0]);
  }

  g0 += my_pages;
  if (!next_segment<kSlots>(p, rows_m, cursor, segment)) break;
  }  // segments
  write_empty_request_tile<kSlots, kWgThreads, kTileN>(p, rows_m, tile);
  MLA_TIMELINE_MARK(p.timeline, kCoreMarkEnd);
  griddep_launch_dependents();  // PDL: this CTA's last store is done
}

}  // namespace mla::core
