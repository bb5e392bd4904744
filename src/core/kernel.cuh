// The FP8 attention core, split-KV decode kernel (DESIGN.md §4), sm_90a, mma.sync f16 tensor cores
// over the FP8 operands converted exactly to f16.
//
// Grid: x = M-tile of the request (16 rows of the folded (q row, head) M side; fastest so that the
// M-tiles of one request read the same pages from L2 at about the same time), y = split, z = request
// (flat slots: y = the CTA, z = 1; flat_cursor).
// Block: 8 warps. Per page of 64 tokens:
//   1. wait for the page's mbarrier (the page was copied kStages-1 pages ahead, one 576-byte
//      cp.async.bulk per token row by threads 0-63, into 592-byte shared rows);
//   2. S = Q·K^T: warp w computes 16 rows x tokens [16(w%4), +16) over k half w/4 (m16n8k16 f16,
//      fp32 accumulate; the second half's partial sums go to the first through shared memory), Q from
//      an f16 tile in shared memory, K converted e4m3 -> f16 per page;
//   3. online softmax in base 2 with a lazily raised max: p = exp2(s·scale·log2e − m) as fp16 into the
//      shared P tile against the running max m (sums kept in fp32); only when a logit passes m by more
//      than kLazyMaxSlack is m raised to the page row max across the token groups (through shared memory);
//   4. O += P·V in fp16 (m16n8k16, fp32 accumulate): warp w computes 16 rows x its 64 latent dims
//      over all 64 tokens; V fragments come from ldmatrix.trans of the FP8 bytes, byte-permuted and
//      converted e4m3 -> f16x2 (exact). NOTE: FP8 P would halve the P·V MMAs but costs ~3 % relative
//      error on zero-mean latents (e4m3 keeps 3 mantissa bits of each weight); fp16 P costs ~3e-4.
// The end writes bf16 latent + LSE (one split) or fp32 partials for the combine kernel.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/lse_merge.cuh"
#include "common/timeline.cuh"
#include "common/wgmma.cuh"
#include "core/config.h"
#include "core/fp8_bits.h"
#include "core/params.h"
#include "core/split_rule.h"

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

// One arrival (release: this thread's prior shared-memory stores are visible to the waiters).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
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

// ldmatrix of four transposed 8x8 b16 matrices: thread (g, c) gets elements [2c][g] and [2c + 1][g].
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
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

// The two e4m3 values of the high 16 bits as f16x2. NOTE: through a 16-bit register view, not a
// shift: ptxas then reads the high half directly (F2FP ... R.H1), one instruction instead of two.
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t pair) {
  uint32_t h2;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(h2) : "r"(pair));
  return h2;
}

// 2^x on the MUFU unit, results below 2^-126 flushed to zero. NOTE: exp2f adds a denormal-range fixup
// (compare, two multiplies) around the same instruction; softmax weights that small are zero in fp16 P
// anyway, and a running-max rescale that small leaves nothing of the old sums at fp32 precision.
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
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

// Asks L2 for this CTA's share of the next stage's weights (CombineParams.l2_prefetch): the grid's CTAs deal the
// bytes in equal 16-byte-multiple pieces, one bulk prefetch each, so that the value stage's weight stream comes from
// L2. A hint: no data reaches the SM, nothing waits for it.
__device__ __forceinline__ void prefetch_l2_share(const uint8_t* base, int64_t total_bytes) {
  if (base == nullptr || threadIdx.x != 0) return;
  const int64_t ctas = int64_t(gridDim.x) * gridDim.y * gridDim.z;
  const int64_t cta = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t share = (total_bytes + 16 * ctas - 1) / (16 * ctas) * 16;
  const int64_t begin = cta * share;
  if (begin >= total_bytes) return;
  const uint32_t bytes = uint32_t(min(share, total_bytes - begin));
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + begin), "r"(bytes) : "memory");
}

// The pages of `request` (0 for a padded one).
__device__ __forceinline__ int request_pages(const int32_t* lengths, int num_requests, int request) {
  return request < num_requests ? pages_of(lengths[request]) : 0;
}

// A request's CTA slots (the combine's partial rows): slots [first, first + count).
struct RequestSlots {
  int first = 0;
  int count = 1;
};

// Inclusive prefix sum of v over the warp's lanes (every lane calls it).
template <class T>
__device__ __forceinline__ T warp_inclusive_sum(T v) {
  const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const T other = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += other;
  }
  return v;
}

// A split kernel CTA's work under uniform slots (grid (M-tiles, splits, requests): request blockIdx.z, split
// blockIdx.y, no scan): where its rows go and which pages of the request it reads (split_range, split_rule.h).
// Host-written data only (lengths, totals): every split kernel computes it before the PDL wait. NOTE: the kernels
// unpack it with a structured binding, in the order of its fields.
struct CtaSplit {
  int request = 0;
  int64_t entry0 = 0;          // the request's first M row in the query / latent / LSE: (b*q + i)*H + h = entry0 + mi
  int64_t partial_row0 = 0;    // this slot's first partial row (more than one split)
  int length = 0;              // the request's (local) length; 0 for padded requests
  int64_t total = 0;           // its global length (DCP), = length without DCP
  int page_begin = 0;          // first page of this split
  int num_pages = 0;           // pages of this split (0 for an empty split)
  bool writes_nothing = false; // empty, and merged by the combine (> 1 split): the CTA exits at once
  const int32_t* pages = nullptr;  // the request's block-table row
};
__device__ __forceinline__ CtaSplit cta_split(const CoreParams& p, int rows_m) {
  const int split = static_cast<int>(blockIdx.y);
  CtaSplit s;
  s.request = static_cast<int>(blockIdx.z);
  s.entry0 = int64_t{s.request} * rows_m;
  s.partial_row0 = int64_t{s.request * p.num_splits + split} * rows_m;  // its slot's partial rows
  if (s.request < p.num_requests) {
    s.length = p.lengths[s.request];
    s.total = p.totals != nullptr ? p.totals[s.request] : s.length;
  }
  const SplitRange range = split_range(s.length, p.num_splits, split);
  s.page_begin = range.page_begin;
  s.num_pages = range.num_pages;
  // With one split the request's latent is the output, so an empty request still writes its zeros / -inf.
  s.writes_nothing = s.num_pages == 0 && p.num_splits > 1;
  s.pages = p.block_table + int64_t{s.request} * p.stride_block_table;
  return s;
}

// ---- Flat slots (split_rule.h, flat_cta_range; the mma.sync and ping-pong kernels, more than one request) -----
// A warp's scan of the batch's pages: lane l sums a run of ceil(grid_requests / 32) requests. Every lane calls it.
struct PageScan {
  int first_request = 0;  // the lane's run [first_request, first_request + count)
  int count = 0;
  int before = 0;         // flattened pages before the run
  int total = 0;          // the batch's pages (every lane)
};
__device__ __forceinline__ PageScan warp_page_scan(const int32_t* lengths, int num_requests, int grid_requests) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int per_lane = (grid_requests + 31) / 32;
  PageScan s;
  s.first_request = lane * per_lane;
  s.count = max(0, min(per_lane, grid_requests - s.first_request));
  int mine = 0;
  for (int i = 0; i < s.count; ++i) mine += request_pages(lengths, num_requests, s.first_request + i);
  const int inclusive = warp_inclusive_sum(mine);
  s.total = __shfl_sync(0xffffffffu, inclusive, 31);
  s.before = inclusive - mine;
  return s;
}

// A flat-slot CTA's walk over its segments (one per request its pages touch). Host-written data only.
struct FlatCursor {
  int cta = 0;
  FlatRange range;        // the CTA's flattened pages
  int pages_per_cta = 1;  // ceil(P / N): every CTA's range but the last
  int request = 0;        // the request holding flattened page `next`
  int request_begin = 0;  // that request's first flattened page
  int next = 0;           // the CTA's next page (flattened)
};
// CTA `cta`'s range and the request of its first page (found by the lane whose run holds it). Every lane of the
// warp calls it; each warp of the CTA runs its own (the same loads, in parallel): no shared memory and no barrier
// between a CTA's start and its first page, which in a step is the critical path.
__device__ __forceinline__ FlatCursor flat_cursor(const CoreParams& p, int cta) {
  const PageScan scan = warp_page_scan(p.lengths, p.num_requests, p.grid_requests);
  FlatCursor cur;
  cur.cta = cta;
  cur.pages_per_cta = flat_pages_per_cta(scan.total, p.num_splits * p.grid_requests);
  cur.range = flat_cta_range(cta, scan.total, cur.pages_per_cta);
  cur.next = cur.range.begin;
  const int page = cur.range.begin;
  int request = scan.first_request, begin = scan.before;
  bool found = false;
  if (page < cur.range.end) {
    for (int i = 0; i < scan.count; ++i) {
      const int pages = request_pages(p.lengths, p.num_requests, scan.first_request + i);
      if (!found && page >= begin && page < begin + pages) {
        found = true;
        request = scan.first_request + i;
      }
      if (!found) begin += pages;
    }
  }
  const unsigned ballot = __ballot_sync(0xffffffffu, found);
  const int owner = ballot != 0 ? __ffs(ballot) - 1 : 0;
  cur.request = __shfl_sync(0xffffffffu, request, owner);
  cur.request_begin = __shfl_sync(0xffffffffu, begin, owner);
  return cur;
}

// The cursor's next segment as a CtaSplit (partial rows at slot request + cta), advancing past it; false when the
// CTA's pages are done.
__device__ __forceinline__ bool flat_next_segment(const CoreParams& p, FlatCursor& cur, int rows_m, CtaSplit& s) {
  while (cur.next < cur.range.end) {
    const int length = cur.request < p.num_requests ? p.lengths[cur.request] : 0;
    const int pages = pages_of(length);
    if (cur.next < cur.request_begin + pages) {
      s.request = cur.request;
      s.entry0 = int64_t{cur.request} * rows_m;
      s.partial_row0 = int64_t{cur.request + cur.cta} * rows_m;
      s.length = length;
      s.total = p.totals != nullptr ? p.totals[cur.request] : length;
      s.page_begin = cur.next - cur.request_begin;
      const int end = min(cur.range.end, cur.request_begin + pages);
      s.num_pages = end - cur.next;
      s.writes_nothing = false;
      s.pages = p.block_table + int64_t{cur.request} * p.stride_block_table;
      cur.next = end;
      return true;
    }
    cur.request_begin += pages;
    ++cur.request;
  }
  return false;
}

// Flat slots: the CTA holding a request's first page records the request's slots (first, count) for the combine, which
// then needs no page scan of its own (one scan per entry-warp cost up to 30 µs at 128 requests, ncu 2026-12-05). Called
// at each segment's start, after the PDL wait; the cursor's request_begin is the segment's request's first page.
template <int kSlots>
__device__ __forceinline__ void record_request_slots(const CoreParams& p, const FlatCursor& cursor,
                                                     const CtaSplit& segment) {
  if constexpr (kSlots == kSlotsFlat) {  // (flat-merged: no combine reads them)
    if (segment.page_begin == 0 && blockIdx.x == 0 && threadIdx.x == 0) {
      const FlatSlots slots =
          flat_request_slots(segment.request, cursor.request_begin, pages_of(segment.length), cursor.pages_per_cta);
      *reinterpret_cast<int2*>(p.request_slots + 2 * segment.request) = make_int2(slots.first, slots.count);
    }
  }
}

// A split kernel CTA's first segment: its split under uniform slots, the first request its pages touch under flat ones.
// False: the CTA writes nothing and exits (an empty split, or past the batch's pages).
// NOTE: the uniform instantiations carry no page scan: inlined there too, a scan (the balanced deal's, since removed)
// grew their code before the first copy from ~100 to ~600 SASS instructions and cost them 1.5-6 % (2026-12-05).
template <int kSlots>
__device__ __forceinline__ bool first_segment(const CoreParams& p, int rows_m, FlatCursor& cursor, CtaSplit& segment) {
  if constexpr (is_flat(kSlots)) {
    cursor = flat_cursor(p, static_cast<int>(blockIdx.y));
    return flat_next_segment(p, cursor, rows_m, segment);
  } else {
    segment = cta_split(p, rows_m);
    return !segment.writes_nothing;
  }
}
// Its next segment: only flat slots have more than one.
template <int kSlots>
__device__ __forceinline__ bool next_segment(const CoreParams& p, int rows_m, FlatCursor& cursor, CtaSplit& segment) {
  if constexpr (is_flat(kSlots)) return flat_next_segment(p, cursor, rows_m, segment);
  return false;
}

// Whether a segment writes the request's bf16 latent and LSE itself (no partial, no merge): the request's only split,
// or under flat slots a segment holding all of the request's pages (the combine then skips it).
template <int kSlots>
__device__ __forceinline__ bool writes_directly(const CoreParams& p, int page_begin, int num_pages, int length) {
  if constexpr (is_flat(kSlots)) return page_begin == 0 && num_pages == pages_of(length);
  return p.num_splits == 1;
}

// Flat slots merged in the split kernel (kSlotsFlatMerged): a request without pages (length 0, or padding past
// num_requests) lies in no CTA's range and no combine runs, so CTA (tile, r) of the first grid_requests CTA slots
// writes request r's tile as the combine would: latent 0, lse -inf. Every thread calls it once the CTA's segments
// are done (or when it has none); it waits for the previous kernel first (which may still read these outputs).
template <int kSlots, int kThreads, int kTileRows>
__device__ __forceinline__ void write_empty_request_tile(const CoreParams& p, int rows_m, int tile) {
  if constexpr (kSlots == kSlotsFlatMerged) {
    const int request = static_cast<int>(blockIdx.y);
    if (request >= p.grid_requests) return;
    if (request < p.num_requests && p.lengths[request] > 0) return;
    griddep_wait();
    const int tile_row0 = tile * kTileRows;
    const int rows = min(kTileRows, rows_m - tile_row0);
    const int64_t entry0 = int64_t{request} * rows_m + tile_row0;
    constexpr int kQuads = kKvLoraRank / 4;  // 8-byte stores of 4 bf16
    for (int i = threadIdx.x; i < rows * kQuads; i += kThreads) {
      *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.latent) + (entry0 + i / kQuads) * kKvLoraRank +
                                (i % kQuads) * 4) = make_uint2(0u, 0u);
    }
    for (int r = threadIdx.x; r < rows; r += kThreads) p.lse[entry0 + r] = -INFINITY;
  }
}

// The 16 e4m3 bytes of one k16 step of the query as f16, in the permuted k order both kernels use:
// lo = logical k 0..7 (k 2c + e holds byte 4c + e: the low halves of the 4 words), hi = k 8..15
// (k 8 + 2c + e holds byte 4c + 2 + e). e4m3 -> f16 is exact.
__device__ __forceinline__ void e4m3x16_to_f16_permuted(const uint4& v, uint4& lo, uint4& hi) {
  lo = make_uint4(e4m3x2_to_f16x2(v.x), e4m3x2_to_f16x2(v.y), e4m3x2_to_f16x2(v.z), e4m3x2_to_f16x2(v.w));
  hi = make_uint4(e4m3x2_hi_to_f16x2(v.x), e4m3x2_hi_to_f16x2(v.y), e4m3x2_hi_to_f16x2(v.z),
                  e4m3x2_hi_to_f16x2(v.w));
}

// Latent dims [dim, dim + 4) of one (row, head) entry, already normalized: bf16 into the latent when
// the request has one split (`direct`), else fp32 into partial row `partial_row` (its slot's) for the combine.
__device__ __forceinline__ void store_latent4(const CoreParams& p, bool direct, int64_t partial_row, int64_t entry,
                                              int dim, float v0, float v1, float v2, float v3) {
  if (direct) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(v0, v1);
    __nv_bfloat162 hi = __floats2bfloat162_rn(v2, v3);
    uint2 packed;
    packed.x = *reinterpret_cast<uint32_t*>(&lo);
    packed.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.latent) + entry * kKvLoraRank + dim) = packed;
  } else {
    float* dst = p.partial_latent + partial_row * kKvLoraRank + dim;
    *reinterpret_cast<float4*>(dst) = make_float4(v0, v1, v2, v3);
  }
}

// One more split's LSE x (natural log) into a running fold: max_lse the largest so far, sum the sum of exp(lse -
// max_lse). A larger x rescales the sum to it; -inf (the split's rows see nothing) adds nothing; a NaN x (a NaN
// logit in the split) makes both NaN, and they stay NaN. The first pass of both merges of split partials (the
// combine kernel, merge_if_last_segment).
__device__ __forceinline__ void fold_lse(float x, float& max_lse, float& sum) {
  if (x > max_lse || x != x) {
    sum = sum * __expf(max_lse - x) + 1.0f;  // max_lse = -inf: sum was 0
    max_lse = x;
  } else if (x != -INFINITY) {
    sum += __expf(x - max_lse);
  }
}

// Flat slots merged in the split kernel (CoreParams::tile_counters, CorePlan::merge_in_split), the ping-pong kernel's
// way (the mma.sync kernel merges into its registers instead: core_split_kernel, Phase 5). Every thread of the CTA
// calls this after its segment's stores; a segment that is one of several of its request takes a ticket on the
// request's M-tile counter, and the CTA holding the last one (every other segment's partial is stored) resets the
// counter to 0 for the next launch and merges the tile's rows from the request's slots as the combine would: latent
// = bf16(k_scale * sum_s exp(lse_s - max) * latent_s / sum_s exp(lse_s - max)), lse = max + ln(sum); all slots
// -inf: latent 0, lse -inf. `scratch`: 2 * kTileRows + 1 floats of shared memory the finished segment no longer
// reads. Returns after a barrier, so the next segment may reuse them. NOTE: the partials of other CTAs are read
// with __ldcg (L2): this SM's L1 may hold none of them, but nothing else says so.
// NOTE: the merge sits on its CTA's path (at the tail of a uniform batch, before the next segment of a varlen one),
// so its loads go out together: no load waits on another (a slot's LSE and latent rows are loaded side by side and
// weighed after both land), kItemsInFlight (row, 4-dim) items of two slots at a time a thread. Loading the LSE
// first and the latent only where it weighs more than 0 made two round trips of every (item batch, slot): 32 at a
// 64-row tile (~15 µs by that count; the first form never ran on a GPU).
template <int kThreads, int kTileRows, int kItemsInFlight>
__device__ __forceinline__ void merge_if_last_segment(const CoreParams& p, const FlatCursor& cursor,
                                                      const CtaSplit& segment, int tile, int rows_m, float* scratch) {
  const FlatSlots slots =
      flat_request_slots(segment.request, cursor.request_begin, pages_of(segment.length), cursor.pages_per_cta);
  if (slots.count <= 1) return;  // the segment held the whole request: written directly (writes_directly)
  __threadfence();               // this thread's partial stores, before the CTA's ticket
  __syncthreads();
  float* row_max = scratch;
  float* row_scale = scratch + kTileRows;
  float* last_flag = scratch + 2 * kTileRows;
  if (threadIdx.x == 0) {
    int* counter = p.tile_counters + int64_t{segment.request} * gridDim.x + tile;
    const bool last = atomicAdd(counter, 1) == slots.count - 1;
    if (last) *counter = 0;  // every segment of the tile has arrived: nobody else touches it this launch
    *last_flag = last ? 1.0f : 0.0f;
  }
  __syncthreads();
  if (*last_flag == 0.0f) {
    __syncthreads();  // the flag is read by every thread before a later call rewrites it
    return;
  }
  __threadfence();  // the other segments' partials, seen through their tickets
  const int tile_row0 = tile * kTileRows;
  const int rows = min(kTileRows, rows_m - tile_row0);
  const int64_t slot_row0 = int64_t{slots.first} * rows_m + tile_row0;  // slot s of tile row r: + s * rows_m + r
  // 1. Per row: the largest LSE and k_scale / sum of exp(lse_s - max); the merged LSE. Four slots' loads at a time.
  constexpr int kLseInFlight = 4;
  for (int r = threadIdx.x; r < rows; r += kThreads) {
    float max_lse = -INFINITY, sum = 0.0f;
    for (int s0 = 0; s0 < slots.count; s0 += kLseInFlight) {
      float x[kLseInFlight];
#pragma unroll
      for (int u = 0; u < kLseInFlight; ++u) {
        x[u] = s0 + u < slots.count ? __ldcg(p.partial_lse + slot_row0 + int64_t{s0 + u} * rows_m + r) : -INFINITY;
      }
#pragma unroll
      for (int u = 0; u < kLseInFlight; ++u) fold_lse(x[u], max_lse, sum);
    }
    row_max[r] = max_lse;
    row_scale[r] = sum_weighs(sum) ? __fdividef(p.k_scale, sum) : 0.0f;
    p.lse[segment.entry0 + tile_row0 + r] = sum_weighs(sum) ? max_lse + logf(sum) : -INFINITY;
  }
  __syncthreads();
  // 2. The latent: (row, 4 dims) items, kItemsInFlight a thread, two slots' loads at a time (each slot's LSE beside
  // its latent rows). Every recorded slot's rows were stored this launch (finite: a segment whose rows see nothing
  // stores zeros), but a slot that weighs 0 is dropped by a select, never multiplied in.
  constexpr int kQuads = kKvLoraRank / 4;
  const int items = rows * kQuads;
  for (int item0 = threadIdx.x; item0 < items; item0 += kItemsInFlight * kThreads) {
    float4 acc[kItemsInFlight];
#pragma unroll
    for (int u = 0; u < kItemsInFlight; ++u) acc[u] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 2
    for (int s = 0; s < slots.count; ++s) {
      float x[kItemsInFlight];
      float4 v[kItemsInFlight];
#pragma unroll
      for (int u = 0; u < kItemsInFlight; ++u) {
        const int item = min(item0 + u * kThreads, items - 1);  // past the last item: a duplicate load, never stored
        const int64_t row = slot_row0 + int64_t{s} * rows_m + item / kQuads;
        x[u] = __ldcg(p.partial_lse + row);
        v[u] = __ldcg(reinterpret_cast<const float4*>(p.partial_latent + row * kKvLoraRank) + item % kQuads);
      }
#pragma unroll
      for (int u = 0; u < kItemsInFlight; ++u) {
        const int r = min(item0 + u * kThreads, items - 1) / kQuads;
        const bool weighs = x[u] != -INFINITY && row_scale[r] != 0.0f;
        const float weight = weighs ? __expf(x[u] - row_max[r]) : 0.0f;
        if (weighs) {
          acc[u].x += weight * v[u].x;
          acc[u].y += weight * v[u].y;
          acc[u].z += weight * v[u].z;
          acc[u].w += weight * v[u].w;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kItemsInFlight; ++u) {
      const int item = item0 + u * kThreads;
      if (item >= items) continue;
      const int r = item / kQuads;
      const float scale = row_scale[r];
      store_latent4(p, /*direct=*/true, 0, segment.entry0 + tile_row0 + r, (item % kQuads) * 4, acc[u].x * scale,
                    acc[u].y * scale, acc[u].z * scale, acc[u].w * scale);
    }
  }
  __syncthreads();  // the scratch rows and the flag may be rewritten by the next segment
}

// The value, hidden from the optimizer: keeps a loop-invariant computation inside the loop, and, as an empty asm
// volatile stays in order with the others (griddep_wait's) and takes the value as an input, keeps the arithmetic that
// makes it from sinking below a later wait.
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
  asm volatile("" : "+r"(v));
  return v;
}

// Global position of local token j (DESIGN.md §4, DCP).
__device__ __forceinline__ int64_t global_position(int64_t j, const CoreParams& p) {
  if (p.dcp_size == 1) return j;
  return ((j / p.dcp_interleave) * p.dcp_size + p.dcp_rank) * p.dcp_interleave + j % p.dcp_interleave;
}

// The last global position the folded row `row` (q row row / num_heads of its request) may see: bottom-right
// causal, the request's q rows ending at `total`.
__device__ __forceinline__ int64_t causal_bound(const CoreParams& p, int64_t total, int row) {
  return total - p.q + row / p.num_heads;
}

// Whether some row of a tile (causal bounds >= bound_min) cannot see a token of the page at page_token0 within the
// length (the newest q - 1 tokens of a request for its earlier rows).
__device__ __forceinline__ bool page_hides_tokens(const CoreParams& p, int64_t page_token0, int length,
                                                  int64_t bound_min) {
  return global_position(min(page_token0 + kPageSize, int64_t{length}) - 1, p) > bound_min;
}

// The V bytes (dims 0-511) of the page's tokens that some row of the tile cannot see, their NaN bytes set to 0, by
// `threads` threads from `t`, after the page's Q·K^T and before its P·V. Such a token's P is 0 in those rows, but in
// the P·V MMA 0 x NaN is NaN: a NaN byte in a token a row cannot see made that row NaN, where the reference (DESIGN.md
// §4: a row sees only its visible tokens) keeps it finite. The rows that see the token stay NaN through its logit:
// the same byte is in K, already read. Those tokens are at most the newest q - 1 of the request (global positions
// after the tile's smallest causal bound), so only the page's last kMaxQueries rows within the length are looked at.
// `v_chunk(row, i)`: 16-byte chunk i (0-31) of token row `row`'s V bytes in the page's layout (any chunk order).
template <typename ChunkAddress>
__device__ __forceinline__ void zero_hidden_v_nans(const CoreParams& p, int64_t page_token0, int length,
                                                   int64_t bound_min, int t, int threads, ChunkAddress v_chunk) {
  constexpr int kChunks = kKvLoraRank / 16;
  const int token0 = static_cast<int>(page_token0);  // a request's tokens fit int (its length)
  const int valid = min(kPageSize, length - token0);  // rows within the length
  for (int idx = t; idx < kMaxQueries * kChunks; idx += threads) {
    const int row = valid - kMaxQueries + idx / kChunks;
    if (row < 0 || global_position(token0 + row, p) <= bound_min) continue;
    uint4* chunk = v_chunk(row, idx % kChunks);
    uint4 v = *chunk;
    v.x = e4m3_nan_to_zero(v.x);
    v.y = e4m3_nan_to_zero(v.y);
    v.z = e4m3_nan_to_zero(v.z);
    v.w = e4m3_nan_to_zero(v.w);
    *chunk = v;
  }
}

}  // namespace detail

// kStages: page ring depth (2: two CTAs per SM; 3, 4: one). kSlots: the CTA slots' deal (config.h): uniform
// (cta_split) or flat (CorePlan.flat_slots: the CTA's pages may span several requests, one segment each, as in the
// ping-pong kernel; its ring counts pages across segments).
template <int kStages, int kMinBlocksPerSm, int kSlots>
__global__ void __launch_bounds__(kNumThreads, kMinBlocksPerSm)
    core_split_kernel(const __grid_constant__ CoreParams p) {
  using namespace detail;
  using Smem = SharedMemoryPlan<kStages>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_raw);

  // ---- Phase 0: grid mapping ---------------------------------------------------------------------
  const int m_tile = blockIdx.x;
  const int rows_m = p.q * p.num_heads;  // M rows of one request

  MLA_TIMELINE_MARK(p.timeline, kCoreMarkStart);
  // ---- Phase 1: metadata (host-written, not produced upstream: read before the PDL wait) -------
  CtaSplit segment;  // which pages of which request (the first of the CTA's segments under flat slots)
  FlatCursor cursor;
  if (!first_segment<kSlots>(p, rows_m, cursor, segment)) {
    write_empty_request_tile<kSlots, kNumThreads, kBlockM>(p, rows_m, m_tile);
    for (int mark = kCoreMarkWaited; mark < kNumCoreMarks; ++mark) MLA_TIMELINE_MARK(p.timeline, mark);
    return;
  }

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&smem.full[s], kPageSize);  // one arrival per token row
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  // PDL: the query and this step's cache rows come from the query kernel.
  griddep_wait();
  MLA_TIMELINE_MARK(p.timeline, kCoreMarkWaited);

  // The CTA's pages before this segment: page it of a segment is the CTA's page g0 + it, which sets its ring stage
  // and mbarrier phase, so the ring runs on across segments.
  int g0 = 0;
  for (;;) {
  const auto [request, entry0, partial_row0, length, total, page_begin, my_pages, writes_nothing, pages] = segment;
  record_request_slots<kSlots>(p, cursor, segment);
  // NOTE: opaque per segment under flat slots, so that ptxas derives the per-thread addressing inside each segment
  // instead of keeping it live across them (as in the ping-pong kernel, where that spilled).
  const uint32_t tid = is_flat(kSlots) ? opaque(threadIdx.x) : threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;  // fragment row group
  const int c = lane % 4;  // fragment column group
  const int row0 = m_tile * kBlockM + g;  // this thread's two M rows
  const int row1 = row0 + 8;
  // Causal bounds of this thread's rows: visible iff global(j) <= total - q + i.
  const int64_t bound0 = causal_bound(p, total, min(row0, rows_m - 1));
  const int64_t bound1 = causal_bound(p, total, min(row1, rows_m - 1));
  const int64_t bound_min = causal_bound(p, total, m_tile * kBlockM);

  // Producer (threads 0-63, one token row each): the split's next page into its stage. A row within the
  // length is one 576-byte cp.async.bulk (the copy engine) counted by expect_tx on the stage's mbarrier;
  // a row past it is zero-filled by the thread's own stores before its arrival (never read: the cache
  // may hold anything there, NaN bytes included, and p = 0 times NaN would poison the accumulators).
  // The next page's block-table entry is loaded one page ahead. NOTE: 16-byte cp.async by every thread
  // (9 a thread and page) spent ~13 % of the warp samples issuing copies and on MIO-queue stalls (ncu,
  // 2026-12-04); the first version's row-wise bulk copies came from one warp (64 a page).
  int issued = 0;  // pages of this split issued so far
  int32_t next_page_id = my_pages > 0 && threadIdx.x < kPageSize ? pages[page_begin] : 0;
  auto issue_next_page = [&]() {
    const int stage = (g0 + issued) % kStages;
    if (threadIdx.x < kPageSize) {
      const int row = threadIdx.x;
      const int32_t page_id = next_page_id;
      if (issued + 1 < my_pages) next_page_id = pages[page_begin + issued + 1];
      uint8_t* dst = &smem.kv[stage][row][0];
      if (int64_t{page_begin + issued} * kPageSize + row < length) {
        mbar_arrive_expect_tx(&smem.full[stage], kKeyDim);
        bulk_copy_g2s(dst, p.cache + int64_t{page_id} * p.stride_cache_page + row * kKeyDim, kKeyDim, &smem.full[stage]);
      } else {
#pragma unroll
        for (int i = 0; i < kKeyDim / 16; ++i) reinterpret_cast<uint4*>(dst)[i] = make_uint4(0u, 0u, 0u, 0u);
        // A later segment's bulk copy (the async proxy) may write this row of the stage again: order these
        // generic stores before it.
        ::mla::wgmma::fence_proxy_async();
        mbar_arrive(&smem.full[stage]);
      }
    }
    ++issued;
  };
  // NOTE: the CTA's first segment requests its first page alone and the rest of the ring once that page has landed
  // (3a): every CTA of the grid asks at once, and the split's pages stream at the rate of its per-page chain (about
  // the copy bandwidth's share of a CTA: README next step 10), so a CTA whose first page lands late stays late to
  // the end. Asking for one page each first lets every first page land after ~half the burst's time.

  // ---- Phase 2: the query tile as f16 into shared memory (rows past rows_m zero) -------------------
  // One thread per (row r, 16-byte group G) = one k16 step of 3a, its k order permuted to match the
  // K fragments there (e4m3x16_to_f16_permuted; one permutation on both operands leaves the dot
  // product unchanged).
  // NOTE: the tile's loads (3 a thread) go out first, then the first page's copies, then the conversions: with the
  // page asked for first the loads waited behind every CTA's page burst (core_bench --timeline, H100 2026-12-06: 2.3-3.8
  // µs from the PDL wait to the tile). Loads before conversions alone: 1.003-1.023x; with the page after them too
  // (both kernels): small cores under the 128k plan 1.009-1.060x, steps 1.004-1.062x (bench/results/core.md ~08:38 UTC).
  {
    constexpr int kItems = kBlockM * (kKeyDim / 16);
    constexpr int kItemsPerThread = (kItems + kNumThreads - 1) / kNumThreads;
    uint4 v[kItemsPerThread];
#pragma unroll
    for (int i = 0; i < kItemsPerThread; ++i) {
      const int idx = threadIdx.x + i * kNumThreads;
      const int row = m_tile * kBlockM + idx / (kKeyDim / 16);
      v[i] = make_uint4(0u, 0u, 0u, 0u);
      // NOTE: plain loads, not __ldg: ptxas hoisted these non-coherent loads above the PDL wait (ACQBULK) in the
      // uniform-deal instances, so the tile was read before the query kernel's grid had completed (cuobjdump -sass,
      // 2026-12-06). A plain load stays after the wait; tests/sass/kernel_sass.py fails if one does not.
      if (idx < kItems && row < rows_m) {
        v[i] = *reinterpret_cast<const uint4*>(p.query + (entry0 + row) * kKeyDim + (idx % (kKeyDim / 16)) * 16);
      }
    }
    const int first_issue = g0 == 0 ? 1 : kStages;
    for (int k = 0; k < min(first_issue, my_pages); ++k) issue_next_page();
#pragma unroll
    for (int i = 0; i < kItemsPerThread; ++i) {
      const int idx = threadIdx.x + i * kNumThreads;
      if (idx >= kItems) break;
      const int r = idx / (kKeyDim / 16);
      const int group = idx % (kKeyDim / 16);
      uint4 lo, hi;
      e4m3x16_to_f16_permuted(v[i], lo, hi);
      *reinterpret_cast<uint4*>(&smem.q[r][16 * group]) = lo;
      *reinterpret_cast<uint4*>(&smem.q[r][16 * group + 8]) = hi;
    }
  }
  __syncthreads();
  if (g0 == 0) MLA_TIMELINE_MARK(p.timeline, kCoreMarkQuery);
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

  // ldmatrix.x4 lane address of P (A of the P·V m16n8k16, the same matrix order as the query's), at k16 step 0.
  const __half* p_lane = &smem.p[(lane % 8) + 8 * ((lane / 8) % 2)][8 * (lane / 16)];
  // ldmatrix.x4.trans lane address of V in a page at k16 step 0: matrices (tokens 0-7 | 8-15) x (dims
  // 0-15 | 16-31 of the warp's first 32-dim chunk).
  const int v_lane_offset = ((lane % 8) + 8 * ((lane / 8) % 2)) * kKvRowBytes + warp * kDimsPerWarp + 16 * (lane / 16);

  float acc[kDimsPerWarp / 32][4][4];  // [32-dim chunk][n8 tile][fragment]: 32 fp32 registers
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
    const int stage = (g0 + it) % kStages;
    mbar_wait(&smem.full[stage], ((g0 + it) / kStages) & 1);
    if (it == 0) {
      while (issued < min(kStages, my_pages)) issue_next_page();  // the rest of the first segment's ring
      if (g0 == 0) MLA_TIMELINE_MARK(p.timeline, kCoreMarkFirstPage);
    }
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
          mma_f16(s[tile], a, e4m3x2_to_f16x2(r), e4m3x2_hi_to_f16x2(r));
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
    if (it >= 1 && issued < my_pages) issue_next_page();

    // 3b. (first k half) Add the partials, scale to base-2 logits, mask (only pages that reach past a
    // causal bound or the length).
    const int64_t page_token0 = int64_t{page_begin + it} * kPageSize;
    // (second k half, idle until barrier (B)) NaN bytes out of the V rows of tokens some row cannot see: every
    // warp's Q·K^T of the page is done (A0), its P·V comes after (B).
    if (k_half == 1 && page_hides_tokens(p, page_token0, length, bound_min)) {
      zero_hidden_v_nans(p, page_token0, length, bound_min, threadIdx.x - kNumThreads / 2, kNumThreads / 2,
                         [&](int row, int i) { return reinterpret_cast<uint4*>(&smem.kv[stage][row][0]) + i; });
      // A later segment's bulk copy (the async proxy) may write this stage again: order these generic stores first.
      ::mla::wgmma::fence_proxy_async();
    }
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
    }

    // 3c. Online softmax with a lazily raised max. P = exp2(x - m) against the running max m of the
    // pages before (the same for every warp); only when some logit of the page exceeds m by more than
    // kLazyMaxSlack (P up to 2^kLazyMaxSlack, far inside fp16) does the CTA take the exact path: page
    // row max across the token groups, m raised, P recomputed, sums and accumulators rescaled. Once the
    // running maxima settle (most pages of a split) a page costs one CTA barrier here instead of two.
    // NOTE: P stays exact to fp16 either way; a lower reference only shifts small weights up, away
    // from fp16's subnormals. A row with nothing visible yet keeps m = -inf and subtracts 0 (never
    // inf - inf); its first visible logit always takes the exact path.
    const float m_use0 = m_run[0] == -INFINITY ? 0.0f : m_run[0];
    const float m_use1 = m_run[1] == -INFINITY ? 0.0f : m_run[1];
    bool raise = false;
    float sum0 = 0.0f, sum1 = 0.0f;
    if (k_half == 0) {
#pragma unroll
      for (int tile = 0; tile < 2; ++tile) {
        raise |= fmaxf(s[tile][0], s[tile][1]) > m_run[0] + kLazyMaxSlack;
        raise |= fmaxf(s[tile][2], s[tile][3]) > m_run[1] + kLazyMaxSlack;
        const float p00 = ex2_ftz(s[tile][0] - m_use0), p01 = ex2_ftz(s[tile][1] - m_use0);
        const float p10 = ex2_ftz(s[tile][2] - m_use1), p11 = ex2_ftz(s[tile][3] - m_use1);
        sum0 += p00 + p01;
        sum1 += p10 + p11;
        // P[row][token] in fp16; this tile's tokens are columns [16 group + 8 tile, +8).
        const int p_col = kQkTokensPerWarp * token_group + 8 * tile + 2 * c;
        *reinterpret_cast<uint32_t*>(&smem.p[g][p_col]) = half2_bits(p00, p01);
        *reinterpret_cast<uint32_t*>(&smem.p[g + 8][p_col]) = half2_bits(p10, p11);
      }
    }
    if (__syncthreads_or(raise)) {  // (B) P complete, unless some row's max must be raised (CTA-uniform)
      if (k_half == 0) {
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
      __syncthreads();  // row maxima visible; nobody reads the tentative P any more
      float page_max0 = smem.row_max[0][g], page_max1 = smem.row_max[0][g + 8];
#pragma unroll
      for (int w = 1; w < kQkTokenGroups; ++w) {
        page_max0 = fmaxf(page_max0, smem.row_max[w][g]);
        page_max1 = fmaxf(page_max1, smem.row_max[w][g + 8]);
      }
      const float m_new0 = fmaxf(m_run[0], page_max0);
      const float m_new1 = fmaxf(m_run[1], page_max1);
      const float m_raised0 = m_new0 == -INFINITY ? 0.0f : m_new0;
      const float m_raised1 = m_new1 == -INFINITY ? 0.0f : m_new1;
      const float alpha0 = ex2_ftz(m_run[0] - m_raised0);
      const float alpha1 = ex2_ftz(m_run[1] - m_raised1);
      m_run[0] = m_new0;
      m_run[1] = m_new1;
      if (k_half == 0) {
        sum0 = 0.0f;
        sum1 = 0.0f;
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) {
          const float p00 = ex2_ftz(s[tile][0] - m_raised0), p01 = ex2_ftz(s[tile][1] - m_raised0);
          const float p10 = ex2_ftz(s[tile][2] - m_raised1), p11 = ex2_ftz(s[tile][3] - m_raised1);
          sum0 += p00 + p01;
          sum1 += p10 + p11;
          const int p_col = kQkTokensPerWarp * token_group + 8 * tile + 2 * c;
          *reinterpret_cast<uint32_t*>(&smem.p[g][p_col]) = half2_bits(p00, p01);
          *reinterpret_cast<uint32_t*>(&smem.p[g + 8][p_col]) = half2_bits(p10, p11);
        }
        l_run[0] *= alpha0;
        l_run[1] *= alpha1;
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
      __syncthreads();  // (B') the exact P complete
    }
    l_run[0] += sum0;  // the second k half adds its zeros
    l_run[1] += sum1;

    // 3d. O += P·V over the page's 64 tokens (4 k16 steps) for this warp's 64 dims. A = P by ldmatrix.x4.
    // B = V by ldmatrix.x4.trans of the FP8 bytes read as b16 pairs: matrix m (tokens [8(m % 2), +8) of the
    // step x dims [16(m / 2), +16) of the 32-dim chunk) gives thread (g, c) the bytes (token 2c: dims 2g,
    // 2g + 1; token 2c + 1: dims 2g, 2g + 1); one prmt pairs them by dim, so its low half is B of the
    // n8 tile of even dims (n = g <-> dim 2g) and its high half B of the tile of odd dims, each
    // converted exactly by one cvt. Tiles j of a chunk: 0 / 1 = even / odd dims of [0, 16), 2 / 3 of
    // [16, 32); the thread ends with dims 4c..4c+3 and 16+4c..16+4c+3 of each chunk.
    // NOTE: 32-bit shared loads + two prmt per B register before (208 -> 140 instructions a warp and page).
#pragma unroll
    for (int kk = 0; kk < kPageSize / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, p_lane + 16 * kk);
#pragma unroll
      for (int ch = 0; ch < kDimsPerWarp / 32; ++ch) {
        uint32_t v[4];
        ldmatrix_x4_trans(v, kv + 16 * kk * kKvRowBytes + v_lane_offset + 32 * ch);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t lo_tokens = prmt(v[2 * half], 0u, 0x3120u);      // tokens 2c, 2c + 1
          const uint32_t hi_tokens = prmt(v[2 * half + 1], 0u, 0x3120u);  // tokens 2c + 8, 2c + 9
          mma_f16(acc[ch][2 * half], a, e4m3x2_to_f16x2(lo_tokens), e4m3x2_to_f16x2(hi_tokens));
          mma_f16(acc[ch][2 * half + 1], a, e4m3x2_hi_to_f16x2(lo_tokens), e4m3x2_hi_to_f16x2(hi_tokens));
        }
      }
    }
  }

  MLA_TIMELINE_MARK(p.timeline, kCoreMarkPages);  // each segment's: the last one stays
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
  // Nothing visible: sum 0 -> latent 0, lse -inf (never NaN); a NaN logit: sum NaN -> both NaN.
  const float inv0 = sum_weighs(sum0) ? 1.0f / sum0 : 0.0f;
  const float inv1 = sum_weighs(sum1) ? 1.0f / sum1 : 0.0f;
  constexpr float kLn2 = 0.69314718055994531f;
  const float lse0 = sum_weighs(sum0) ? (m_run[0] + log2f(sum0)) * kLn2 : -INFINITY;
  const float lse1 = sum_weighs(sum1) ? (m_run[1] + log2f(sum1)) * kLn2 : -INFINITY;

  // ---- Phase 5: stores: the thread holds dims chunk·32 + 16b + 4c + [0, 4) (b = 0, 1) of rows g, g+8 --
  // (tile 2b: dims 4c, 4c + 2 as fragments 0, 1; tile 2b + 1: dims 4c + 1, 4c + 3; rows g + 8: 2, 3).
  const bool direct = writes_directly<kSlots>(p, page_begin, my_pages, length);
  const float out_scale0 = direct ? inv0 * p.k_scale : inv0;
  const float out_scale1 = direct ? inv1 * p.k_scale : inv1;
  // Flat slots merged here (kSlotsFlatMerged) and the request spans several CTAs: each takes a ticket on the request's
  // M-tile before its stores; the last one stores no partial of its own but merges the others' into its registers
  // (after the stores below), the others store theirs and count them.
  bool merges_here = false;
  int* tile_counter = nullptr;  // [arrived, stored] of the request's M-tile
  FlatSlots request_slots;
  if constexpr (kSlots == kSlotsFlatMerged) {
    if (!direct) {
      request_slots = flat_request_slots(request, cursor.request_begin, pages_of(length), cursor.pages_per_cta);
      tile_counter = p.tile_counters + (int64_t{request} * gridDim.x + m_tile) * 2;
      int* flag = reinterpret_cast<int*>(smem.s_part);  // free once the segment's pages are done
      if (threadIdx.x == 0) *flag = atomicAdd(tile_counter, 1) == request_slots.count - 1 ? 1 : 0;
      __syncthreads();
      merges_here = *flag != 0;
      __syncthreads();  // the flag is read by every thread before a later segment's pages rewrite s_part
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = half == 0 ? row0 : row1;
    if (row >= rows_m || merges_here) continue;
    const float scale = half == 0 ? out_scale0 : out_scale1;
    const int64_t entry = entry0 + row;
#pragma unroll
    for (int ch = 0; ch < kDimsPerWarp / 32; ++ch) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const float v0 = acc[ch][2 * b][2 * half] * scale, v1 = acc[ch][2 * b + 1][2 * half] * scale;
        const float v2 = acc[ch][2 * b][2 * half + 1] * scale, v3 = acc[ch][2 * b + 1][2 * half + 1] * scale;
        store_latent4(p, direct, partial_row0 + row, entry, warp * kDimsPerWarp + ch * 32 + 16 * b + 4 * c, v0, v1, v2,
                      v3);
      }
    }
    if (warp == 0 && c == 0) {
      const float lse = half == 0 ? lse0 : lse1;
      if (direct) {
        p.lse[entry] = lse;
      } else {
        p.partial_lse[partial_row0 + row] = lse;
      }
    }
  }

  if constexpr (kSlots == kSlotsFlatMerged) {
    if (!direct && !merges_here) {
      __threadfence();  // this thread's partial stores, before the CTA's count
      __syncthreads();
      if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(tile_counter + 1) : "memory");
    } else if (merges_here) {
      if (threadIdx.x == 0) {
        // Every other segment took its ticket before this one, so each is past its page loop: it stores and counts.
        int stored = 0;
        do {
          asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(stored) : "l"(tile_counter + 1) : "memory");
        } while (stored < request_slots.count - 1);
        tile_counter[0] = 0;  // nobody reads the counters again this launch
        tile_counter[1] = 0;
      }
      __syncthreads();  // the other segments' partials, seen through thread 0's acquire
      const int own_slot = static_cast<int>(partial_row0 / rows_m);
      const float own_lse[2] = {lse0, lse1};
      const float own_inv[2] = {inv0, inv1};
      // Per row (g, g + 8) and 32-dim chunk: a running LSE fold (natural log) over the request's slots in slot order,
      // this segment's from its registers (the fp32 values and LSE it would have stored), so that the result does not
      // depend on which segment arrives last (graph replays and direct launches give the same bytes). A chunk at a
      // time: both chunks' loads at once spill at two CTAs an SM.
#pragma unroll
      for (int ch = 0; ch < kDimsPerWarp / 32; ++ch) {
        float fold_max[2] = {-INFINITY, -INFINITY}, fold_sum[2] = {0.0f, 0.0f}, v[2][2][4] = {};
        for (int slot = request_slots.first; slot < request_slots.first + request_slots.count; ++slot) {
          float x[2];
          float4 w[2][2];
          if (slot == own_slot) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              x[half] = own_lse[half];
#pragma unroll
              for (int b = 0; b < 2; ++b) {
                w[half][b] = make_float4(acc[ch][2 * b][2 * half] * own_inv[half],
                                         acc[ch][2 * b + 1][2 * half] * own_inv[half],
                                         acc[ch][2 * b][2 * half + 1] * own_inv[half],
                                         acc[ch][2 * b + 1][2 * half + 1] * own_inv[half]);
              }
            }
          } else {
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // both rows' loads at once (a padded row reads the last row's)
              // NOTE: row0 itself is padding where the tile holds fewer than 8 rows (H·q % 16 in 1..7): reading it
              // read past the last slot's partials, i.e. past the workspace (unused values, but out of bounds).
              const int row = min(half == 0 ? row0 : row1, rows_m - 1);
              const int64_t prow = int64_t{slot} * rows_m + row;
              x[half] = __ldcg(p.partial_lse + prow);
#pragma unroll
              for (int b = 0; b < 2; ++b) {
                w[half][b] = __ldcg(reinterpret_cast<const float4*>(
                    p.partial_latent + prow * kKvLoraRank + warp * kDimsPerWarp + ch * 32 + 16 * b + 4 * c));
              }
            }
          }
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            if (x[half] == -INFINITY) continue;  // the slot's rows see nothing: weight 0
            float keep = 1.0f, weight;
            if (x[half] > fold_max[half]) {
              keep = fold_max[half] == -INFINITY ? 0.0f : __expf(fold_max[half] - x[half]);
              weight = 1.0f;
              fold_max[half] = x[half];
            } else {
              weight = __expf(x[half] - fold_max[half]);
            }
            fold_sum[half] = fold_sum[half] * keep + weight;
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              v[half][b][0] = v[half][b][0] * keep + weight * w[half][b].x;
              v[half][b][1] = v[half][b][1] * keep + weight * w[half][b].y;
              v[half][b][2] = v[half][b][2] * keep + weight * w[half][b].z;
              v[half][b][3] = v[half][b][3] * keep + weight * w[half][b].w;
            }
          }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = half == 0 ? row0 : row1;
          if (row >= rows_m) continue;
          const float scale = sum_weighs(fold_sum[half]) ? __fdividef(p.k_scale, fold_sum[half]) : 0.0f;
          const int64_t entry = entry0 + row;
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            store_latent4(p, /*direct=*/true, 0, entry, warp * kDimsPerWarp + ch * 32 + 16 * b + 4 * c,
                          v[half][b][0] * scale, v[half][b][1] * scale, v[half][b][2] * scale, v[half][b][3] * scale);
          }
          if (ch == 0 && warp == 0 && c == 0) {
            p.lse[entry] = sum_weighs(fold_sum[half]) ? fold_max[half] + logf(fold_sum[half]) : -INFINITY;
          }
        }
      }
    }
  }

  g0 += my_pages;
  if (!next_segment<kSlots>(p, rows_m, cursor, segment)) break;
  }  // segments
  write_empty_request_tile<kSlots, kNumThreads, kBlockM>(p, rows_m, m_tile);
  MLA_TIMELINE_MARK(p.timeline, kCoreMarkEnd);
  // PDL: this CTA's last store is done; the combine (or the value stage) may start launching.
  griddep_launch_dependents();
}

// ---- Combine: merge the splits' partials by LSE (DESIGN.md §4, split-KV) -------------------------

namespace detail {
// acc += weight * v, per component (the combine's weighed sums).
__device__ __forceinline__ void add_weighted(float4& acc, float weight, const float4& v) {
  acc.x += weight * v.x;
  acc.y += weight * v.y;
  acc.z += weight * v.z;
  acc.w += weight * v.w;
}
}  // namespace detail
// A group of p.warps_per_entry warps merges one (entry, 128-dim chunk): warp w of the group takes the
// request's nonempty splits w, w + G, ... (G = warps_per_entry), eight loads in flight, lane holds 4 dims,
// weighted against the entry's largest LSE (one pass over the LSEs first; several requests) or against a running
// max of the warp's own (one request: the uniform deal); the group's first warp sums the G partial sums (brought to
// their common max). Block: max(G, kCombineMinWarps) warps; grid: x = the groups (entries * 4) over the groups of
// a block.
// Splits past nonempty_splits() wrote nothing and no load reads them (every round is bounded by `splits`); a
// nonempty split whose rows see no token has lse -inf and weighs exactly 0; no nonempty split => latent 0 and
// lse -inf. kSlots: the split kernel's deal (kSlotsUniform, ...).
template <int kSlots>
__global__ void __launch_bounds__(kCombineMaxWarps * 32) core_combine_kernel(const __grid_constant__ CombineParams p) {
  __shared__ float4 partial_sums[kCombineMaxWarps][32];
  __shared__ float2 warp_max_sum[kCombineMaxWarps];  // uniform deal: each warp's (running max, sum of weights)
  MLA_TIMELINE_MARK(p.timeline, kCombineMarkStart);
  constexpr int kChunks = kKvLoraRank / kCombineDims;
  constexpr int kLoadsInFlight = kCombineLoadsInFlight;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group_warp = warp % p.warps_per_entry;
  const int groups_per_block = static_cast<int>(blockDim.x / 32) / p.warps_per_entry;
  const int64_t group = int64_t{blockIdx.x} * groups_per_block + warp / p.warps_per_entry;
  const bool active = group < p.num_entries * kChunks;
  const int64_t entry = active ? group / kChunks : 0;
  const int dim = static_cast<int>(group % kChunks) * kCombineDims + lane * 4;

  // Host-written metadata: read before the PDL wait. The entry's request's slots: num_splits each (flat slots: the
  // split kernel's record, read after the wait below).
  const int rows_m = p.entries_per_request;
  const int request = static_cast<int>(entry) / rows_m;  // entries < 2^31 (plan_core)
  const int length = active && request < p.num_requests ? p.lengths[request] : 0;
  // An inactive warp (past the last entry: request 0) only reads inside request 0's slots.
  detail::RequestSlots slots{request * p.num_splits, p.num_splits};
  int splits = 0;
  if constexpr (kSlots != kSlotsFlat) splits = nonempty_splits(length, slots.count);
  // Split s of the entry's request at partial row (slots.first + s) * rows_m + its row in the request (< 2^31:
  // plan_core). Under the uniform deal split 0's row is known now and is computed here, in 32 bits, through opaque():
  // ptxas otherwise sank the index math below the wait, in front of the first partial load; two such 64-bit offsets
  // instead cost 16 registers, which halved the 512-thread CTAs an SM holds (1 x 4k x 12 x q4 0.895x).
  auto first_partial_row = [&] {
    return static_cast<uint32_t>(slots.first * rows_m + (static_cast<int>(entry) - request * rows_m));
  };
  uint32_t partial_row_known = 0;
  if constexpr (kSlots != kSlotsFlat) partial_row_known = detail::opaque(first_partial_row());

  // The value stage's weights into L2 while this grid merges (its partials mostly in L2, DRAM mostly idle).
  detail::prefetch_l2_share(p.l2_prefetch, p.l2_prefetch_bytes);
  MLA_TIMELINE_MARK(p.timeline, kCombineMarkMetadata);
  detail::griddep_wait();  // the partials come from the split kernel
  MLA_TIMELINE_MARK(p.timeline, kCombineMarkWaited);

  bool written = false;
  if constexpr (kSlots == kSlotsFlat) {
    // Every slot of the request holds one of its segments: the slots the split CTA holding its first page recorded
    // (record_request_slots). A request without pages (and an inactive warp: length 0) has none; its record may be
    // a stale one, never read. A request in one CTA's pages was written there, directly (writes_directly): nothing
    // to merge or store.
    slots = detail::RequestSlots{0, 0};
    if (pages_of(length) > 0) {
      const int2 recorded = *reinterpret_cast<const int2*>(p.request_slots + 2 * request);
      slots = detail::RequestSlots{recorded.x, recorded.y};
    }
    written = slots.count == 1;
    splits = written ? 0 : slots.count;
    slots.count = splits;
  }
  const int64_t partial_row = kSlots == kSlotsFlat ? first_partial_row() : partial_row_known;
  const float* lse_of_entry = p.partial_lse + partial_row;  // split s at [s * rows_m]

  // NOTE: the first round of loads (a split per lane for phase 1, kLoadsInFlight latent rows per warp for
  // phase 2) reads the nonempty splits only (< `splits`). `splits` comes from the lengths load before the PDL wait,
  // which ptxas completes before the wait's ACQBULK anyway (cuobjdump -sass), so bounding by it costs no round trip;
  // the earlier bound, every planned slot (speculation against that round trip, which the SASS never had), read
  // 2-6 MB of partial rows no split wrote when a short request runs under a long plan (src/core/README.md next
  // step 12). Under flat slots the slots themselves come from the split kernel (one load after the wait; every
  // recorded slot is nonempty).
  const float* latent_of_entry = p.partial_latent + partial_row * kKvLoraRank + dim;  // split s at [s * rows_m * 512]
  const int64_t split_stride = int64_t{rows_m} * kKvLoraRank;
  float round_lse[kLoadsInFlight];
  float4 round_v[kLoadsInFlight];
  auto load_round = [&](int s0, int bound) {  // this warp's splits s0 + u·G below `bound`
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int s = s0 + u * p.warps_per_entry;
      round_lse[u] = s < bound ? lse_of_entry[int64_t{s} * rows_m] : -INFINITY;
      round_v[u] = s < bound ? *reinterpret_cast<const float4*>(latent_of_entry + s * split_stride)
                             : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  const float first_lse = lane < splits ? lse_of_entry[int64_t{lane} * rows_m] : -INFINITY;
  load_round(group_warp, splits);
  // The group's first warp: the merged latent chunk (sum of weights `sum` against the reference max `max_lse`) and LSE.
  auto store_combined = [&](const float4& total, float sum, float max_lse) {
    // NOTE: __fdividef (2 ulp; sum is in [1, splits]), not /: the IEEE division's slow-path call made ptxas spill.
    const float scale = sum_weighs(sum) ? __fdividef(p.k_scale, sum) : 0.0f;
    __nv_bfloat162 lo = __floats2bfloat162_rn(total.x * scale, total.y * scale);
    __nv_bfloat162 hi = __floats2bfloat162_rn(total.z * scale, total.w * scale);
    uint2 packed;
    packed.x = *reinterpret_cast<uint32_t*>(&lo);
    packed.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.latent) + entry * kKvLoraRank + dim) = packed;
    if (dim == 0) p.lse[entry] = sum_weighs(sum) ? max_lse + logf(sum) : -INFINITY;
  };
  if constexpr (kSlots == kSlotsUniform) {
    // One request (up to kMaxSplits splits, two or more rounds a warp at > 128): no pass over all the LSEs before the
    // first weighed row. Each warp folds its own splits into a running max round by round (the split kernels' merge
    // of pages), and the group's first warp brings the G warps' sums to their common max. Measured (H100, 2026-12-06,
    // src/core/README.md next step 9): one-request cores 1.005-1.073x; the flat deal's small batches lost up to 10 %
    // with it (one round of few splits a warp, where one LSE a lane and five shuffles are cheaper), so they keep the
    // LSE pass below.
    (void)first_lse;  // the pass's first LSEs: unused here (ptxas drops the load)
    float warp_max = -INFINITY, warp_sum = 0.0f;  // this warp's running max and sum of weights against it
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = group_warp; s0 < splits; s0 += kLoadsInFlight * p.warps_per_entry) {
      if (s0 != group_warp) load_round(s0, splits);
      float round_max = warp_max;
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        if (s0 + u * p.warps_per_entry < splits) round_max = max_keep_nan(round_max, round_lse[u]);
      }
      if (round_max == -INFINITY) continue;  // a round of rows that see no token (every LSE -inf): all stays 0
      const float rescale = __expf(warp_max - round_max);  // warp_max = -inf: 0 (sum and acc are 0 too)
      warp_sum *= rescale;
      acc.x *= rescale;
      acc.y *= rescale;
      acc.z *= rescale;
      acc.w *= rescale;
      warp_max = round_max;
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        const bool nonempty = s0 + u * p.warps_per_entry < splits;
        const float weight = nonempty ? __expf(round_lse[u] - round_max) : 0.0f;  // -inf -> 0
        const float4 v = nonempty ? round_v[u] : make_float4(0.f, 0.f, 0.f, 0.f);
        warp_sum += weight;
        detail::add_weighted(acc, weight, v);
      }
    }
    partial_sums[warp][lane] = acc;
    if (lane == 0) warp_max_sum[warp] = make_float2(warp_max, warp_sum);
    __syncthreads();

    if (active && group_warp == 0) {
      float max_lse = warp_max;
      for (int w = 1; w < p.warps_per_entry; ++w) max_lse = max_keep_nan(max_lse, warp_max_sum[warp + w].x);
      float4 total = make_float4(0.f, 0.f, 0.f, 0.f);
      float sum = 0.0f;
      if (max_lse != -INFINITY) {
        for (int w = 0; w < p.warps_per_entry; ++w) {
          const float2 max_sum = warp_max_sum[warp + w];
          const float4 v = partial_sums[warp + w][lane];
          const float weight = __expf(max_sum.x - max_lse);  // a warp without a weighed split: -inf -> 0
          sum += weight * max_sum.y;
          detail::add_weighted(total, weight, v);
        }
      }
      store_combined(total, sum, max_lse);
    }
  } else {
    // Phase 1: max and sum of exp over the splits' LSEs in one pass (every warp redundantly: no barrier).
    float max_lse = -INFINITY, sum = 0.0f;
    detail::fold_lse(lane < splits ? first_lse : -INFINITY, max_lse, sum);
    for (int s = lane + 32; s < splits; s += 32) detail::fold_lse(lse_of_entry[int64_t{s} * rows_m], max_lse, sum);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float other_max = __shfl_xor_sync(0xffffffffu, max_lse, off);
      const float other_sum = __shfl_xor_sync(0xffffffffu, sum, off);
      const float m = max_keep_nan(max_lse, other_max);
      sum = m == -INFINITY ? 0.0f : sum * __expf(max_lse - m) + other_sum * __expf(other_max - m);
      max_lse = m;
    }
    const float base = max_lse == -INFINITY ? 0.0f : max_lse;

    // Phase 2: this warp's splits, weighted, a round of kLoadsInFlight latent rows at a time (the first
    // loaded above).
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = group_warp; s0 < splits; s0 += kLoadsInFlight * p.warps_per_entry) {
      if (s0 != group_warp) load_round(s0, splits);
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        const bool nonempty = s0 + u * p.warps_per_entry < splits;
        const float weight = nonempty ? __expf(round_lse[u] - base) : 0.0f;  // -inf -> 0
        const float4 v = nonempty ? round_v[u] : make_float4(0.f, 0.f, 0.f, 0.f);
        detail::add_weighted(acc, weight, v);
      }
    }
    partial_sums[warp][lane] = acc;
    __syncthreads();

    // Phase 3: the group's first warp sums its warps, scales, stores.
    if (active && !written && group_warp == 0) {
      float4 total = acc;
      for (int w = 1; w < p.warps_per_entry; ++w) {
        const float4 v = partial_sums[warp + w][lane];
        detail::add_weighted(total, 1.0f, v);
      }
      store_combined(total, sum, base);
    }
  }
  MLA_TIMELINE_MARK(p.timeline, kCombineMarkEnd);
  detail::griddep_launch_dependents();
}

}  // namespace mla::core
