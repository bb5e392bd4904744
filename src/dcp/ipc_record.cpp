// Packing and checking the records a CUDA-IPC group all-gathers, and the ranks' agreement on a setup step
// (dcp/internal.h).
#include <cstring>
#include <string>

#include "dcp/internal.h"
#include "mla/error.h"

namespace mla::dcp {
namespace {

// Appends / reads the fields in one fixed order; both sides of pack / unpack go through these.
template <class T>
void put(std::vector<uint8_t>& out, const T& value) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &value, sizeof(T));
}
template <class T>
void get(const uint8_t*& in, T& value) {
  std::memcpy(&value, in, sizeof(T));
  in += sizeof(T);
}

// The record's fields in their one wire order (after the magic and version words): pack and unpack
// both walk this list, so they cannot disagree.
template <class Record, class Visit>
void for_each_field(Record& r, Visit&& visit) {
  visit(r.rank);
  visit(r.size);
  visit(r.interleave);
  visit(r.num_heads);
  visit(r.max_rows);
  visit(r.block_bytes);
  visit(r.process_id);
  visit(r.device_uuid);
  visit(r.handle);
}

std::string peer_name(int from) { return "dcp peer " + std::to_string(from); }

template <class T>
void check_equal(const char* field, T mine, T peer, int from) {
  if (mine == peer) return;
  throw_bad_argument(peer_name(from) + ": " + field, std::to_string(mine) + " (this rank's)", std::to_string(peer));
}

}  // namespace

std::vector<uint8_t> pack(const IpcRankRecord& r) {
  std::vector<uint8_t> out;
  put(out, kIpcRecordMagic);
  put(out, kIpcRecordVersion);
  for_each_field(r, [&](const auto& field) { put(out, field); });
  return out;
}

size_t packed_record_bytes() { return pack(IpcRankRecord{}).size(); }

IpcRankRecord unpack(const uint8_t* bytes, size_t count, int from) {
  if (count != packed_record_bytes()) {
    throw_bad_argument(peer_name(from) + ": record", std::to_string(packed_record_bytes()) + " bytes",
                       std::to_string(count) + " bytes");
  }
  const uint8_t* in = bytes;
  uint32_t magic = 0, version = 0;
  get(in, magic);
  get(in, version);
  if (magic != kIpcRecordMagic || version != kIpcRecordVersion) {
    throw_bad_argument(peer_name(from) + ": record", "an mla-decode CUDA-IPC record of version " +
                                                         std::to_string(kIpcRecordVersion),
                       "magic " + std::to_string(magic) + ", version " + std::to_string(version));
  }
  IpcRankRecord r;
  for_each_field(r, [&](auto& field) { get(in, field); });
  return r;
}

void check_peer(const IpcRankRecord& mine, const IpcRankRecord& peer, int from) {
  if (peer.rank != from) {
    throw_bad_argument(peer_name(from) + ": rank", std::to_string(from) + " (its place in the all-gather)",
                       std::to_string(peer.rank));
  }
  check_equal("size", mine.size, peer.size, from);
  check_equal("interleave", mine.interleave, peer.interleave, from);
  check_equal("num_heads", mine.num_heads, peer.num_heads, from);
  check_equal("max_rows", mine.max_rows, peer.max_rows, from);
  check_equal("block_bytes", mine.block_bytes, peer.block_bytes, from);
  if (from != mine.rank && peer.process_id == mine.process_id) {
    throw_bad_argument(peer_name(from) + ": process",
                       "another process than rank " + std::to_string(mine.rank) +
                           "'s (CUDA IPC cannot map memory into the process that exported it; for ranks "
                           "in one process use InProcessDcp)",
                       "the same process " + std::to_string(peer.process_id));
  }
}

void agree_all_succeeded(DcpBootstrap& bootstrap, const std::string& failure, const std::string& step) {
  const uint8_t succeeded = failure.empty() ? 1 : 0;
  std::vector<uint8_t> all(static_cast<size_t>(bootstrap.size()));
  bootstrap.all_gather(&succeeded, 1, all.data());
  if (!failure.empty()) throw Error(failure);
  for (int p = 0; p < bootstrap.size(); ++p) {
    if (all[p] == 0) {
      throw Error("dcp rank " + std::to_string(bootstrap.rank()) + ": rank " + std::to_string(p) + " of " +
                  std::to_string(bootstrap.size()) + " failed to " + step + " (its own error says why), so this "
                  "rank stops too");
    }
  }
}

}  // namespace mla::dcp
