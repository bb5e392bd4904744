// DCP transports without a GPU: FileBootstrap's all-gather among threads (each its own rank, as
// processes would be), its errors and timeouts, the CUDA-IPC record's packing and peer checks, and
// IpcDcp's argument validation (all before its first CUDA call).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cpu/error_of.h"
#include "dcp/internal.h"
#include "mla/dcp.h"

namespace mla {
namespace {

using test::error_of;

// A fresh private directory, removed at the end.
struct TempDir {
  std::string path;
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "mla_dcp_XXXXXX").string();
    path = mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

// Runs body(k) for ranks k = 0..size - 1, each on its own thread (each its own rank, as processes would be), and
// returns once all have.
void on_rank_threads(int size, const std::function<void(int)>& body) {
  std::vector<std::thread> ranks;
  for (int k = 0; k < size; ++k) ranks.emplace_back(body, k);
  for (std::thread& t : ranks) t.join();
}

TEST(FileBootstrap, AllGathersAmongRanksRepeatedly) {
  constexpr int kSize = 4, kCalls = 5;
  TempDir dir;
  std::vector<std::vector<uint32_t>> got(kSize);
  std::vector<std::string> errors(kSize);
  on_rank_threads(kSize, [&](int k) {
    errors[k] = error_of([&] {
      FileBootstrap boot(dir.path, k, kSize, /*timeout_ms=*/10000);
      EXPECT_EQ(boot.rank(), k);
      EXPECT_EQ(boot.size(), kSize);
      for (int call = 0; call < kCalls; ++call) {
        const uint32_t mine[2] = {uint32_t(100 * call + k), uint32_t(0xabc0000 + k)};
        std::vector<uint32_t> all(2 * kSize);
        boot.all_gather(mine, sizeof(mine), all.data());
        got[k].insert(got[k].end(), all.begin(), all.end());
      }
    });
  });
  for (int k = 0; k < kSize; ++k) {
    EXPECT_EQ(errors[k], "no error") << "rank " << k;
    ASSERT_EQ(got[k].size(), size_t{2} * kSize * kCalls);
    for (int call = 0; call < kCalls; ++call) {
      for (int p = 0; p < kSize; ++p) {
        EXPECT_EQ(got[k][(call * kSize + p) * 2], uint32_t(100 * call + p)) << "rank " << k << " call " << call;
        EXPECT_EQ(got[k][(call * kSize + p) * 2 + 1], uint32_t(0xabc0000 + p));
      }
    }
  }
  // Only the last call's files remain (one per rank): earlier ones were deleted once read by all.
  int files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir.path)) ++files;
  EXPECT_EQ(files, kSize);
}

TEST(FileBootstrap, AllGathersAmongForkedProcesses) {
  // What the multi-process GPU test relies on: separate processes (no CUDA in them), each a rank.
  constexpr int kSize = 3, kCalls = 3;
  TempDir dir;
  std::vector<pid_t> children;
  for (int k = 0; k < kSize; ++k) {
    const pid_t pid = fork();
    if (pid == 0) {
      int code = 0;
      try {
        FileBootstrap boot(dir.path, k, kSize, /*timeout_ms=*/10000);
        for (int call = 0; call < kCalls && code == 0; ++call) {
          const int32_t mine = 1000 * call + k;
          int32_t all[kSize];
          boot.all_gather(&mine, sizeof(mine), all);
          for (int p = 0; p < kSize; ++p) {
            if (all[p] != 1000 * call + p) code = 10 + p;
          }
        }
      } catch (...) {
        code = 2;
      }
      _exit(code);
    }
    ASSERT_GT(pid, 0);
    children.push_back(pid);
  }
  for (int k = 0; k < kSize; ++k) {
    int status = 0;
    ASSERT_EQ(waitpid(children[k], &status, 0), children[k]);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << k << " status " << status;
  }
}

// A setup step that failed on one rank only (IpcDcp's peer mapping): every rank throws, none returns a group.
TEST(DcpAgreement, EveryRankThrowsWhereOneFailed) {
  TempDir dir;
  constexpr int kSize = 3;
  std::vector<std::string> errors(kSize);
  on_rank_threads(kSize, [&](int k) {
    FileBootstrap boot(dir.path, k, kSize, /*timeout_ms=*/10000);
    const std::string failure = k == 1 ? "dcp peer 0: GPU: expected one this process sees" : "";
    errors[k] = error_of([&] { dcp::agree_all_succeeded(boot, failure, "map the group's blocks"); });
    // Then all succeed: nobody throws.
    const std::string again = error_of([&] { dcp::agree_all_succeeded(boot, "", "map the group's blocks"); });
    if (again != "no error") errors[k] += " | second agreement: " + again;
  });
  EXPECT_EQ(errors[1], "dcp peer 0: GPU: expected one this process sees");
  for (int k : {0, 2}) {
    EXPECT_EQ(errors[k], "dcp rank " + std::to_string(k) +
                             ": rank 1 of 3 failed to map the group's blocks (its own error says why), so this rank "
                             "stops too");
  }
}

TEST(FileBootstrap, RejectsBadArgumentsAndTimesOut) {
  TempDir dir;
  EXPECT_ERROR_HAS(FileBootstrap(dir.path, 0, 1), "FileBootstrap size: expected 2..8, got 1");
  EXPECT_ERROR_HAS(FileBootstrap(dir.path, 0, 9), "FileBootstrap size: expected 2..8, got 9");
  EXPECT_ERROR_HAS(FileBootstrap(dir.path, 2, 2), "FileBootstrap rank: expected in [0, 2), got 2");
  EXPECT_ERROR_HAS(FileBootstrap(dir.path, 0, 2, 0), "FileBootstrap timeout_ms: expected >= 1, got 0");
  EXPECT_ERROR_HAS(FileBootstrap(dir.path + "/missing", 0, 2), "FileBootstrap directory: expected an existing directory");

  // Rank 1 never comes: rank 0 gives up after its timeout, naming the missing rank.
  FileBootstrap lonely(dir.path, 0, 2, /*timeout_ms=*/50);
  uint8_t byte = 7, all[2];
  EXPECT_ERROR_HAS(lonely.all_gather(&byte, 1, all), "rank 0 timed out after 50 ms in all-gather 1 waiting for rank 1");
}

TEST(FileBootstrap, RejectsADifferentByteCount) {
  TempDir dir;
  std::string error0, error1;
  std::thread rank1([&] {
    error1 = error_of([&] {
      FileBootstrap boot(dir.path, 1, 2, 5000);
      uint8_t mine[3] = {}, all[6];
      boot.all_gather(mine, 3, all);
    });
  });
  error0 = error_of([&] {
    FileBootstrap boot(dir.path, 0, 2, 5000);
    uint8_t mine[2] = {}, all[4];
    boot.all_gather(mine, 2, all);
  });
  rank1.join();
  EXPECT_NE(error0.find("FileBootstrap all-gather 1 from rank 1: expected 2 bytes (every rank passes the same count), "
                        "got 3 bytes"),
            std::string::npos)
      << error0;
  EXPECT_NE(error1.find("from rank 0: expected 3 bytes"), std::string::npos) << error1;
}

dcp::IpcRankRecord sample_record(int rank) {
  dcp::IpcRankRecord r;
  r.rank = rank;
  r.size = 4;
  r.interleave = 64;
  r.num_heads = 12;
  r.max_rows = 64;
  r.block_bytes = dcp_buffer_layout(4, 12, 64).block_bytes;
  r.process_id = 1000 + rank;
  for (int i = 0; i < 16; ++i) r.device_uuid[i] = uint8_t(i * 7 + 1);
  for (int i = 0; i < 64; ++i) r.handle.reserved[i] = char(i * 3 + rank);
  return r;
}

TEST(IpcRecord, PacksToFixedBytesAndBack) {
  const dcp::IpcRankRecord r = sample_record(2);
  const std::vector<uint8_t> bytes = dcp::pack(r);
  EXPECT_EQ(bytes.size(), dcp::packed_record_bytes());
  EXPECT_EQ(bytes.size(), 8u + 4 * 4 + 3 * 8 + 16 + 64);  // magic, version, 4 ints, 3 64-bit, uuid, handle
  const dcp::IpcRankRecord back = dcp::unpack(bytes.data(), bytes.size(), 2);
  EXPECT_EQ(dcp::pack(back), bytes);
  EXPECT_EQ(back.max_rows, 64);
  EXPECT_EQ(back.block_bytes, r.block_bytes);
  EXPECT_EQ(back.process_id, 1002);
  EXPECT_EQ(back.device_uuid, r.device_uuid);
  EXPECT_EQ(std::memcmp(back.handle.reserved, r.handle.reserved, 64), 0);

  EXPECT_ERROR_HAS(dcp::unpack(bytes.data(), bytes.size() - 1, 3), "dcp peer 3: record: expected 128 bytes, got 127");
  std::vector<uint8_t> other = bytes;
  other[4] = 9;  // version
  EXPECT_ERROR_HAS(dcp::unpack(other.data(), other.size(), 1), "dcp peer 1: record: expected an mla-decode CUDA-IPC");
}

TEST(IpcRecord, PeersMustMatchThisRanksGroup) {
  const dcp::IpcRankRecord mine = sample_record(0);
  dcp::check_peer(mine, mine, 0);  // itself
  dcp::check_peer(mine, sample_record(3), 3);
  EXPECT_ERROR_HAS(dcp::check_peer(mine, sample_record(2), 3), "dcp peer 3: rank: expected 3 (its place in the all-gather), got 2");
  dcp::IpcRankRecord r = sample_record(1);
  r.size = 2;
  EXPECT_ERROR_HAS(dcp::check_peer(mine, r, 1), "dcp peer 1: size: expected 4 (this rank's), got 2");
  r = sample_record(1);
  r.interleave = 1;
  EXPECT_ERROR_HAS(dcp::check_peer(mine, r, 1), "dcp peer 1: interleave: expected 64 (this rank's), got 1");
  r = sample_record(1);
  r.num_heads = 16;
  EXPECT_ERROR_HAS(dcp::check_peer(mine, r, 1), "dcp peer 1: num_heads: expected 12");
  r = sample_record(1);
  r.max_rows = 32;
  EXPECT_ERROR_HAS(dcp::check_peer(mine, r, 1), "dcp peer 1: max_rows: expected 64");
  r = sample_record(1);
  r.block_bytes += 256;
  EXPECT_ERROR_HAS(dcp::check_peer(mine, r, 1), "dcp peer 1: block_bytes");
  r = sample_record(1);
  r.process_id = mine.process_id;
  EXPECT_ERROR_HAS(dcp::check_peer(mine, r, 1), "dcp peer 1: process: expected another process than rank 0's");
}

// A bootstrap of one rank whose peers always send what it does (IpcDcp's own checks come before any exchange but
// the ranks' agreement on them, where this rank's failure is its own error).
class FixedBootstrap final : public DcpBootstrap {
 public:
  FixedBootstrap(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_gather(const void* mine, size_t bytes, void* all) override {
    for (int p = 0; p < size_; ++p) std::memcpy(static_cast<uint8_t*>(all) + p * bytes, mine, bytes);
  }

 private:
  int rank_, size_;
};

TEST(IpcDcp, ValidatesBeforeAnyCudaCall) {
  FixedBootstrap one(0, 1), nine(0, 9), bad_rank(3, 2), good(0, 2);
  EXPECT_ERROR_HAS(IpcDcp(one, 64, 12, 8, 0), "dcp size: expected 2..8 ranks");
  EXPECT_ERROR_HAS(IpcDcp(nine, 64, 12, 8, 0), "dcp size: expected 2..8 ranks");
  EXPECT_ERROR_HAS(IpcDcp(bad_rank, 64, 12, 8, 0), "dcp bootstrap rank: expected in [0, 2), got 3");
  EXPECT_ERROR_HAS(IpcDcp(good, 0, 12, 8, 0), "dcp interleave: expected >= 1, got 0");
  EXPECT_ERROR_HAS(IpcDcp(good, 64, 129, 8, 0), "dcp num_heads");
  EXPECT_ERROR_HAS(IpcDcp(good, 64, 12, 0, 0), "dcp max_rows: expected >= 1, got 0");
  EXPECT_ERROR_HAS(IpcDcp(good, 64, 12, 8, -1), "dcp device_index: expected >= 0, got -1");
  EXPECT_ERROR_HAS(IpcDcp(good, 64, 12, 8, 0, 0), "dcp wait_timeout_ms: expected >= 1, got 0");
}

// One rank's own bad argument: every rank throws; none waits in the record exchange for the rank that stopped (there
// it would time out, or with NcclBootstrap hang). Where this process sees a GPU, the other rank allocates its blocks
// and then learns of rank 0's failure; without one its own CUDA error stops it first.
TEST(IpcDcp, EveryRankThrowsWhereOneHasABadArgument) {
  TempDir dir;
  constexpr int kSize = 2;
  std::vector<std::string> errors(kSize);
  on_rank_threads(kSize, [&](int k) {
    FileBootstrap boot(dir.path, k, kSize, /*timeout_ms=*/20000);
    errors[k] = error_of([&] { IpcDcp group(boot, 64, 12, 8, /*device_index=*/k == 0 ? -1 : 0); });
  });
  EXPECT_NE(errors[0].find("dcp device_index: expected >= 0, got -1"), std::string::npos) << errors[0];
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    EXPECT_EQ(errors[1], "dcp rank 1: rank 0 of 2 failed to check its arguments and allocate its blocks (its own error "
                         "says why), so this rank stops too");
  } else {
    EXPECT_NE(errors[1], "no error");
  }
}

}  // namespace
}  // namespace mla
