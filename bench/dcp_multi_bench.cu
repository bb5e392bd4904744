// DCP on several real GPUs (issue 7; DESIGN.md §4 DCP, §6): one request of 1M global tokens, 96 heads
// spread over D ranks (H = 96 / D a rank), rank k on GPU k with its 1/D shard of the KV cache, against
// one GPU holding the whole context and all 96 heads, in the same run.
//
//   dcp_multi_bench [--ranks D ...] [--quick] [--allow-shared-gpu] [--out FILE]
//
// The parent forks one process per rank, each re-executing this binary with MLA_DCP_MULTI_BENCH_CHILD
// naming its rank (CUDA IPC cannot map memory into the exporting process, so ranks are processes).
// Ranks find each other through a FileBootstrap in a fresh directory; with one GPU a rank, rank 0's
// ncclUniqueId goes through it and the group is built over an NcclBootstrap (NCCL_NVLS_ENABLE=0 in
// every child). Each rank: one IpcDcp group, PreparedMla objects of parity 0 and 1 alternating steps,
// q = 1, interleave 64, random FP8 cache, synthetic weights. D ranks need D GPUs; with
// --allow-shared-gpu a larger D runs all ranks on GPU 0 over the FileBootstrap: a functional smoke run
// only, since kernels of different processes on one GPU are time-sliced (the times say nothing then).
//
// Timing: each rank captures a graph of 1 + 20 steps (parities alternating). The first step only
// aligns the ranks (its first signal wait holds every rank until the slowest has started; the
// FileBootstrap polls every millisecond), then events around the next 20 steps time them. Before each
// replay, a bootstrap barrier, so all ranks start together; a replay's per-step time is the max over
// ranks (rank 0 all-gathers every rank's times), the result the median over 30 replays (10 with
// --quick). The one-GPU step is timed like dcp_bench's: 20 steps a graph, median of 30 replays. L2:
// the one-GPU KV is 576 MB, a rank's shard >= 72 MB (D = 8) plus its weights, past the 50 MB L2, so
// replays stay mostly L2-cold without replicas. Floors as in dcp_bench, from ceilings measured on GPU 0.
#include <fcntl.h>
#include <nccl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_inputs.cuh"
#include "common/cuda_check.h"
#include "device_timing.h"
#include "mla/dcp.h"
#include "mla/mla.h"
#include "reference.h"
#include "synthetic.h"

extern char** environ;

namespace mla::bench {
namespace {

constexpr int kTotalHeads = 96, kInterleave = 64, kTimedSteps = 20;
constexpr int64_t kContext = int64_t{1} << 20;
constexpr const char* kChildVariable = "MLA_DCP_MULTI_BENCH_CHILD";
constexpr int kWaitTimeoutMs = 10000, kBootstrapTimeoutMs = 60000, kGroupDeadlineS = 180;

// One GPU's inputs: one request of `local` cached tokens (of kContext global), H heads; the new
// token's slot only where this GPU owns the last global position.
struct Inputs {
  DeviceArena arena;  // declared first: freed last, after the PreparedMla that uses it
  Weights weights;
  StepInputs step;
};

std::unique_ptr<Inputs> make_inputs(int heads, int64_t local, bool dcp, bool owner, int gpu, uint64_t seed,
                                    cudaStream_t stream) {
  auto in = std::make_unique<Inputs>();
  DeviceArena& a = in->arena;
  const int64_t pages_per_request = (local + kPageSize - 1) / kPageSize + 1;
  const int64_t pitch = (projected_width(heads) + 7) / 8 * 8;
  const synth::SyntheticLayer layer = synth::make_layer(heads, seed);
  in->weights = device_weights(layer, a);
  for (TensorView* v : {&in->weights.q_a_norm, &in->weights.kv_a_norm, &in->weights.q_b_proj, &in->weights.w_uk_t,
                        &in->weights.w_uv}) {
    v->device_index = gpu;
  }

  synth::Rng rng(synth::stream_seed(seed, 1));
  std::vector<uint16_t> projected(pitch);
  synth::fill_random_bf16(projected, 0.0, 1.0, rng);
  const std::vector<int32_t> pages = shuffled_pages(pages_per_request, rng);
  const int64_t j = local - 1;  // the new token is this GPU's last cached one where it owns it
  const std::vector<int64_t> slots = {owner ? int64_t{pages[j / kPageSize]} * kPageSize + j % kPageSize : -1};
  const int64_t cache_bytes = pages_per_request * kPageSize * kKeyDim;
  uint8_t* cache = a.alloc<uint8_t>(cache_bytes);
  fill_cache_kernel<<<2048, 256, 0, stream>>>(cache, cache_bytes, seed);
  MLA_CUDA_CHECK_LAUNCH();

  StepInputs& st = in->step;
  st.projected = make_strided_view(a.copy(projected), DType::kBF16, Memory::kDevice, {1, projected_width(heads)},
                                   {pitch, 1}, gpu);
  st.out = make_view(a.alloc<uint16_t>(heads * kVHeadDim), DType::kBF16, Memory::kDevice, {1, heads * kVHeadDim}, gpu);
  st.cache = make_view(cache, DType::kFP8E4M3, Memory::kDevice, {pages_per_request, kPageSize, kKeyDim}, gpu);
  st.slots = make_view(a.copy(slots), DType::kI64, Memory::kDevice, {1}, gpu);
  st.block_table = make_view(a.copy(pages), DType::kI32, Memory::kDevice, {1, pages_per_request}, gpu);
  const std::vector<int32_t> lengths = {static_cast<int32_t>(local)}, totals = {static_cast<int32_t>(kContext)};
  st.lengths = make_view(a.copy(lengths), DType::kI32, Memory::kDevice, {1}, gpu);
  if (dcp) st.totals = make_view(a.copy(totals), DType::kI32, Memory::kDevice, {1}, gpu);
  st.q = 1;
  return in;
}

// The cost a rank's step must pay (as dcp_bench's rank_cost): its weights, its shard of the KV,
// activations, the D partial latents + LSEs it merges and the queries it publishes; the core's FP8
// FLOPs over D*H heads.
timing::StepCost rank_cost(int size, int heads, double local_tokens) {
  timing::StepCost c = timing::step_cost(heads, 1, local_tokens, local_tokens);
  c.fp8_flops *= size;
  c.activation_bytes += double(size) * heads * (kKvLoraRank * 2 + 4);
  c.activation_bytes += double(size - 1) * heads * kKeyDim;
  return c;
}

void check_nccl(ncclResult_t result, const char* call) {
  if (result != ncclSuccess) throw Error(std::string("NCCL error from ") + call + ": " + ncclGetErrorString(result));
}

// What the parent asks of one child: rank `rank` of `size` on GPU `gpu` (size 1: the one-GPU step).
struct ChildSpec {
  int size = 1, rank = 0, gpu = 0;
  bool nccl = false;
  int replays = 30;
  std::string directory;  // the FileBootstrap's exchange directory
  std::string encode() const {
    return std::to_string(size) + "," + std::to_string(rank) + "," + std::to_string(gpu) + "," + (nccl ? "1" : "0") +
           "," + std::to_string(replays) + "," + directory;
  }
};

ChildSpec decode_spec(const char* text) {
  ChildSpec c;
  int nccl = 0;
  char directory[4096] = {};
  if (std::sscanf(text, "%d,%d,%d,%d,%d,%4095s", &c.size, &c.rank, &c.gpu, &nccl, &c.replays, directory) != 6) {
    throw_bad_argument(kChildVariable, "size,rank,gpu,nccl,replays,directory", text);
  }
  c.nccl = nccl != 0;
  c.directory = directory;
  return c;
}

// The one-GPU step: the whole context and all heads on GPU 0; prints its time and GPU 0's ceilings.
void run_one_gpu(const ChildSpec& c) {
  MLA_CUDA_CHECK(cudaSetDevice(0));
  cudaStream_t stream;
  MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const timing::Ceilings ceilings = timing::measure_ceilings(stream);
  {
    std::unique_ptr<Inputs> in = make_inputs(kTotalHeads, kContext, /*dcp=*/false, /*owner=*/true, 0, 7, stream);
    const TensorView scratch = make_view(in->arena.alloc<uint8_t>(size_t{kTotalHeads} * kKeyDim), DType::kFP8E4M3,
                                         Memory::kDevice, {1, kTotalHeads, kKeyDim});
    PreparedMla mla(in->weights, LayerDims{kTotalHeads, 1e-5f}, {{1, in->step.projected.stride[0]}}, scratch,
                    PrepareOptions{.max_context = kContext, .queries = {1}});
    mla.prepare(in->step.cache);
    MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
    mla.check_step(in->step);
    const double us = timing::time_graph_us(stream, [&](int) { mla.run(in->step, stream); }, kTimedSteps, c.replays);
    std::printf("RESULT %.3f %.1f %.1f %.1f\n", us, ceilings.copy_gbs, ceilings.bf16_tflops, ceilings.fp8_tflops);
  }
  MLA_CUDA_CHECK(cudaStreamDestroy(stream));
}

void barrier(DcpBootstrap& bootstrap) {
  const uint8_t mine = 1;
  std::vector<uint8_t> all(bootstrap.size());
  bootstrap.all_gather(&mine, 1, all.data());
}

// One rank of a D-rank group; rank 0 prints the group's per-step µs (median over replays of the
// max over ranks).
void run_rank(const ChildSpec& c) {
  MLA_CUDA_CHECK(cudaSetDevice(c.gpu));
  cudaStream_t stream;
  MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int heads = kTotalHeads / c.size;
  const DcpLayout layout{c.rank, c.size, kInterleave};
  const int64_t local = ref::dcp_local_length(kContext, layout);
  const bool owner = ((kContext - 1) / kInterleave) % c.size == c.rank;
  std::unique_ptr<Inputs> in = make_inputs(heads, local, /*dcp=*/true, owner, c.gpu, 11 + c.rank, stream);

  FileBootstrap file_bootstrap(c.directory, c.rank, c.size, kBootstrapTimeoutMs);
  DcpBootstrap* bootstrap = &file_bootstrap;
  ncclComm_t comm = nullptr;
  std::unique_ptr<NcclBootstrap> nccl_bootstrap;
  if (c.nccl) {
    ncclUniqueId id{};
    if (c.rank == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    // Bytes, not std::vector<ncclUniqueId>: nvcc's front end crashes on a vector of that unnamed struct.
    std::vector<char> ids(c.size * sizeof id);
    file_bootstrap.all_gather(&id, sizeof id, ids.data());
    std::memcpy(&id, ids.data(), sizeof id);  // rank 0's
    check_nccl(ncclCommInitRank(&comm, c.size, id, c.rank), "ncclCommInitRank");
    nccl_bootstrap = std::make_unique<NcclBootstrap>(comm, c.gpu);
    bootstrap = nccl_bootstrap.get();
  }
  {  // the group ends before the communicator its destructor's barrier uses
    IpcDcp group(*bootstrap, kInterleave, heads, /*max_rows=*/1, c.gpu, kWaitTimeoutMs);
    std::vector<std::unique_ptr<PreparedMla>> objects;  // [parity]
    for (int parity = 0; parity < 2; ++parity) {
      objects.push_back(std::make_unique<PreparedMla>(
          in->weights, LayerDims{heads, 1e-5f}, std::map<int64_t, int64_t>{{1, in->step.projected.stride[0]}},
          TensorView{}, PrepareOptions{.max_context = kContext, .dcp = &group, .parity = parity, .queries = {1}}));
      objects.back()->prepare(in->step.cache);
    }
    MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
    objects[0]->check_step(in->step);

    cudaEvent_t start, stop;
    MLA_CUDA_CHECK(cudaEventCreate(&start));
    MLA_CUDA_CHECK(cudaEventCreate(&stop));
    // Two graphs: the aligning step (parity 0), then the timed steps (parity 1, 0, 1, ...); the events
    // are recorded on the stream between their launches (an event recorded inside a graph cannot be
    // timed: cudaEventElapsedTime rejects it).
    auto capture = [&](int first, int last) {
      cudaGraph_t graph;
      MLA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      for (int i = first; i <= last; ++i) objects[i % 2]->run(in->step, stream);
      MLA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec;
      MLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      MLA_CUDA_CHECK(cudaGraphDestroy(graph));
      return exec;
    };
    cudaGraphExec_t align = capture(0, 0), timed = capture(1, kTimedSteps);

    // Every rank prepared before any rank's first step (prepare's warm-up writes its own blocks).
    std::vector<double> step_us;
    for (int replay = -2; replay < c.replays; ++replay) {  // two warm-up replays
      barrier(*bootstrap);
      MLA_CUDA_CHECK(cudaGraphLaunch(align, stream));
      MLA_CUDA_CHECK(cudaEventRecord(start, stream));
      MLA_CUDA_CHECK(cudaGraphLaunch(timed, stream));
      MLA_CUDA_CHECK(cudaEventRecord(stop, stream));
      MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
      float ms = 0;
      MLA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (replay >= 0) step_us.push_back(1e3 * ms / kTimedSteps);
    }
    std::vector<double> all(step_us.size() * c.size);
    bootstrap->all_gather(step_us.data(), step_us.size() * sizeof(double), all.data());
    if (c.rank == 0) {
      std::vector<double> worst(step_us.size(), 0.0), rank_median(c.size);
      for (int p = 0; p < c.size; ++p) {
        const std::vector<double> mine(all.begin() + p * step_us.size(), all.begin() + (p + 1) * step_us.size());
        for (size_t r = 0; r < mine.size(); ++r) worst[r] = std::max(worst[r], mine[r]);
        rank_median[p] = timing::median(mine);
      }
      std::printf("RESULT %.3f\n", timing::median(worst));
      for (int p = 0; p < c.size; ++p) std::printf("rank %d median %.2f µs a step\n", p, rank_median[p]);
    }
    MLA_CUDA_CHECK(cudaGraphExecDestroy(align));
    MLA_CUDA_CHECK(cudaGraphExecDestroy(timed));
    MLA_CUDA_CHECK(cudaEventDestroy(start));
    MLA_CUDA_CHECK(cudaEventDestroy(stop));
  }  // group
  if (comm != nullptr) check_nccl(ncclCommDestroy(comm), "ncclCommDestroy");
  MLA_CUDA_CHECK(cudaStreamDestroy(stream));
}

// ---- The parent --------------------------------------------------------------------------------------

std::string read_file(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// The children's results: per child whether it exited 0, and its log.
struct ChildRun {
  bool ok = false;
  std::string outcome;  // "exit code 1", "signal 9", "killed after 180 s"
  std::string log;
};

// Forks one process per spec (this binary, MLA_DCP_MULTI_BENCH_CHILD = the spec, NCCL_NVLS_ENABLE=0),
// waits for all of them and kills (by pid) what still runs after kGroupDeadlineS.
std::vector<ChildRun> run_children(const std::vector<ChildSpec>& specs, const std::string& log_directory) {
  // Everything the children need is built before fork(): between fork and exec only
  // async-signal-safe calls.
  std::vector<std::string> environment;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    if (entry.rfind(std::string(kChildVariable) + "=", 0) == 0 || entry.rfind("NCCL_NVLS_ENABLE=", 0) == 0) continue;
    environment.push_back(entry);
  }
  environment.push_back("NCCL_NVLS_ENABLE=0");  // never NVLink multicast, whatever the parent had
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<pid_t> children;
  std::vector<std::string> logs;
  for (const ChildSpec& spec : specs) {
    std::vector<std::string> env = environment;
    env.push_back(std::string(kChildVariable) + "=" + spec.encode());
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<char*> argv = {const_cast<char*>(exe.c_str()), nullptr};
    logs.push_back(log_directory + "/child" + std::to_string(logs.size()) + ".log");
    const int log = open(logs.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (log < 0) throw Error("cannot create the child log " + logs.back() + ": " + std::strerror(errno));
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(log, 1);
      dup2(log, 2);
      execve(exe.c_str(), argv.data(), envp.data());
      _exit(127);
    }
    close(log);
    if (pid < 0) throw Error(std::string("fork failed: ") + std::strerror(errno));
    children.push_back(pid);
  }

  std::vector<ChildRun> runs(specs.size());
  std::vector<int> status(specs.size(), 0);
  std::vector<bool> done(specs.size(), false);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kGroupDeadlineS);
  size_t remaining = specs.size();
  while (remaining > 0) {
    for (size_t k = 0; k < specs.size(); ++k) {
      if (!done[k] && waitpid(children[k], &status[k], WNOHANG) == children[k]) {
        done[k] = true;
        --remaining;
      }
    }
    if (remaining > 0 && std::chrono::steady_clock::now() > deadline) {
      for (size_t k = 0; k < specs.size(); ++k) {
        if (done[k]) continue;
        kill(children[k], SIGKILL);
        waitpid(children[k], &status[k], 0);
        runs[k].outcome = "killed after " + std::to_string(kGroupDeadlineS) + " s";
        done[k] = true;
      }
      remaining = 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (size_t k = 0; k < specs.size(); ++k) {
    runs[k].log = read_file(logs[k]);
    if (!runs[k].outcome.empty()) continue;
    runs[k].ok = WIFEXITED(status[k]) && WEXITSTATUS(status[k]) == 0;
    runs[k].outcome = WIFEXITED(status[k]) ? "exit code " + std::to_string(WEXITSTATUS(status[k]))
                                           : "signal " + std::to_string(WTERMSIG(status[k]));
  }
  return runs;
}

// The numbers after "RESULT " in a child's log, or empty when it printed none.
std::vector<double> result_of(const std::string& log) {
  std::vector<double> values;
  const size_t at = log.find("RESULT ");
  if (at == std::string::npos) return values;
  std::istringstream line(log.substr(at + 7, log.find('\n', at) - at - 7));
  for (double v; line >> v;) values.push_back(v);
  return values;
}

// Runs the children; on any failure prints which and their log tails and returns false.
bool run_group(const char* what, const std::vector<ChildSpec>& specs, const std::string& log_directory,
               std::string* rank0_log) {
  const std::vector<ChildRun> runs = run_children(specs, log_directory);
  bool ok = true;
  for (size_t k = 0; k < runs.size(); ++k) {
    if (runs[k].ok && (k != 0 || !result_of(runs[k].log).empty())) continue;
    ok = false;
    const std::string& log = runs[k].log;
    std::fprintf(stderr, "%s: process %zu failed (%s%s); its log ends:\n%s\n", what, k, runs[k].outcome.c_str(),
                 runs[k].ok ? ", but printed no RESULT line" : "",
                 log.size() > 3000 ? ("..." + log.substr(log.size() - 3000)).c_str() : log.c_str());
  }
  if (ok) *rank0_log = runs[0].log;
  return ok;
}

struct Options {
  std::vector<int> ranks = {2, 4, 8};
  bool quick = false, allow_shared_gpu = false;
  std::string out;
};

Options parse(int argc, char** argv) {
  Options o;
  bool ranks_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      o.quick = true;
    } else if (arg == "--allow-shared-gpu") {
      o.allow_shared_gpu = true;
    } else if (arg == "--out") {
      if (i + 1 == argc) throw_bad_argument("--out", "a file name", "nothing");
      o.out = argv[++i];
    } else if (arg == "--ranks") {
      if (!ranks_given) o.ranks.clear();
      ranks_given = true;
      for (; i + 1 < argc && argv[i + 1][0] != '-'; ++i) {
        char* end = nullptr;
        const long d = std::strtol(argv[i + 1], &end, 10);
        if (*end != '\0' || d < 2 || d > kMaxDcpRanks || kTotalHeads % d != 0) {
          throw_bad_argument("--ranks", "rank counts in {2, 3, 4, 6, 8} (2..8 dividing the 96 heads)", argv[i + 1]);
        }
        o.ranks.push_back(static_cast<int>(d));
      }
      if (o.ranks.empty()) throw_bad_argument("--ranks", "one or more rank counts", "none");
    } else {
      throw_bad_argument("argument " + std::to_string(i),
                         "--ranks D ..., --quick, --allow-shared-gpu or --out FILE", arg);
    }
  }
  return o;
}

int run_parent(const Options& o) {
  int visible = 0;
  MLA_CUDA_CHECK(cudaGetDeviceCount(&visible));
  if (visible < 1) throw Error("dcp_multi_bench: no CUDA device visible");
  std::string report;
  auto say = [&](const std::string& text) {
    std::printf("%s", text.c_str());
    std::fflush(stdout);
    report += text;
  };
  char line[512];
  for (int d = 0; d < visible; ++d) {
    cudaDeviceProp prop{};
    MLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, d));
    std::snprintf(line, sizeof line, "GPU %d: %s, %d SMs\n", d, prop.name, prop.multiProcessorCount);
    say(line);
  }
  const int replays = o.quick ? 10 : 30;
  std::string pattern = (std::filesystem::temp_directory_path() / "mla_dcp_multi_bench_XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) throw Error("mkdtemp " + pattern + ": " + std::strerror(errno));
  const std::string directory = pattern;

  bool failed = false;
  std::string log;
  ChildSpec one_gpu_spec;
  one_gpu_spec.replays = replays;
  one_gpu_spec.directory = directory;  // unused by the one-GPU step, but the spec's format needs one
  if (!run_group("one-GPU step", {one_gpu_spec}, directory, &log)) {
    std::filesystem::remove_all(directory);
    return 1;
  }
  const std::vector<double> one = result_of(log);  // µs, copy GB/s, bf16 and fp8 TFLOP/s
  const timing::Ceilings ceilings{one.at(1), one.at(2), one.at(3)};
  const double one_gpu_us = one.at(0);
  const timing::StepCost one_cost = timing::step_cost(kTotalHeads, 1, double(kContext), double(kContext));
  const double one_floor = timing::floor_us(ceilings, one_cost.bytes(), one_cost.bf16_flops, one_cost.fp8_flops);
  std::snprintf(line, sizeof line,
                "GPU 0 ceilings: %s\none GPU, 1 x %lld tokens, %d heads: %.1f µs a step, floor %.1f µs (step/floor %.2f)\n\n",
                ceilings.describe().c_str(), static_cast<long long>(kContext), kTotalHeads, one_gpu_us, one_floor,
                one_gpu_us / one_floor);
  say(line);

  std::string table =
      "| D | heads/rank | µs per step (max over ranks) | one-GPU µs | speedup | transport | rank floor µs | step/floor |\n"
      "|---:|---:|---:|---:|---:|---|---:|---:|\n";
  std::string notes;
  bool shared_rows = false;
  for (int size : o.ranks) {
    const bool own_gpus = size <= visible;
    if (!own_gpus && !o.allow_shared_gpu) {
      std::snprintf(line, sizeof line,
                    "D = %d: skipped, needs %d GPUs (one rank a GPU), %d visible (--allow-shared-gpu runs the ranks "
                    "on GPU 0 as a smoke run)\n",
                    size, size, visible);
      notes += line;
      continue;
    }
    if (!own_gpus) {
      int mode = 0;
      MLA_CUDA_CHECK(cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, 0));
      if (mode == cudaComputeModeExclusiveProcess || mode == cudaComputeModeProhibited) {
        throw_bad_argument("--allow-shared-gpu", "GPU 0 in a compute mode several processes can share",
                           "compute mode " + std::to_string(mode));
      }
    }
    const std::string exchange = directory + "/exchange" + std::to_string(size);
    std::filesystem::create_directory(exchange);
    std::vector<ChildSpec> specs;
    for (int k = 0; k < size; ++k) {
      ChildSpec& spec = specs.emplace_back();
      spec.size = size;
      spec.rank = k;
      spec.gpu = own_gpus ? k : 0;
      spec.nccl = own_gpus;
      spec.replays = replays;
      spec.directory = exchange;
    }
    const std::string what = "D = " + std::to_string(size);
    if (!run_group(what.c_str(), specs, directory, &log)) {
      failed = true;
      notes += what + ": failed (log tails above)\n";
      continue;
    }
    const double step_us = result_of(log).at(0);
    const int heads = kTotalHeads / size;
    const double local = double(ref::dcp_local_length(kContext, DcpLayout{0, size, kInterleave}));
    const timing::StepCost cost = rank_cost(size, heads, local);
    const double floor = timing::floor_us(ceilings, cost.bytes(), cost.bf16_flops, cost.fp8_flops);
    shared_rows |= !own_gpus;
    std::snprintf(line, sizeof line, "| %d | %d | %.1f%s | %.1f | %.2f | %s | %.1f | %.2f |\n", size, heads, step_us,
                  own_gpus ? "" : " *", one_gpu_us, one_gpu_us / step_us,
                  own_gpus ? "cuda-ipc, NcclBootstrap, GPU k" : "cuda-ipc, FileBootstrap, all on GPU 0", floor,
                  step_us / floor);
    table += line;
    std::printf("%s: %.1f µs per step\n%s", what.c_str(), step_us,
                log.substr(log.find('\n', log.find("RESULT ")) + 1).c_str());
  }
  std::filesystem::remove_all(directory);
  std::printf("\n");
  say(table);
  if (shared_rows) {
    say("\n* ranks share GPU 0 (--allow-shared-gpu): kernels of different processes are time-sliced, so these "
        "times are not meaningful (a functional smoke run only).\n");
  }
  if (!notes.empty()) say("\n" + notes);
  if (!o.out.empty()) {
    std::ofstream file(o.out);
    file << report;
    if (!file) throw_bad_argument("--out", "a writable file", o.out);
  }
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace mla::bench

int main(int argc, char** argv) {
  using namespace mla::bench;
  try {
    if (const char* spec = std::getenv(kChildVariable)) {
      const ChildSpec c = decode_spec(spec);
      if (c.size == 1) {
        run_one_gpu(c);
      } else {
        run_rank(c);
      }
      return 0;
    }
    return run_parent(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcp_multi_bench: %s\n", e.what());
    return 1;
  }
}
