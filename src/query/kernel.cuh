// The two kernels of the fused query stage, chained by programmatic dependent launch (PDL):
//
//   proj_kernel    griddepcontrol.wait -> RMSNorm(q_a) of the CTA's rows -> split-K partials of
//                  q_b_proj . qn on mma.sync (weights streamed global -> registers, 16-byte loads,
//                  kProjPrefetch chunks in flight; the first ones issued before the wait).
//   absorb_kernel  prefetches its W_UK_T slice into shared memory BEFORE griddepcontrol.wait (so its
//                  weight traffic hides under proj_kernel), then sums the partials into bf16 q,
//                  computes ql = q_nope . W_UK_T[h] on mma.sync, writes the e4m3 query (and the
//                  rope part), and the e4m3 cache rows; triggers its dependents after its last store.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "query/config.h"
#include "query/params.h"

namespace mla::query {

// ---- Small device helpers ----------------------------------------------------------------------

__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void trigger_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Streaming 16-byte load: weights are read once, keep them out of L1.
__device__ __forceinline__ uint4 load_stream(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_ptr) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_ptr) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void cp_async_16(void* smem_ptr, const void* gmem_ptr) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(addr), "l"(gmem_ptr));
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Eight bf16 (one 16-byte vector) to floats.
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// e4m3 with saturation (DESIGN.md §4: saturate to +-448, NaN stays NaN), two at a time.
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// ---- Kernel 1: RMSNorm(q_a) + split-K q_b_proj ---------------------------------------------------
//
// Grid: x = row chunk (fastest, so CTAs sharing a weight tile run together and hit L2),
//       y = group of kProjWarps feature tiles, z = K split.
// Warp w of CTA (x, y, z) owns feature tile y*8+w (16 rows of q_b_proj) over K slice
// [z*split_len, (z+1)*split_len) and rows [x*8*kNTiles, ...). It writes fp32 partial sums to
// workspace[z][row][feature].
//
// NOTE: the A fragments come straight from global memory. Lane (g = lane/4, t = lane%4) loads the
// 16 bytes at k = chunk*32 + t*8 of rows g and g+8; the B fragment (normed q_a) uses the SAME
// permutation of k (16 bytes at k = chunk*32 + t*8 of row g), so each pair of mma k-steps sees
// a consistent reordering of the reduction and no shuffle or shared-memory staging is needed.
template <int kNTiles>
__global__ void __launch_bounds__(kProjThreads) proj_kernel(const __grid_constant__ QueryParams p) {
  constexpr int kRowTile = 8 * kNTiles;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const ProjSmemPlan plan{kRowTile, p.split_len};
  const int qn_stride = proj_smem_stride(p.split_len);
  __nv_bfloat16* s_qn = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  float* s_inv_rms = reinterpret_cast<float*>(smem_raw + plan.qn_bytes());

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int row0 = blockIdx.x * kRowTile;
  const int tile = blockIdx.y * kProjWarps + warp;
  const int k0 = blockIdx.z * p.split_len;
  const int num_features = p.num_heads * kQkHeadDim;
  const bool active = tile * kFeatureTile < num_features;
  const int num_chunks = p.split_len / kKChunk;

  // Phase 0: weights do not depend on the producer: start streaming them before the wait.
  const __nv_bfloat16* w_lo = p.q_b_proj + int64_t(tile * kFeatureTile + g) * kQLoraRank + k0 + t * 8;
  const __nv_bfloat16* w_hi = w_lo + 8 * kQLoraRank;
  uint4 a_lo[kProjPrefetch], a_hi[kProjPrefetch];
#pragma unroll
  for (int i = 0; i < kProjPrefetch; ++i) {
    if (active && i < num_chunks) {
      a_lo[i] = load_stream(w_lo + i * kKChunk);
      a_hi[i] = load_stream(w_hi + i * kKChunk);
    }
  }

  // Phase 1: wait for the producer of `projected`; our dependent may start its own prologue.
  grid_dependency_wait();
  // NOTE: absorb_kernel's griddepcontrol.wait waits for this grid's completion whatever the trigger
  // time; triggering early lets its W_UK_T prefetch overlap us, but its resident CTAs then take SM
  // slots from our later waves (launch.cu: which one the planner picks).
  if (p.trigger_early) trigger_dependents();

  // Phase 2: RMSNorm of q_a for the CTA's rows; the K slice of qn goes to shared memory (bf16).
  // Each warp owns rows warp, warp+8, ...; lane holds columns (j*32 + lane)*8 + [0,8), j < 6.
  constexpr int kRowUnroll = 1;  // measured: 2 (more loads in flight) costs occupancy and was slower
  for (int rr0 = warp; rr0 < kRowTile; rr0 += kRowUnroll * kProjWarps) {
    uint4 v[kRowUnroll][6];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int rr = rr0 + u * kProjWarps, row = row0 + rr;
      if (rr < kRowTile && row < p.num_rows) {
        const __nv_bfloat16* src = p.projected + int64_t(row) * p.stride_projected_row + kProjectedQaOffset;
#pragma unroll
        for (int j = 0; j < 6; ++j) v[u][j] = *reinterpret_cast<const uint4*>(src + (j * 32 + lane) * 8);
      }
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int rr = rr0 + u * kProjWarps, row = row0 + rr;
      if (rr >= kRowTile) continue;
      __nv_bfloat16* dst = s_qn + rr * qn_stride;
      if (row >= p.num_rows) {
        for (int k = lane * 8; k < p.split_len; k += 256) *reinterpret_cast<uint4*>(dst + k) = make_uint4(0, 0, 0, 0);
        continue;
      }
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < 6; ++j) {
        float f[8];
        unpack8(v[u][j], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
      }
      ss = warp_sum(ss);
      const float inv_rms = rsqrtf(ss / float(kQLoraRank) + p.rms_eps);
#pragma unroll
      for (int j = 0; j < 6; ++j) {
        const int k = (j * 32 + lane) * 8;
        if (k < k0 || k >= k0 + p.split_len) continue;
        float f[8], w[8];
        unpack8(v[u][j], f);
        unpack8(*reinterpret_cast<const uint4*>(p.q_a_norm + k), w);
        uint4 out;
        out.x = pack_bf16x2(f[0] * inv_rms * w[0], f[1] * inv_rms * w[1]);
        out.y = pack_bf16x2(f[2] * inv_rms * w[2], f[3] * inv_rms * w[3]);
        out.z = pack_bf16x2(f[4] * inv_rms * w[4], f[5] * inv_rms * w[5]);
        out.w = pack_bf16x2(f[6] * inv_rms * w[6], f[7] * inv_rms * w[7]);
        *reinterpret_cast<uint4*>(dst + (k - k0)) = out;
      }
      if (lane == 0) s_inv_rms[rr] = inv_rms;
    }
  }
  __syncthreads();
  if (!active) {
    if (!p.trigger_early) trigger_dependents();
    return;
  }

  // Phase 3: stream the weight tile over the K slice; kProjPrefetch chunks in flight.
  float acc[kNTiles][4];
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  const __nv_bfloat16* b_base = s_qn + g * qn_stride + t * 8;
  for (int c0 = 0; c0 < num_chunks; c0 += kProjPrefetch) {
#pragma unroll
    for (int i = 0; i < kProjPrefetch; ++i) {
      const int c = c0 + i;
      if (c < num_chunks) {
        const uint4 lo = a_lo[i], hi = a_hi[i];
        const int next = c + kProjPrefetch;
        if (next < num_chunks) {
          a_lo[i] = load_stream(w_lo + next * kKChunk);
          a_hi[i] = load_stream(w_hi + next * kKChunk);
        }
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) {
          const uint4 b = *reinterpret_cast<const uint4*>(b_base + n * 8 * qn_stride + c * kKChunk);
          mma_bf16_16816(acc[n], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
          mma_bf16_16816(acc[n], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
        }
      }
    }
  }

  // Phase 4: fp32 partials. d0 (feature g, row 2t), d1 (g, 2t+1), d2 (g+8, 2t), d3 (g+8, 2t+1).
  float* ws = p.workspace + int64_t(blockIdx.z) * p.num_rows * num_features + tile * kFeatureTile + g;
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) {
    const int r = row0 + n * 8 + 2 * t;
    if (r < p.num_rows) {
      ws[int64_t(r) * num_features] = acc[n][0];
      ws[int64_t(r) * num_features + 8] = acc[n][2];
    }
    if (r + 1 < p.num_rows) {
      ws[int64_t(r + 1) * num_features] = acc[n][1];
      ws[int64_t(r + 1) * num_features + 8] = acc[n][3];
    }
  }
  if (!p.trigger_early) trigger_dependents();  // after this CTA's last store
}

// ---- Kernel 2: absorption, query quantization, cache rows ----------------------------------------
//
// Grid: x = latent column chunk (absorb_cols wide), y = head, z = row chunk (absorb_rows rows).
// mma orientation: M = latent columns (A = W_UK_T[h]^T through ldmatrix.trans), N = rows
// (B = bf16 q_nope rows through ldmatrix), K = 128.
__global__ void __launch_bounds__(kAbsorbThreads) absorb_kernel(const __grid_constant__ QueryParams p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const AbsorbSmemPlan plan{p.absorb_cols, p.absorb_rows};
  __nv_bfloat16* s_w = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* s_q = reinterpret_cast<__nv_bfloat16*>(smem_raw + plan.w_bytes());
  uint8_t* s_out = smem_raw + plan.w_bytes() + plan.q_bytes();
  const int w_stride = plan.w_stride(), q_stride = plan.q_stride(), out_stride = plan.out_stride();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head = blockIdx.y;
  const int col0 = blockIdx.x * p.absorb_cols;
  const int row0 = blockIdx.z * p.absorb_rows;
  const int rows_here = min(p.absorb_rows, p.num_rows - row0);
  const int num_features = p.num_heads * kQkHeadDim;

  // Phase 0: W_UK_T[head][:, col0 : col0+cols] -> shared memory, before the wait: it does not
  // depend on proj_kernel, so this traffic overlaps it.
  {
    const __nv_bfloat16* src = p.w_uk_t + int64_t(head) * kNopeDim * kKvLoraRank + col0;
    const int vecs_per_row = p.absorb_cols / 8;
    for (int i = threadIdx.x; i < kNopeDim * vecs_per_row; i += kAbsorbThreads) {
      const int d = i / vecs_per_row, v = i % vecs_per_row;
      cp_async_16(s_w + d * w_stride + v * 8, src + int64_t(d) * kKvLoraRank + v * 8);
    }
  }

  // Phase 1: proj_kernel (and transitively the producer of `projected`) is complete after this.
  grid_dependency_wait();

  // Phase 2: q = bf16(sum of split partials); nope part -> shared memory; rope part -> query bytes.
  // NOTE: kSumBatch items per thread have their loads in flight together (the workspace sits in
  // L2; one round trip per item would dominate at 64 rows).
  {
    constexpr int kSumBatch = 4;
    constexpr int kVecPerRow = kQkHeadDim / 4;  // float4 groups of the head's 192 features
    const int num_vec = p.absorb_rows * kVecPerRow;
    const int64_t split_stride = int64_t(p.num_rows) * num_features;
    for (int base = threadIdx.x; base < num_vec; base += kSumBatch * kAbsorbThreads) {
      float4 s[kSumBatch];
#pragma unroll
      for (int u = 0; u < kSumBatch; ++u) {
        s[u] = make_float4(0.f, 0.f, 0.f, 0.f);
        const int i = base + u * kAbsorbThreads;
        const int rr = i / kVecPerRow, f = (i % kVecPerRow) * 4;
        if (i >= num_vec || rr >= rows_here || (f >= kNopeDim && blockIdx.x != 0)) continue;
        const float* src = p.workspace + int64_t(row0 + rr) * num_features + head * kQkHeadDim + f;
        for (int sp = 0; sp < p.num_splits; ++sp) {
          const float4 v = *reinterpret_cast<const float4*>(src + sp * split_stride);
          s[u].x += v.x; s[u].y += v.y; s[u].z += v.z; s[u].w += v.w;
        }
      }
#pragma unroll
      for (int u = 0; u < kSumBatch; ++u) {
        const int i = base + u * kAbsorbThreads;
        if (i >= num_vec) continue;
        const int rr = i / kVecPerRow, f = (i % kVecPerRow) * 4;
        const uint32_t lo = pack_bf16x2(s[u].x, s[u].y), hi = pack_bf16x2(s[u].z, s[u].w);
        if (f < kNopeDim) {
          *reinterpret_cast<uint2*>(s_q + rr * q_stride + f) = make_uint2(lo, hi);
        } else if (blockIdx.x == 0 && rr < rows_here) {
          const float q0 = __uint_as_float(lo << 16), q1 = __uint_as_float(lo & 0xffff0000u);
          const float q2 = __uint_as_float(hi << 16), q3 = __uint_as_float(hi & 0xffff0000u);
          const uint32_t bytes = uint32_t(e4m3x2(q0 * p.inv_q_scale, q1 * p.inv_q_scale)) |
                                 (uint32_t(e4m3x2(q2 * p.inv_q_scale, q3 * p.inv_q_scale)) << 16);
          uint8_t* dst = p.query + (int64_t(row0 + rr) * p.num_heads_out + p.head_offset + head) * kKeyDim +
                         kKvLoraRank + (f - kNopeDim);
          *reinterpret_cast<uint32_t*>(dst) = bytes;
        }
      }
    }
  }

  // Phase 3: cache rows: e4m3([RMSNorm(kv_a) | k_pe] * inv_k_scale). One warp per row, the rows of
  // this row chunk spread over all CTAs of the chunk.
  {
    const int ctas = gridDim.x * gridDim.y;
    const int cta = blockIdx.y * gridDim.x + blockIdx.x;
    for (int rr = cta + ctas * warp; rr < rows_here; rr += ctas * kAbsorbWarps) {
      const int row = row0 + rr;
      const int64_t slot = p.slots[row];
      if (slot < 0 || slot / kPageSize >= p.num_cache_pages) continue;
      const __nv_bfloat16* src = p.projected + int64_t(row) * p.stride_projected_row;
      uint8_t* dst = p.cache + (slot / kPageSize) * p.stride_cache_page + (slot % kPageSize) * kKeyDim;
      uint4 v[2];
      v[0] = *reinterpret_cast<const uint4*>(src + kProjectedKvaOffset + lane * 8);
      v[1] = *reinterpret_cast<const uint4*>(src + kProjectedKvaOffset + 256 + lane * 8);
      float f[2][8];
      unpack8(v[0], f[0]);
      unpack8(v[1], f[1]);
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += f[j][e] * f[j][e];
      ss = warp_sum(ss);
      const float inv_rms = rsqrtf(ss / float(kKvLoraRank) + p.rms_eps);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float w[8];
        unpack8(*reinterpret_cast<const uint4*>(p.kv_a_norm + j * 256 + lane * 8), w);
        float y[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          // kvn = bf16(kv_a * inv_rms * w), then e4m3(kvn * inv_k_scale).
          y[e] = __bfloat162float(__float2bfloat16_rn(f[j][e] * inv_rms * w[e])) * p.inv_k_scale;
        }
        uint2 out;
        out.x = uint32_t(e4m3x2(y[0], y[1])) | (uint32_t(e4m3x2(y[2], y[3])) << 16);
        out.y = uint32_t(e4m3x2(y[4], y[5])) | (uint32_t(e4m3x2(y[6], y[7])) << 16);
        *reinterpret_cast<uint2*>(dst + j * 256 + lane * 8) = out;
      }
      if (lane < kRopeDim / 8) {
        float k[8];
        unpack8(*reinterpret_cast<const uint4*>(src + kProjectedKpeOffset + lane * 8), k);
        uint2 out;
        out.x = uint32_t(e4m3x2(k[0] * p.inv_k_scale, k[1] * p.inv_k_scale)) |
                (uint32_t(e4m3x2(k[2] * p.inv_k_scale, k[3] * p.inv_k_scale)) << 16);
        out.y = uint32_t(e4m3x2(k[4] * p.inv_k_scale, k[5] * p.inv_k_scale)) |
                (uint32_t(e4m3x2(k[6] * p.inv_k_scale, k[7] * p.inv_k_scale)) << 16);
        *reinterpret_cast<uint2*>(dst + kKvLoraRank + lane * 8) = out;
      }
    }
  }

  cp_async_wait_all();
  __syncthreads();

  // Phase 4: ql = q_nope . W_UK_T[h] over (16-column m-tile, 8-row n-tile) pairs; e4m3 into s_out.
  {
    const int m_tiles = p.absorb_cols / 16;
    const int n_tiles = (rows_here + 7) / 8;
    const int g = lane / 4, t = lane % 4;
    const int mi = lane / 8, mj = lane % 8;
    for (int pair = warp; pair < m_tiles * n_tiles; pair += kAbsorbWarps) {
      const int mt = pair % m_tiles, nt = pair / m_tiles;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ks = 0; ks < kNopeDim / 16; ks += 2) {
        uint32_t a0[4], a1[4], b[4];
        ldmatrix_x4_trans(a0, s_w + (ks * 16 + mj + 8 * (mi / 2)) * w_stride + mt * 16 + 8 * (mi % 2));
        ldmatrix_x4_trans(a1, s_w + ((ks + 1) * 16 + mj + 8 * (mi / 2)) * w_stride + mt * 16 + 8 * (mi % 2));
        ldmatrix_x4(b, s_q + (nt * 8 + mj) * q_stride + ks * 16 + 8 * mi);
        mma_bf16_16816(acc, a0[0], a0[1], a0[2], a0[3], b[0], b[1]);
        mma_bf16_16816(acc, a1[0], a1[1], a1[2], a1[3], b[2], b[3]);
      }
      // d0 (col g, row 2t), d1 (g, 2t+1), d2 (g+8, 2t), d3 (g+8, 2t+1)
      const uint16_t v01 = e4m3x2(acc[0] * p.inv_q_scale, acc[1] * p.inv_q_scale);
      const uint16_t v23 = e4m3x2(acc[2] * p.inv_q_scale, acc[3] * p.inv_q_scale);
      uint8_t* o = s_out + (nt * 8 + 2 * t) * out_stride + mt * 16 + g;
      o[0] = uint8_t(v01 & 0xff);
      o[out_stride] = uint8_t(v01 >> 8);
      o[8] = uint8_t(v23 & 0xff);
      o[out_stride + 8] = uint8_t(v23 >> 8);
    }
  }
  __syncthreads();

  // Phase 5: coalesced 16-byte stores of the latent part of the query.
  {
    const int vecs_per_row = p.absorb_cols / 16;
    for (int i = threadIdx.x; i < rows_here * vecs_per_row; i += kAbsorbThreads) {
      const int rr = i / vecs_per_row, v = i % vecs_per_row;
      uint8_t* dst = p.query + (int64_t(row0 + rr) * p.num_heads_out + p.head_offset + head) * kKeyDim + col0 + v * 16;
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(s_out + rr * out_stride + v * 16);
    }
  }

  // Phase 6: every store of this CTA is issued; let the dependents (the attention core) launch.
  __syncthreads();
  trigger_dependents();
}

}  // namespace mla::query
