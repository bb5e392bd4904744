// Internals of the DCP transports shared by group.cpp, ipc.cpp and the CPU tests: size validation and
// the record each rank of a CUDA-IPC group all-gathers (packed to fixed bytes, checked field by field).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "mla/dcp.h"

namespace mla::dcp {

// D in 2..8, interleave >= 1, H in 1..128, max_rows >= 1; throws mla::Error naming the argument.
void validate_sizes(int size, int interleave, int num_heads, int64_t max_rows);

// What rank `rank` tells its peers about its blocks (parity 0 at the handle's base, parity 1 one
// block further).
struct IpcRankRecord {
  int32_t rank = 0, size = 0, interleave = 0, num_heads = 0;
  int64_t max_rows = 0;
  uint64_t block_bytes = 0;
  int64_t process_id = 0;                 // CUDA IPC maps only into other processes
  std::array<uint8_t, 16> device_uuid{};  // which GPU holds the blocks (indices differ per process)
  cudaIpcMemHandle_t handle{};            // of this rank's allocation of 2 blocks
};

inline constexpr uint32_t kIpcRecordMagic = 0x4d4c4144;  // "MLAD"
inline constexpr uint32_t kIpcRecordVersion = 1;

// Fixed-size bytes (magic, version, then the fields in order, little-endian as on the host).
std::vector<uint8_t> pack(const IpcRankRecord& record);
size_t packed_record_bytes();
// Throws mla::Error when `bytes` is not a record of this version (naming the peer `from`).
IpcRankRecord unpack(const uint8_t* bytes, size_t count, int from);
// Throws mla::Error naming peer and field where `peer` (received from rank `from`) cannot join
// `mine`'s group: another D, I, H, max_rows or block size, another rank than `from`, the same process.
void check_peer(const IpcRankRecord& mine, const IpcRankRecord& peer, int from);

// Every rank tells the others whether its part of a step of the group's setup succeeded (one all-gathered byte;
// `failure` empty = it did), so a rank that failed alone cannot leave its peers running against it or waiting in a
// later collective (NcclBootstrap's all-gather never times out). Throws on every rank if any failed: the failed
// rank its own `failure`, the others an mla::Error naming the first failed rank and `step`.
void agree_all_succeeded(DcpBootstrap& bootstrap, const std::string& failure, const std::string& step);

}  // namespace mla::dcp
