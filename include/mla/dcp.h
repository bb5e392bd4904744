// Decode context parallelism (DESIGN.md §4, DCP): the rank group a PreparedMla joins, the buffers
// every rank exchanges, and the transports that provide them.
//
//   mla::InProcessDcp group(/*size=*/4, /*interleave=*/64, /*num_heads=*/12, /*max_rows=*/64);
//   mla::PreparedMla rank0(weights0, dims, pitches, /*query_scratch=*/{},
//                          {.dcp = &group.rank(0), .parity = 0, .queries = {1}});
//   ...                                            // one object per rank (and per parity)
//   for (k) rank[k].run_phase(DcpPhase::kQuery, step[k], stream);   // every rank's query,
//   for (k) rank[k].run_phase(DcpPhase::kCore, step[k], stream);    // then every core,
//   for (k) rank[k].run_phase(DcpPhase::kValue, step[k], stream);   // then every value stage
//
// Per rank and per parity of the double buffer, one block of device memory holds:
//   mailbox  [max_rows, D*H, 576] FP8: every rank's query; rank k's query kernel publishes its H heads
//            at heads [k*H, (k+1)*H) into EVERY rank's mailbox;
//   latent   [max_rows, D*H, 512] bf16 and lse [max_rows, D*H] fp32 (natural log): this rank's core
//            output over its shard for all D*H heads; rank k's value stage reads heads [k*H, (k+1)*H)
//            of every rank's latent / lse and merges them by LSE;
//   signals  [2*D] uint32 epoch counters (see DcpPeerTable) for a transport whose ranks run on
//            different GPUs and streams.
// Two parities let layer l (parity l % 2) publish while a slower peer still reads layer l - 1.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "mla/mla.h"

namespace mla {

inline constexpr int kMaxDcpRanks = 8;         // D: 2..8 ranks (one NVLink domain of H200s)
inline constexpr size_t kDcpAlignment = 256;   // every buffer of a block starts on this boundary

// Where each buffer of one (rank, parity) block lies, in bytes from the block's start.
struct DcpBufferLayout {
  int size = 0;             // D
  int num_heads = 0;        // H per rank; the core serves D*H heads
  int64_t max_rows = 0;     // rows of the largest batch
  size_t mailbox_offset = 0, mailbox_bytes = 0;  // [max_rows, D*H, 576] FP8
  size_t latent_offset = 0, latent_bytes = 0;    // [max_rows, D*H, 512] bf16
  size_t lse_offset = 0, lse_bytes = 0;          // [max_rows, D*H] fp32
  size_t signal_offset = 0, signal_bytes = 0;    // [2*D] uint32
  size_t block_bytes = 0;                        // the whole block, a multiple of kDcpAlignment
};

// The layout for D ranks of H heads and `max_rows` rows; throws mla::Error on D outside 2..8, H
// outside 1..128 or max_rows < 1.
DcpBufferLayout dcp_buffer_layout(int size, int num_heads, int64_t max_rows);

// One parity's device pointers as one rank sees them: entry [p] is rank p's buffer (entries >= D are
// null). For the in-process transport they are plain device pointers of one GPU; for a multi-GPU
// transport, peer-mapped pointers (NCCL symmetric-memory windows or CUDA IPC).
//
// Signals (epoch = how many steps of this parity a rank has run): in rank p's block, signals[j] is
// written by rank j after its query has landed in p's mailbox, signals[D + j] by rank j after its
// core output is complete for p to read. Before its core a rank waits for signals[0..D) to reach the
// epoch, before its value stage for signals[D..2D). That also keeps a rank one step ahead from
// overwriting what a peer still reads: rank j rewrites p's mailbox (next epoch of this parity) only
// after it saw p's partial of the step in between, so p's core finished; it rewrites its own latent
// only after p published the next query, so p's value stage finished (stream order on p).
struct DcpPeerTable {
  std::array<void*, kMaxDcpRanks> mailbox{};     // FP8 [max_rows, D*H, 576]
  std::array<void*, kMaxDcpRanks> latent{};      // bf16 [max_rows, D*H, 512]
  std::array<float*, kMaxDcpRanks> lse{};        // fp32 [max_rows, D*H], natural log
  std::array<uint32_t*, kMaxDcpRanks> signals{}; // uint32 [2*D] epoch counters
};

// One rank's view of a DCP group: its layout, sizes and the peer tables of both parities. The
// transport (how the peer pointers were obtained and how ranks signal each other) is the subclass.
class DcpGroup {
 public:
  virtual ~DcpGroup() = default;
  DcpGroup(const DcpGroup&) = delete;
  DcpGroup& operator=(const DcpGroup&) = delete;

  const DcpLayout& layout() const { return layout_; }
  int rank() const { return layout_.rank; }
  int size() const { return layout_.size; }
  int interleave() const { return layout_.interleave; }
  int num_heads() const { return num_heads_; }           // H per rank
  int core_heads() const { return layout_.size * num_heads_; }  // H_core = D*H
  int64_t max_rows() const { return buffers_.max_rows; }
  int device_index() const { return device_index_; }      // this rank's GPU
  const DcpBufferLayout& buffers() const { return buffers_; }
  // Parity 0 or 1; anything else is an Error.
  const DcpPeerTable& peers(int parity) const;

  // Whether ranks are ordered by stream order on one device (true: no signal is waited on) or must
  // signal each other across GPUs (a multi-GPU transport, not in this build).
  virtual bool stream_ordered() const = 0;
  virtual const char* transport() const = 0;  // "in-process", ...

 protected:
  // Validates everything (layout, sizes, a non-null pointer per rank and buffer, null past D) and
  // throws mla::Error naming what is wrong.
  DcpGroup(const DcpLayout& layout, int num_heads, int64_t max_rows, int device_index,
           const std::array<DcpPeerTable, 2>& peers);

 private:
  DcpLayout layout_;
  int num_heads_ = 0;
  int device_index_ = 0;
  DcpBufferLayout buffers_;
  std::array<DcpPeerTable, 2> peers_;
};

// All D ranks on one GPU, for tests and single-GPU simulation (DESIGN.md §4, transports): owns the
// 2*D blocks (one allocation, zeroed), hands out one DcpGroup per rank. Phases must be launched in
// order on one stream (every rank's query, then every core, then every value stage). Prepare every
// rank's objects before the first step: prepare()'s warm-up writes its own rank's mailbox and partials.
class InProcessDcp {
 public:
  // Validates (throws mla::Error) before allocating anything on `device_index`.
  InProcessDcp(int size, int interleave, int num_heads, int64_t max_rows, int device_index = 0);
  ~InProcessDcp();
  InProcessDcp(const InProcessDcp&) = delete;
  InProcessDcp& operator=(const InProcessDcp&) = delete;

  int size() const { return static_cast<int>(ranks_.size()); }
  const DcpGroup& rank(int k) const;  // k in [0, size), else an Error

  // The peer tables every rank shares when the 2*D blocks start at `base`: rank p's block of parity
  // s is block 2*p + s. Pure arithmetic (no CUDA call), exposed for tests.
  static std::array<DcpPeerTable, 2> peer_tables(void* base, const DcpBufferLayout& layout);

 private:
  void* memory_ = nullptr;
  std::vector<std::unique_ptr<DcpGroup>> ranks_;
};

}  // namespace mla
