// The FP8 attention core, wgmma version (sm_90a Hopper warpgroup MMAs), DESIGN.md §4.
//
// Grid: x = N-tile of the request (kTileN rows of the folded (q row, head) M side), y and z = the split and the
// request (slot_split). Block: two warpgroups. "Swap AB": the 64 tokens of a page are the wgmma M side and the
// attention rows the N side, so H·q = 16 runs an m64n16 tile without padding. Per page:
//   1. wait for the page's mbarrier (the page was copied kStages − 1 pages ahead by every thread's
//      16-byte cp.async, stored in a 64-byte-swizzle layout: [column block 9][token 64][64 B], which
//      keeps the ldmatrix of K and the V loads conflict-free);
//   2. S^T = K·Q^T: warpgroup w computes the partial sums of 64 tokens × all kTileN rows over its half
//      of the 576-long reduction with f16 wgmma m64nNk16 (fp32 accumulate: exact products; FP8 wgmma
//      accumulates with ~14 bits and missed the LSE bound, and FP8 mma.sync is emulated on sm_90 by
//      converting its operands to f16 on every instruction), A = K from registers (ldmatrix of the
//      FP8 page, converted e4m3 -> f16: each K byte by one warpgroup), B = Q^T from the f16 query tile
//      in shared memory (converted once per CTA), 18 k-steps; the warpgroups then swap the partials
//      of each other's rows through shared memory (one CTA barrier);
//   3. online softmax in base 2 over the tokens with a lazily raised max (kLazyMaxSlack): P^T in fp16
//      into a 128-byte-swizzle shared tile against the running max, one CTA barrier that also votes on
//      whether some row's max must be raised; only then the page row max (quad shuffles, then the 4
//      warps of the warpgroup through shared memory), P^T again and the per-row rescale factors beside
//      it, and a second CTA barrier;
//   4. O^T += V^T·P^T: warpgroup w computes its 256 latent dims (four m64 tiles) × all kTileN rows
//      (m64nNk16 f16, A = V^T from registers: 32-bit shared loads of the FP8 bytes, byte-permuted and
//      converted e4m3 → f16x2, exact; B = P^T from shared memory). NOTE: FP8 wgmma needs K-major
//      operands; V is token-major, so the register-A form avoids a transposed copy of every page.
// The end writes bf16 latent + LSE (one split) or fp32 partials for the combine kernel.
#pragma once

#include <type_traits>

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/config.h"
#include "core/kernel.cuh"
#include "core/params.h"

namespace mla::core {
namespace wgmma_detail {

// Shared-memory matrix descriptor (PTX "matrix-descriptor"): start address, leading byte offset 1
// (unused by the swizzled K-major layouts), stride byte offset = bytes between 8-row groups, layout
// 1 = 128-byte swizzle (P^T). The base-offset field stays 0: every swizzle atom is aligned to its
// repeat (1024 B), and a k-step inside an atom only moves the start address.
inline constexpr uint32_t kSwizzle128 = 1;
__device__ __forceinline__ uint64_t gmma_desc(uint32_t smem_address, uint32_t stride_bytes, uint32_t layout) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (static_cast<uint64_t>(layout) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Generic-proxy shared stores (P^T) become visible to wgmma (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Pins a register's accesses in program order against the wgmma fence / wait (the compiler must not
// move an accumulator or A-fragment write across them).
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// Waits until at most N committed wgmma groups of this warpgroup are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
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
      if (idx < kItems && row < rows_m) {
        v[i] = __ldg(reinterpret_cast<const uint4*>(p.query + (entry0 + row) * kKeyDim + (idx % kChunksPerRow) * 16));
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
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
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
// a sum of 0 (nothing visible) gives -inf, never NaN. Written to the latent's LSE (one split) or the split's partial.
__device__ __forceinline__ void store_row_lse(const CoreParams& p, bool direct, int64_t entry0, int64_t partial_row0,
                                              int row, float m, float sum) {
  constexpr float kLn2 = 0.69314718055994531f;
  const float lse = sum > 0.0f ? (m + log2f(sum)) * kLn2 : -INFINITY;
  if (direct) {
    p.lse[entry0 + row] = lse;
  } else {
    p.partial_lse[partial_row0 + row] = lse;
  }
}

// The end of a warpgroup's softmax over tokens (M): each of its kGroups·8 rows' running sum (l_run: this thread's
// share, rows 8j + 2c + e) summed over the lanes g, then over the 4 warps through `red` ([warp][row], after the
// named barrier `barrier`); warp 0's lanes g = 0 write the sums to `row_sum` and each row's LSE (natural log; a sum of
// 0, nothing visible, gives -inf, never NaN) to the latent's LSE (one split) or the split's partial LSE. The
// warpgroup's rows are tile rows first_row + [0, kGroups·8) (request rows tile_row0 + those); rows past rows_m are
// padding.
template <int kGroups>
__device__ __forceinline__ void finish_row_sums(const CoreParams& p, const float (&l_run)[kGroups][2],
                                                const float (&m_run)[kGroups][2], float (*red)[kGroups * 8],
                                                float* row_sum, uint32_t barrier, int wi, int g, int c, int first_row,
                                                int tile_row0, int rows_m, int64_t entry0, int64_t partial_row0) {
  publish_row_sums<kGroups>(l_run, red, wi, g, c);
  named_barrier_sync(barrier, 128);
  const bool direct = p.num_splits == 1;
  if (wi == 0 && g == 0) {
#pragma unroll
    for (int j = 0; j < kGroups; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int nl = 8 * j + 2 * c + e;
        const int n = first_row + nl;
        const float sum = red[0][nl] + red[1][nl] + red[2][nl] + red[3][nl];
        row_sum[n] = sum;
        const int row = tile_row0 + n;
        if (row < rows_m) store_row_lse(p, direct, entry0, partial_row0, row, m_run[j][e], sum);
      }
  }
}

// One warpgroup's share of a page copy into the ring's 64-byte-swizzle layout (16-byte cp.async by its 128
// threads, wt = the thread within the warpgroup, then one arrival per thread on `full`): part 0 copies column
// blocks 0-3 and 8 (20 chunks a row), part 1 blocks 4-7 (16 chunks), i.e. the blocks of the latent dims
// [256·part, +256) that the part's P·V reads, part 0 also the rope block. Rows past the length are zero-filled.
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

// kTileN: rows of the N-tile (16, 32, 48, 64). kStages: page ring depth. kBalancedSlots: as core_split_kernel's.
template <int kTileN, int kStages, int kMinBlocksPerSm, bool kBalancedSlots>
__global__ void __launch_bounds__(kWgThreads, kMinBlocksPerSm)
    core_wgmma_kernel(const __grid_constant__ CoreParams p) {
  using namespace detail;
  using namespace wgmma_detail;
  using Smem = WgmmaSharedMemoryPlan<kTileN, kStages>;
  constexpr int kRowsWg = kTileN / 2;  // S^T rows (N) of one warpgroup
  constexpr int kGroupsS = kRowsWg / 8;  // n8 groups of the S^T accumulator
  constexpr int kGroupsO = kTileN / 8;   // n8 groups of each O^T accumulator
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_raw);
  // NOTE: the swizzle atoms assume a 1024-byte aligned base (the dynamic window starts after the
  // 1 KB reserved block on sm_90); a misaligned base would compute garbage, so it traps instead.
  if ((smem_addr(smem_raw) & 1023u) != 0) __trap();

  // ---- Phase 0: grid mapping ---------------------------------------------------------------------
  // Accumulator fragments (m64nN, fp32): warp wi of the warpgroup holds M rows 16·wi + g and
  // 16·wi + g + 8, N columns 8j + 2c and 8j + 2c + 1 (registers 4j + {0, 1} and 4j + {2, 3}).
  const int wg = threadIdx.x / 128;
  const int wi = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int c = lane % 4;
  const int tile = blockIdx.x;
  const int rows_m = p.q * p.num_heads;
  const int tile_row0 = tile * kTileN;  // first M row (mi) of this tile

  // ---- Phase 1: metadata (host-written: read before the PDL wait) ------------------------------
  const auto [request, entry0, partial_row0, length, total, page_begin, my_pages, writes_nothing, pages] =
      cta_split<kBalancedSlots>(p, rows_m);  // which split of which request
  if (writes_nothing) return;
  const int64_t bound_min = causal_bound(p, total, tile_row0);  // the tile's smallest causal bound

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&smem.full[s], kWgThreads);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  griddep_wait();  // PDL: the query and this step's cache rows come from the query kernel

  // Producer (every thread): page k of the split (9 16-byte cp.async per thread) into the swizzled
  // layout, then one arrival per thread on the stage's mbarrier.
  auto issue_page = [&](int k) {
    const int stage = k % kStages;
    copy_page_async<kWgThreads>(p, pages, page_begin + k, length, [&](int r, int chunk) {
      return smem.kv[stage] + (chunk / 4) * kPageBlockBytes + r * kSw64Bytes + (((chunk % 4) ^ ((r >> 1) & 3)) << 4);
    });
    cp_async_mbar_arrive(&smem.full[stage]);
  };
  for (int k = 0; k < min(kStages, my_pages); ++k) issue_page(k);

  // ---- Phase 2: the query tile as f16 into shared memory (rows past rows_m zero) -------------------
  load_query_tile<kTileN, kWgThreads>(smem.q, p, entry0, tile_row0, rows_m);
  fence_proxy_async();  // the query tile is read by wgmma (the async proxy)
  __syncthreads();

  const KLaneOffsets k_off = k_lane_offsets(wi, lane);  // ldmatrix.x4 addresses of K
  const uint32_t q_addr = smem_addr(&smem.q[0][0][0]);  // Q^T, all kTileN rows (3a: k halves per warpgroup)
  float o[4][kGroupsO * 4];  // O^T: [m64 dim tile][fragment]: dims 256·wg + 4·(16·wi + 8h + g) + tile
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int e = 0; e < kGroupsO * 4; ++e) o[mt][e] = 0.0f;
  float m_run[kGroupsS][2];  // running max (base-2 logits) of rows 8j + 2c + e of this warpgroup
  float l_run[kGroupsS][2];  // this thread's share (its two tokens per page) of the softmax sums
#pragma unroll
  for (int j = 0; j < kGroupsS; ++j) {
    m_run[j][0] = m_run[j][1] = -INFINITY;
    l_run[j][0] = l_run[j][1] = 0.0f;
  }
  const float scale_log2 = p.softmax_scale_log2;
  const int token_a = 16 * wi + g;  // this thread's two tokens of a page (S^T rows)
  const int token_b = token_a + 8;
  const VtLaneOffsets v_off = vt_lane_offsets(wg, wi, g, c);  // V^T fragments of this warpgroup's dims

  // ---- Phase 3: the page loop ------------------------------------------------------------------
  for (int it = 0; it < my_pages; ++it) {
    const int stage = it % kStages;
    const int buf = it % 2;
    mbar_wait(&smem.full[stage], (it / kStages) & 1);
    const uint32_t kv_addr = smem_addr(smem.kv[stage]);

    // 3a. S^T = K·Q^T: warpgroup w computes the partial sums of all kTileN rows over its half of the
    // 576-long reduction (k16 steps [18w, 18w + 18)), then the two warpgroups swap the halves of the
    // partials that belong to the other one's rows (shared memory), so each converts only half of the
    // page's K. f16 wgmma m64nNk16 (fp32 accumulate). A = K from registers: each FP8 fragment register
    // (4 bytes 4c.. of token g or g + 8) gives two f16x2 registers (bytes 4c, 4c + 1 -> k 2c, 2c + 1;
    // bytes 4c + 2, 4c + 3 -> k 2c + 8, 2c + 9), the order the query tile was permuted to. B = Q^T by
    // descriptor. NOTE: not FP8: Hopper FP8 wgmma accumulates with ~14 significant bits (DeepSeek-V3
    // §3.3.2; one 18-step chain measured LSE errors up to 5e-3, bound 1e-3), and FP8 mma.sync is not
    // native on sm_90 (it converts both operands to f16 on every instruction). One group per 32-byte
    // half block, at most two in flight, bounds the live A registers to 16.
    float s_all[kTileN / 2];  // m64 x kTileN partial accumulator: rows 16wi + g (+ 8), columns 8j + 2c (+ 1)
#pragma unroll
    for (int e = 0; e < kTileN / 2; ++e) {
      s_all[e] = 0.0f;
      fence_operand(s_all[e]);
    }
    // The warpgroup's half as compile-time constants (hb: 32-byte half blocks of the 576-byte row).
    auto qk_half = [&](auto wg_constant) {
      constexpr int kWg = decltype(wg_constant)::value;
      // NOTE: the base address is made opaque per page: otherwise the compiler hoists the
      // loop-invariant 64-bit descriptors out of the page loop (more registers, spills).
      const uint64_t desc_q = gmma_desc(opaque(q_addr), 8 * kSw128Halves * 2, kSwizzle128);
#pragma unroll
      for (int i = 0; i < kKeyBlocks; ++i) {
        issue_qk_half_block<kTileN>(s_all, smem.kv[stage], k_off, desc_q, kWg * kKeyBlocks + i);  // of 2·kKeyBlocks
        wgmma_commit();
        wgmma_wait<1>();
      }
      wgmma_wait<0>();
#pragma unroll
      for (int e = 0; e < kTileN / 2; ++e) fence_operand(s_all[e]);
      // Hand the other warpgroup its rows' partials: n8 groups [(1 - w) kGroupsS, +kGroupsS).
#pragma unroll
      for (int jj = 0; jj < kGroupsS; ++jj) {
        const int j = (1 - kWg) * kGroupsS + jj;
        smem.swap[1 - kWg][jj][threadIdx.x % 128] =
            make_float4(s_all[4 * j], s_all[4 * j + 1], s_all[4 * j + 2], s_all[4 * j + 3]);
      }
    };
    if (wg == 0) {
      qk_half(std::integral_constant<int, 0>{});
    } else {
      qk_half(std::integral_constant<int, 1>{});
    }
    __syncthreads();  // (S) both halves' partials handed over
    float s[kRowsWg / 2];  // this warpgroup's rows: columns 8j + 2c (+ 1) of its kGroupsS n8 groups
    auto own_rows = [&](auto wg_constant) {
      constexpr int kWg = decltype(wg_constant)::value;
#pragma unroll
      for (int jj = 0; jj < kGroupsS; ++jj) {
        const float4 other = smem.swap[kWg][jj][threadIdx.x % 128];
        const int j = kWg * kGroupsS + jj;
        s[4 * jj] = s_all[4 * j] + other.x;
        s[4 * jj + 1] = s_all[4 * j + 1] + other.y;
        s[4 * jj + 2] = s_all[4 * j + 2] + other.z;
        s[4 * jj + 3] = s_all[4 * j + 3] + other.w;
      }
    };
    if (wg == 0) {
      own_rows(std::integral_constant<int, 0>{});
    } else {
      own_rows(std::integral_constant<int, 1>{});
    }

    // 3b. Scale to base-2 logits and mask (only pages reaching past a causal bound or the length).
    const int64_t page_token0 = int64_t{page_begin + it} * kPageSize;
    const bool full_page = page_token0 + kPageSize <= length &&
                           global_position(page_token0 + kPageSize - 1, p) <= bound_min;
    float x[kGroupsS * 4];
#pragma unroll
    for (int j = 0; j < kGroupsS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[4 * j + e] = s[4 * j + e] * scale_log2;
    if (!full_page) {
      mask_page_logits<kGroupsS>(x, p, page_token0, token_a, token_b, length, total, tile_row0 + wg * kRowsWg, c, rows_m);
    }
    // 3c. Online softmax with a lazily raised max (as in version 1, kernel.cuh): P^T = exp2(x - m) in
    // fp16 against the running max m of the pages before; only when a logit of the page passes m by more
    // than kLazyMaxSlack does the CTA take the exact path (page row max over the warpgroup's 4 warps, m
    // raised, P^T recomputed, the rescale factors for both warpgroups). Otherwise every alpha is 1: no
    // row max exchange, no rescale of O^T.
    uint8_t* p_tile = reinterpret_cast<uint8_t*>(&smem.p[buf][0][0]);
    auto store_p = [&](int n, float pa, float pb) {  // row n of the tile, this thread's two tokens
      uint8_t* row = p_tile + n * (kPageSize * 2);
      *reinterpret_cast<__half*>(row + (((token_a >> 3) ^ (n & 7)) << 4) + (token_a & 7) * 2) = __float2half_rn(pa);
      *reinterpret_cast<__half*>(row + (((token_b >> 3) ^ (n & 7)) << 4) + (token_b & 7) * 2) = __float2half_rn(pb);
    };
    bool raise = false;
    float page_sum[kGroupsS][2];
#pragma unroll
    for (int j = 0; j < kGroupsS; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        // NOTE: a row with nothing visible yet keeps m = -inf and subtracts 0 (never inf - inf); its
        // first visible logit always takes the exact path.
        const float m_use = m_run[j][e] == -INFINITY ? 0.0f : m_run[j][e];
        raise |= fmaxf(x[4 * j + e], x[4 * j + 2 + e]) > m_run[j][e] + kLazyMaxSlack;
        const float pa = ex2_ftz(x[4 * j + e] - m_use);
        const float pb = ex2_ftz(x[4 * j + 2 + e] - m_use);
        page_sum[j][e] = pa + pb;
        store_p(wg * kRowsWg + 8 * j + 2 * c + e, pa, pb);
      }
    fence_proxy_async();
    // (P) P^T complete unless some row's max must be raised (CTA-uniform); every thread is done with the
    // previous page.
    const bool raised = __syncthreads_or(raise);
    if (raised) {
      // Page row max: the thread's two tokens, the 8 lanes g of the quad column, the 4 warps.
      publish_page_row_max<kGroupsS>(x, smem.red[wg], wi, g, c);
      named_barrier_sync(1 + wg, 128);
#pragma unroll
      for (int j = 0; j < kGroupsS; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int nl = 8 * j + 2 * c + e;  // row within the warpgroup
          const float m_new = fmaxf(m_run[j][e], page_row_max(smem.red[wg], nl));
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;
          const float alpha = ex2_ftz(m_run[j][e] - m_use);
          m_run[j][e] = m_new;
          const float pa = ex2_ftz(x[4 * j + e] - m_use);
          const float pb = ex2_ftz(x[4 * j + 2 + e] - m_use);
          l_run[j][e] *= alpha;
          page_sum[j][e] = pa + pb;
          const int n = wg * kRowsWg + nl;  // row within the tile
          store_p(n, pa, pb);
          if (wi == 0 && g == 0) smem.alpha[buf][n] = alpha;
        }
      fence_proxy_async();
      __syncthreads();  // (P') the exact P^T and the rescale factors complete
    }
#pragma unroll
    for (int j = 0; j < kGroupsS; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) l_run[j][e] += page_sum[j][e];

    // The previous page's stage is free now: refill it kStages - 1 pages ahead.
    if (it >= 1 && it - 1 + kStages < my_pages) issue_page(it - 1 + kStages);

    // 3d. O^T = O^T·alpha + V^T·P^T over the page's 64 tokens (4 k16 steps) x this warpgroup's dims
    // (alpha = 1 unless the max was raised).
    if (raised) rescale_rows<kTileN>(o, smem.alpha[buf], c);
    fence_accumulators<kTileN>(o);
    const uint32_t p_addr = smem_addr(p_tile);
#pragma unroll
    for (int kk = 0; kk < kPageSize / 16; ++kk) issue_pv_step<kTileN>(o, smem.kv[stage], v_off, p_addr, kk);
    wgmma_commit();
    // NOTE: waited here, not after the next page's Q·K^T: with P·V still in flight at the loop exit,
    // ptxas serializes every wgmma of the kernel (C7515, the loop-skipped path defines the
    // accumulators); the next page's MMAs would queue behind this one anyway.
    wgmma_wait<0>();
    fence_accumulators<kTileN>(o);
  }

  // ---- Phase 4: finalize: softmax sums over the tokens (lanes g, then the 4 warps) and the LSE ----------
  // NOTE: the last reads of smem.red were before the loop's last CTA barrier, so it can be reused.
  finish_row_sums<kGroupsS>(p, l_run, m_run, smem.red[wg], smem.row_sum, 1 + wg, wi, g, c, wg * kRowsWg, tile_row0,
                            rows_m, entry0, partial_row0);
  const bool direct = p.num_splits == 1;
  __syncthreads();

  // ---- Phase 5: stores ---------------------------------------------------------------------------
  store_ot<kTileN>(p, o, smem.row_sum, wg, wi, g, c, tile_row0, rows_m, entry0, partial_row0, direct);
  griddep_launch_dependents();  // PDL: this CTA's last store is done
}

}  // namespace mla::core
