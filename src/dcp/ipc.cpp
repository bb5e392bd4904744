// IpcDcp: one rank per process, blocks exchanged with CUDA IPC (include/mla/dcp.h).
#include <unistd.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "dcp/internal.h"
#include "mla/dcp.h"

namespace mla {

struct IpcDcp::Mapping {
  int device_index = 0, rank = 0, size = 0;
  void* own = nullptr;                      // this rank's 2 blocks (cudaMalloc, zeroed)
  std::array<void*, kMaxDcpRanks> opened{};  // the peers' 2 blocks (cudaIpcOpenMemHandle); null for p = rank
  std::array<DcpPeerTable, 2> tables;

  ~Mapping() {
    // Errors cannot be reported here, and the context may already be broken (a trapped wait).
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess) return;
    if (cudaSetDevice(device_index) != cudaSuccess) return;
    for (void* p : opened) {
      if (p != nullptr) cudaIpcCloseMemHandle(p);
    }
    if (own != nullptr) cudaFree(own);
    cudaSetDevice(previous);
  }
};

namespace {

std::array<uint8_t, 16> device_uuid(int device) {
  cudaDeviceProp prop{};
  MLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::array<uint8_t, 16> uuid{};
  std::memcpy(uuid.data(), prop.uuid.bytes, uuid.size());
  return uuid;
}

// The local index of the GPU with `uuid` (indices differ between processes with different
// CUDA_VISIBLE_DEVICES), or -1 where this process does not see it.
int device_with_uuid(const std::array<uint8_t, 16>& uuid) {
  int count = 0;
  MLA_CUDA_CHECK(cudaGetDeviceCount(&count));
  for (int d = 0; d < count; ++d) {
    if (device_uuid(d) == uuid) return d;
  }
  return -1;
}

// Restores the caller's current device on every exit path.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MLA_CUDA_CHECK(cudaGetDevice(&previous_));
    MLA_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

}  // namespace

std::unique_ptr<IpcDcp::Mapping> IpcDcp::map_blocks(DcpBootstrap& bootstrap, int interleave, int num_heads,
                                                     int64_t max_rows, int device_index, int wait_timeout_ms) {
  const int size = bootstrap.size(), rank = bootstrap.rank();
  if (rank < 0 || rank >= size) {  // a broken bootstrap: no exchange can run
    throw_bad_argument("dcp bootstrap rank", "in [0, " + std::to_string(size) + ")", std::to_string(rank));
  }
  // ---- This rank's checks (everything checkable without CUDA first) and its blocks. A failure here may be this rank's
  // alone (its device index, an allocation refused), so the ranks agree on success before the record exchange: a rank
  // that threw before it left its peers waiting in that all-gather.
  auto mapping = std::make_unique<Mapping>();
  mapping->device_index = device_index;
  mapping->rank = rank;
  mapping->size = size;
  DcpBufferLayout layout;
  std::optional<DeviceGuard> guard;
  dcp::IpcRankRecord mine;
  std::string failure;
  try {
    dcp::validate_sizes(size, interleave, num_heads, max_rows);
    if (device_index < 0) throw_bad_argument("dcp device_index", ">= 0", std::to_string(device_index));
    if (wait_timeout_ms < 1) throw_bad_argument("dcp wait_timeout_ms", ">= 1", std::to_string(wait_timeout_ms));
    layout = dcp_buffer_layout(size, num_heads, max_rows);
    guard.emplace(device_index);

    // This rank's blocks, zeroed (epochs and signals start at 0; a finite latent / LSE everywhere) and complete
    // before any peer learns of them, so no peer's early signal is wiped.
    const size_t bytes = 2 * layout.block_bytes;
    MLA_CUDA_CHECK(cudaMalloc(&mapping->own, bytes));
    MLA_CUDA_CHECK(cudaMemset(mapping->own, 0, bytes));
    MLA_CUDA_CHECK(cudaDeviceSynchronize());

    mine.rank = rank;
    mine.size = size;
    mine.interleave = interleave;
    mine.num_heads = num_heads;
    mine.max_rows = max_rows;
    mine.block_bytes = layout.block_bytes;
    mine.process_id = static_cast<int64_t>(getpid());
    mine.device_uuid = device_uuid(device_index);
    MLA_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, mapping->own));
  } catch (const std::exception& e) {
    failure = e.what();
  }
  dcp::agree_all_succeeded(bootstrap, failure, "check its arguments and allocate its blocks");

  const std::vector<uint8_t> packed = dcp::pack(mine);
  std::vector<uint8_t> all(packed.size() * size);
  bootstrap.all_gather(packed.data(), packed.size(), all.data());

  // ---- Check every record, then map the peers' blocks. A failure here may be one rank's alone (a GPU it does not see,
  // no peer access, an IPC open refused), so every rank learns of it before any of them returns a group.
  try {
    std::vector<dcp::IpcRankRecord> records;
    for (int p = 0; p < size; ++p) {
      records.push_back(dcp::unpack(all.data() + p * packed.size(), packed.size(), p));
      dcp::check_peer(mine, records[p], p);
    }
    std::array<uint8_t*, kMaxDcpRanks> base{};
    for (int p = 0; p < size; ++p) {
      if (p == rank) {
        base[p] = static_cast<uint8_t*>(mapping->own);
        continue;
      }
      if (records[p].device_uuid != mine.device_uuid) {
        const int peer_device = device_with_uuid(records[p].device_uuid);
        if (peer_device < 0) {
          throw_bad_argument("dcp peer " + std::to_string(p) + ": GPU", "one this process sees (CUDA_VISIBLE_DEVICES)",
                             "a GPU it does not see");
        }
        int can_access = 0;
        MLA_CUDA_CHECK(cudaDeviceCanAccessPeer(&can_access, device_index, peer_device));
        if (!can_access) {
          throw_bad_argument("dcp peer " + std::to_string(p) + ": GPU " + std::to_string(peer_device),
                             "peer access from GPU " + std::to_string(device_index), "no peer access");
        }
      }
      // Lazy peer access: the driver enables peer access to the exporting GPU where it is another one.
      void* opened = nullptr;
      MLA_CUDA_CHECK(cudaIpcOpenMemHandle(&opened, records[p].handle, cudaIpcMemLazyEnablePeerAccess));
      mapping->opened[p] = opened;
      base[p] = static_cast<uint8_t*>(opened);
    }
    for (int parity = 0; parity < 2; ++parity) {
      for (int p = 0; p < size; ++p) {
        uint8_t* block = base[p] + parity * layout.block_bytes;
        mapping->tables[parity].mailbox[p] = block + layout.mailbox_offset;
        mapping->tables[parity].latent[p] = block + layout.latent_offset;
        mapping->tables[parity].lse[p] = reinterpret_cast<float*>(block + layout.lse_offset);
        mapping->tables[parity].signals[p] = reinterpret_cast<uint32_t*>(block + layout.signal_offset);
      }
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  dcp::agree_all_succeeded(bootstrap, failure, "map the group's blocks");
  return mapping;
}

IpcDcp::IpcDcp(DcpBootstrap& bootstrap, int interleave, int num_heads, int64_t max_rows, int device_index,
               int wait_timeout_ms)
    : IpcDcp(bootstrap, map_blocks(bootstrap, interleave, num_heads, max_rows, device_index, wait_timeout_ms),
             interleave, num_heads, max_rows, device_index, wait_timeout_ms) {}

IpcDcp::IpcDcp(DcpBootstrap& bootstrap, std::unique_ptr<Mapping> mapping, int interleave, int num_heads,
               int64_t max_rows, int device_index, int wait_timeout_ms)
    : DcpGroup(DcpLayout{bootstrap.rank(), bootstrap.size(), interleave}, num_heads, max_rows, device_index,
               mapping->tables),
      bootstrap_(&bootstrap), mapping_(std::move(mapping)), wait_timeout_ns_(int64_t{wait_timeout_ms} * 1000000) {}

IpcDcp::~IpcDcp() {
  // A barrier before unmapping: no peer may still write signals into (or read from) these blocks.
  // Every rank synchronizes its own work first; a failed barrier (a peer died) cannot be reported.
  try {
    DeviceGuard guard(mapping_->device_index);
    cudaDeviceSynchronize();
    uint8_t mine = 0;
    std::vector<uint8_t> all(size());
    bootstrap_->all_gather(&mine, 1, all.data());
  } catch (...) {
  }
}

}  // namespace mla
