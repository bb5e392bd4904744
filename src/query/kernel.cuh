// The fused query kernel: one launch computes both RMSNorms, q_b_proj, the W_UK absorption, the e4m3
// query and the e4m3 cache rows (DESIGN.md §4, query stage).
//
// Grid (C, row tiles, H), clusters of C CTAs along x: the cluster of (row tile, head) owns that head
// for those rows, so the head's q never leaves it. CTA r of the cluster:
//   0. before griddepcontrol.wait: the first kFusedPrefetch chunks of its q_b_proj K slice into registers, then
//      cp.async of its W_UK_T[h] column slice (FusedSmemPlan::col_begin) into shared memory (neither depends on
//      the producer of `projected`);
//   1. RMSNorm(q_a) of the tile's rows, its K slice of qn to shared memory; the cache rows of the tile (spread over
//      all CTAs: row rr by CTA rr % CTAs, in the warp that norms it, its loads beside the q_a ones);
//   2. partial q = q_b_proj[h] . qn over its K slice on mma.sync (weights global -> registers);
//   3. the fp32 partial tile to shared memory;
//   4. cluster barrier; q = bf16(sum of the C partials, rank order) of the batch's rows, read through
//      distributed shared memory (rank 0 also quantizes the rope part and, for tests, stores the fp32 q);
//   5. ql = q_nope . W_UK_T[h][:, its columns] on mma.sync, e4m3, 16-byte stores;
//   6. waits until every peer has read its partials, then triggers its dependents.
// With kRopeCtas (C = 1 only, QueryPlan.rope_ctas): the head CTAs (blockIdx.z < H) project only the 128 nope
// features (warps 0-7) and the CTAs past them each project p.rope_tiles_per_cta 16-feature rope tiles of any heads
// (a warp a tile, the whole K) and quantize them straight into the query's rope bytes: the SMs that no head
// would occupy stream a third of q_b_proj (H = 96 on 132 SMs: 96 head CTAs of 8 tiles plus W_UK, 35 rope CTAs
// of up to 11 tiles, about the same bytes each, instead of 96 CTAs of 12 tiles plus W_UK).
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/timeline.cuh"
#include "query/config.h"
#include "query/device_utils.cuh"
#include "query/params.h"

namespace mla::query {

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// NOTE: a release arrive is MEMBAR.ALL.GPU + UCGABAR_ARV in SASS: it waits until every earlier global store of the
// thread is performed at GPU scope (a round trip to L2). Only the partial tiles' hand-over needs it; the arrive that
// only says "done reading the peers" is relaxed.
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

template <int kNTiles, int kCluster, bool kRopeCtas>
__global__ void __launch_bounds__(kFusedThreads, 1) fused_query_kernel(const __grid_constant__ QueryParams p) {
  static_assert(!kRopeCtas || kCluster == 1, "rope CTAs only with whole-K head CTAs (C = 1)");
  constexpr int kRowTile = 8 * kNTiles;
  constexpr FusedSmemPlan kPlan{kRowTile, kCluster};
  constexpr int kSplitLen = kPlan.split_len(), kCols = kPlan.cols();
  constexpr int kNumChunks = kSplitLen / kKChunk;
  constexpr int kQnStride = kPlan.qn_stride(), kWStride = kPlan.w_stride(), kQStride = kPlan.q_stride();
  constexpr int kOutStride = kPlan.out_stride();
  static_assert(kPlan.bytes() <= kMaxSmemPerCta, "shared-memory plan too large for this (rows, C)");

  extern __shared__ __align__(16) uint8_t smem_raw[];
  __nv_bfloat16* s_qn = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  float* s_part = reinterpret_cast<float*>(smem_raw);  // aliases s_qn after the projection
  __nv_bfloat16* s_w = reinterpret_cast<__nv_bfloat16*>(smem_raw + kPlan.w_offset());
  __nv_bfloat16* s_q = reinterpret_cast<__nv_bfloat16*>(smem_raw + kPlan.q_offset());
  uint8_t* s_out = smem_raw + kPlan.out_offset();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int rank = blockIdx.x;  // == the cluster rank: the cluster spans grid x exactly
  const int row0 = blockIdx.y * kRowTile;
  const bool rope_cta = kRopeCtas && int(blockIdx.z) >= p.num_heads;
  const int head = blockIdx.z;  // a head CTA's head (rope CTAs: unused)
  const int rows_here = min(kRowTile, p.num_rows - row0);
  // This warp's 16-feature tile of q_b_proj: rows tile_head * 192 + tile_feature + [0, 16), if it has one.
  int tile_head = head, tile_feature = warp * kFeatureTile;
  bool has_tile = true;
  if constexpr (kRopeCtas) {
    if (rope_cta) {
      const int tile = (int(blockIdx.z) - p.num_heads) * p.rope_tiles_per_cta + warp;  // of the H * 4 rope tiles
      has_tile = warp < p.rope_tiles_per_cta && tile < p.num_heads * kRopeTilesPerHead;
      tile_head = tile / kRopeTilesPerHead;
      tile_feature = kNopeDim + (tile % kRopeTilesPerHead) * kFeatureTile;
    } else {
      has_tile = tile_feature < kNopeDim;  // warps 0-7: the nope features
    }
  }
  // This rank's latent columns (C = 3 and 6 deal the 32 tiles unevenly; constant otherwise).
  const int k0 = rank * kSplitLen, col0 = kPlan.col_begin(rank);
  const int cols_here = kColTiles % kCluster == 0 ? kCols : kPlan.cols_of(rank);
  const int num_features = p.num_heads * kQkHeadDim;
  MLA_TIMELINE_MARK(p.timeline, kMarkStart);

  // Phase 0: weight traffic that does not depend on the producer, issued before the wait.
  // Warp w owns features [16w, 16w+16) of the head; lane (g, t) streams rows g and g+8 of that tile
  // at k = k0 + 32c + 8t (the permutation of k that the B fragments below repeat; see proj_kernel).
  const __nv_bfloat16* w_lo =
      p.q_b_proj + (int64_t(tile_head) * kQkHeadDim + tile_feature + g) * kQLoraRank + k0 + t * 8;
  const __nv_bfloat16* w_hi = w_lo + 8 * kQLoraRank;
  uint4 a_lo[kFusedPrefetch], a_hi[kFusedPrefetch];
#pragma unroll
  for (int i = 0; i < kFusedPrefetch; ++i) {
    if (i < kNumChunks && has_tile) {
      a_lo[i] = load_stream(w_lo + i * kKChunk);
      a_hi[i] = load_stream(w_hi + i * kKChunk);
    }
  }
  // W_UK_T's slice after the first q_b_proj chunks: the absorption needs it last. NOTE: measured (H100, 2026-12-06,
  // two calls): issued before the chunks it held up the projection, 1.02-1.04x slower at H = 12-64 x 1-16 rows.
  if (!rope_cta) {
    const __nv_bfloat16* src = p.w_uk_t + int64_t(head) * kNopeDim * kKvLoraRank + col0;
    const int vecs_per_row = cols_here / 8;
    for (int i = threadIdx.x; i < kNopeDim * vecs_per_row; i += kFusedThreads) {
      const int d = i / vecs_per_row, v = i % vecs_per_row;
      cp_async_16(s_w + d * kWStride + v * 8, src + int64_t(d) * kKvLoraRank + v * 8);
    }
    cp_async_commit();
  }

  // q_a_norm's weights for this lane's columns of the K slice (the norm below: column (j*32 + lane)*8,
  // slot j - norm_first_j), also a weight: loaded before the wait so that the norm after it waits on one
  // round trip (the projected row), not two. NOTE: measured (timeline, H=12 rows=1) 2.56 µs from the
  // wait to the normed tile while the q_a_norm load came after the row's sum.
  // A lane's columns of the slice lie in j = k0/256 .. (k0 + kSplitLen - 8)/256: kSplitLen / 256 of
  // them when the slice is 256-aligned, else up to two more (a slice of 192 can straddle two j).
  constexpr int kNormSlots = kSplitLen % 256 == 0 ? kSplitLen / 256 : kSplitLen / 256 + 2;
  const int norm_first_j = k0 / 256;
  uint4 norm_w[kNormSlots];
#pragma unroll
  for (int slot = 0; slot < kNormSlots; ++slot) {
    const int k = ((norm_first_j + slot) * 32 + lane) * 8;
    norm_w[slot] = k >= k0 && k < k0 + kSplitLen ? *reinterpret_cast<const uint4*>(p.q_a_norm + k)
                                                 : make_uint4(0u, 0u, 0u, 0u);
  }

  MLA_TIMELINE_MARK(p.timeline, kMarkIssued);

  // Phase 1: the producer of `projected` is complete (and, transitively, whatever read our outputs).
  grid_dependency_wait();
  MLA_TIMELINE_MARK(p.timeline, kMarkWaited);

  // Cache rows, e4m3([RMSNorm(kv_a) | k_pe] * inv_k_scale): row rr of the tile by CTA rr % (CTAs of the row tile),
  // in the warp that norms its q_a below, whose kv_a / k_pe / kv_a_norm loads go out with the q_a ones (one round
  // trip for both). NOTE: measured (timeline, H100, H = 12 x 1 row): written after the projection by one warp of
  // one CTA, the cache row's own round trips kept that CTA's partials ~1.3 µs behind its peers', and so its cluster.
  const int tile_ctas = gridDim.x * gridDim.z;
  const int tile_cta = blockIdx.z * gridDim.x + blockIdx.x;
  auto write_cache_row = [&](int64_t cache_slot, const uint4 (&kv)[2], const uint4 (&kv_w)[2], const uint4& k_pe) {
    uint8_t* dst =
        p.cache + (cache_slot / kPageSize) * p.stride_cache_page + (cache_slot % kPageSize) * kKeyDim;
    float f[2][8];
    unpack8(kv[0], f[0]);
    unpack8(kv[1], f[1]);
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
      unpack8(kv_w[j], w);
      float y[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        // kvn = bf16(kv_a * inv_rms * w), then e4m3(kvn * inv_k_scale).
        y[e] = __bfloat162float(__float2bfloat16_rn(f[j][e] * inv_rms * w[e])) * p.inv_k_scale;
      }
      *reinterpret_cast<uint2*>(dst + j * 256 + lane * 8) = e4m3x8(y, 1.0f);
    }
    if (lane < kRopeDim / 8) {
      float k[8];
      unpack8(k_pe, k);
      *reinterpret_cast<uint2*>(dst + kKvLoraRank + lane * 8) = e4m3x8(k, p.inv_k_scale);
    }
  };

  // RMSNorm of q_a, one warp per row; lane holds columns (j*32 + lane)*8 + [0,8), j < 6. Rows past
  // the batch get a zero slice (their partials are then zero and never stored).
  for (int rr = warp; rr < kRowTile; rr += kFusedWarps) {
    const int row = row0 + rr;
    __nv_bfloat16* dst = s_qn + rr * kQnStride;
    if (row >= p.num_rows) {
      for (int k = lane * 8; k < kSplitLen; k += 256) *reinterpret_cast<uint4*>(dst + k) = make_uint4(0, 0, 0, 0);
      continue;
    }
    const __nv_bfloat16* src = p.projected + int64_t(row) * p.stride_projected_row + kProjectedQaOffset;
    uint4 v[6];
#pragma unroll
    for (int j = 0; j < 6; ++j) v[j] = *reinterpret_cast<const uint4*>(src + (j * 32 + lane) * 8);
    // This CTA's cache row: its loads do not wait for the slot's (a slot of -1 or past the cache writes nothing).
    const bool owns_cache_row = rr % tile_ctas == tile_cta;
    const int64_t cache_slot = owns_cache_row ? p.slots[row] : -1;
    uint4 kv[2], kv_w[2], k_pe = make_uint4(0u, 0u, 0u, 0u);
    if (owns_cache_row) {
      const __nv_bfloat16* row_base = p.projected + int64_t(row) * p.stride_projected_row;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        kv[j] = *reinterpret_cast<const uint4*>(row_base + kProjectedKvaOffset + j * 256 + lane * 8);
        kv_w[j] = *reinterpret_cast<const uint4*>(p.kv_a_norm + j * 256 + lane * 8);
      }
      if (lane < kRopeDim / 8) k_pe = *reinterpret_cast<const uint4*>(row_base + kProjectedKpeOffset + lane * 8);
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 6; ++j) {
      float f[8];
      unpack8(v[j], f);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
    }
    ss = warp_sum(ss);
    if (rr == 0) MLA_TIMELINE_MARK(p.timeline, kMarkRowLoaded);  // splits the norm phase: the row's round trip
    const float inv_rms = rsqrtf(ss / float(kQLoraRank) + p.rms_eps);
#pragma unroll
    for (int j = 0; j < 6; ++j) {
      const int k = (j * 32 + lane) * 8;
      if (k < k0 || k >= k0 + kSplitLen) continue;
      float f[8], w[8];
      unpack8(v[j], f);
      uint4 w_packed = norm_w[0];  // the slot of column k (static register indexing: no local memory)
#pragma unroll
      for (int slot = 1; slot < kNormSlots; ++slot) {
        if (j == norm_first_j + slot) w_packed = norm_w[slot];
      }
      unpack8(w_packed, w);
      uint4 out;
      out.x = pack_bf16x2(f[0] * inv_rms * w[0], f[1] * inv_rms * w[1]);
      out.y = pack_bf16x2(f[2] * inv_rms * w[2], f[3] * inv_rms * w[3]);
      out.z = pack_bf16x2(f[4] * inv_rms * w[4], f[5] * inv_rms * w[5]);
      out.w = pack_bf16x2(f[6] * inv_rms * w[6], f[7] * inv_rms * w[7]);
      *reinterpret_cast<uint4*>(dst + (k - k0)) = out;
    }
    if (cache_slot >= 0 && cache_slot / kPageSize < p.num_cache_pages) write_cache_row(cache_slot, kv, kv_w, k_pe);
  }
  __syncthreads();
  MLA_TIMELINE_MARK(p.timeline, kMarkNormed);

  // Phase 2: the projection over the K slice; kFusedPrefetch chunks in flight per warp.
  float acc[kNTiles][4];
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  if (has_tile) {
    const __nv_bfloat16* b_base = s_qn + g * kQnStride + t * 8;
#pragma unroll 1
    for (int c0 = 0; c0 < kNumChunks; c0 += kFusedPrefetch) {
#pragma unroll
      for (int i = 0; i < kFusedPrefetch; ++i) {
        const int c = c0 + i;
        if (c < kNumChunks) {
          const uint4 lo = a_lo[i], hi = a_hi[i];
          const int next = c + kFusedPrefetch;
          if (next < kNumChunks) {
            a_lo[i] = load_stream(w_lo + next * kKChunk);
            a_hi[i] = load_stream(w_hi + next * kKChunk);
          }
#pragma unroll
          for (int n = 0; n < kNTiles; ++n) {
            const uint4 b = *reinterpret_cast<const uint4*>(b_base + n * 8 * kQnStride + c * kKChunk);
            mma_bf16_16816(acc[n], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
            mma_bf16_16816(acc[n], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
          }
        }
      }
    }
  }
  __syncthreads();  // every warp is done with s_qn: region A becomes the partial tile
  MLA_TIMELINE_MARK(p.timeline, kMarkProjected);

  // A rope CTA's tiles are whole q features: bf16, then e4m3 into the query's rope bytes (and, for tests, the
  // fp32 q), and it is done (no partials, no absorption; its share of the cache rows went out with the norm).
  if constexpr (kRopeCtas) {
    if (rope_cta) {
      if (has_tile) {
        const int f = tile_feature - kNopeDim + g;  // this thread's features f and f + 8 of the rope part
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int row = row0 + n * 8 + 2 * t + e;
            if (row >= p.num_rows) continue;
            const float lo = acc[n][e], hi = acc[n][2 + e];  // features f, f + 8
            if (p.workspace != nullptr) {
              float* ws = p.workspace + int64_t(row) * num_features + tile_head * kQkHeadDim + kNopeDim + f;
              ws[0] = lo;
              ws[8] = hi;
            }
            const float q_lo = __bfloat162float(__float2bfloat16_rn(lo)), q_hi = __bfloat162float(__float2bfloat16_rn(hi));
            const uint16_t bytes = e4m3x2(q_lo * p.inv_q_scale, q_hi * p.inv_q_scale);
            uint8_t* dst =
                p.query + (int64_t(row) * p.num_heads_out + p.head_offset + tile_head) * kKeyDim + kKvLoraRank + f;
            dst[0] = uint8_t(bytes & 0xff);
            dst[8] = uint8_t(bytes >> 8);
          }
        }
      }
      // The phases a rope CTA skips (cluster, sum, absorption) take no time in a timeline report.
      for (int mark = kMarkPartials; mark <= kMarkEnd; ++mark) MLA_TIMELINE_MARK(p.timeline, mark);
      trigger_dependents();  // every store of this CTA is issued
      return;
    }
  }

  // Phase 3: partial tile [row][feature] (fp32). d0 (feature g, row 2t), d1 (g, 2t+1), d2 (g+8, 2t),
  // d3 (g+8, 2t+1) of n-tile n.
  {
    float* dst = s_part + warp * kFeatureTile + g;
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
      const int r = n * 8 + 2 * t;
      dst[r * kPartialStride] = acc[n][0];
      dst[(r + 1) * kPartialStride] = acc[n][1];
      dst[r * kPartialStride + 8] = acc[n][2];
      dst[(r + 1) * kPartialStride + 8] = acc[n][3];
    }
  }

  // Phase 4: every partial tile of the cluster is written and visible (release/acquire; a CTA barrier where the
  // cluster is this CTA alone).
  MLA_TIMELINE_MARK(p.timeline, kMarkPartials);
  if constexpr (kCluster > 1) {
    cluster_arrive_release();
    cluster_wait_acquire();
  } else {
    __syncthreads();
  }
  MLA_TIMELINE_MARK(p.timeline, kMarkClusterSynced);
  {
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    const float* parts[kCluster];
#pragma unroll
    for (int r = 0; r < kCluster; ++r) parts[r] = cluster.map_shared_rank(s_part, r);
    // Rank 0 also owns the rope features (48 float4 groups a row; the others take the 32 nope ones), unless
    // rope CTAs do (kRopeCtas).
    // NOTE: two items per thread per round: their 2*C distributed-shared-memory loads are in flight
    // together (one round trip each would dominate at C = 16).
    const int vec_per_row = rank == 0 && !kRopeCtas ? kQkHeadDim / 4 : kNopeDim / 4;
    // Only the batch's rows: at 1 row of an 8-row tile this is 8x less distributed-shared-memory
    // traffic (H=12 rows=1: 8.0 -> 6.7 µs). Rows past the batch stay unset in s_q; their mma outputs
    // (one n column each) are never stored.
    const int num_vec = rows_here * vec_per_row;
    // Item i is float4 group f / 4 of tile row rr. vec_per_row is 32 or 48: two divisions by constants (a shift, a
    // multiply-high) and a select, not the ~20-instruction runtime division in front of the peer loads.
    auto item_row = [vec_per_row](int i) {
      constexpr unsigned kNopeVecs = kNopeDim / 4, kHeadVecs = kQkHeadDim / 4;
      return int(vec_per_row == int(kNopeVecs) ? unsigned(i) / kNopeVecs : unsigned(i) / kHeadVecs);
    };
    constexpr int kBatch = 2;
    for (int base = threadIdx.x; base < num_vec; base += kBatch * kFusedThreads) {
      float4 v[kBatch][kCluster];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * kFusedThreads;
        if (i >= num_vec) continue;
        const int rr = item_row(i), f = (i - rr * vec_per_row) * 4;
#pragma unroll
        for (int r = 0; r < kCluster; ++r) v[u][r] = *reinterpret_cast<const float4*>(parts[r] + rr * kPartialStride + f);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * kFusedThreads;
        if (i >= num_vec) continue;
        const int rr = item_row(i), f = (i - rr * vec_per_row) * 4;
        float4 s = v[u][0];
#pragma unroll
        for (int r = 1; r < kCluster; ++r) {
          s.x += v[u][r].x; s.y += v[u][r].y; s.z += v[u][r].z; s.w += v[u][r].w;
        }
        const int row = row0 + rr;
        if (rank == 0 && p.workspace != nullptr && row < p.num_rows)
          *reinterpret_cast<float4*>(p.workspace + int64_t(row) * num_features + head * kQkHeadDim + f) = s;
        const uint32_t lo = pack_bf16x2(s.x, s.y), hi = pack_bf16x2(s.z, s.w);
        if (f < kNopeDim) {
          *reinterpret_cast<uint2*>(s_q + rr * kQStride + f) = make_uint2(lo, hi);
        } else if (row < p.num_rows) {
          const float q0 = __uint_as_float(lo << 16), q1 = __uint_as_float(lo & 0xffff0000u);
          const float q2 = __uint_as_float(hi << 16), q3 = __uint_as_float(hi & 0xffff0000u);
          const uint32_t bytes = uint32_t(e4m3x2(q0 * p.inv_q_scale, q1 * p.inv_q_scale)) |
                                 (uint32_t(e4m3x2(q2 * p.inv_q_scale, q3 * p.inv_q_scale)) << 16);
          uint8_t* dst = p.query + (int64_t(row) * p.num_heads_out + p.head_offset + head) * kKeyDim + kKvLoraRank +
                         (f - kNopeDim);
          *reinterpret_cast<uint32_t*>(dst) = bytes;
        }
      }
    }
  }
  cp_async_wait_all();
  __syncthreads();           // s_q and s_w complete
  MLA_TIMELINE_MARK(p.timeline, kMarkSummed);
  // This CTA has read its peers' partials (matched by the wait at the end, before a peer may exit). Relaxed: every
  // one of those loads has returned (its value is in s_q, behind the barrier above), and a release would first wait
  // for this thread's global stores (rank 0's rope bytes) to reach L2.
  if constexpr (kCluster > 1) cluster_arrive_relaxed();

  // Phase 5: ql = q_nope . W_UK_T[h][:, col0 : col0 + cols_here] over (16-column m-tile, 8-row n-tile)
  // pairs: M = columns (A through ldmatrix.trans), N = rows, K = 128; e4m3 into s_out.
  {
    const int m_tiles = cols_here / kColTile;
    const int n_tiles = (rows_here + 7) / 8;
    const int mi = lane / 8, mj = lane % 8;
    for (int pair = warp; pair < m_tiles * n_tiles; pair += kFusedWarps) {
      const int mt = pair % m_tiles, nt = pair / m_tiles;
      float acc2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ks = 0; ks < kNopeDim / 16; ks += 2) {
        uint32_t a0[4], a1[4], b[4];
        ldmatrix_x4_trans(a0, s_w + (ks * 16 + mj + 8 * (mi / 2)) * kWStride + mt * 16 + 8 * (mi % 2));
        ldmatrix_x4_trans(a1, s_w + ((ks + 1) * 16 + mj + 8 * (mi / 2)) * kWStride + mt * 16 + 8 * (mi % 2));
        ldmatrix_x4(b, s_q + (nt * 8 + mj) * kQStride + ks * 16 + 8 * mi);
        mma_bf16_16816(acc2, a0[0], a0[1], a0[2], a0[3], b[0], b[1]);
        mma_bf16_16816(acc2, a1[0], a1[1], a1[2], a1[3], b[2], b[3]);
      }
      stage_e4m3_fragment(s_out, kOutStride, nt * 8, mt * 16, acc2, p.inv_q_scale, g, t);
    }
  }
  __syncthreads();
  MLA_TIMELINE_MARK(p.timeline, kMarkAbsorbed);
  {
    const int vecs_per_row = cols_here / 16;
    for (int i = threadIdx.x; i < rows_here * vecs_per_row; i += kFusedThreads) {
      const int rr = i / vecs_per_row, v = i % vecs_per_row;
      uint8_t* dst = p.query + (int64_t(row0 + rr) * p.num_heads_out + p.head_offset + head) * kKeyDim + col0 + v * 16;
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(s_out + rr * kOutStride + v * 16);
    }
  }

  // Phase 6: no peer reads this CTA's shared memory any more (it may exit), and every store of this
  // CTA is issued: let the dependents launch.
  if constexpr (kCluster > 1) cluster_wait_acquire();
  MLA_TIMELINE_MARK(p.timeline, kMarkEnd);
  trigger_dependents();
}

}  // namespace mla::query
