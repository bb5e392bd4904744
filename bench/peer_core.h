// The interface of a peer attention core that `core_bench --peer LIB.so` times in the same run as ours, on
// the same inputs, and checks against ours (issue 4 compares with FP8 FlashMLA this way). A peer is a
// shared library built outside this repository (e.g. from a git-ignored `peers/` folder: a peer's code is
// never committed here) that exports these four functions with C linkage.
//
// Inputs are ours: the e4m3 query [batch * q, heads, 576], the dense e4m3 cache [num_pages, 64, 576]
// (page stride 64 * 576 bytes), an int32 block table [batch, max_pages] and int32 lengths [batch]; the q
// rows of a request see the bottom-right causal window (row i of q sees tokens < length - q + 1 + i). The
// logits are softmax_scale * (query . key) over the e4m3 values (the descales are 1). Outputs are ours too:
// the bf16 latent [batch * q, heads, 512] and the fp32 natural-log LSE [batch * q, heads].
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

extern "C" {

struct MlaPeerCoreShape {
  int batch;                 // requests
  int q;                     // query rows per request (1..8)
  int heads;                 // query heads (one latent KV head)
  int max_pages;             // the block table's row stride, in entries
  int64_t num_pages;         // pages in the cache
  const int32_t* lengths;    // device [batch]; the same values in every run of this shape
  float softmax_scale;       // multiplies query . key
};

struct MlaPeerCoreIo {
  const void* query;         // device e4m3 [batch * q, heads, 576]
  const void* cache;         // device e4m3 [num_pages, 64, 576]
  const int32_t* block_table;  // device [batch, max_pages]: may change between runs (core_bench rotates page sets)
  void* latent;              // device bf16 [batch * q, heads, 512], written
  float* lse;                // device fp32 [batch * q, heads], written
};

// A line naming the peer and its version, for the benchmark's table.
const char* mla_peer_core_name(void);
// Everything the peer needs for this shape (scheduling metadata, scratch), outside the timed region. On a
// shape it cannot run it returns NULL with the reason in `error` (NUL-terminated, at most error_size bytes).
void* mla_peer_core_prepare(const MlaPeerCoreShape* shape, cudaStream_t stream, char* error, size_t error_size);
// Launches one step on `stream` (no allocation, no synchronization: core_bench captures it in a CUDA graph);
// 0 on success, else a CUDA error code.
int mla_peer_core_run(void* state, const MlaPeerCoreIo* io, cudaStream_t stream);
void mla_peer_core_release(void* state);

}  // extern "C"
