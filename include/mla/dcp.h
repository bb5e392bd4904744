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
// One rank per process (CUDA IPC between processes, ranks on one or several GPUs of one host):
//   mla::FileBootstrap boot("/tmp/job42", rank, /*size=*/8);   // or NcclBootstrap over a communicator
//   mla::IpcDcp group(boot, /*interleave=*/64, /*num_heads=*/12, /*max_rows=*/64, /*device_index=*/rank);
//   mla::PreparedMla layer(weights, dims, pitches, {}, {.dcp = &group, .parity = l % 2, .queries = {1}});
//   layer.prepare(cache);  layer.run(step, stream);            // the whole step, epoch-signalled
//
// Per rank and per parity of the double buffer, one block of device memory holds:
//   mailbox  [max_rows, D*H, 576] FP8: every rank's query; rank k's query kernel publishes its H heads
//            at heads [k*H, (k+1)*H) into EVERY rank's mailbox;
//   latent   [max_rows, D*H, 512] bf16 and lse [max_rows, D*H] fp32 (natural log): this rank's core
//            output over its shard for all D*H heads; rank k's value stage reads heads [k*H, (k+1)*H)
//            of every rank's latent / lse and merges them by LSE;
//   signals  [2*D] uint32 epoch counters (see DcpPeerTable) for a transport whose ranks run on
//            different GPUs and streams;
//   epoch    one uint32: how many steps this rank has run on this parity (its own, read by no peer);
//            kept in device memory and advanced by the signal kernel, so CUDA-graph replays count.
// Two parities let layer l (parity l % 2) publish while a slower peer still reads layer l - 1.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mla/mla.h"

struct ncclComm;  // NCCL's communicator (ncclComm_t is ncclComm*): NcclBootstrap, without nccl.h here

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
  size_t epoch_offset = 0;                       // one uint32 right after the signals
  size_t block_bytes = 0;                        // the whole block, a multiple of kDcpAlignment
};

// The layout for D ranks of H heads and `max_rows` rows; throws mla::Error on D outside 2..8, H
// outside 1..128 or max_rows < 1.
DcpBufferLayout dcp_buffer_layout(int size, int num_heads, int64_t max_rows);

// One parity's device pointers as one rank sees them: entry [p] is rank p's buffer (entries >= D are
// null). For the in-process transport they are plain device pointers of one GPU; for a multi-GPU
// transport, peer-mapped pointers (NCCL symmetric-memory windows or CUDA IPC).
//
// Signals (epoch = how many steps of this parity a rank has run, counted by every object of that
// parity: layers l, l + 2, ... share it): in rank p's block, signals[j] is
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
  std::array<uint32_t*, kMaxDcpRanks> signals{}; // uint32 [2*D] epoch counters, then (own block
                                                 // only) the rank's epoch word at signals[2*D]
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

  // Whether ranks are ordered by stream order on one device (true: no signal is waited on, phases
  // launched with run_phase) or signal each other (PreparedMla::run waits on the epoch signals).
  virtual bool stream_ordered() const = 0;
  virtual const char* transport() const = 0;  // "in-process", "cuda-ipc", ...
  // How long a signal wait spins before it traps (the step then fails with a CUDA error instead of
  // hanging); 0 for stream-ordered groups, which never wait.
  virtual int64_t wait_timeout_ns() const { return 0; }
  // This rank's epoch word of `parity` (device memory, in its own block).
  uint32_t* epoch(int parity) const { return peers(parity).signals[rank()] + 2 * size(); }

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

// ---- Multi-process groups ------------------------------------------------------------------------

// How the ranks of a group first find each other: a blocking all-gather of bytes. Used only while a
// group is created and destroyed (never per step).
class DcpBootstrap {
 public:
  virtual ~DcpBootstrap() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Collective: every rank passes `bytes` bytes (the same count everywhere); on return `gathered`
  // holds rank p's at [p * bytes, (p + 1) * bytes). Throws mla::Error on a timeout or a mismatch.
  virtual void all_gather(const void* mine, size_t bytes, void* gathered) = 0;
};

// Processes of one host (for example forked from one parent) exchanging through files in a
// directory all of them see: call n writes <directory>/ag<n>.r<rank> (written to a temporary name,
// then renamed, so a reader never sees half a file) and waits for every rank's file of call n; a
// rank deletes its file of call n - 1 once call n has gathered (every rank has read it by then).
// The directory must exist, be empty at the start and be private to one group; the caller removes it.
class FileBootstrap final : public DcpBootstrap {
 public:
  // Throws mla::Error on size outside 2..8, rank outside [0, size), timeout < 1.
  FileBootstrap(std::string directory, int rank, int size, int timeout_ms = 30000);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_gather(const void* mine, size_t bytes, void* gathered) override;

 private:
  std::string path(int call, int rank) const;
  std::string directory_;
  int rank_, size_, timeout_ms_;
  int calls_ = 0;
};

// One rank per process, on any GPUs of one host: each rank allocates its own two blocks (zeroed),
// exports them with cudaIpcGetMemHandle, all-gathers the handles through `bootstrap` and maps every
// peer's with cudaIpcOpenMemHandle (peer access enabled for ranks on other GPUs; two ranks on one
// GPU work too, which is how it is tested). Not stream-ordered: PreparedMla::run signals and waits
// on the epochs (DcpPeerTable). CUDA IPC cannot map memory in the process that exported it, so two
// ranks in one process are an error (use InProcessDcp). No NVLink multicast object is ever created.
// As with InProcessDcp, every rank prepares all its objects of a parity before any rank runs a step of that
// parity (or between group-wide barriers of the caller's): prepare()'s warm-up writes this rank's mailbox and
// partials, which a slower peer may still be reading for the last step.
class IpcDcp final : public DcpGroup {
 public:
  // Validates (sizes from the bootstrap, interleave, heads, max_rows, device, timeout) before any
  // CUDA call; then every rank's record is checked against this rank's (same D, I, H, max_rows and
  // block size, one rank per process, a peer GPU this one can access), naming the peer and field.
  // The bootstrap is used again by the destructor (a barrier before unmapping): it must outlive
  // the group. Collective: every rank constructs its group at the same time.
  IpcDcp(DcpBootstrap& bootstrap, int interleave, int num_heads, int64_t max_rows, int device_index,
         int wait_timeout_ms = 10000);
  ~IpcDcp() override;
  bool stream_ordered() const override { return false; }
  const char* transport() const override { return "cuda-ipc"; }
  int64_t wait_timeout_ns() const override { return wait_timeout_ns_; }

 private:
  struct Mapping;  // this rank's allocation, the peers' opened handles and the peer tables
  static std::unique_ptr<Mapping> map_blocks(DcpBootstrap& bootstrap, int interleave, int num_heads,
                                             int64_t max_rows, int device_index, int wait_timeout_ms);
  IpcDcp(DcpBootstrap& bootstrap, std::unique_ptr<Mapping> mapping, int interleave, int num_heads, int64_t max_rows,
         int device_index, int wait_timeout_ms);
  DcpBootstrap* bootstrap_;
  std::unique_ptr<Mapping> mapping_;
  int64_t wait_timeout_ns_;
};

// All-gather over an NCCL communicator (ncclCommInitRank done by the caller, one rank per GPU; keep
// NCCL_NVLS_ENABLE=0: nothing here needs NVLink multicast). Built into the separate library
// mla_dcp_nccl (src/dcp/nccl_bootstrap.cpp) where NCCL is found, so `mla` itself needs no NCCL.
class NcclBootstrap final : public DcpBootstrap {
 public:
  NcclBootstrap(ncclComm* comm, int device_index);  // comm: an ncclComm_t
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_gather(const void* mine, size_t bytes, void* gathered) override;

 private:
  ncclComm* comm_;
  int device_index_, rank_ = 0, size_ = 0;
};

}  // namespace mla
