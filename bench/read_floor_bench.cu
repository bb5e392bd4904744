// How long a kernel takes only to read N bytes, L2-cold, timed like every benchmark here (CUDA events over graph
// replays of PDL-chained launches, median): the practical floor of a stage or a step that must move those bytes.
// DESIGN.md §6's byte floor is bytes / the copy bandwidth of a 2 GiB memcpy; a short read also pays a launch, the
// first requests' latency and a tail, and the ratio "read / byte floor" says how much of a target stated against the
// byte floor those alone take at that size. The bytes are read as 576-byte token rows of 64-token pages through an
// identity block table (bench/page_read_floor.cuh's kernel, as `core_bench --read-floor` reads the KV cache).
//
//   read_floor_bench [--mb X ...] [--out results.md]
// Without --mb: the byte counts of the query stage at 1 row (H 12, 16, 64, 96, 128; tools/device_timing.h
// query_stage_bytes), of whole steps at small shapes (DESIGN.md §6's count, tools/device_timing.h step_cost) and of
// long single-request cores (the visible KV).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_device.cuh"
#include "common/cuda_check.h"
#include "device_timing.h"
#include "mla/dims.h"
#include "page_read_floor.cuh"

namespace {

struct Size {
  std::string what;
  double bytes;
};

// A whole step's bytes: `batch` requests of `context` tokens, q rows each.
double step_bytes(int batch, int context, int heads, int q) {
  const double visible = double(batch) * q * context;  // (rows x tokens): only the FLOPs use it
  return mla::timing::step_cost(heads, int64_t{batch} * q, double(batch) * context, visible).bytes();
}

__global__ void fill_bytes(uint8_t* data, int64_t bytes) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < bytes; i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = static_cast<uint8_t>((i * 0x9E3779B1ull) >> 24);
  }
}

struct Measured {
  double us;
  int64_t bytes;  // read: whole token rows
};

Measured measure(double bytes, cudaStream_t stream) {
  const int64_t page_bytes = int64_t{mla::kPageSize} * mla::kKeyDim;
  const int tokens = static_cast<int>(std::max(1.0, bytes / mla::kKeyDim));
  const int pages = (tokens + mla::kPageSize - 1) / mla::kPageSize;
  // L2-cold as core_bench: a set comes back only after ~400 MB of others; at least 20 launches a graph.
  const int num_sets = static_cast<int>(std::clamp<int64_t>((int64_t{400} << 20) / (int64_t{pages} * page_bytes) + 1,
                                                            1, 1024));
  const int launches = std::max(20, num_sets);
  uint8_t* pool;
  int32_t *tables, *length;
  MLA_CUDA_CHECK(cudaMalloc(&pool, int64_t{pages} * num_sets * page_bytes));
  MLA_CUDA_CHECK(cudaMalloc(&tables, int64_t{pages} * num_sets * sizeof(int32_t)));
  MLA_CUDA_CHECK(cudaMalloc(&length, sizeof(int32_t)));
  fill_bytes<<<1024, 256, 0, stream>>>(pool, int64_t{pages} * num_sets * page_bytes);
  MLA_CUDA_CHECK_LAUNCH();
  std::vector<int32_t> table(int64_t{pages} * num_sets);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);  // set k: its own pages, in order
  MLA_CUDA_CHECK(cudaMemcpy(tables, table.data(), table.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  MLA_CUDA_CHECK(cudaMemcpy(length, &tokens, sizeof tokens, cudaMemcpyHostToDevice));
  auto set_of = [&](int i) {
    return mla::bench::ReadFloorParams{.cache = pool, .stride_cache_page = page_bytes,
                                       .block_table = tables + int64_t{i % num_sets} * pages,
                                       .stride_block_table = pages, .lengths = length, .num_requests = 1};
  };
  // Set 0's pages are the pool's first: only those are copied back for the check.
  const double us = mla::bench::time_read_floor_us(stream, launches, /*replays=*/20, set_of,
                                                   int64_t{pages} * page_bytes, table.data(), &tokens);
  MLA_CUDA_CHECK(cudaFree(pool));
  MLA_CUDA_CHECK(cudaFree(tables));
  MLA_CUDA_CHECK(cudaFree(length));
  return {us, int64_t{tokens} * mla::kKeyDim};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Size> sizes;
  const char* out_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--mb") && i + 1 < argc) {
      const double mb = std::atof(argv[++i]);
      if (!(mb > 0 && mb <= 4096)) {
        std::fprintf(stderr, "read_floor_bench: --mb expects a size in (0, 4096] MB, got '%s'\n", argv[i]);
        return 2;
      }
      sizes.push_back({"--mb " + std::string(argv[i]), mb * 1e6});
    } else if (!std::strcmp(argv[i], "--out") && i + 1 < argc) {
      out_path = argv[++i];
    } else {
      std::fprintf(stderr,
                   "read_floor_bench: bad argument '%s'\nusage: read_floor_bench [--mb X ...] [--out file.md]\n",
                   argv[i]);
      return 2;
    }
  }
  if (sizes.empty()) {
    for (int heads : {12, 16, 64, 96, 128}) {
      sizes.push_back(
          {"query stage, H " + std::to_string(heads) + " x 1 row", mla::timing::query_stage_bytes(heads, 1)});
    }
    sizes.push_back({"query stage, H 64 x 16 rows", mla::timing::query_stage_bytes(64, 16)});
    const int steps[][4] = {{1, 4096, 12, 1}, {4, 4096, 12, 1}, {16, 4096, 12, 4}, {1, 32768, 12, 1},
                            {1, 4096, 96, 1}, {1, 131072, 96, 1}};
    for (const auto& s : steps) {
      sizes.push_back({"step " + std::to_string(s[0]) + " x " + std::to_string(s[1] / 1024) + "k x H" +
                           std::to_string(s[2]) + " x q" + std::to_string(s[3]),
                       step_bytes(s[0], s[1], s[2], s[3])});
    }
    for (int context : {131072, 262144, 1 << 20}) {
      sizes.push_back(
          {"core 1 x " + std::to_string(context / 1024) + "k (visible KV)", double(context) * mla::kKeyDim});
    }
  }
  try {
    cudaDeviceProp prop;
    MLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const double copy_gbs = mla::timing::measure_copy_gbs(nullptr);
    cudaStream_t stream;
    MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    char line[512];
    std::snprintf(line, sizeof line,
                  "device: %s, %d SMs; copy bandwidth (D2D, read+write): %.0f GB/s; read kernel: %d CTAs\n\n",
                  prop.name, prop.multiProcessorCount, copy_gbs, mla::bench::read_floor_ctas());
    std::string table = line;
    table += "| bytes of | MB | read µs | GB/s | % copy BW | byte floor µs | read / byte floor |\n";
    table += "|---|---:|---:|---:|---:|---:|---:|\n";
    std::fputs(table.c_str(), stdout);
    for (const Size& s : sizes) {
      const Measured m = measure(s.bytes, stream);
      const double gbs = m.bytes / (m.us * 1e-6) / 1e9;
      const double floor_us = m.bytes / (copy_gbs * 1e9) * 1e6;
      std::snprintf(line, sizeof line, "| %s | %.2f | %.2f | %.0f | %.1f | %.2f | %.2fx |\n", s.what.c_str(),
                    m.bytes / 1e6, m.us, gbs, 100.0 * gbs / copy_gbs, floor_us, m.us / floor_us);
      table += line;
      std::fputs(line, stdout);
      std::fflush(stdout);
    }
    MLA_CUDA_CHECK(cudaStreamDestroy(stream));
    if (out_path) mla::bench::write_out_file(out_path, table);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "read_floor_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
