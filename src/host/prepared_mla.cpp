#include <cuda_runtime_api.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "host/validate.h"
#include "mla/mla.h"

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

struct PreparedMla::State {
  Weights weights;
  LayerDims dims;
  TensorView query_scratch;
  PrepareOptions options;
  int device_index = 0;
  std::vector<PreparedShape> shapes;  // sorted by (rows, q)
};

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
  if (options.dcp != nullptr) {
    throw_bad_argument("dcp", "null: DCP groups are not available in this build yet", "a DcpGroup");
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
  const int device = query_scratch.device_index;
  detail::validate_weights(weights, dims, Memory::kDevice, device);
  state_->shapes = plan_shapes(pitches, options, dims.num_heads);
  const int64_t max_rows = pitches.rbegin()->first;
  detail::validate_query_scratch(query_scratch, max_rows, dims.num_heads, Memory::kDevice, device);

  state_->weights = weights;
  state_->dims = dims;
  state_->query_scratch = query_scratch;
  state_->options = options;
  state_->device_index = device;
}

PreparedMla::~PreparedMla() = default;

const LayerDims& PreparedMla::dims() const { return state_->dims; }
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
  const int64_t extent = device.rank == 0 ? 1 : device.shape[0] * device.stride[0];
  copy.bytes.resize(static_cast<size_t>(extent * dtype_size(device.dtype)));
  if (!copy.bytes.empty()) {
    MLA_CUDA_CHECK(cudaMemcpy(copy.bytes.data(), device.data, copy.bytes.size(), cudaMemcpyDeviceToHost));
  }
  copy.view.data = copy.bytes.empty() ? static_cast<void*>(&copy.bytes) : copy.bytes.data();
  copy.view.memory = Memory::kHost;
  return copy;
}

}  // namespace

void PreparedMla::prepare(const TensorView& cache) {
  (void)cache;
  throw Error("prepare: the GPU pipeline is not part of this build yet (query kernel, core and value kernel "
              "land with issues 3, 4 and 8)");
}

void PreparedMla::run(const StepInputs& step, cudaStream_t stream) {
  (void)stream;
  const PreparedShape& shape = this->shape(step.projected.shape[0], step.q);
  detail::validate_step(step, device_contract(state_->dims, state_->options, state_->device_index, shape));
  throw Error("run: the GPU pipeline is not part of this build yet (query kernel, core and value kernel land "
              "with issues 3, 4 and 8)");
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
