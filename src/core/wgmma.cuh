// wgmma helpers of the FP8 attention core (sm_90a Hopper warpgroup MMAs), DESIGN.md §4: the PTX wrappers, operand
// fragments, layouts and epilogue stores that the ping-pong kernel (kernel_wgmma_pp.cuh) is built from. The lockstep
// two-warpgroup kernel that first used them was removed on 2026-12-06 (never planned; src/core/README.md).
//
// "Swap AB": the 64 tokens of a page are the wgmma M side and the attention rows (kTileN of a request's folded
// (q row, head) M side) the N side, so H·q = 16 runs an m64n16 tile without padding.
//   - Pages: 16-byte cp.async of the FP8 rows into a 64-byte-swizzle layout [column block 9][token 64][64 B], which
//     keeps the ldmatrix of K and the V loads conflict-free (copy_page_part_async).
//   - S^T = K·Q^T: f16 wgmma m64nNk16 (fp32 accumulate: exact products), A = K from registers (ldmatrix of the FP8
//     page, converted e4m3 -> f16), B = Q^T from the f16 query tile in shared memory (converted once per CTA:
//     load_query_tile). NOTE: not FP8: FP8 wgmma accumulates with ~14 bits and missed the LSE bound, and FP8
//     mma.sync is emulated on sm_90 by converting its operands to f16 on every instruction.
//   - O^T += V^T·P^T: m64nNk16 f16, A = V^T from registers (32-bit shared loads of the FP8 bytes, byte-permuted and
//     converted e4m3 -> f16x2, exact: vt_fragments), B = P^T from a 128-byte-swizzle shared tile. NOTE: FP8 wgmma
//     needs K-major operands; V is token-major, so the register-A form avoids a transposed copy of every page.
//   - The end: bf16 latent + LSE (one split) or fp32 partials for a merge (store_ot, store_row_lse).
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/wgmma.cuh"
#include "core/config.h"
#include "core/kernel.cuh"
#include "core/params.h"

namespace mla::core {
namespace wgmma_detail {

// The generic wgmma helpers (descriptor, fence / commit / wait, proxy fence, operand pins): common/wgmma.cuh.
using wgmma::fence_operand;
using wgmma::fence_proxy_async;
using wgmma::gmma_desc;
using wgmma::kSwizzle128;
using wgmma::wgmma_commit;
using wgmma::wgmma_fence;
using wgmma::wgmma_wait;
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// D(64 x N) += A(64 x 16) · B(N x 16)^T, f16, A from registers, B from shared memory (K-major).
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b);

template <>
__device__ __forceinline__ void wgmma_rs<16>(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_rs<32>(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_rs<48>(float (&d)[24], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_rs<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// The f16 A fragments (m64nNk16, A = K, tokens on M) of one 32-byte half block of an FP8 page: ldmatrix.x4
// of the bytes at `k_lane` (this lane's row and chunk through the 64-byte swizzle), each register converted
// exactly into two f16x2 registers; a[t] feeds k16 step t of the half block.
__device__ __forceinline__ void k_half_block_fragments(uint32_t (&a)[2][4], const uint8_t* k_lane) {
  uint32_t f[4];  // FP8 K fragments of the half block's two 16-byte chunks
  detail::ldmatrix_x4(f, k_lane);
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    a[t][0] = detail::e4m3x2_to_f16x2(f[2 * t]);
    a[t][1] = detail::e4m3x2_to_f16x2(f[2 * t + 1]);
    a[t][2] = detail::e4m3x2_hi_to_f16x2(f[2 * t]);
    a[t][3] = detail::e4m3x2_hi_to_f16x2(f[2 * t + 1]);
  }
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int r = 0; r < 4; ++r) fence_operand(a[t][r]);
}

// The f16 A fragments (m64nNk16, A = V^T, latent dims on M) of one k16 step of tokens: 32-bit shared loads
// of the FP8 bytes at v0 / v1 (this thread's two dim groups, tokens 2c, 2c + 1, 2c + 8, 2c + 9 in the rows
// of the 64-byte swizzle), byte-permuted and converted exactly; a[mt] feeds m64 dim tile mt.
__device__ __forceinline__ void vt_fragments(uint32_t (&a)[4][4], const uint8_t* v0, const uint8_t* v1) {
  // [h][token 2c, 2c + 1, 2c + 8, 2c + 9]
  const uint32_t w00 = *reinterpret_cast<const uint32_t*>(v0);
  const uint32_t w01 = *reinterpret_cast<const uint32_t*>(v0 + kSw64Bytes);
  const uint32_t w08 = *reinterpret_cast<const uint32_t*>(v0 + 8 * kSw64Bytes);
  const uint32_t w09 = *reinterpret_cast<const uint32_t*>(v0 + 9 * kSw64Bytes);
  const uint32_t w10 = *reinterpret_cast<const uint32_t*>(v1);
  const uint32_t w11 = *reinterpret_cast<const uint32_t*>(v1 + kSw64Bytes);
  const uint32_t w18 = *reinterpret_cast<const uint32_t*>(v1 + 8 * kSw64Bytes);
  const uint32_t w19 = *reinterpret_cast<const uint32_t*>(v1 + 9 * kSw64Bytes);
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
    const uint32_t selector = mt | ((4 + mt) << 4);  // byte mt of the two words, the lower token first
    a[mt][0] = detail::e4m3x2_to_f16x2(detail::prmt(w00, w01, selector));  // row g,     tokens 2c, 2c + 1
    a[mt][1] = detail::e4m3x2_to_f16x2(detail::prmt(w10, w11, selector));  // row g + 8, tokens 2c, 2c + 1
    a[mt][2] = detail::e4m3x2_to_f16x2(detail::prmt(w08, w09, selector));  // row g,     tokens 2c + 8, 2c + 9
    a[mt][3] = detail::e4m3x2_to_f16x2(detail::prmt(w18, w19, selector));  // row g + 8, tokens 2c + 8, 2c + 9
  }
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int r = 0; r < 4; ++r) fence_operand(a[mt][r]);
}

// The tile's query rows as f16 into shared memory (B of Q·K^T, the 128-byte swizzle: q[k block][row][64]),
// rows past rows_m zero, by kThreads threads. One thread per (row r, 16-byte group G) = one k16 step, its k
// order permuted to match the K fragments (e4m3x16_to_f16_permuted; one permutation on both operands
// leaves the dot product unchanged). The caller fences the async proxy and synchronizes.
template <int kTileN, int kThreads>
__device__ __forceinline__ void load_query_tile(__half (&q)[kKeyDim / kSw128Halves][kTileN][kSw128Halves],
                                                const CoreParams& p, int64_t entry0, int tile_row0, int rows_m) {
  constexpr int kChunksPerRow = kKeyDim / 16;  // 36
  constexpr int kItems = kTileN * kChunksPerRow;
  // NOTE: loads issued kBatch at a time before their conversions, not a load, convert and store an item (a round trip
  // each where nothing else is in flight); all of them at once (9 at 64 rows) put 16-224 B of stack on the ping-pong
  // kernels, batches of 4 none beyond main's.
  constexpr int kBatch = 4;
  for (int base = 0; base < kItems; base += kBatch * kThreads) {
    uint4 v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int idx = base + threadIdx.x + i * kThreads;
      const int row = tile_row0 + idx / kChunksPerRow;
      v[i] = make_uint4(0u, 0u, 0u, 0u);
      // NOTE: plain loads, not __ldg: ptxas hoisted these non-coherent loads above the PDL wait (ACQBULK) in the
      // uniform-deal instances, so the tile was read before the query kernel's grid had completed (cuobjdump -sass,
      // 2026-12-06). A plain load stays after the wait; tests/sass/kernel_sass.py fails if one does not.
      if (idx < kItems && row < rows_m) {
        v[i] = *reinterpret_cast<const uint4*>(p.query + (entry0 + row) * kKeyDim + (idx % kChunksPerRow) * 16);
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int idx = base + threadIdx.x + i * kThreads;
      if (idx >= kItems) break;
      const int r = idx / kChunksPerRow;
      const int group = idx % kChunksPerRow;
      uint4 lo, hi;
      detail::e4m3x16_to_f16_permuted(v[i], lo, hi);
      __half* dst = &q[group / 4][r][0];
      const int chunk = 2 * (group % 4);  // the step's two 16-byte chunks in its 128-byte row
      *reinterpret_cast<uint4*>(dst + 8 * (chunk ^ (r & 7))) = lo;
      *reinterpret_cast<uint4*>(dst + 8 * ((chunk + 1) ^ (r & 7))) = hi;
    }
  }
}

// This lane's ldmatrix.x4 addresses of K through the 64-byte swizzle (lane l gives row l % 8 of matrix l / 8):
// byte 16·chunk of token r in column block kb sits at kb·kPageBlockBytes + 64·r + 16·(chunk ^ ((r >> 1) & 3)),
// and 32-byte half block hb covers chunks 2·(hb % 2) + {0, 1} of block hb / 2. The K fragments (m16 x k32
// bytes) are the matrices (tokens 0-7 | 8-15 of warp wi) x (chunk 0 | 1 of the half block), so registers
// 0..3 = tokens g / g + 8, bytes 4c.. of chunk 0, then of chunk 1.
struct KLaneOffsets {
  int row;         // the lane's token row in a column block
  int chunk_even;  // its chunk's offset in even half blocks
  int chunk_odd;   // and in odd ones
};
__device__ __forceinline__ KLaneOffsets k_lane_offsets(int wi, int lane) {
  const int token = 16 * wi + lane % 8 + 8 * ((lane / 8) % 2);
  return {token * kSw64Bytes, ((lane / 16) ^ ((token >> 1) & 3)) << 4, ((2 + lane / 16) ^ ((token >> 1) & 3)) << 4};
}

// Issues (does not commit) S^T += K·Q^T over 32-byte half block hb of the 576-byte rows (two k16 steps):
// A = the page's K (at `page`) through k_half_block_fragments, B = the f16 query tile (desc_q: its start,
// kTileN rows of 64-element k blocks in the 128-byte swizzle).
template <int kTileN>
__device__ __forceinline__ void issue_qk_half_block(float (&s)[kTileN / 2], const uint8_t* page, KLaneOffsets off,
                                                    uint64_t desc_q, int hb) {
  constexpr int kQBlockBytes = kTileN * kSw128Halves * 2;  // one 64-element k block of Q
  const int kb = hb / 2;
  uint32_t a[2][4];  // f16 A fragments of its two k16 steps
  k_half_block_fragments(a, page + off.row + kb * kPageBlockBytes + (hb % 2 == 0 ? off.chunk_even : off.chunk_odd));
  wgmma_fence();
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    // the descriptor's address field counts 16-byte units
    wgmma_rs<kTileN>(s, a[t], desc_q + ((kb * kQBlockBytes + ((hb % 2) * 2 + t) * 32) >> 4));
  }
}

// This thread's byte offsets (v0, v1 of vt_fragments) into a page for latent dims 256·w + 64·wi + 32h + 4g
// (h = 0, 1) of tokens 2c, 2c + 1, 2c + 8, 2c + 9: the 32-bit word of those dims of token t sits in column
// block 4·w + wi, chunk (2h + g / 4) ^ ((t >> 1) & 3) = (2h + g / 4) ^ c; k16 step kk adds 16 rows.
struct VtLaneOffsets {
  int v0;
  int v1;
};
__device__ __forceinline__ VtLaneOffsets vt_lane_offsets(int w, int wi, int g, int c) {
  const int row = (4 * w + wi) * kPageBlockBytes + 2 * c * kSw64Bytes + 4 * (g & 3);
  return {row + (((g >> 2) ^ c) << 4), row + (((2 + (g >> 2)) ^ c) << 4)};
}

// Issues (does not commit) O^T += V^T·P^T for k16 step kk of a page (tokens 16kk .. 16kk + 15): the A
// fragments of the page at `page` (vt_fragments), B = the P^T tile at shared address p_addr (128-byte
// swizzle, kPageSize f16 a row), one m64nNk16 wgmma per m64 dim tile.
template <int kTileN>
__device__ __forceinline__ void issue_pv_step(float (&o)[4][kTileN / 2], const uint8_t* page, VtLaneOffsets off,
                                              uint32_t p_addr, int kk) {
  uint32_t a[4][4];  // [m64 dim tile mt = byte of the word][A fragment register]
  vt_fragments(a, page + kk * 16 * kSw64Bytes + off.v0, page + kk * 16 * kSw64Bytes + off.v1);
  wgmma_fence();  // the A registers (and, at kk = 0, the rescaled accumulators) are written
  const uint64_t desc_p = gmma_desc(p_addr + kk * 32, 8 * kPageSize * 2, kSwizzle128);
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) wgmma_rs<kTileN>(o[mt], a[mt], desc_p);
}

// O^T columns (attention rows) times their page's rescale factor: the thread's rows 8j + 2c and 8j + 2c + 1.
template <int kTileN>
__device__ __forceinline__ void rescale_rows(float (&o)[4][kTileN / 2], const float* alpha_of_row, int c) {
#pragma unroll
  for (int j = 0; j < kTileN / 8; ++j) {
    const float2 alpha = *reinterpret_cast<const float2*>(&alpha_of_row[8 * j + 2 * c]);
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      o[mt][4 * j + 0] *= alpha.x;
      o[mt][4 * j + 1] *= alpha.y;
      o[mt][4 * j + 2] *= alpha.x;
      o[mt][4 * j + 3] *= alpha.y;
    }
  }
}

// Masks this thread's base-2 logits of a page that reaches past a causal bound or the request's length (the
// caller skips full pages): x[4j + e] of token_a and x[4j + 2 + e] of token_b belong to tile row
// first_row + 8j + 2c + e (rows past rows_m take the last row's bound; they are padding).
template <int kGroups>
__device__ __forceinline__ void mask_page_logits(float (&x)[4 * kGroups], const CoreParams& p, int64_t page_token0,
                                                 int token_a, int token_b, int length, int64_t total, int first_row,
                                                 int c, int rows_m) {
  const int64_t ja = page_token0 + token_a, jb = page_token0 + token_b;
  const int64_t ga = ja < length ? detail::global_position(ja, p) : INT64_MAX;
  const int64_t gb = jb < length ? detail::global_position(jb, p) : INT64_MAX;
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int mi = min(first_row + 8 * j + 2 * c + e, rows_m - 1);
      const int64_t bound = detail::causal_bound(p, total, mi);
      if (ga > bound) x[4 * j + e] = -INFINITY;
      if (gb > bound) x[4 * j + 2 + e] = -INFINITY;
    }
}

// The first half of a warpgroup's page row max exchange: each thread's max of its two tokens' logits (x[4j + e],
// x[4j + 2 + e]) of rows 8j + 2c + e, over the 8 lanes g of its quad column, into red[warp wi][row] (lanes g = 0).
// The caller synchronizes the warpgroup, then reads each row's max with page_row_max.
template <int kGroups>
__device__ __forceinline__ void publish_page_row_max(const float (&x)[4 * kGroups], float (*red)[kGroups * 8], int wi,
                                                     int g, int c) {
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mx = fmaxf(x[4 * j + e], x[4 * j + 2 + e]);
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      if (g == 0) red[wi][8 * j + 2 * c + e] = mx;
    }
}

// Row n's page max over the warpgroup's 4 warps (after publish_page_row_max and the warpgroup's barrier).
template <int kRows>
__device__ __forceinline__ float page_row_max(const float (*red)[kRows], int n) {
  return fmaxf(fmaxf(red[0][n], red[1][n]), fmaxf(red[2][n], red[3][n]));
}

// fence_operand on every O^T register: pins their accesses against the wgmma fences and waits around them.
template <int kTileN>
__device__ __forceinline__ void fence_accumulators(float (&o)[4][kTileN / 2]) {
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int e = 0; e < kTileN / 2; ++e) fence_operand(o[mt][e]);
}

// The end of a split: this thread's O^T values, dims 256·w + 64·wi + 32h + 4g + [0, 4) (h = 0, 1) of tile rows
// 8j + 2c + e, normalized by their rows' softmax sums (row_sum; a sum of 0 gives 0) and, when the request has
// one split (`direct`), by k_scale: bf16 latent or fp32 partials (store_latent4). Rows past rows_m are padding.
template <int kTileN>
__device__ __forceinline__ void store_ot(const CoreParams& p, const float (&o)[4][kTileN / 2], const float* row_sum,
                                         int w, int wi, int g, int c, int tile_row0, int rows_m, int64_t entry0,
                                         int64_t partial_row0, bool direct) {
#pragma unroll
  for (int j = 0; j < kTileN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = 8 * j + 2 * c + e;
      const int row = tile_row0 + n;
      if (row >= rows_m) continue;
      const float sum = row_sum[n];
      const float inv = sum_weighs(sum) ? 1.0f / sum : 0.0f;
      const float scale = direct ? inv * p.k_scale : inv;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int dim = w * kWgDims + 64 * wi + 32 * h + 4 * g;
        detail::store_latent4(p, direct, partial_row0 + row, entry0 + row, dim, o[0][4 * j + 2 * h + e] * scale,
                              o[1][4 * j + 2 * h + e] * scale, o[2][4 * j + 2 * h + e] * scale,
                              o[3][4 * j + 2 * h + e] * scale);
      }
    }
}

// The first half of a warpgroup's final softmax sums: this thread's share (l_run, rows 8j + 2c + e) summed over the
// lanes g of its quad column into red[warp wi][row] (lanes g = 0). The caller synchronizes, then adds the warps.
template <int kGroups>
__device__ __forceinline__ void publish_row_sums(const float (&l_run)[kGroups][2], float (*red)[kGroups * 8], int wi,
                                                 int g, int c) {
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float l = l_run[j][e];
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
      if (g == 0) red[wi][8 * j + 2 * c + e] = l;
    }
}

// Row `row` of the request's tile rows: its LSE (natural log) from the running max m (base 2) and the softmax sum;
// a sum of 0 (nothing visible) gives -inf, never NaN; a NaN sum (a NaN logit) gives NaN. Written to the latent's LSE
// (one split) or the split's partial.
__device__ __forceinline__ void store_row_lse(const CoreParams& p, bool direct, int64_t entry0, int64_t partial_row0,
                                              int row, float m, float sum) {
  constexpr float kLn2 = 0.69314718055994531f;
  const float lse = sum_weighs(sum) ? (m + log2f(sum)) * kLn2 : -INFINITY;
  if (direct) {
    p.lse[entry0 + row] = lse;
  } else {
    p.partial_lse[partial_row0 + row] = lse;
  }
}

// One warpgroup's share of a page copy into the ring's 64-byte-swizzle layout (16-byte cp.async by its 128
// threads, wt = the thread within the warpgroup, then one arrival per thread on `full`): part 0 copies column
// blocks 0-3 and 8 (20 chunks a row), part 1 blocks 4-7 (16 chunks), i.e. the blocks of the latent dims
// [256·part, +256) that the part's P·V reads, part 0 also the rope block. Rows past the length are zero-filled (src
// size 0), never read: the cache may hold anything there (NaN bytes included) and p = 0 times NaN would poison O^T.
template <int kPart>
__device__ __forceinline__ void copy_page_part_async(const CoreParams& p, const int32_t* pages, int page, int length,
                                                     uint8_t* stage, uint64_t* full, int wt) {
  constexpr int kRowChunks = kPart == 0 ? 20 : 16;
  const int valid = static_cast<int>(min(int64_t{kPageSize}, length - int64_t{page} * kPageSize));
  const uint8_t* src = p.cache + int64_t{pages[page]} * p.stride_cache_page;
#pragma unroll
  for (int i = 0; i < kPageSize * kRowChunks / 128; ++i) {
    const int idx = wt + i * 128;
    const int r = idx / kRowChunks;
    const int local = idx % kRowChunks;
    const int chunk = kPart == 0 ? (local < 16 ? local : local + 16) : 16 + local;
    uint8_t* dst = stage + (chunk / 4) * kPageBlockBytes + r * kSw64Bytes + (((chunk % 4) ^ ((r >> 1) & 3)) << 4);
    detail::cp_async_16(dst, src + r * kKeyDim + chunk * 16, r < valid ? 16u : 0u);
  }
  detail::cp_async_mbar_arrive(full);
}

}  // namespace wgmma_detail

}  // namespace mla::core
