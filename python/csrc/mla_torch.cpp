// PyTorch binding of mla::PreparedMla (issue 6): a torch custom class that owns one prepared layer and
// the torch tensors its non-owning views point into, a torch custom class that owns one rank's DCP
// group, and one custom op that runs a decode step on the current CUDA stream. Tensors become
// mla::TensorView unchanged (dtype, shape, strides in elements, device), so the library's own
// validation judges them and its mla::Error message reaches Python.
//
//   torch.classes.mla_decode.DcpGroup(directory, rank, size, interleave, num_heads, max_rows,
//       device_index, wait_timeout_ms, bootstrap_timeout_ms)      collective: every rank at once
//   .barrier()                          collective: every rank's prepare() done before any first step
//   torch.classes.mla_decode.PreparedMla(q_a_norm, kv_a_norm, q_b_proj, w_uk_t, w_uv, q_scale, k_scale,
//       rms_eps, num_heads, batch_sizes, pitches, query_scratch?, max_context, core, dcp?, parity, queries)
//   .prepare(cache)                     once, outside graph capture (plans, allocates, warms, syncs)
//   torch.ops.mla_decode.run(handle, projected, out, cache, slots, block_table, lengths, totals, q)
//
// NOTE: the step op takes the object as an integer handle, not as the script object itself: an int is
// a constant to torch.compile, so the op stays one opaque node without a fake-class registration (the
// pattern of vLLM's custom all-reduce handles). The class owns the object; the handle only finds it.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "mla/dcp.h"
#include "mla/mla.h"

namespace mla_torch {
namespace {

// ---- Tensor -> mla::TensorView ---------------------------------------------------------------------

mla::DType to_mla_dtype(const std::string& name, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return mla::DType::kBF16;
    case at::kFloat: return mla::DType::kF32;
    case at::kInt: return mla::DType::kI32;
    case at::kLong: return mla::DType::kI64;
    case at::kFloat8_e4m3fn: return mla::DType::kFP8E4M3;
    case at::kByte: return mla::DType::kU8;
    default:
      mla::throw_bad_argument(name, "dtype bfloat16, float32, int32, int64, float8_e4m3fn or uint8",
                              std::string(c10::toString(t.scalar_type())));
  }
}

// A zero-element tensor may have no storage (data_ptr() == nullptr), which a view reads as "absent".
// The library never dereferences a view with no elements, so any non-null address says "present".
char zero_element_sentinel;

mla::TensorView to_view(const std::string& name, const at::Tensor& t) {
  if (!t.defined()) mla::throw_bad_argument(name, "a tensor", "None");
  if (t.dim() > mla::TensorView::kMaxRank) {
    mla::throw_bad_argument(name, "at most " + std::to_string(mla::TensorView::kMaxRank) + " dimensions",
                            std::to_string(t.dim()) + " dimensions");
  }
  mla::TensorView view;
  view.data = t.data_ptr();
  if (view.data == nullptr && t.numel() == 0) view.data = &zero_element_sentinel;
  view.dtype = to_mla_dtype(name, t);
  view.memory = t.is_cuda() ? mla::Memory::kDevice : mla::Memory::kHost;
  view.device_index = t.is_cuda() ? t.get_device() : 0;
  view.rank = static_cast<int>(t.dim());
  for (int d = 0; d < view.rank; ++d) {
    view.shape[d] = t.size(d);
    view.stride[d] = t.stride(d);
  }
  return view;
}

mla::TensorView to_optional_view(const std::string& name, const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? to_view(name, *t) : mla::TensorView{};
}

int to_int(const std::string& name, int64_t value, const std::string& expected) {
  if (value != static_cast<int>(value)) mla::throw_bad_argument(name, expected, std::to_string(value));
  return static_cast<int>(value);
}

// Every entry point runs through here: mla::Error (bad arguments, CUDA errors) becomes a c10::Error,
// which Python raises as RuntimeError with the library's message unchanged.
template <class Body>
auto translating_errors(Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const mla::Error& error) {
    TORCH_CHECK(false, error.what());
  }
}

// ---- One rank's DCP group -------------------------------------------------------------------------

// One rank per process: a FileBootstrap in a directory every rank sees, and the IpcDcp built over it
// (include/mla/dcp.h). Construction and destruction are collective (the group all-gathers its CUDA-IPC
// handles, and its destructor is a barrier before unmapping), so every rank creates and drops its
// group at the same point. Every PreparedMla built with it holds a reference: the group outlives them.
class DcpGroupHolder : public torch::CustomClassHolder {
 public:
  DcpGroupHolder(std::string directory, int64_t rank, int64_t size, int64_t interleave, int64_t num_heads,
                 int64_t max_rows, int64_t device_index, int64_t wait_timeout_ms, int64_t bootstrap_timeout_ms) {
    translating_errors([&] {
      bootstrap_ = std::make_unique<mla::FileBootstrap>(
          std::move(directory), to_int("rank", rank, "in [0, size)"), to_int("size", size, "2..8"),
          to_int("bootstrap_timeout_ms", bootstrap_timeout_ms, ">= 1 (milliseconds)"));
      group_ = std::make_unique<mla::IpcDcp>(
          *bootstrap_, to_int("interleave", interleave, ">= 1"), to_int("num_heads", num_heads, "in [1, 128]"),
          max_rows, to_int("device_index", device_index, "a CUDA device index"),
          to_int("wait_timeout_ms", wait_timeout_ms, ">= 1 (milliseconds)"));
    });
  }

  // Collective: returns once every rank called it (or throws after the bootstrap timeout, naming the
  // missing rank). Never per step: a file exchange, milliseconds.
  void barrier() {
    translating_errors([&] {
      const uint8_t mine = 1;
      std::vector<uint8_t> all(bootstrap_->size());
      bootstrap_->all_gather(&mine, 1, all.data());
    });
  }

  const mla::DcpGroup& group() const { return *group_; }
  int64_t rank() const { return group_->rank(); }
  int64_t size() const { return group_->size(); }
  int64_t interleave() const { return group_->interleave(); }
  int64_t num_heads() const { return group_->num_heads(); }
  int64_t max_rows() const { return group_->max_rows(); }
  int64_t device_index() const { return group_->device_index(); }
  std::string transport() const { return group_->transport(); }

 private:
  // Declared first, destroyed last: the group's destructor runs its barrier through the bootstrap.
  std::unique_ptr<mla::FileBootstrap> bootstrap_;
  std::unique_ptr<mla::IpcDcp> group_;
};

// ---- The prepared object --------------------------------------------------------------------------

class PreparedMlaHolder;

// Handles of live objects. Looked up once per step under a mutex (uncontended: tens of nanoseconds).
class HandleRegistry {
 public:
  static HandleRegistry& instance() {
    static HandleRegistry registry;
    return registry;
  }
  int64_t add(PreparedMlaHolder* holder) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t handle = next_handle_++;
    holders_[handle] = holder;
    return handle;
  }
  void remove(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    holders_.erase(handle);
  }
  PreparedMlaHolder& find(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = holders_.find(handle);
    if (it == holders_.end()) {
      mla::throw_bad_argument("handle", "the handle() of a live mla_decode.PreparedMla", std::to_string(handle));
    }
    return *it->second;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<int64_t, PreparedMlaHolder*> holders_;
  int64_t next_handle_ = 1;
};

class PreparedMlaHolder : public torch::CustomClassHolder {
 public:
  // `batch_sizes[i]` rows use row stride `pitches[i]` (elements) in `projected`. The weights, the
  // query scratch, the DCP group and (from prepare()) a caller's workspace must outlive nothing: this object keeps
  // references to them.
  // Without `dcp` the query scratch is required and selects the device; with it the scratch must be
  // absent (the group's mailboxes replace it) and the group's device is the object's.
  PreparedMlaHolder(at::Tensor q_a_norm, at::Tensor kv_a_norm, at::Tensor q_b_proj, at::Tensor w_uk_t,
                    at::Tensor w_uv, double q_scale, double k_scale, double rms_eps, int64_t num_heads,
                    std::vector<int64_t> batch_sizes, std::vector<int64_t> pitches,
                    std::optional<at::Tensor> query_scratch, int64_t max_context, std::string core,
                    std::optional<c10::intrusive_ptr<DcpGroupHolder>> dcp, int64_t parity,
                    std::vector<int64_t> queries)
      : tensors_{std::move(q_a_norm), std::move(kv_a_norm), std::move(q_b_proj), std::move(w_uk_t),
                 std::move(w_uv), query_scratch.value_or(at::Tensor())},
        group_(dcp.has_value() ? *dcp : c10::intrusive_ptr<DcpGroupHolder>()) {
    translating_errors([&] {
      if (batch_sizes.size() != pitches.size()) {
        mla::throw_bad_argument("pitches", std::to_string(batch_sizes.size()) + " pitches (one per batch size)",
                                std::to_string(pitches.size()));
      }
      std::map<int64_t, int64_t> pitch_of_batch;
      for (size_t i = 0; i < batch_sizes.size(); ++i) {
        if (!pitch_of_batch.emplace(batch_sizes[i], pitches[i]).second) {
          mla::throw_bad_argument("pitches", "distinct batch sizes", std::to_string(batch_sizes[i]) + " twice");
        }
      }
      mla::Weights weights;
      weights.q_a_norm = to_view("q_a_norm", tensors_.q_a_norm);
      weights.kv_a_norm = to_view("kv_a_norm", tensors_.kv_a_norm);
      weights.q_b_proj = to_view("q_b_proj", tensors_.q_b_proj);
      weights.w_uk_t = to_view("w_uk_t", tensors_.w_uk_t);
      weights.w_uv = to_view("w_uv", tensors_.w_uv);
      weights.q_scale = static_cast<float>(q_scale);
      weights.k_scale = static_cast<float>(k_scale);
      mla::LayerDims dims;
      dims.num_heads = to_int("num_heads", num_heads, "in [1, 128]");
      dims.rms_eps = static_cast<float>(rms_eps);
      mla::PrepareOptions options;
      options.max_context = max_context;
      options.core = mla::parse_core_kind(core.c_str());
      options.dcp = group_ ? &group_->group() : nullptr;
      options.parity = to_int("parity", parity, "0 or 1");
      options.queries.clear();
      for (int64_t q : queries) options.queries.push_back(to_int("queries", q, "values in [1, 8]"));
      const mla::TensorView scratch = to_optional_view("query_scratch", tensors_.query_scratch);
      device_index_ = group_ ? static_cast<int>(group_->device_index()) : scratch.device_index;
      prepared_ = std::make_unique<mla::PreparedMla>(weights, dims, pitch_of_batch, scratch, options);
    });
    handle_ = HandleRegistry::instance().add(this);
  }

  ~PreparedMlaHolder() override { HandleRegistry::instance().remove(handle_); }

  // Outside graph capture only: allocates the stage buffers and synchronizes the device.
  void prepare(const at::Tensor& cache, const std::optional<at::Tensor>& workspace) {
    translating_errors([&] {
      const mla::TensorView view = to_view("cache", cache);
      const mla::TensorView workspace_view = to_optional_view("workspace", workspace);
      const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
      prepared_->prepare(view, workspace_view);
      // The stage buffers live in the caller's workspace from now on: keep its storage, or a temporary passed here
      // would go back to PyTorch's allocator and every later step would write into whatever reuses it.
      tensors_.workspace = workspace.value_or(at::Tensor());
    });
  }

  int64_t workspace_bytes() const {
    int64_t bytes = 0;
    translating_errors([&] {
      const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
      bytes = static_cast<int64_t>(prepared_->workspace_bytes());
    });
    return bytes;
  }

  // Launches only, on the current CUDA stream of the object's device: capturable in a CUDA graph.
  void run(const at::Tensor& projected, const at::Tensor& out, const at::Tensor& cache, const at::Tensor& slots,
           const at::Tensor& block_table, const at::Tensor& lengths, const std::optional<at::Tensor>& totals,
           int64_t q) {
    translating_errors([&] {
      const mla::StepInputs step = step_inputs(projected, out, cache, slots, block_table, lengths, totals, q);
      const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
      prepared_->run(step, at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index_)).stream());
    });
  }

  // run()'s checks plus the values of the device metadata (pages, slots, lengths). SYNCHRONIZES.
  void check_step(const at::Tensor& projected, const at::Tensor& out, const at::Tensor& cache,
                  const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& lengths,
                  const std::optional<at::Tensor>& totals, int64_t q) {
    translating_errors([&] {
      const mla::StepInputs step = step_inputs(projected, out, cache, slots, block_table, lengths, totals, q);
      const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
      prepared_->check_step(step);
    });
  }

  // [[rows, q, pitch, num_splits], ...] sorted by (rows, q); num_splits is fixed by prepare().
  std::vector<std::vector<int64_t>> shapes() const {
    std::vector<std::vector<int64_t>> rows;
    for (const mla::PreparedShape& shape : prepared_->shapes()) {
      rows.push_back({shape.rows, shape.q, shape.pitch, shape.num_splits});
    }
    return rows;
  }

  int64_t handle() const { return handle_; }
  int64_t device_bytes() const { return static_cast<int64_t>(prepared_->device_bytes()); }
  int64_t num_heads() const { return prepared_->dims().num_heads; }
  int64_t device_index() const { return device_index_; }

 private:
  static mla::StepInputs step_inputs(const at::Tensor& projected, const at::Tensor& out, const at::Tensor& cache,
                                     const at::Tensor& slots, const at::Tensor& block_table,
                                     const at::Tensor& lengths, const std::optional<at::Tensor>& totals,
                                     int64_t q) {
    mla::StepInputs step;
    step.projected = to_view("projected", projected);
    step.out = to_view("out", out);
    step.cache = to_view("cache", cache);
    step.slots = to_view("slots", slots);
    step.block_table = to_view("block_table", block_table);
    step.lengths = to_view("lengths", lengths);
    step.totals = to_optional_view("totals", totals);
    step.q = to_int("q", q, "in [1, 8]");
    return step;
  }

  // What `prepared_` points into, kept alive as long as the object (declared first, destroyed last):
  // the tensors of its views and the DCP group (null without DCP).
  struct OwnedTensors {
    at::Tensor q_a_norm, kv_a_norm, q_b_proj, w_uk_t, w_uv, query_scratch;  // query_scratch undefined under DCP
    at::Tensor workspace;  // the caller's workspace of the last prepare(), undefined where the object allocated its own
  } tensors_;
  c10::intrusive_ptr<DcpGroupHolder> group_;
  std::unique_ptr<mla::PreparedMla> prepared_;
  int64_t device_index_ = 0;
  int64_t handle_ = 0;
};

// The step op: every backend key lands here, so a CPU tensor gets the library's "memory on cuda:N"
// message rather than the dispatcher's "no kernel for CPU".
void run_step(int64_t handle, const at::Tensor& projected, const at::Tensor& out, const at::Tensor& cache,
              const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& lengths,
              const std::optional<at::Tensor>& totals, int64_t q) {
  PreparedMlaHolder& holder = translating_errors([&]() -> PreparedMlaHolder& {
    return HandleRegistry::instance().find(handle);
  });
  holder.run(projected, out, cache, slots, block_table, lengths, totals, q);
}

}  // namespace
}  // namespace mla_torch

TORCH_LIBRARY(mla_decode, m) {
  using mla_torch::DcpGroupHolder;
  using mla_torch::PreparedMlaHolder;
  m.class_<DcpGroupHolder>("DcpGroup")
      .def(torch::init<std::string, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>())
      .def("barrier", &DcpGroupHolder::barrier)
      .def("rank", &DcpGroupHolder::rank)
      .def("size", &DcpGroupHolder::size)
      .def("interleave", &DcpGroupHolder::interleave)
      .def("num_heads", &DcpGroupHolder::num_heads)
      .def("max_rows", &DcpGroupHolder::max_rows)
      .def("device_index", &DcpGroupHolder::device_index)
      .def("transport", &DcpGroupHolder::transport);
  m.class_<PreparedMlaHolder>("PreparedMla")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, double, double, int64_t,
                       std::vector<int64_t>, std::vector<int64_t>, std::optional<at::Tensor>, int64_t, std::string,
                       std::optional<c10::intrusive_ptr<DcpGroupHolder>>, int64_t, std::vector<int64_t>>())
      .def("prepare", &PreparedMlaHolder::prepare)
      .def("check_step", &PreparedMlaHolder::check_step)
      .def("shapes", &PreparedMlaHolder::shapes)
      .def("handle", &PreparedMlaHolder::handle)
      .def("device_bytes", &PreparedMlaHolder::device_bytes)
      .def("workspace_bytes", &PreparedMlaHolder::workspace_bytes)
      .def("num_heads", &PreparedMlaHolder::num_heads)
      .def("device_index", &PreparedMlaHolder::device_index);
  // `out` and `cache` are written (the alias annotations tell torch.compile and functionalization).
  m.def(
      "run(int handle, Tensor projected, Tensor(a!) out, Tensor(b!) cache, Tensor slots, Tensor block_table, "
      "Tensor lengths, Tensor? totals, int q) -> ()");
}

TORCH_LIBRARY_IMPL(mla_decode, CUDA, m) { m.impl("run", &mla_torch::run_step); }
TORCH_LIBRARY_IMPL(mla_decode, CPU, m) { m.impl("run", &mla_torch::run_step); }
