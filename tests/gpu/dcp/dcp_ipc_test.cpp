// DCP across processes on one GPU (IpcDcp): the test forks D processes, each re-executing this binary
// as one rank (DcpIpcRank.Child, driven by MLA_DCP_CHILD) with its own PreparedMla objects, stream and
// step buffers on GPU 0; the ranks find each other through a FileBootstrap in a fresh directory, map
// each other's blocks with CUDA IPC and run PreparedMla::run (query, signal, wait, core, signal, wait,
// value) for steps alternating parity with changing lengths, eagerly or as replays of captured
// graphs. Every rank builds every rank's steps from the same seeds and checks its own out and cache
// against mla::ref::run_layer_dcp (the bound of the in-process DCP tests), its epochs and signals.
//
// Kernels of different processes on one GPU are time-sliced, so a waiting rank's spin only ends once
// a peer's context is scheduled: steps are few, every wait traps after the group's timeout (10 s),
// every bootstrap exchange gives up after 20 s, and the parent kills what is left after 60 s. A child
// that fails (exit code, signal, timeout) fails the test with the tail of its log.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dcp_test_util.h"
#include "gpu/dcp/dcp_gpu_util.h"
#include "gpu_compare.h"
#include "gpu_test_util.h"
#include "mla/dcp.h"
#include "mla/mla.h"
#include "reference.h"
#include "synthetic.h"

#ifdef MLA_DCP_WITH_NCCL
#include <nccl.h>
#endif

extern char** environ;

namespace mla {
namespace {

using test::DeviceRankStep;
using test::RankStep;
using test::RankWeights;
using test::StepSequence;

constexpr const char* kChildVariable = "MLA_DCP_CHILD";
constexpr int kWaitTimeoutMs = 10000, kBootstrapTimeoutMs = 20000, kParentDeadlineS = 60;

struct Case {
  int size = 2;
  bool graph = false;
  int steps = 20;
  bool nccl = false;  // rank k on GPU k over an NcclBootstrap (binary mla_gpu_dcp_nccl_tests only)
};

// The group's shape per D: different interleaves, heads and q for the two sizes.
struct Shape {
  int interleave, heads, q, requests, max_length;
};
Shape shape_for(int size) {
  if (size == 8) return Shape{64, 12, 1, 3, 1200};
  return size == 2 ? Shape{64, 12, 1, 3, 600} : Shape{1, 16, 2, 3, 500};
}

// Step i of a case: random lengths, except one all-empty step and one where some ranks hold nothing.
std::vector<RankStep> step_of(const StepSequence& sequence, uint64_t seed, int i) {
  if (i == 2) return sequence.make(seed + i, {0, 0, 0});
  if (i == 3) return sequence.make(seed + i, {1, 2, 0});  // positions 0, 1 only: ranks >= 2 (D = 4) / rank 1 (I = 64) empty
  return sequence.make(seed + i);
}

// ---- The child: one rank ---------------------------------------------------------------------------

int visible_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  return count;
}

// Every view of a step or of weights on `device` (the helpers make views of GPU 0).
void place_on(StepInputs& s, int device) {
  for (TensorView* v : {&s.projected, &s.out, &s.cache, &s.slots, &s.block_table, &s.lengths, &s.totals}) {
    v->device_index = device;
  }
}
void place_on(Weights& w, int device) {
  for (TensorView* v : {&w.q_a_norm, &w.kv_a_norm, &w.q_b_proj, &w.w_uk_t, &w.w_uv}) v->device_index = device;
}

#ifdef MLA_DCP_WITH_NCCL
void check_nccl(ncclResult_t result, const char* call) {
  if (result != ncclSuccess) throw Error(std::string(call) + ": " + ncclGetErrorString(result));
}
#endif

void run_rank(const Case& c, int rank, const std::string& directory) {
  // Rank k on GPU k % count: GPU 0 for every rank on a one-GPU machine (as before), one GPU a rank on
  // a machine of D or more GPUs.
  const int gpu = rank % std::max(1, visible_gpus());
  ASSERT_EQ(cudaSetDevice(gpu), cudaSuccess);
  const Shape s = shape_for(c.size);
  const uint64_t seed = 1200 + 10 * c.size + (c.graph ? 1 : 0);
  const synth::SyntheticLayer layer = synth::make_layer(c.size * s.heads, seed);
  const StepSequence sequence{layer, c.size, s.interleave, s.heads, s.q, s.requests, s.max_length};
  std::vector<RankWeights> weights;
  for (int k = 0; k < c.size; ++k) weights.emplace_back(layer, k * s.heads, s.heads);
  test::DeviceWeights device_weights(weights[rank].host());
  place_on(device_weights.weights, gpu);

  std::vector<RankStep> steps = step_of(sequence, seed, 0);
  FileBootstrap file_bootstrap(directory, rank, c.size, kBootstrapTimeoutMs);
  DcpBootstrap* bootstrap = &file_bootstrap;
#ifdef MLA_DCP_WITH_NCCL
  // Rank 0's ncclUniqueId reaches the others through the FileBootstrap; each rank joins on its GPU.
  ncclComm_t comm = nullptr;
  std::unique_ptr<NcclBootstrap> nccl_bootstrap;
  if (c.nccl) {
    ncclUniqueId id{};
    if (rank == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::vector<ncclUniqueId> ids(c.size);
    file_bootstrap.all_gather(&id, sizeof id, ids.data());
    check_nccl(ncclCommInitRank(&comm, c.size, ids[0], rank), "ncclCommInitRank");
    nccl_bootstrap = std::make_unique<NcclBootstrap>(comm, gpu);
    EXPECT_EQ(nccl_bootstrap->rank(), rank);
    EXPECT_EQ(nccl_bootstrap->size(), c.size);
    bootstrap = nccl_bootstrap.get();
  }
#else
  ASSERT_FALSE(c.nccl) << "built without NCCL";
#endif
  {  // the group (and the NCCL communicator's users) end before the communicator
    IpcDcp group(*bootstrap, s.interleave, s.heads, steps[rank].rows, /*device_index=*/gpu, kWaitTimeoutMs);
    EXPECT_FALSE(group.stream_ordered());
    EXPECT_STREQ(group.transport(), "cuda-ipc");

    DeviceRankStep device(steps[rank]);
    auto inputs_of = [&](RankStep& host) {
      StepInputs in = device.inputs(host);
      place_on(in, gpu);
      return in;
    };
    std::vector<std::unique_ptr<PreparedMla>> objects;  // [parity]
    for (int parity = 0; parity < 2; ++parity) {
      objects.push_back(std::make_unique<PreparedMla>(
          device_weights.weights, LayerDims{s.heads, 1e-5f},
          std::map<int64_t, int64_t>{{steps[rank].rows, steps[rank].pitch}}, TensorView{},
          PrepareOptions{.dcp = &group, .parity = parity, .queries = {s.q}}));
      objects.back()->prepare(inputs_of(steps[rank]).cache);
    }
    device.upload(steps[rank]);
    MLA_CUDA_CHECK(cudaDeviceSynchronize());
    objects[0]->check_step(inputs_of(steps[rank]));

    // Every rank prepared before any rank's first step (prepare's warm-up writes its own blocks), and
    // the first waits do not count a slow peer's start-up against the wait timeout.
    uint8_t ready = 1;
    std::vector<uint8_t> all_ready(c.size);
    bootstrap->all_gather(&ready, 1, all_ready.data());

    cudaStream_t stream;
    MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::vector<cudaGraphExec_t> graphs;
    if (c.graph) {
      // One graph per parity over the fixed step buffers; each replay must advance its epoch.
      for (int parity = 0; parity < 2; ++parity) {
        cudaGraph_t graph;
        MLA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        objects[parity]->run(inputs_of(steps[rank]), stream);
        MLA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec;
        MLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        MLA_CUDA_CHECK(cudaGraphDestroy(graph));
        graphs.push_back(exec);
      }
    }

    double worst = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < c.steps; ++i) {
      const int parity = i % 2;
      SCOPED_TRACE(::testing::Message() << "rank " << rank << " step " << i << " parity " << parity);
      if (i > 0) {
        steps = step_of(sequence, seed, i);
        device.upload(steps[rank]);  // out poisoned
        MLA_CUDA_CHECK(cudaDeviceSynchronize());
      }
      if (c.graph) {
        MLA_CUDA_CHECK(cudaGraphLaunch(graphs[parity], stream));
      } else {
        objects[parity]->run(inputs_of(steps[rank]), stream);
      }
      MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<uint16_t> out = device.out.download();
      const std::vector<uint8_t> cache = device.cache.download();

      std::vector<RankStep> reference = steps;
      std::vector<Weights> reference_weights;
      std::vector<StepInputs> views;
      for (int k = 0; k < c.size; ++k) {
        reference_weights.push_back(weights[k].host());
        views.push_back(reference[k].inputs());
      }
      ref::run_layer_dcp(reference_weights, LayerDims{s.heads, 1e-5f}, views, s.interleave);
      const RankStep& mine = steps[rank];
      const double error = test::worst_out_error(mine.rows, mine.heads, [&](int64_t r) { return mine.zero_row(r); }, out,
                                                 reference[rank].out);
      worst = test::worse(worst, error);
      EXPECT_LE(error, test::kOutWholeChainBound);
      int64_t cache_far = 0;
      for (size_t b = 0; b < cache.size(); ++b) {
        if (cache[b] == reference[rank].cache[b]) continue;
        if (reference[rank].cache[b] == mine.cache[b] || test::e4m3_steps(cache[b], reference[rank].cache[b]) > 1) {
          ++cache_far;
        }
      }
      EXPECT_EQ(cache_far, 0) << "cache bytes wrong or written outside this rank's slots";
      if (::testing::Test::HasFailure()) break;
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

    // The epochs count this rank's steps per parity; every signal word of its blocks reached them.
    const int buffers_words = 2 * c.size + 1;
    for (int parity = 0; parity < 2; ++parity) {
      std::vector<uint32_t> words(buffers_words);
      MLA_CUDA_CHECK(cudaMemcpy(words.data(), group.peers(parity).signals[rank], words.size() * 4, cudaMemcpyDeviceToHost));
      const uint32_t runs = static_cast<uint32_t>((c.steps + 1 - parity) / 2);
      EXPECT_EQ(words[2 * c.size], runs) << "epoch of parity " << parity;
      for (int w = 0; w < 2 * c.size; ++w) EXPECT_GE(words[w], runs) << "signal word " << w << " of parity " << parity;
    }
    for (cudaGraphExec_t exec : graphs) MLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MLA_CUDA_CHECK(cudaStreamDestroy(stream));
    std::printf("SUMMARY rank %d of %d on GPU %d (%s, %s): %d steps, worst per-(row, head) relative L2 error of out %.2e (bound %.1e), "
                "%.1f ms per step with the CPU reference\n",
                rank, c.size, gpu, c.nccl ? "NcclBootstrap" : "FileBootstrap", c.graph ? "graph replays" : "eager run()", c.steps, worst, test::kOutWholeChainBound,
                ms / c.steps);
  }  // group
#ifdef MLA_DCP_WITH_NCCL
  if (comm != nullptr) check_nccl(ncclCommDestroy(comm), "ncclCommDestroy");
#endif
}

TEST(DcpIpcRank, Child) {
  const char* spec = std::getenv(kChildVariable);
  if (spec == nullptr) GTEST_SKIP() << "runs only as a child process of the DcpMultiProcess tests";
  Case c;
  int rank = -1, graph = 0, nccl = 0;
  char directory[4096] = {};
  ASSERT_EQ(std::sscanf(spec, "%d,%d,%d,%d,%d,%4095s", &c.size, &rank, &graph, &nccl, &c.steps, directory), 6) << spec;
  c.graph = graph != 0;
  c.nccl = nccl != 0;
  run_rank(c, rank, directory);
}

// ---- The parent --------------------------------------------------------------------------------------

std::string tail_of(const std::string& path, size_t max_chars = 3000) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  const std::string all = text.str();
  return all.size() > max_chars ? "..." + all.substr(all.size() - max_chars) : all;
}

void run_processes(const Case& c) {
  int mode = 0;
  MLA_CUDA_CHECK(cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, 0));
  if (mode == cudaComputeModeExclusiveProcess || mode == cudaComputeModeProhibited) {
    GTEST_SKIP() << "GPU 0 is in compute mode " << mode << ": several processes cannot share it";
  }
  std::string pattern = (std::filesystem::temp_directory_path() / "mla_dcp_ipc_XXXXXX").string();
  ASSERT_NE(mkdtemp(pattern.data()), nullptr);
  const std::string directory = pattern;
  const std::string exchange = directory + "/exchange";
  std::filesystem::create_directory(exchange);

  // Everything the children need is built before fork(): between fork and exec only
  // async-signal-safe calls.
  std::vector<std::string> environment;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string e_string(*e);
    if (e_string.rfind(std::string(kChildVariable) + "=", 0) == 0 || e_string.rfind("NCCL_NVLS_ENABLE=", 0) == 0) continue;
    environment.push_back(*e);
  }
  environment.push_back("NCCL_NVLS_ENABLE=0");  // never NVLink multicast, whatever the parent had
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string filter = "--gtest_filter=DcpIpcRank.Child";
  std::vector<pid_t> children;
  std::vector<std::string> logs;
  for (int k = 0; k < c.size; ++k) {
    std::vector<std::string> env = environment;
    env.push_back(std::string(kChildVariable) + "=" + std::to_string(c.size) + "," + std::to_string(k) + "," +
                  (c.graph ? "1" : "0") + "," + (c.nccl ? "1" : "0") + "," + std::to_string(c.steps) + "," + exchange);
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<char*> argv = {const_cast<char*>(exe.c_str()), const_cast<char*>(filter.c_str()), nullptr};
    logs.push_back(directory + "/rank" + std::to_string(k) + ".log");
    const int log = open(logs.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(log, 0);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(log, 1);
      dup2(log, 2);
      execve(exe.c_str(), argv.data(), envp.data());
      _exit(127);
    }
    close(log);
    ASSERT_GT(pid, 0) << "fork failed";
    children.push_back(pid);
  }

  // Collect every child's status; kill (by pid) what is still running at the deadline.
  std::vector<int> status(c.size, -1);
  std::vector<bool> done(c.size, false);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kParentDeadlineS);
  int remaining = c.size;
  while (remaining > 0) {
    for (int k = 0; k < c.size; ++k) {
      if (done[k]) continue;
      if (waitpid(children[k], &status[k], WNOHANG) == children[k]) {
        done[k] = true;
        --remaining;
      }
    }
    if (remaining > 0 && std::chrono::steady_clock::now() > deadline) {
      for (int k = 0; k < c.size; ++k) {
        if (done[k]) continue;
        kill(children[k], SIGKILL);
        waitpid(children[k], &status[k], 0);
        ADD_FAILURE() << "rank " << k << " still running after " << kParentDeadlineS << " s: killed";
        done[k] = true;
      }
      remaining = 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int k = 0; k < c.size; ++k) {
    const bool ok = WIFEXITED(status[k]) && WEXITSTATUS(status[k]) == 0;
    const std::string log = tail_of(logs[k]);
    if (!ok) {
      ADD_FAILURE() << "rank " << k << " failed ("
                    << (WIFEXITED(status[k]) ? "exit code " + std::to_string(WEXITSTATUS(status[k]))
                                             : "signal " + std::to_string(WTERMSIG(status[k])))
                    << "); its log ends:\n"
                    << log;
      continue;
    }
    const size_t at = log.find("SUMMARY ");
    if (at == std::string::npos) {
      ADD_FAILURE() << "rank " << k << " exited 0 without its summary (did the child test run?):\n" << log;
      continue;
    }
    std::printf("    %s\n", log.substr(at + 8, log.find('\n', at) - at - 8).c_str());
  }
  std::filesystem::remove_all(directory);
}

TEST(DcpMultiProcess, TwoRanksRunStepsAlternatingParity) {
  MLA_REQUIRE_GPU();
  run_processes({.size = 2, .graph = false, .steps = 20});
}

TEST(DcpMultiProcess, FourRanksRunStepsAlternatingParity) {
  MLA_REQUIRE_GPU();
  run_processes({.size = 4, .graph = false, .steps = 20});
}

TEST(DcpMultiProcess, FourRanksReplayCapturedGraphs) {
  MLA_REQUIRE_GPU();
  run_processes({.size = 4, .graph = true, .steps = 10});
}

#ifdef MLA_DCP_WITH_NCCL
// ---- Ranks on different GPUs over NcclBootstrap (mla_gpu_dcp_nccl_tests) -----------------------------

// One rank a GPU: NCCL refuses two ranks of a communicator on one GPU, so D ranks need D GPUs.
#define MLA_REQUIRE_GPUS(n)                                                                            \
  do {                                                                                                 \
    MLA_REQUIRE_GPU();                                                                                 \
    if (visible_gpus() < (n)) {                                                                        \
      GTEST_SKIP() << "needs " << (n) << " GPUs (one rank a GPU over NCCL), " << visible_gpus()     \
                   << " visible: not run";                                                           \
    }                                                                                                  \
  } while (0)

// A 1-rank communicator: what one GPU can check of NcclBootstrap.
TEST(DcpNcclBootstrap, OneRankAllGatherReturnsTheBytes) {
  MLA_REQUIRE_GPU();
  ASSERT_EQ(setenv("NCCL_NVLS_ENABLE", "0", 1), 0);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ncclComm_t comm = nullptr;
  int devices[1] = {0};
  check_nccl(ncclCommInitAll(&comm, 1, devices), "ncclCommInitAll");
  {
    NcclBootstrap bootstrap(comm, 0);
    EXPECT_EQ(bootstrap.rank(), 0);
    EXPECT_EQ(bootstrap.size(), 1);
    synth::Rng rng(77);
    for (size_t bytes : {size_t{1}, size_t{128}, size_t{4099}}) {
      std::vector<uint8_t> mine(bytes), gathered(bytes, 0);
      for (uint8_t& b : mine) b = static_cast<uint8_t>(rng());
      bootstrap.all_gather(mine.data(), bytes, gathered.data());
      EXPECT_EQ(gathered, mine) << bytes << " bytes";
    }
    // A 1-rank group is no DCP group: IpcDcp names the size.
    try {
      IpcDcp group(bootstrap, 64, 12, 4, 0);
      ADD_FAILURE() << "IpcDcp over a 1-rank bootstrap did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("size"), std::string::npos) << e.what();
    }
  }
  check_nccl(ncclCommDestroy(comm), "ncclCommDestroy");
  try {
    NcclBootstrap bootstrap(nullptr, 0);
    ADD_FAILURE() << "NcclBootstrap(nullptr) did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("comm"), std::string::npos) << e.what();
  }
}

TEST(DcpMultiGpu, TwoRanks) {
  MLA_REQUIRE_GPUS(2);
  run_processes({.size = 2, .graph = false, .steps = 20, .nccl = true});
}
TEST(DcpMultiGpu, TwoRanksReplayCapturedGraphs) {
  MLA_REQUIRE_GPUS(2);
  run_processes({.size = 2, .graph = true, .steps = 10, .nccl = true});
}
TEST(DcpMultiGpu, FourRanks) {
  MLA_REQUIRE_GPUS(4);
  run_processes({.size = 4, .graph = false, .steps = 20, .nccl = true});
}
TEST(DcpMultiGpu, EightRanks) {
  MLA_REQUIRE_GPUS(8);
  run_processes({.size = 8, .graph = false, .steps = 20, .nccl = true});
}
TEST(DcpMultiGpu, EightRanksReplayCapturedGraphs) {
  MLA_REQUIRE_GPUS(8);
  run_processes({.size = 8, .graph = true, .steps = 10, .nccl = true});
}
#endif  // MLA_DCP_WITH_NCCL

}  // namespace
}  // namespace mla
