// DCP groups: buffer layout, peer-table validation and the in-process transport (include/mla/dcp.h).
#include <cuda_runtime_api.h>

#include <string>

#include "common/cuda_check.h"
#include "dcp/internal.h"
#include "mla/dcp.h"

namespace mla {
namespace dcp {

void validate_sizes(int size, int interleave, int num_heads, int64_t max_rows) {
  if (size < 2 || size > kMaxDcpRanks) {
    throw_bad_argument("dcp size", "2.." + std::to_string(kMaxDcpRanks) + " ranks (no DCP: pass no group)",
                       std::to_string(size));
  }
  if (interleave < 1) throw_bad_argument("dcp interleave", ">= 1", std::to_string(interleave));
  if (num_heads < 1 || num_heads > kMaxHeads) {
    throw_bad_argument("dcp num_heads", "in [1, " + std::to_string(kMaxHeads) + "] (heads per rank)",
                       std::to_string(num_heads));
  }
  if (max_rows < 1) throw_bad_argument("dcp max_rows", ">= 1", std::to_string(max_rows));
}

}  // namespace dcp

namespace {

using dcp::validate_sizes;

size_t align_up(size_t bytes) { return (bytes + kDcpAlignment - 1) / kDcpAlignment * kDcpAlignment; }

std::string pointer_name(const char* buffer, int parity, int peer) {
  return std::string("dcp peers(") + std::to_string(parity) + ")." + buffer + "[" + std::to_string(peer) + "]";
}

// Entries [0, D) present, entries [D, kMaxDcpRanks) null: a table from another group size is caught.
template <class T>
void validate_pointers(const std::array<T*, kMaxDcpRanks>& table, const char* buffer, int parity, int size) {
  for (int p = 0; p < kMaxDcpRanks; ++p) {
    const bool present = table[p] != nullptr;
    if (p < size && !present) {
      throw_bad_argument(pointer_name(buffer, parity, p), "a device pointer (rank " + std::to_string(p) + " of " +
                                                              std::to_string(size) + ")", "null");
    }
    if (p >= size && present) {
      throw_bad_argument(pointer_name(buffer, parity, p), "null (the group has " + std::to_string(size) + " ranks)",
                         "a pointer");
    }
  }
}

// A rank's view of the in-process group: stream order replaces the signals.
class InProcessRank final : public DcpGroup {
 public:
  InProcessRank(const DcpLayout& layout, int num_heads, int64_t max_rows, int device_index,
                const std::array<DcpPeerTable, 2>& peers)
      : DcpGroup(layout, num_heads, max_rows, device_index, peers) {}
  bool stream_ordered() const override { return true; }
  const char* transport() const override { return "in-process"; }
};

}  // namespace

DcpBufferLayout dcp_buffer_layout(int size, int num_heads, int64_t max_rows) {
  validate_sizes(size, /*interleave=*/1, num_heads, max_rows);
  DcpBufferLayout layout;
  layout.size = size;
  layout.num_heads = num_heads;
  layout.max_rows = max_rows;
  const size_t entries = static_cast<size_t>(max_rows) * size * num_heads;  // rows x D*H
  layout.mailbox_bytes = entries * kKeyDim;
  layout.latent_bytes = entries * kKvLoraRank * 2;
  layout.lse_bytes = entries * sizeof(float);
  layout.signal_bytes = 2 * static_cast<size_t>(size) * sizeof(uint32_t);
  layout.mailbox_offset = 0;
  layout.latent_offset = align_up(layout.mailbox_offset + layout.mailbox_bytes);
  layout.lse_offset = align_up(layout.latent_offset + layout.latent_bytes);
  layout.signal_offset = align_up(layout.lse_offset + layout.lse_bytes);
  layout.epoch_offset = layout.signal_offset + layout.signal_bytes;
  layout.block_bytes = align_up(layout.epoch_offset + sizeof(uint32_t));
  return layout;
}

DcpGroup::DcpGroup(const DcpLayout& layout, int num_heads, int64_t max_rows, int device_index,
                   const std::array<DcpPeerTable, 2>& peers)
    : layout_(layout), num_heads_(num_heads), device_index_(device_index), peers_(peers) {
  validate_sizes(layout.size, layout.interleave, num_heads, max_rows);
  if (layout.rank < 0 || layout.rank >= layout.size) {
    throw_bad_argument("dcp rank", "in [0, " + std::to_string(layout.size) + ")", std::to_string(layout.rank));
  }
  if (device_index < 0) throw_bad_argument("dcp device_index", ">= 0", std::to_string(device_index));
  for (int parity = 0; parity < 2; ++parity) {
    validate_pointers(peers[parity].mailbox, "mailbox", parity, layout.size);
    validate_pointers(peers[parity].latent, "latent", parity, layout.size);
    validate_pointers(peers[parity].lse, "lse", parity, layout.size);
    validate_pointers(peers[parity].signals, "signals", parity, layout.size);
  }
  for (int p = 0; p < layout.size; ++p) {
    if (peers[0].mailbox[p] == peers[1].mailbox[p] || peers[0].latent[p] == peers[1].latent[p]) {
      throw_bad_argument(pointer_name("mailbox / latent", 1, p), "buffers distinct from parity 0's",
                         "the same pointer");
    }
  }
  buffers_ = dcp_buffer_layout(layout.size, num_heads, max_rows);
}

const DcpPeerTable& DcpGroup::peers(int parity) const {
  if (parity != 0 && parity != 1) throw_bad_argument("dcp parity", "0 or 1", std::to_string(parity));
  return peers_[parity];
}

std::array<DcpPeerTable, 2> InProcessDcp::peer_tables(void* base, const DcpBufferLayout& layout) {
  std::array<DcpPeerTable, 2> tables;
  auto* bytes = static_cast<uint8_t*>(base);
  for (int parity = 0; parity < 2; ++parity) {
    for (int p = 0; p < layout.size; ++p) {
      uint8_t* block = bytes + (2 * static_cast<size_t>(p) + parity) * layout.block_bytes;
      tables[parity].mailbox[p] = block + layout.mailbox_offset;
      tables[parity].latent[p] = block + layout.latent_offset;
      tables[parity].lse[p] = reinterpret_cast<float*>(block + layout.lse_offset);
      tables[parity].signals[p] = reinterpret_cast<uint32_t*>(block + layout.signal_offset);
    }
  }
  return tables;
}

InProcessDcp::InProcessDcp(int size, int interleave, int num_heads, int64_t max_rows, int device_index) {
  validate_sizes(size, interleave, num_heads, max_rows);
  if (device_index < 0) throw_bad_argument("dcp device_index", ">= 0", std::to_string(device_index));
  const DcpBufferLayout layout = dcp_buffer_layout(size, num_heads, max_rows);
  const size_t bytes = 2 * static_cast<size_t>(size) * layout.block_bytes;

  int previous = 0;
  MLA_CUDA_CHECK(cudaGetDevice(&previous));
  MLA_CUDA_CHECK(cudaSetDevice(device_index));
  MLA_CUDA_CHECK(cudaMalloc(&memory_, bytes));
  // Zeroed once: an LSE of 0 and a latent of 0 are finite, so even a read of a never-written row
  // cannot bring a NaN into a merge (every step writes all of its rows before they are read).
  MLA_CUDA_CHECK(cudaMemset(memory_, 0, bytes));
  MLA_CUDA_CHECK(cudaSetDevice(previous));

  const std::array<DcpPeerTable, 2> tables = peer_tables(memory_, layout);
  for (int k = 0; k < size; ++k) {
    ranks_.push_back(std::make_unique<InProcessRank>(DcpLayout{k, size, interleave}, num_heads, max_rows,
                                                     device_index, tables));
  }
}

InProcessDcp::~InProcessDcp() {
  if (memory_ != nullptr) cudaFree(memory_);
}

const DcpGroup& InProcessDcp::rank(int k) const {
  if (k < 0 || k >= size()) {
    throw_bad_argument("InProcessDcp::rank", "in [0, " + std::to_string(size()) + ")", std::to_string(k));
  }
  return *ranks_[k];
}

}  // namespace mla
