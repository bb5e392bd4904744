// The time a kernel takes only to read KV-cache-shaped bytes (576-byte token rows of 64-token pages, within each
// request's length, through a block table), with no math and no output: `core_bench --read-floor` reads the same page
// sets as the core (the part of a shape's time that its bytes alone take at that size), `read_floor_bench` contiguous
// buffers of a stage's or a step's byte count. The copy bandwidth (a 2 GiB memcpy) does not say this: a short read
// also pays a launch, the first requests' latency and a tail.
//
// Not a library kernel: a diagnostic floor, written to stream as fast as a plain kernel can (16-byte loads, all of
// a thread's loads for two pages issued before any is used, two CTAs an SM, pages dealt round-robin so every SM reads
// from the first microsecond to the last), and launched as the core is (programmatic dependent launch, after the
// previous launch's wait), but triggering its dependents at once: the most overlap the launch pattern allows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <vector>

#include "common/cuda_check.h"
#include "device_timing.h"
#include "mla/dims.h"

namespace mla::bench {

constexpr int kReadFloorThreads = 256;
constexpr int kReadFloorChunks = mla::kPageSize * mla::kKeyDim / 16;  // 16-byte chunks of a full page: 2304
constexpr int kReadFloorChunksPerThread = 2 * kReadFloorChunks / kReadFloorThreads;  // two pages at a time: 18
static_assert(kReadFloorChunks % kReadFloorThreads == 0, "a page is whole loads of every thread");

struct ReadFloorParams {
  const uint8_t* cache;         // [pages, 64, 576] e4m3
  int64_t stride_cache_page;    // bytes
  const int32_t* block_table;   // [num_requests, stride_block_table]
  int stride_block_table;
  const int32_t* lengths;       // [num_requests]
  int num_requests;
  uint32_t never;               // a value the XOR of the bytes never takes here (so the loads cannot be dropped)
  uint32_t* sink;               // written only if it does
  uint32_t* check;              // null when timed; else the XOR of every 32-bit word read is XORed into *check
};

__global__ void __launch_bounds__(kReadFloorThreads, 2) read_floor_kernel(const __grid_constant__ ReadFloorParams p) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int64_t pages = int64_t{p.num_requests} * p.stride_block_table;
  // Where the two pages of a pair are (flat pages 2 * pair and 2 * pair + 1, of any requests) and how many of their
  // tokens lie within the length (0: nothing to read).
  struct Pair {
    const uint8_t* base[2];
    int tokens[2];
  };
  auto locate = [&](int64_t pair) {
    Pair where;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t page = 2 * pair + h;
      const int request = static_cast<int>(page / p.stride_block_table);
      const int k = static_cast<int>(page % p.stride_block_table);
      where.tokens[h] = page < pages ? min(mla::kPageSize, __ldg(p.lengths + request) - k * mla::kPageSize) : 0;
      const int32_t* entry = p.block_table + int64_t{request} * p.stride_block_table + k;
      where.base[h] = where.tokens[h] > 0 ? p.cache + __ldg(entry) * p.stride_cache_page : nullptr;
    }
    return where;
  };
  uint32_t x = 0;
  // Pairs round-robin over the CTAs; the next pair's block-table entries are asked for while this pair's bytes are in
  // flight.
  Pair here = locate(blockIdx.x);
  for (int64_t pair = blockIdx.x; 2 * pair < pages; pair += gridDim.x) {
    uint4 v[kReadFloorChunksPerThread];
#pragma unroll
    for (int u = 0; u < kReadFloorChunksPerThread; ++u) {
      constexpr int kPerPage = kReadFloorChunksPerThread / 2;  // chunk u of the thread is in page u / kPerPage
      const int h = u / kPerPage;
      const int in_page = threadIdx.x + (u % kPerPage) * kReadFloorThreads;
      v[u] = make_uint4(0, 0, 0, 0);
      if (in_page / (mla::kKeyDim / 16) < here.tokens[h]) {
        // volatile: every load of the pair goes out before the first XOR (below) waits on one; ptxas would otherwise
        // interleave them and keep only a few in flight.
        asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                     : "l"(here.base[h] + 16 * in_page));
      }
    }
    const Pair next = locate(pair + gridDim.x);
#pragma unroll
    for (int u = 0; u < kReadFloorChunksPerThread; ++u) {
      asm volatile("xor.b32 %0, %0, %1;" : "+r"(x) : "r"(v[u].x ^ v[u].y ^ v[u].z ^ v[u].w));
    }
    here = next;
  }
  if (x == p.never) *p.sink = x;
  if (p.check != nullptr) {  // the bench's proof that exactly the visible bytes were read (page_set_xor)
    for (int offset = 16; offset > 0; offset /= 2) x ^= __shfl_xor_sync(0xffffffffu, x, offset);
    if (threadIdx.x % 32 == 0) atomicXor(p.check, x);
  }
}

// Enqueues one read of the page set (a PDL launch: chained after the previous one as the core is).
inline void launch_read_floor(const ReadFloorParams& params, int ctas, cudaStream_t stream) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(kReadFloorThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, read_floor_kernel, params));
}

// The XOR of every 32-bit word of the visible token rows of a page set, on the host (what the kernel's check must
// give).
inline uint32_t page_set_xor(const uint8_t* cache, int64_t stride_cache_page, const int32_t* block_table,
                             int stride_block_table, const int32_t* lengths, int num_requests) {
  uint32_t x = 0;
  for (int r = 0; r < num_requests; ++r) {
    for (int t = 0; t < lengths[r]; ++t) {
      const int32_t page = block_table[int64_t{r} * stride_block_table + t / mla::kPageSize];
      const uint8_t* row = cache + page * stride_cache_page + int64_t{t % mla::kPageSize} * mla::kKeyDim;
      for (int w = 0; w < mla::kKeyDim / 4; ++w) {
        uint32_t word;
        std::memcpy(&word, row + 4 * w, 4);
        x ^= word;
      }
    }
  }
  return x;
}

// CTAs for the read: as many as fit on the device at once (every SM streams until the end).
inline int read_floor_ctas() {
  int device = 0, sms = 0, per_sm = 0;
  MLA_CUDA_CHECK(cudaGetDevice(&device));
  MLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  MLA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_floor_kernel, kReadFloorThreads, 0));
  return sms * per_sm;
}

// The read's time: `launches` PDL launches in a graph, `replays` times (launch i reads the page set `set_of(i)`
// describes; the sink, check and `never` fields are filled here), median of the replays. Then launch 0's set is read
// once more and its XOR checked against the host's (a floor that skipped or added bytes would be no floor: throws):
// `cache_bytes` of set_of(0).cache are copied back for that; `host_table` and `host_lengths` are set 0's block table
// and lengths.
inline double time_read_floor_us(cudaStream_t stream, int launches, int replays,
                                 const std::function<ReadFloorParams(int)>& set_of, int64_t cache_bytes,
                                 const int32_t* host_table, const int32_t* host_lengths) {
  uint32_t* words;  // [0]: the sink, [1]: the check
  MLA_CUDA_CHECK(cudaMalloc(&words, 2 * sizeof(uint32_t)));
  MLA_CUDA_CHECK(cudaMemsetAsync(words, 0, 2 * sizeof(uint32_t), stream));
  const int ctas = read_floor_ctas();
  auto read = [&](int i, uint32_t* check) {
    ReadFloorParams params = set_of(i);
    params.never = 0x5a5a5a5au;
    params.sink = words;
    params.check = check;
    launch_read_floor(params, ctas, stream);
  };
  const double us = mla::timing::time_graph_us(stream, [&](int i) { read(i, nullptr); }, launches, replays);
  read(0, words + 1);
  const ReadFloorParams set0 = set_of(0);
  std::vector<uint8_t> cache(cache_bytes);
  uint32_t device_xor = 0;
  MLA_CUDA_CHECK(cudaMemcpyAsync(&device_xor, words + 1, sizeof device_xor, cudaMemcpyDeviceToHost, stream));
  MLA_CUDA_CHECK(cudaMemcpyAsync(cache.data(), set0.cache, cache.size(), cudaMemcpyDeviceToHost, stream));
  MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  MLA_CUDA_CHECK(cudaFree(words));
  const uint32_t host_xor = page_set_xor(cache.data(), set0.stride_cache_page, host_table, set0.stride_block_table,
                                         host_lengths, set0.num_requests);
  if (device_xor != host_xor) throw std::runtime_error("the read-floor kernel missed or added bytes");
  return us;
}

}  // namespace mla::bench
