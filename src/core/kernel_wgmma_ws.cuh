// The FP8 attention core, warp-specialized wgmma version (sm_90a), DESIGN.md §4.
//
// Grid as the wgmma kernel (x = N-tile, y and z = split and request); block: three warpgroups with their own
// roles, so that the phases of one page overlap those of the next instead of running in lockstep:
//   - the score warpgroup (0, kWsScoreRegisters registers): per page, waits for it, computes
//     S^T = K·Q^T over the whole 576-long reduction for all kTileN rows (f16 wgmma m64nNk16, A = K from
//     registers: ldmatrix of the FP8 page converted e4m3 -> f16, B = the f16 query tile), the online
//     softmax with the lazily raised max of version 1 (one named-barrier vote among its 128 threads a
//     page; the row max exchange only when a max is raised), and writes P^T (fp16), the rows' rescale
//     factors and the "raised" flag into a ring of kWsPBuffers shared tiles;
//   - the value warpgroups (1 and 2, kWsValueRegisters registers): per page, wait for its P^T, rescale
//     O^T when a max was raised, O^T += V^T·P^T for latent dims [256(w - 1), +256) (m64nNk16 f16,
//     A = V^T from registers as in the wgmma kernel), then refill the page's ring slot with page
//     it + kStages: warpgroup 1 copies column blocks 0-3 and 8, warpgroup 2 blocks 4-7. NOTE: the value
//     warpgroups are a page's last readers (the score warpgroup's Q·K^T of the page precedes its P^T), so
//     no "page empty" barrier is needed, and each refills only blocks it read itself.
// Each K byte is converted once (score warpgroup), each V byte once (its value warpgroup): the same
// conversions as the wgmma kernel, without its partial swap and its two CTA barriers a page. The tensor
// pipe runs P·V of page i while the score warpgroup does the softmax of page i + 1.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/config.h"
#include "core/kernel.cuh"
#include "core/kernel_wgmma.cuh"
#include "core/params.h"

namespace mla::core {
namespace wgmma_ws_detail {

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

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

// Named barriers (0 is __syncthreads).
inline constexpr uint32_t kScoreVoteBarrier = 1;  // the score warpgroup's per-page vote
inline constexpr uint32_t kScoreRowBarrier = 2;   // its row max / final sum exchange

}  // namespace wgmma_ws_detail

// kTileN: rows of the N-tile (16, 32, 48, 64). kStages: page ring depth. kBalancedSlots: as core_split_kernel's.
template <int kTileN, int kStages, bool kBalancedSlots>
__global__ void __launch_bounds__(kWsThreads, 1) core_wgmma_ws_kernel(const __grid_constant__ CoreParams p) {
  using namespace detail;
  using namespace wgmma_detail;
  using namespace wgmma_ws_detail;
  using Smem = WgmmaWsSharedMemoryPlan<kTileN, kStages>;
  constexpr int kGroups = kTileN / 8;  // n8 groups of an m64 x kTileN accumulator
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_raw);
  // NOTE: the swizzle atoms assume a 1024-byte aligned base (see the wgmma kernel).
  if ((smem_addr(smem_raw) & 1023u) != 0) __trap();

  // ---- Phase 0: grid mapping ---------------------------------------------------------------------
  // Accumulator fragments (m64nN, fp32): warp wi of a warpgroup holds M rows 16·wi + g and
  // 16·wi + g + 8, N columns 8j + 2c and 8j + 2c + 1 (registers 4j + {0, 1} and 4j + {2, 3}).
  const int wg = threadIdx.x / 128;
  const int wt = threadIdx.x % 128;  // thread within the warpgroup
  const int wi = wt / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int c = lane % 4;
  const int tile = blockIdx.x;
  const int rows_m = p.q * p.num_heads;
  const int tile_row0 = tile * kTileN;

  // ---- Phase 1: metadata (host-written: read before the PDL wait) ------------------------------
  const auto [request, entry0, partial_row0, length, total, page_begin, my_pages, writes_nothing, pages] =
      cta_split<kBalancedSlots>(p, rows_m);  // which split of which request
  if (writes_nothing) return;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&smem.full[s], 256);
    for (int b = 0; b < kWsPBuffers; ++b) {
      mbar_init(&smem.p_full[b], 128);
      mbar_init(&smem.p_empty[b], 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  griddep_wait();  // PDL: the query and this step's cache rows come from the query kernel

  // Value warpgroup v = wg - 1 copies its part of page k (copy_page_part_async: v = 0 column blocks 0-3 and 8,
  // v = 1 blocks 4-7) into its ring slot.
  auto issue_own_blocks = [&](auto v_constant, int k) {
    const int stage = k % kStages;
    copy_page_part_async<decltype(v_constant)::value>(p, pages, page_begin + k, length, smem.kv[stage],
                                                      &smem.full[stage], wt);
  };
  if (wg == 1) {
    for (int k = 0; k < min(kStages, my_pages); ++k) issue_own_blocks(std::integral_constant<int, 0>{}, k);
  } else if (wg == 2) {
    for (int k = 0; k < min(kStages, my_pages); ++k) issue_own_blocks(std::integral_constant<int, 1>{}, k);
  }

  // ---- Phase 2: the query tile as f16 into shared memory (rows past rows_m zero) -------------------
  load_query_tile<kTileN, kWsThreads>(smem.q, p, entry0, tile_row0, rows_m);
  fence_proxy_async();  // the query tile is read by wgmma (the async proxy)
  __syncthreads();

  const int token_a = 16 * wi + g;  // this thread's two tokens of a page (accumulator M rows)
  const int token_b = token_a + 8;
  const bool direct = p.num_splits == 1;

  if (wg == 0) {
    // ==== Score warpgroup ==============================================================================
    setmaxnreg_dec<kWsScoreRegisters>();
    const KLaneOffsets k_off = k_lane_offsets(wi, lane);  // ldmatrix.x4 addresses of K
    const uint32_t q_addr = smem_addr(&smem.q[0][0][0]);
    const int64_t bound_min = total - p.q + tile_row0 / p.num_heads;  // the tile's smallest causal bound
    const float scale_log2 = p.softmax_scale_log2;
    float m_run[kGroups][2];  // running max (base-2 logits) of rows 8j + 2c + e
    float l_run[kGroups][2];  // this thread's share (its two tokens per page) of the softmax sums
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      m_run[j][0] = m_run[j][1] = -INFINITY;
      l_run[j][0] = l_run[j][1] = 0.0f;
    }
    for (int it = 0; it < my_pages; ++it) {
      const int stage = it % kStages;
      const int buf = it % kWsPBuffers;
      mbar_wait(&smem.full[stage], (it / kStages) & 1);

      // S^T = K·Q^T over all 36 k16 steps: one commit group per 32-byte half block, at most two in flight.
      float s[kTileN / 2];
#pragma unroll
      for (int e = 0; e < kTileN / 2; ++e) {
        s[e] = 0.0f;
        fence_operand(s[e]);
      }
      {
        // NOTE: opaque per page, or the compiler hoists the 64-bit descriptors out of the loop (registers).
        const uint64_t desc_q = gmma_desc(opaque(q_addr), 8 * kSw128Halves * 2, kSwizzle128);
#pragma unroll
        for (int hb = 0; hb < 2 * kKeyBlocks; ++hb) {
          issue_qk_half_block<kTileN>(s, smem.kv[stage], k_off, desc_q, hb);
          wgmma_commit();
          wgmma_wait<1>();
        }
        wgmma_wait<0>();
#pragma unroll
        for (int e = 0; e < kTileN / 2; ++e) fence_operand(s[e]);
      }

      // Base-2 logits, masked only on pages reaching past a causal bound or the length.
      const int64_t page_token0 = int64_t{page_begin + it} * kPageSize;
      const bool full_page = page_token0 + kPageSize <= length &&
                             global_position(page_token0 + kPageSize - 1, p) <= bound_min;
#pragma unroll
      for (int e = 0; e < kTileN / 2; ++e) s[e] *= scale_log2;
      if (!full_page) {
        mask_page_logits<kGroups>(s, p, page_token0, token_a, token_b, length, total, tile_row0, c, rows_m);
      }

      // The P^T buffer must be free: the value warpgroups finished the page kWsPBuffers before.
      if (it >= kWsPBuffers) mbar_wait(&smem.p_empty[buf], ((it / kWsPBuffers) - 1) & 1);
      uint8_t* p_tile = reinterpret_cast<uint8_t*>(&smem.p[buf][0][0]);
      auto store_p = [&](int n, float pa, float pb) {  // row n of the tile, this thread's two tokens
        uint8_t* row = p_tile + n * (kPageSize * 2);
        *reinterpret_cast<__half*>(row + (((token_a >> 3) ^ (n & 7)) << 4) + (token_a & 7) * 2) = __float2half_rn(pa);
        *reinterpret_cast<__half*>(row + (((token_b >> 3) ^ (n & 7)) << 4) + (token_b & 7) * 2) = __float2half_rn(pb);
      };
      // P^T against the running max; only when a logit passes it by more than kLazyMaxSlack (a vote of
      // the 128 threads, taken before any exponential) is the max raised exactly (as in version 1,
      // kernel.cuh 3c). NOTE: voting first keeps no per-page sums beside l_run (registers at 64 rows).
      bool raise = false;
#pragma unroll
      for (int j = 0; j < kGroups; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) raise |= fmaxf(s[4 * j + e], s[4 * j + 2 + e]) > m_run[j][e] + kLazyMaxSlack;
      const bool raised = named_barrier_or(kScoreVoteBarrier, 128, raise);
      if (!raised) {
#pragma unroll
        for (int j = 0; j < kGroups; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            // NOTE: a row with nothing visible yet keeps m = -inf and subtracts 0 (never inf - inf).
            const float m_use = m_run[j][e] == -INFINITY ? 0.0f : m_run[j][e];
            const float pa = ex2_ftz(s[4 * j + e] - m_use);
            const float pb = ex2_ftz(s[4 * j + 2 + e] - m_use);
            l_run[j][e] += pa + pb;
            store_p(8 * j + 2 * c + e, pa, pb);
          }
      } else {
        // Page row max: the thread's two tokens, the 8 lanes g of the quad column, the 4 warps.
#pragma unroll
        for (int j = 0; j < kGroups; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float mx = fmaxf(s[4 * j + e], s[4 * j + 2 + e]);
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            if (g == 0) smem.red[wi][8 * j + 2 * c + e] = mx;
          }
        named_barrier_sync(kScoreRowBarrier, 128);
#pragma unroll
        for (int j = 0; j < kGroups; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int n = 8 * j + 2 * c + e;
            const float page_max = fmaxf(fmaxf(smem.red[0][n], smem.red[1][n]), fmaxf(smem.red[2][n], smem.red[3][n]));
            const float m_new = fmaxf(m_run[j][e], page_max);
            const float m_use = m_new == -INFINITY ? 0.0f : m_new;
            const float alpha = ex2_ftz(m_run[j][e] - m_use);
            m_run[j][e] = m_new;
            const float pa = ex2_ftz(s[4 * j + e] - m_use);
            const float pb = ex2_ftz(s[4 * j + 2 + e] - m_use);
            l_run[j][e] = l_run[j][e] * alpha + (pa + pb);
            store_p(n, pa, pb);
            if (wi == 0 && g == 0) smem.alpha[buf][n] = alpha;
          }
      }
      if (wt == 0) smem.raised[buf] = raised ? 1u : 0u;
      fence_proxy_async();  // P^T is read by the value warpgroups' wgmma (the async proxy)
      mbar_arrive(&smem.p_full[buf]);
    }

    // Final sums over the tokens (lanes g, then the 4 warps), the LSE, the sums for the value warpgroups.
    finish_row_sums<kGroups>(p, l_run, m_run, smem.sum_red, smem.row_sum, kScoreRowBarrier, wi, g, c, 0, tile_row0,
                             rows_m, entry0, partial_row0);
    __syncthreads();  // (E) the sums are in shared memory
  } else {
    // ==== Value warpgroups =============================================================================
    setmaxnreg_inc<kWsValueRegisters>();
    const int v = wg - 1;  // latent dims [256v, 256v + 256)
    float o[4][kGroups * 4];  // O^T: [m64 dim tile][fragment]: dims 256·v + 4·(16·wi + 8h + g) + tile
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int e = 0; e < kGroups * 4; ++e) o[mt][e] = 0.0f;
    const VtLaneOffsets v_off = vt_lane_offsets(v, wi, g, c);  // V^T fragments of this warpgroup's dims
    auto value_loop = [&](auto v_constant) {
      for (int it = 0; it < my_pages; ++it) {
        const int stage = it % kStages;
        const int buf = it % kWsPBuffers;
        mbar_wait(&smem.full[stage], (it / kStages) & 1);  // the other value threads' copies are visible
        mbar_wait(&smem.p_full[buf], (it / kWsPBuffers) & 1);
        if (smem.raised[buf] != 0) rescale_rows<kTileN>(o, smem.alpha[buf], c);
        fence_accumulators<kTileN>(o);
        const uint32_t p_addr = smem_addr(&smem.p[buf][0][0]);
#pragma unroll
        for (int kk = 0; kk < kPageSize / 16; ++kk) {
          issue_pv_step<kTileN>(o, smem.kv[stage], v_off, p_addr, kk);
          // NOTE: one group per k16 step, at most two in flight: the A registers of a group stay live
          // until it completes, and four steps' worth (64) beside O^T (128 at 64 rows) exceed the
          // warpgroup's budget (ptxas C7511 serializes every wgmma).
          wgmma_commit();
          wgmma_wait<1>();
        }
        // The page's V bytes are in registers (converted): refill its slot while the MMAs run.
        if (it + kStages < my_pages) issue_own_blocks(v_constant, it + kStages);
        // NOTE: waited in the page's own iteration (P·V in flight across the back edge serializes every
        // wgmma: ptxas C7515, see the wgmma kernel).
        wgmma_wait<0>();
        fence_accumulators<kTileN>(o);
        mbar_arrive(&smem.p_empty[buf]);
      }
    };
    if (v == 0) {
      value_loop(std::integral_constant<int, 0>{});
    } else {
      value_loop(std::integral_constant<int, 1>{});
    }
    __syncthreads();  // (E) the score warpgroup's sums are in shared memory

    store_ot<kTileN>(p, o, smem.row_sum, v, wi, g, c, tile_row0, rows_m, entry0, partial_row0, direct);
  }
  griddep_launch_dependents();  // PDL: this CTA's last store is done
}

}  // namespace mla::core
