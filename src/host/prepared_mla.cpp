#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "core/launch.h"
#include "dcp/signal.h"
#include "host/validate.h"
#include "mla/dcp.h"
#include "mla/mla.h"
#include "query/launch.h"
#include "value/config.h"  // kCudaCoreMaxHeadsAtOneRow: the W_UV prefetch bound
#include "value/launch.h"

namespace mla {

CoreKind parse_core_kind(const char* name) {
  if (name != nullptr && std::string(name) == "auto") return CoreKind::kAuto;
  throw_bad_argument("core", "one of {auto}", name == nullptr ? "null" : std::string("'") + name + "'");
}

const char* core_kind_name(CoreKind kind) {
  switch (kind) {
    case CoreKind::kAuto: return "auto";
  }
  return "unknown";
}

namespace {

// Device memory owned by the prepared object (allocated once, in prepare()).
class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) MLA_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  }
  ~DeviceMemory() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceMemory(DeviceMemory&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) { other.ptr_ = nullptr; }
  DeviceMemory& operator=(DeviceMemory&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A cuBLAS handle owned by the prepared object: the query stage's GEMM path (large batches) runs its two
// projections through it. Created in prepare() only where a prepared shape takes that path.
class CublasHandle {
 public:
  CublasHandle() = default;
  ~CublasHandle() {
    if (handle_ != nullptr) cublasDestroy(handle_);
  }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  void create() {
    if (handle_ != nullptr) return;
    const cublasStatus_t status = cublasCreate(&handle_);
    if (status != CUBLAS_STATUS_SUCCESS) {
      handle_ = nullptr;
      throw Error("prepare: cublasCreate failed (status " + std::to_string(int(status)) + ")");
    }
  }
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

// The launch plans of one prepared shape.
struct ShapeKernels {
  query::QueryPlan query;
  core::CorePlan core;
  value::ValuePlan value;
};

}  // namespace

struct PreparedMla::State {
  Weights weights;
  LayerDims dims;
  TensorView query_scratch;
  PrepareOptions options;
  int device_index = 0;
  std::vector<PreparedShape> shapes;  // sorted by (rows, q)

  // ---- Fixed by plan() (the first workspace_bytes() or prepare()) ----
  std::vector<ShapeKernels> kernels;  // parallel to `shapes`; empty until planned
  bool query_gemm = false;            // a shape takes the query GEMM path (it needs the cuBLAS handle)
  int64_t max_rows = 0, max_pitch = 0;
  // The stage buffers, sized for the largest shape, at 256-byte aligned offsets of one workspace:
  // the query GEMM path's buffers + cuBLAS workspace, the split-KV partials, and (without DCP; under
  // DCP the group's buffers hold them) the latent [max rows, H, 512] bf16 and LSE [max rows, H] fp32.
  struct Region {
    size_t offset = 0, bytes = 0;
  };
  Region query_region, core_region, latent_region, lse_region;
  size_t workspace_bytes = 0;  // the end of the last region
  int64_t core_tile_counters = 0;  // the most any shape's core merges with (CorePlan::tile_counters)

  // ---- Fixed by prepare() ----
  bool prepared = false;
  CublasHandle cublas;          // the query GEMM path's handle (only if a shape takes that path)
  DeviceMemory own_workspace;   // when prepare() got no caller workspace
  // The core's tile counters (merges in the split kernel): state between steps, zero before and after each, so
  // never in the workspace, which the caller may clobber between steps or share with other objects.
  DeviceMemory core_counters;
  uint8_t* workspace = nullptr; // own_workspace or the caller's
  // Each buffer, or null where it has no bytes (like an empty allocation).
  void* at(const Region& r) const { return r.bytes > 0 ? workspace + r.offset : nullptr; }
  void* query_workspace() const { return at(query_region); }
  void* core_workspace() const { return at(core_region); }
  int* counters() const { return static_cast<int*>(core_counters.get()); }
  void* latent() const { return at(latent_region); }
  float* lse() const { return static_cast<float*>(at(lse_region)); }

  void plan();
};

namespace {
size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }
}  // namespace

// Grids, split counts, shared-memory limits and buffer sizes of every shape: device queries only.
void PreparedMla::State::plan() {
  if (!kernels.empty()) return;
  const int heads = dims.num_heads;
  const DcpGroup* group = options.dcp;
  const int core_heads = group != nullptr ? group->core_heads() : heads;  // H_core
  std::vector<ShapeKernels> planned_kernels;
  size_t query_bytes = 0, core_bytes = 0;
  for (PreparedShape& shape : shapes) {
    ShapeKernels k;
    k.query = query::make_query_plan(shape.rows, heads);
    core::CoreShape core_shape;
    core_shape.rows = shape.rows;
    core_shape.heads = core_heads;
    core_shape.q = shape.q;
    core_shape.max_context = options.max_context;
    k.core = core::plan_core(core_shape);
    // Under DCP the value stage merges the D ranks' partials (the CUDA-core kernel, plan_value).
    k.value = value::plan_value(static_cast<int>(shape.rows), heads, group != nullptr ? group->size() : 1);
    shape.num_splits = k.core.num_splits;
    query_bytes = std::max(query_bytes, k.query.workspace_bytes);
    query_gemm = query_gemm || k.query.path == query::QueryPath::kGemm;
    core_bytes = std::max(core_bytes, k.core.workspace_bytes);
    core_tile_counters = std::max(core_tile_counters, k.core.tile_counters);
    max_rows = std::max(max_rows, shape.rows);
    max_pitch = std::max(max_pitch, shape.pitch);
    planned_kernels.push_back(k);
  }
  const size_t latent_bytes = group == nullptr ? static_cast<size_t>(max_rows) * heads * kKvLoraRank * 2 : 0;
  const size_t lse_bytes = group == nullptr ? static_cast<size_t>(max_rows) * heads * sizeof(float) : 0;
  auto place = [&](size_t bytes) {  // the next region, at the end of the previous one
    const Region region{workspace_bytes, bytes};
    workspace_bytes = align256(workspace_bytes + bytes);
    return region;
  };
  query_region = place(query_bytes);
  core_region = place(core_bytes);
  latent_region = place(latent_bytes);
  lse_region = place(lse_bytes);
  kernels = std::move(planned_kernels);  // last: a throw above leaves the object unplanned
}

namespace {

void validate_options(const PrepareOptions& options) {
  if (options.max_context < 1) {
    throw_bad_argument("max_context", ">= 1", std::to_string(options.max_context));
  }
  if (options.parity != 0 && options.parity != 1) {
    throw_bad_argument("parity", "0 or 1", std::to_string(options.parity));
  }
  if (options.queries.empty()) throw_bad_argument("queries", "at least one q", "an empty list");
  std::set<int> seen;
  for (int q : options.queries) {
    if (q < 1 || q > kMaxQueries) {
      throw_bad_argument("queries", "values in [1, " + std::to_string(kMaxQueries) + "]", std::to_string(q));
    }
    if (!seen.insert(q).second) throw_bad_argument("queries", "distinct values", std::to_string(q) + " twice");
  }
}

// Under DCP the group replaces the query scratch and fixes H, the largest batch and the device.
void validate_group(const DcpGroup& group, const LayerDims& dims, int64_t max_rows, const TensorView& query_scratch) {
  if (group.num_heads() != dims.num_heads) {
    throw_bad_argument("dcp", "a group of num_heads = " + std::to_string(dims.num_heads) + " heads per rank",
                       std::to_string(group.num_heads()) + " heads per rank");
  }
  if (group.max_rows() < max_rows) {
    throw_bad_argument("pitches", "batch sizes <= the DCP group's max_rows = " + std::to_string(group.max_rows()),
                       std::to_string(max_rows));
  }
  if (query_scratch.present()) {
    throw_bad_argument("query_scratch", "absent under DCP (the group's mailboxes hold the query)",
                       query_scratch.describe());
  }
}

std::vector<PreparedShape> plan_shapes(const std::map<int64_t, int64_t>& pitches, const PrepareOptions& options,
                                       int num_heads) {
  if (pitches.empty()) throw_bad_argument("pitches", "at least one batch size", "an empty map");
  std::vector<PreparedShape> shapes;
  for (const auto& [rows, pitch] : pitches) {
    if (rows < 1) throw_bad_argument("pitches", "batch sizes >= 1", std::to_string(rows));
    if (pitch < projected_width(num_heads)) {
      throw_bad_argument("pitches[" + std::to_string(rows) + "]",
                         ">= " + std::to_string(projected_width(num_heads)) + " (2112 + H * 128)",
                         std::to_string(pitch));
    }
    for (int q : options.queries) {
      if (rows % q == 0) shapes.push_back(PreparedShape{rows, q, pitch, 1});
    }
  }
  if (shapes.empty()) {
    throw_bad_argument("pitches", "at least one batch size divisible by one of the queries", "none");
  }
  std::sort(shapes.begin(), shapes.end(),
            [](const PreparedShape& a, const PreparedShape& b) { return std::pair(a.rows, a.q) < std::pair(b.rows, b.q); });
  return shapes;
}

}  // namespace

PreparedMla::PreparedMla(const Weights& weights, const LayerDims& dims, const std::map<int64_t, int64_t>& pitches,
                         const TensorView& query_scratch, const PrepareOptions& options)
    : state_(std::make_unique<State>()) {
  // Everything is validated before the first CUDA call, so bad arguments fail the same way everywhere.
  validate_options(options);
  detail::validate_dims(dims);
  state_->shapes = plan_shapes(pitches, options, dims.num_heads);
  const int64_t max_rows = pitches.rbegin()->first;
  // The device is the group's or the scratch's: whichever names it is checked before the weights are held to it.
  const int device = options.dcp != nullptr ? options.dcp->device_index() : query_scratch.device_index;
  if (options.dcp != nullptr) {
    validate_group(*options.dcp, dims, max_rows, query_scratch);
  } else {
    detail::validate_query_scratch(query_scratch, max_rows, dims.num_heads, Memory::kDevice, device);
  }
  detail::validate_weights(weights, dims, Memory::kDevice, device);

  state_->weights = weights;
  state_->dims = dims;
  state_->query_scratch = query_scratch;
  state_->options = options;
  state_->device_index = device;
}

PreparedMla::~PreparedMla() = default;

const LayerDims& PreparedMla::dims() const { return state_->dims; }
size_t PreparedMla::device_bytes() const { return state_->own_workspace.bytes() + state_->core_counters.bytes(); }
const std::vector<PreparedShape>& PreparedMla::shapes() const { return state_->shapes; }

const PreparedShape& PreparedMla::shape(int64_t rows, int q) const {
  for (const PreparedShape& shape : state_->shapes) {
    if (shape.rows == rows && shape.q == q) return shape;
  }
  std::string known;
  for (const PreparedShape& shape : state_->shapes) {
    known += (known.empty() ? "" : ", ") + std::string("(") + std::to_string(shape.rows) + ", " +
             std::to_string(shape.q) + ")";
  }
  throw_bad_argument("(batch, q)", "one of the prepared shapes {" + known + "}",
                     "(" + std::to_string(rows) + ", " + std::to_string(q) + ")");
}

namespace {

detail::StepContract device_contract(const LayerDims& dims, const PrepareOptions& options, int device_index,
                                     const PreparedShape& shape) {
  detail::StepContract contract;
  contract.num_heads = dims.num_heads;
  contract.pitch = shape.pitch;
  contract.max_context = options.max_context;
  contract.queries = options.queries;
  contract.memory = Memory::kDevice;
  contract.device_index = device_index;
  if (options.dcp != nullptr) contract.dcp = options.dcp->layout();  // totals required, local lengths
  contract.check_values = false;
  return contract;
}

// A host copy of a small device metadata tensor (contiguous rows), and a host view of it.
struct HostCopy {
  std::vector<uint8_t> bytes;
  TensorView view;
};

HostCopy copy_to_host(const TensorView& device) {
  HostCopy copy;
  copy.view = device;
  if (!device.present()) return copy;
  // The elements the view spans (rows of a strided block table end at their last column, not at the stride).
  const int64_t last_row = device.rank > 1 ? device.shape[1] : 1;
  const int64_t extent = device.rank == 0       ? 1
                         : device.shape[0] == 0 ? 0
                                                : (device.shape[0] - 1) * device.stride[0] + last_row;
  copy.bytes.resize(static_cast<size_t>(extent * dtype_size(device.dtype)));
  if (!copy.bytes.empty()) {
    MLA_CUDA_CHECK(cudaMemcpy(copy.bytes.data(), device.data, copy.bytes.size(), cudaMemcpyDeviceToHost));
  }
  copy.view.data = copy.bytes.empty() ? static_cast<void*>(&copy.bytes) : copy.bytes.data();
  copy.view.memory = Memory::kHost;
  return copy;
}

void require_current_device(int device_index, const char* where) {
  int current = -1;
  MLA_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device_index) {
    throw_bad_argument(std::string(where) + ": current CUDA device",
                       std::to_string(device_index) + " (the prepared object's)", std::to_string(current));
  }
}

}  // namespace

namespace {

// The stages' arguments for one step, shared by the whole-step path and the DCP phases.
query::QueryArgs query_args(const Weights& w, const LayerDims& dims, const PreparedShape& shape, const StepInputs& step,
                            void* query_out, int num_heads_out, int head_offset, void* workspace,
                            cublasHandle_t cublas) {
  query::QueryArgs query;
  query.projected = step.projected.data;
  query.pitch = shape.pitch;
  query.q_a_norm = w.q_a_norm.data;
  query.kv_a_norm = w.kv_a_norm.data;
  query.q_b_proj = w.q_b_proj.data;
  query.w_uk_t = w.w_uk_t.data;
  query.slots = step.slots.as<const int64_t>();
  query.rms_eps = dims.rms_eps;
  query.q_scale = w.q_scale;
  query.k_scale = w.k_scale;
  query.query = query_out;
  query.num_heads_out = num_heads_out;
  query.head_offset = head_offset;
  query.cache = step.cache.data;
  query.stride_cache_page = step.cache.stride[0];
  query.num_cache_pages = step.cache.shape[0];
  query.workspace = workspace;
  query.cublas = cublas;
  return query;
}

core::CoreArgs core_args(const Weights& w, const StepInputs& step, const void* query, void* latent, float* lse,
                         void* workspace, int* tile_counters) {
  core::CoreArgs core;
  core.tile_counters = tile_counters;
  core.query = query;
  core.cache = step.cache.data;
  core.stride_cache_page = step.cache.stride[0];
  core.block_table = step.block_table.as<const int32_t>();
  core.stride_block_table = step.block_table.stride[0];
  core.lengths = step.lengths.as<const int32_t>();
  core.totals = step.totals.present() ? step.totals.as<const int32_t>() : nullptr;
  core.num_requests = static_cast<int>(step.block_table.shape[0]);
  core.softmax_scale = static_cast<float>(double{w.q_scale} * w.k_scale / std::sqrt(double{kQkHeadDim}));
  core.k_scale = w.k_scale;
  core.latent = latent;
  core.lse = lse;
  core.workspace = workspace;
  // The value stage's weights into L2 while the core's combine kernel merges (DRAM is mostly idle then), up to the
  // heads whose one-row steps the value plan gives the CUDA-core kernel for it (value::kCudaCoreMaxHeadsAtOneRow:
  // 64 heads, 8 MB). Measured on an H100 (bench/results/step.md, 2026-12-06 ~06:50-07:12 UTC): steps at H = 12 x 4-16
  // rows 1.03-1.04x, 1 x 4k x H48 / H64 1.08-1.09x; at H = 96 the whole 12.6 MB cost up to 2 % and its first 4 or 8 MB
  // changed nothing, so larger W_UV is not asked for.
  constexpr int64_t kMaxWUvPrefetchBytes =
      int64_t{value::kCudaCoreMaxHeadsAtOneRow} * kKvLoraRank * kVHeadDim * sizeof(__nv_bfloat16);
  static_assert(kMaxWUvPrefetchBytes == int64_t{8} << 20, "the bound measured");
  const int64_t w_uv_bytes = w.w_uv.numel() * dtype_size(w.w_uv.dtype);
  if (w_uv_bytes <= kMaxWUvPrefetchBytes) {
    core.l2_prefetch = w.w_uv.data;
    core.l2_prefetch_bytes = w_uv_bytes;
  }
  return core;
}

// Everything but the latent source (a final latent, or the DCP partials).
value::ValueParams value_params(const Weights& w, const PreparedShape& shape, const StepInputs& step, int heads) {
  value::ValueParams value{};
  value.w_uv = w.w_uv.as<const __nv_bfloat16>();
  value.projected = step.projected.as<const __nv_bfloat16>();
  value.stride_projected_row = shape.pitch;
  value.lengths = step.lengths.as<const int32_t>();
  value.totals = step.totals.present() ? step.totals.as<const int32_t>() : nullptr;
  value.num_requests = static_cast<int>(step.block_table.shape[0]);
  value.q = shape.q;
  value.out = step.out.as<__nv_bfloat16>();
  value.rows = static_cast<int>(shape.rows);
  value.num_heads = heads;
  return value;
}

}  // namespace

// Everything here is a launch: no allocation, no synchronization, so a CUDA graph can capture it.
void PreparedMla::launch_step(size_t shape_index, const StepInputs& step, cudaStream_t stream,
                              const std::array<cudaEvent_t, 4>* stage_events, const StepStamps* stamps) const {
  auto mark = [&](int boundary) {
    if (stage_events != nullptr) MLA_CUDA_CHECK(cudaEventRecord((*stage_events)[boundary], stream));
  };
  const State& state = *state_;
  const PreparedShape& shape = state.shapes[shape_index];
  const ShapeKernels& kernels = state.kernels[shape_index];
  const Weights& w = state.weights;
  const int heads = state.dims.num_heads;

  mark(0);
  query::QueryArgs query = query_args(w, state.dims, shape, step, state.query_scratch.data, heads, /*head_offset=*/0,
                                      state.query_workspace(), state.cublas.get());
  if (stamps != nullptr && kernels.query.path == query::QueryPath::kFused) query.timeline = stamps->query;
  query::launch_query(kernels.query, query, stream, /*pdl=*/true);
  mark(1);

  core::CoreArgs core = core_args(w, step, state.query_scratch.data, state.latent(), state.lse(),
                                  state.core_workspace(), state.counters());
  if (stamps != nullptr) {
    core.timeline = stamps->split;
    core.combine_timeline = stamps->combine;
  }
  core::launch_core(kernels.core, core, stream);
  mark(2);

  value::ValueParams value = value_params(w, shape, step, heads);
  value.latent = static_cast<const __nv_bfloat16*>(state.latent());
  value.stride_latent_row = int64_t{heads} * kKvLoraRank;
  if (stamps != nullptr) value.timeline = stamps->value;
  value::launch_value(value, kernels.value, stream, /*pdl=*/true);
  mark(3);
}

// One DCP phase (launches only). NOTE: each phase's first kernel is launched without PDL, so it starts
// after everything before it on the stream completed: in the in-process order a phase reads what
// other ranks' phases wrote two or more launches earlier, which PDL (a wait on the previous grid only)
// would not order by itself.
void PreparedMla::launch_phase(DcpPhase phase, size_t shape_index, const StepInputs& step, cudaStream_t stream,
                               bool publish_to_peers) const {
  const State& state = *state_;
  const DcpGroup& group = *state.options.dcp;
  const DcpPeerTable& peers = group.peers(state.options.parity);
  const PreparedShape& shape = state.shapes[shape_index];
  const ShapeKernels& kernels = state.kernels[shape_index];
  const Weights& w = state.weights;
  const int heads = state.dims.num_heads;
  const int rank = group.rank();
  const int core_heads = group.core_heads();

  switch (phase) {
    case DcpPhase::kQuery: {
      query::launch_query(kernels.query,
                          query_args(w, state.dims, shape, step, peers.mailbox[rank], core_heads, rank * heads,
                                     state.query_workspace(), state.cublas.get()),
                          stream, /*pdl=*/false);
      if (!publish_to_peers) return;
      // Publish: this rank's heads of every row into each peer's mailbox (strided rows of H*576 bytes
      // in rows of D*H*576). cudaMemcpyDefault: peer-mapped pointers of a multi-GPU transport work too.
      const size_t row_bytes = static_cast<size_t>(core_heads) * kKeyDim;
      const size_t head_bytes = static_cast<size_t>(rank) * heads * kKeyDim;
      const auto* own = static_cast<const uint8_t*>(peers.mailbox[rank]) + head_bytes;
      for (int p = 0; p < group.size(); ++p) {
        if (p == rank) continue;
        MLA_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<uint8_t*>(peers.mailbox[p]) + head_bytes, row_bytes, own,
                                         row_bytes, static_cast<size_t>(heads) * kKeyDim,
                                         static_cast<size_t>(shape.rows), cudaMemcpyDefault, stream));
      }
      return;
    }
    case DcpPhase::kCore: {
      core::CoreArgs core = core_args(w, step, peers.mailbox[rank], peers.latent[rank], peers.lse[rank],
                                      state.core_workspace(), state.counters());
      core.dcp = group.layout();
      core::launch_core(kernels.core, core, stream, /*pdl=*/false);
      return;
    }
    case DcpPhase::kValue: {
      value::ValueParams value = value_params(w, shape, step, heads);
      value.latent = nullptr;
      value.stride_latent_row = int64_t{core_heads} * kKvLoraRank;
      value.stride_lse_row = core_heads;
      value.num_partials = group.size();
      for (int p = 0; p < group.size(); ++p) {
        value.partial_latent[p] =
            static_cast<const __nv_bfloat16*>(peers.latent[p]) + int64_t{rank} * heads * kKvLoraRank;
        value.partial_lse[p] = peers.lse[p] + int64_t{rank} * heads;
      }
      value::launch_value(value, kernels.value, stream, /*pdl=*/false);
      return;
    }
  }
}

size_t PreparedMla::workspace_bytes() const {
  require_current_device(state_->device_index, "workspace_bytes");
  state_->plan();
  return state_->workspace_bytes;
}

void PreparedMla::prepare(const TensorView& cache, const TensorView& workspace) {
  State& state = *state_;
  const int device = state.device_index;
  detail::validate_cache(cache, Memory::kDevice, device);
  if (workspace.present()) detail::validate_workspace(workspace, device);
  require_current_device(device, "prepare");
  const int heads = state.dims.num_heads;
  const DcpGroup* group = state.options.dcp;
  for (const PreparedShape& shape : state.shapes) {
    if (shape.pitch % 8 != 0) {
      throw_bad_argument("pitches[" + std::to_string(shape.rows) + "]", "a multiple of 8 (16-byte aligned rows)",
                         std::to_string(shape.pitch));
    }
  }

  // ---- 1. Plans: grids, split counts, shared-memory limits, buffer sizes.
  state.plan();
  const int64_t max_rows = state.max_rows, max_pitch = state.max_pitch;

  // ---- 2. The stage buffers: in the caller's workspace, or allocated here.
  if (workspace.present() && static_cast<size_t>(workspace.shape[0]) < state.workspace_bytes) {
    throw_bad_argument("workspace", "at least " + std::to_string(state.workspace_bytes) + " bytes (workspace_bytes())",
                       workspace.describe());
  }
  // From here until the warm-up has finished the object is not runnable: a failure below (in a second prepare()
  // too) leaves it unprepared rather than half-prepared.
  state.prepared = false;
  if (workspace.present()) {
    state.own_workspace = DeviceMemory();
    state.workspace = static_cast<uint8_t*>(workspace.data);
  } else {
    state.own_workspace = DeviceMemory(state.workspace_bytes);
    state.workspace = static_cast<uint8_t*>(state.own_workspace.get());
  }
  if (state.core_tile_counters > 0 && state.core_counters.bytes() == 0) {
    state.core_counters = DeviceMemory(static_cast<size_t>(state.core_tile_counters) * sizeof(int));
    MLA_CUDA_CHECK(cudaMemset(state.core_counters.get(), 0, state.core_counters.bytes()));
  }
  if (state.query_gemm) state.cublas.create();

  // ---- 3. Warm every shape once on an all-padding step (no request, no cache write), so module
  // loading and first-launch costs stay out of the engine's first real step and of graph capture.
  // Under DCP the phases run on this rank's own buffers only: nothing is published to a peer (the
  // value stage reads the peers' partials, all rows of which are padding here).
  DeviceMemory projected(static_cast<size_t>(max_rows) * max_pitch * 2);
  DeviceMemory out(static_cast<size_t>(max_rows) * heads * kVHeadDim * 2);
  DeviceMemory slots(static_cast<size_t>(max_rows) * sizeof(int64_t));
  DeviceMemory metadata(64);
  MLA_CUDA_CHECK(cudaMemset(projected.get(), 0, static_cast<size_t>(max_rows) * max_pitch * 2));
  MLA_CUDA_CHECK(cudaMemset(slots.get(), 0xff, static_cast<size_t>(max_rows) * sizeof(int64_t)));  // -1
  MLA_CUDA_CHECK(cudaMemset(metadata.get(), 0, 64));
  for (size_t i = 0; i < state.shapes.size(); ++i) {
    const PreparedShape& shape = state.shapes[i];
    StepInputs warm;
    warm.projected = make_strided_view(projected.get(), DType::kBF16, Memory::kDevice,
                                       {shape.rows, projected_width(heads)}, {shape.pitch, 1}, device);
    warm.out = make_view(out.get(), DType::kBF16, Memory::kDevice, {shape.rows, int64_t{heads} * kVHeadDim}, device);
    warm.cache = cache;
    warm.slots = make_view(slots.get(), DType::kI64, Memory::kDevice, {shape.rows}, device);
    warm.block_table = make_view(metadata.get(), DType::kI32, Memory::kDevice, {0, 1}, device);
    warm.lengths = make_view(metadata.get(), DType::kI32, Memory::kDevice, {0}, device);
    warm.q = shape.q;
    if (group == nullptr) {
      launch_step(i, warm, nullptr);
    } else {
      warm.totals = warm.lengths;
      for (DcpPhase phase : {DcpPhase::kQuery, DcpPhase::kCore, DcpPhase::kValue}) {
        launch_phase(phase, i, warm, nullptr, /*publish_to_peers=*/false);
      }
    }
  }
  MLA_CUDA_CHECK(cudaDeviceSynchronize());
  state.prepared = true;
}

size_t PreparedMla::checked_shape_index(const StepInputs& step, const char* caller) const {
  const PreparedShape& shape = this->shape(step.projected.shape[0], step.q);
  detail::validate_step(step, device_contract(state_->dims, state_->options, state_->device_index, shape));
  if (!state_->prepared) throw Error(std::string(caller) + ": prepare(cache) has not been called on this PreparedMla");
  require_current_device(state_->device_index, caller);
  return static_cast<size_t>(&shape - state_->shapes.data());
}

namespace {

// run_profiled's stage events would separate the stages of a DCP step from their signals; it stays
// a one-GPU tool.
void require_no_group(const PrepareOptions& options, const char* caller) {
  if (options.dcp == nullptr) return;
  throw_bad_argument(std::string(caller), "a PreparedMla without a DCP group (profile DCP phases with run_phase "
                                          "on an in-process group)",
                     std::string("a group of transport '") + options.dcp->transport() + "'");
}

// The signal-and-wait between two stages (dcp.h, DcpPeerTable): this rank writes its epoch into
// signal word `slot` of every rank's block, then waits for words [first, first + D) of its own.
dcp::SignalArgs signal_args(const DcpGroup& group, int parity, bool advance, int slot, int first) {
  const DcpPeerTable& peers = group.peers(parity);
  dcp::SignalArgs args;
  args.epoch = group.epoch(parity);
  args.advance = advance;
  for (int p = 0; p < group.size(); ++p) args.targets[p] = peers.signals[p] + slot;
  args.wait = peers.signals[group.rank()] + first;
  args.size = group.size();
  args.rank = group.rank();
  args.timeout_ns = group.wait_timeout_ns();
  return args;
}

}  // namespace

// Under a signalling group: query (+ publish) -> signal / wait for every query -> core -> signal /
// wait for every partial -> value, all on `stream`. The epoch advances on the device, so a captured
// graph replays correctly. The in-process group has no signals: its ranks' phases are ordered by
// the caller (run_phase).
void PreparedMla::run(const StepInputs& step, cudaStream_t stream) {
  const DcpGroup* group = state_->options.dcp;
  if (group == nullptr) {
    launch_step(checked_shape_index(step, "run"), step, stream);
    return;
  }
  if (group->stream_ordered()) {
    throw_bad_argument("run", "a group whose ranks signal each other (under a stream-ordered group launch "
                              "run_phase(kQuery), (kCore), (kValue) of every rank in order)",
                       std::string("a group of transport '") + group->transport() + "'");
  }
  const size_t index = checked_shape_index(step, "run");
  const int parity = state_->options.parity, size = group->size(), rank = group->rank();
  launch_phase(DcpPhase::kQuery, index, step, stream, /*publish_to_peers=*/true);
  dcp::launch_signal_wait(signal_args(*group, parity, /*advance=*/true, /*slot=*/rank, /*first=*/0), stream);
  launch_phase(DcpPhase::kCore, index, step, stream, /*publish_to_peers=*/true);
  dcp::launch_signal_wait(signal_args(*group, parity, /*advance=*/false, /*slot=*/size + rank, /*first=*/size), stream);
  launch_phase(DcpPhase::kValue, index, step, stream, /*publish_to_peers=*/true);
}

void PreparedMla::run_profiled(const StepInputs& step, cudaStream_t stream,
                               const std::array<cudaEvent_t, 4>& stage_events) {
  require_no_group(state_->options, "run_profiled");
  launch_step(checked_shape_index(step, "run_profiled"), step, stream, &stage_events);
}

PreparedMla::StepCtas PreparedMla::timeline_ctas(int64_t rows, int q) const {
  const PreparedShape& shape = this->shape(rows, q);
  require_current_device(state_->device_index, "timeline_ctas");
  state_->plan();
  const ShapeKernels& kernels = state_->kernels[static_cast<size_t>(&shape - state_->shapes.data())];
  auto ctas = [](const dim3& grid) { return static_cast<int>(grid.x * grid.y * grid.z); };
  StepCtas counts;
  counts.query = kernels.query.path == query::QueryPath::kFused ? ctas(kernels.query.grid) : 0;
  counts.split = ctas(kernels.core.grid);
  counts.combine = core::launches_combine(kernels.core) ? ctas(kernels.core.combine_grid) : 0;
  counts.value = ctas(kernels.value.grid);
  return counts;
}

void PreparedMla::run_timeline(const StepInputs& step, cudaStream_t stream, const StepStamps& stamps) {
#if !(defined(MLA_TIMELINE) && MLA_TIMELINE)
  (void)step, (void)stream, (void)stamps;
  throw Error("run_timeline: this build records no timeline (configure it with -DMLA_TIMELINE=ON)");
#else
  require_no_group(state_->options, "run_timeline");
  launch_step(checked_shape_index(step, "run_timeline"), step, stream, /*stage_events=*/nullptr, &stamps);
#endif
}

void PreparedMla::run_phase(DcpPhase phase, const StepInputs& step, cudaStream_t stream) {
  const DcpGroup* group = state_->options.dcp;
  if (group == nullptr) {
    throw_bad_argument("run_phase", "a PreparedMla prepared with a DCP group (without one, use run())", "no group");
  }
  if (!group->stream_ordered()) {
    throw_bad_argument("run_phase", "a stream-ordered DCP group (this one signals between stages: use run())",
                       std::string("a group of transport '") + group->transport() + "'");
  }
  if (phase != DcpPhase::kQuery && phase != DcpPhase::kCore && phase != DcpPhase::kValue) {
    throw_bad_argument("run_phase: phase", "DcpPhase::kQuery, kCore or kValue",
                       std::to_string(static_cast<int>(phase)));
  }
  launch_phase(phase, checked_shape_index(step, "run_phase"), step, stream, /*publish_to_peers=*/true);
}

void PreparedMla::check_step(const StepInputs& step) const {
  const PreparedShape& shape = this->shape(step.projected.shape[0], step.q);
  detail::StepContract contract = device_contract(state_->dims, state_->options, state_->device_index, shape);
  detail::validate_step(step, contract);  // shapes, dtypes and strides first: the copies below rely on them

  // The values live on the device: copy the metadata (not the activations) and check it on the host.
  HostCopy slots = copy_to_host(step.slots);
  HostCopy block_table = copy_to_host(step.block_table);
  HostCopy lengths = copy_to_host(step.lengths);
  HostCopy totals = copy_to_host(step.totals);
  StepInputs host = step;
  host.slots = slots.view;
  host.block_table = block_table.view;
  host.lengths = lengths.view;
  host.totals = totals.view;
  // The activations and the cache stay on the device; only their shapes are read from here on.
  for (TensorView* view : {&host.projected, &host.out, &host.cache}) view->memory = Memory::kHost;
  contract.memory = Memory::kHost;
  contract.check_values = true;
  detail::validate_step(host, contract);
}

}  // namespace mla
