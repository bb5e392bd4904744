// Public API of mla-decode: the decode step of a Multi-head Latent Attention layer (Kimi K3,
// DeepSeek-V3 style with an output gate) as a prepared object. DESIGN.md is the specification.
//
//   mla::PreparedMla mla(weights, dims, /*pitches=*/{{1, 4096}, {8, 4096}}, query_scratch,
//                        {.max_context = 1 << 17, .queries = {1, 4}});
//   mla.prepare(cache);                                   // once: plans, attributes, warm-up
//   mla.run(step, stream);                                // per step: launches only (graph-capturable)
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "mla/dims.h"
#include "mla/error.h"
#include "mla/tensor.h"

namespace mla {

// Run-time dimensions of one layer on one GPU.
struct LayerDims {
  int num_heads = 0;       // H: heads on this GPU, 1..128 (K3: 96 heads, 12 per GPU at TP8)
  float rms_eps = 1e-5f;   // epsilon of both RMSNorms
};

// The layer's weights (bf16, contiguous, 16-byte aligned data pointers) and per-tensor FP8 scales.
// Non-owning.
struct Weights {
  TensorView q_a_norm;   // [1536] bf16: RMSNorm weight of q_a
  TensorView kv_a_norm;  // [512] bf16: RMSNorm weight of kv_a
  TensorView q_b_proj;   // [H*192, 1536] bf16: per head rows h*192+[0,128) nope, +[128,192) rope
  TensorView w_uk_t;     // [H, 128, 512] bf16: absorbs q_nope into the latent space
  TensorView w_uv;       // [H, 512, 128] bf16: latent -> per-head value
  float q_scale = 1.0f;  // FP8 query dequant scale: query bytes = e4m3(q / q_scale)
  float k_scale = 1.0f;  // FP8 cache dequant scale: cache bytes = e4m3(k / k_scale)
};

// Decode context parallelism seen from one rank: which global positions this rank's cache holds.
// Rank k owns global position g iff (g / interleave) % size == k (DESIGN.md §4, DCP).
struct DcpLayout {
  int rank = 0;        // k in [0, size)
  int size = 1;        // D: ranks in the group (1 = no DCP)
  int interleave = 1;  // I: consecutive positions owned together (1 or the page size, typically)
};

// What one decode step reads and writes. All device tensors on the prepared object's GPU.
struct StepInputs {
  TensorView projected;    // [rows, >= 2112 + H*128] bf16, 16-byte aligned, row stride = the pitch prepared for `rows`
  TensorView out;          // [rows, H*128] bf16, contiguous, 16-byte aligned: feeds o_proj
  TensorView cache;        // [num_pages, 64, 576] FP8 e4m3 (or u8), 16-byte aligned; page stride >= 64*576, multiple of 16
  TensorView slots;        // [rows] int64: cache slot (page*64 + offset) of each row's token, -1 = none
  TensorView block_table;  // [reqs, max_pages] int32, reqs <= rows/q (missing requests are padding)
  TensorView lengths;      // [reqs] int32: tokens in this GPU's cache, including this step's new ones
  TensorView totals;       // [reqs] int32: global lengths; required under DCP, absent otherwise
  int q = 1;               // rows per request (spec verify: 1 + draft length), 1..8
};

// Which attention core runs a shape. `kAuto` picks per (batch, q) from measurements.
enum class CoreKind { kAuto };
CoreKind parse_core_kind(const char* name);  // "auto"; anything else is an Error
const char* core_kind_name(CoreKind kind);

class DcpGroup;  // rank group, mailboxes and transports: mla/dcp.h (DESIGN.md §4, DCP)

// The phases of one DCP step, in the order the group runs them: rank k's kCore reads what every
// rank's kQuery published, rank k's kValue what every rank's kCore wrote.
enum class DcpPhase {
  kQuery,  // this rank's H heads of the FP8 query into every rank's mailbox at heads [k*H, (k+1)*H);
           // this rank's cache writes (slots of the tokens it owns)
  kCore,   // the core over all D*H heads of this rank's mailbox and its cache shard, global causal
           // bounds from `totals` -> this rank's partial latent (bf16) + LSE in the group's buffers
  kValue,  // merge the D partials of this rank's heads by LSE (fp32, not rounded), W_UV, gate -> out
};

struct PrepareOptions {
  int64_t max_context = int64_t{1} << 17;  // longest sequence of the deployment; bounds the split count
  CoreKind core = CoreKind::kAuto;
  const DcpGroup* dcp = nullptr;           // optional: null = the whole context is on this GPU; the
                                           // group must outlive the object
  int parity = 0;                          // DCP buffer parity of this object (0 or 1): consecutive
                                           // layers alternate, so one never overwrites what a peer
                                           // still reads of the other
  std::vector<int> queries = {1};          // the q values steps will use
};

// One (batch rows, q) launch shape and the plan fixed for it at construction.
struct PreparedShape {
  int64_t rows = 0;        // rows of projected/out
  int q = 1;               // rows per request
  int64_t pitch = 0;       // row stride of projected (elements)
  int num_splits = 1;      // split-KV count of the core for this shape
};

class PreparedMla {
 public:
  // `pitches` maps each batch size (rows) to the row stride of its projected tensor.
  // `query_scratch` is [max rows, H, 576] FP8 device memory (contiguous, 16-byte aligned) owned by the
  // caller; under DCP it must be absent (a default TensorView): the group's mailboxes
  // [max_rows, D*H, 576] replace it, the group's H must be dims.num_heads, its max_rows at least the
  // largest batch, its device the weights'.
  // Shapes {(b, q) : b in pitches, q in queries, b % q == 0} are planned here; bad arguments throw.
  PreparedMla(const Weights& weights, const LayerDims& dims, const std::map<int64_t, int64_t>& pitches,
              const TensorView& query_scratch, const PrepareOptions& options = {});
  ~PreparedMla();
  PreparedMla(const PreparedMla&) = delete;
  PreparedMla& operator=(const PreparedMla&) = delete;

  // Bytes of device memory the stage buffers take, sized for the largest prepared shape: the query
  // GEMM path's buffers with its 32 MiB cuBLAS workspace where a shape takes that path, the core's
  // split-KV partials, and without DCP the latent and LSE between the stages. Plans every shape (device
  // queries, no allocation) on the current device, which must be the object's.
  size_t workspace_bytes() const;

  // Instantiate every shape's kernels for this cache, set shared-memory limits, warm each shape once.
  // Without `workspace` the object allocates its stage buffers (workspace_bytes()); with it they live
  // there: u8 [>= workspace_bytes()] device memory of the object's device, 256-byte aligned, that
  // outlives the object. Objects whose steps never overlap in time (the layers of one model, run in
  // order on one stream) can share one workspace of the largest of their sizes: a prepared object
  // per layer then holds no stage memory of its own. prepare() runs warm-up steps in the workspace:
  // call it while no object sharing it runs (typically: prepare every layer, then run or capture).
  void prepare(const TensorView& cache, const TensorView& workspace = {});

  // Validate `step`, then only launch the PDL-chained kernels on `stream`: no allocation, no
  // synchronization, capturable in a CUDA graph. Writes step.out and this step's cache slots.
  // Under a signalling DCP group (IpcDcp; DcpGroup::stream_ordered() false): the rank's whole step,
  // query (+ publish) -> signal, wait for every rank's query -> core -> signal, wait for every
  // partial -> value, on `stream`; each wait traps after the group's timeout rather than hang. The
  // epoch lives in device memory, so graph replays count steps. Every rank runs the same steps in
  // the same order (layer by layer, alternating parity). Under the in-process group: an Error (use
  // run_phase).
  void run(const StepInputs& step, cudaStream_t stream);

  // Stream-ordered DCP groups only (InProcessDcp; a signalling group is an Error: use run()):
  // validate `step` (totals required, lengths = this rank's local lengths), then launch one
  // phase on `stream` (launches only; graph-capturable). The caller orders the phases across ranks:
  // with the in-process group, every rank's kQuery, then every kCore, then every kValue on one stream
  // (each phase starts after everything before it on the stream completed; no PDL across phases).
  void run_phase(DcpPhase phase, const StepInputs& step, cudaStream_t stream);

  // Without DCP only: run() with `stage_events` recorded before the query stage and after the query, core and value
  // stages, for per-stage profiling. The events separate the kernels, so the stages lose their PDL
  // overlap: the four intervals sum to more than a plain run() takes.
  void run_profiled(const StepInputs& step, cudaStream_t stream, const std::array<cudaEvent_t, 4>& stage_events);

  // Where a step's time goes, kernel by kernel (latency work; `step_bench --timeline`): in a build configured with
  // -DMLA_TIMELINE=ON, run() with each kernel's per-CTA %globaltimer stamps (ns) written to device buffers laid out
  // [CTAs][16] (src/common/timeline.h; CTA = the linear block index; each kernel folder's config.h names the marks).
  // A null buffer records nothing. In other builds, and under DCP, an Error.
  struct StepStamps {
    uint64_t* query = nullptr;    // the fused query kernel (QueryMark)
    uint64_t* split = nullptr;    // the core's split kernel (CoreMark)
    uint64_t* combine = nullptr;  // the core's combine kernel (CombineMark)
    uint64_t* value = nullptr;    // the value kernel (ValueMark)
  };
  // The CTAs each StepStamps buffer of shape (rows, q) must hold; 0 where that shape launches no such kernel (a core
  // whose splits merge in the split kernel has no combine) or one without marks (the query's GEMM path: cuBLAS).
  struct StepCtas {
    int query = 0, split = 0, combine = 0, value = 0;
  };
  StepCtas timeline_ctas(int64_t rows, int q) const;
  void run_timeline(const StepInputs& step, cudaStream_t stream, const StepStamps& stamps);

  // The value checks run() cannot afford on device tensors (page indices and slots in range, lengths
  // within the block table and max_context, DCP local lengths): copies the metadata to the host and
  // SYNCHRONIZES. For debugging and tests; throws like run() does.
  void check_step(const StepInputs& step) const;

  const LayerDims& dims() const;
  // Device memory this object allocated: 0 before prepare(); then workspace_bytes() unless the caller gave a
  // workspace, plus the attention core's tile counters where a shape merges its splits in the split kernel (4 bytes
  // per request and M-tile: a few KB, state kept between steps, so never in the caller's workspace). The caller's
  // tensors (weights, cache, query scratch, workspace) are not counted.
  size_t device_bytes() const;
  const std::vector<PreparedShape>& shapes() const;
  const PreparedShape& shape(int64_t rows, int q) const;  // unknown (rows, q) is an Error

 private:
  struct State;
  // Validates `step` against its prepared shape and the object's state; returns the shape's index.
  size_t checked_shape_index(const StepInputs& step, const char* caller) const;
  // Launches the three PDL-chained stages of prepared shape `shape_index` (launches only).
  void launch_step(size_t shape_index, const StepInputs& step, cudaStream_t stream,
                   const std::array<cudaEvent_t, 4>* stage_events = nullptr, const StepStamps* stamps = nullptr) const;
  // Launches one DCP phase of prepared shape `shape_index`. `publish_to_peers` = false keeps the
  // query in this rank's own mailbox (prepare's warm-up writes into no peer's buffers).
  void launch_phase(DcpPhase phase, size_t shape_index, const StepInputs& step, cudaStream_t stream,
                    bool publish_to_peers) const;
  std::unique_ptr<State> state_;
};

}  // namespace mla
