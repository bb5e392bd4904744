// FileBootstrap: an all-gather among processes of one host through files in a shared directory
// (include/mla/dcp.h). Only group creation and destruction use it, so polling every millisecond is fine.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "dcp/internal.h"
#include "mla/dcp.h"

namespace mla {

FileBootstrap::FileBootstrap(std::string directory, int rank, int size, int timeout_ms)
    : directory_(std::move(directory)), rank_(rank), size_(size), timeout_ms_(timeout_ms) {
  if (size < 2 || size > kMaxDcpRanks) {
    throw_bad_argument("FileBootstrap size", "2.." + std::to_string(kMaxDcpRanks), std::to_string(size));
  }
  if (rank < 0 || rank >= size) {
    throw_bad_argument("FileBootstrap rank", "in [0, " + std::to_string(size) + ")", std::to_string(rank));
  }
  if (timeout_ms < 1) throw_bad_argument("FileBootstrap timeout_ms", ">= 1", std::to_string(timeout_ms));
  if (!std::filesystem::is_directory(directory_)) {
    throw_bad_argument("FileBootstrap directory", "an existing directory", "'" + directory_ + "'");
  }
}

std::string FileBootstrap::path(int call, int rank) const {
  return directory_ + "/ag" + std::to_string(call) + ".r" + std::to_string(rank);
}

void FileBootstrap::all_gather(const void* mine, size_t bytes, void* gathered) {
  const int call = ++calls_;
  const std::string own = path(call, rank_);
  {
    const std::string temporary = own + ".tmp";
    std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
    file.write(static_cast<const char*>(mine), static_cast<std::streamsize>(bytes));
    file.close();
    if (!file) throw Error("FileBootstrap: cannot write '" + temporary + "'");
    // rename() is atomic: a peer sees no file or the whole file.
    if (std::rename(temporary.c_str(), own.c_str()) != 0) throw Error("FileBootstrap: cannot rename to '" + own + "'");
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_);
  auto* out = static_cast<char*>(gathered);
  for (int p = 0; p < size_; ++p) {
    const std::string theirs = path(call, p);
    while (!std::filesystem::exists(theirs)) {
      if (std::chrono::steady_clock::now() > deadline) {
        throw Error("FileBootstrap: rank " + std::to_string(rank_) + " timed out after " +
                    std::to_string(timeout_ms_) + " ms in all-gather " + std::to_string(call) + " waiting for rank " +
                    std::to_string(p) + " ('" + theirs + "' missing)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::ifstream file(theirs, std::ios::binary);
    const std::vector<char> content((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    if (content.size() != bytes) {
      throw_bad_argument("FileBootstrap all-gather " + std::to_string(call) + " from rank " + std::to_string(p),
                         std::to_string(bytes) + " bytes (every rank passes the same count)",
                         std::to_string(content.size()) + " bytes");
    }
    std::copy(content.begin(), content.end(), out + p * bytes);
  }
  // Every rank has written call `call`, so every rank has finished reading call `call - 1`.
  if (call > 1) std::filesystem::remove(path(call - 1, rank_));
}

}  // namespace mla
