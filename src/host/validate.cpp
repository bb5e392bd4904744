#include "host/validate.h"

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <unordered_map>

namespace mla::detail {
namespace {

std::string shape_string(std::initializer_list<int64_t> shape) {
  std::ostringstream s;
  s << "[";
  int d = 0;
  for (int64_t extent : shape) s << (d++ ? ", " : "") << extent;
  s << "]";
  return s.str();
}

std::string memory_string(Memory memory, int device_index) {
  return memory == Memory::kHost ? std::string("host") : "cuda:" + std::to_string(device_index);
}

bool is_fp8_bytes(DType dtype) { return dtype == DType::kFP8E4M3 || dtype == DType::kU8; }

void require_present(const std::string& name, const TensorView& t) {
  if (!t.present()) throw_bad_argument(name, "a tensor", "absent (null data pointer)");
}

void require_memory(const std::string& name, const TensorView& t, Memory memory, int device_index) {
  const bool same = t.memory == memory && (memory == Memory::kHost || t.device_index == device_index);
  if (!same) {
    throw_bad_argument(name, "memory on " + memory_string(memory, device_index),
                       memory_string(t.memory, t.device_index));
  }
}

void require_dtype(const std::string& name, const TensorView& t, DType dtype) {
  if (t.dtype != dtype) throw_bad_argument(name, std::string("dtype ") + dtype_name(dtype), t.describe());
}

void require_fp8(const std::string& name, const TensorView& t) {
  if (!is_fp8_bytes(t.dtype)) throw_bad_argument(name, "dtype fp8_e4m3 or u8", t.describe());
}

// Exact shape match; -1 in `shape` accepts any extent.
void require_shape(const std::string& name, const TensorView& t, std::initializer_list<int64_t> shape) {
  bool ok = t.rank == static_cast<int>(shape.size());
  int d = 0;
  for (int64_t extent : shape) {
    if (ok && extent >= 0 && t.shape[d] != extent) ok = false;
    ++d;
  }
  if (!ok) throw_bad_argument(name, "shape " + shape_string(shape) + " (-1 = any)", t.describe());
}

void require_contiguous(const std::string& name, const TensorView& t) {
  if (!t.is_contiguous()) throw_bad_argument(name, "a contiguous (row-major, packed) tensor", t.describe());
}

// Unit innermost stride and a row stride of at least the row: rows may be padded, never overlap.
void require_rows(const std::string& name, const TensorView& t) {
  if (t.stride[1] != 1 || t.stride[0] < t.shape[1]) {
    throw_bad_argument(name, "inner stride 1 and row stride >= " + std::to_string(t.shape[1]), t.describe());
  }
}

// A data pointer aligned to `bytes`; `why`, if given, follows the expectation in parentheses.
void require_aligned(const std::string& name, const TensorView& t, size_t bytes, const std::string& why = "") {
  if (reinterpret_cast<uintptr_t>(t.data) % bytes != 0) {
    std::ostringstream got;
    got << "data pointer " << t.data << " (" << t.describe() << ")";
    throw_bad_argument(name, "a " + std::to_string(bytes) + "-byte aligned data pointer" + (why.empty() ? "" : " (" + why + ")"),
                       got.str());
  }
}

// The kernels read and write these tensors with 16-byte vector accesses.
void require_16_byte_aligned(const std::string& name, const TensorView& t) { require_aligned(name, t, 16); }

void require_tensor(const std::string& name, const TensorView& t, DType dtype,
                    std::initializer_list<int64_t> shape, Memory memory, int device_index) {
  require_present(name, t);
  require_memory(name, t, memory, device_index);
  require_dtype(name, t, dtype);
  require_shape(name, t, shape);
  require_contiguous(name, t);
}

void require_positive_finite(const std::string& name, double value) {
  if (!(std::isfinite(value) && value > 0)) {
    std::ostringstream got;
    got << value;
    throw_bad_argument(name, "a finite value > 0", got.str());
  }
}

int64_t local_length(int64_t total, const DcpLayout& dcp) {
  const int64_t cycle = int64_t{dcp.interleave} * dcp.size;
  const int64_t full = total / cycle;
  const int64_t rest = total % cycle - int64_t{dcp.rank} * dcp.interleave;
  return full * dcp.interleave + std::min<int64_t>(std::max<int64_t>(rest, 0), dcp.interleave);
}

std::string indexed(const std::string& name, int64_t i) { return name + "[" + std::to_string(i) + "]"; }

void validate_dcp(const DcpLayout& dcp) {
  if (dcp.size < 1) throw_bad_argument("dcp.size", ">= 1", std::to_string(dcp.size));
  if (dcp.rank < 0 || dcp.rank >= dcp.size) {
    throw_bad_argument("dcp.rank", "in [0, " + std::to_string(dcp.size) + ")", std::to_string(dcp.rank));
  }
  if (dcp.interleave < 1) throw_bad_argument("dcp.interleave", ">= 1", std::to_string(dcp.interleave));
}

// Values of the metadata: only for host-visible tensors (the GPU path cannot read device memory
// without synchronizing; PreparedMla offers a separate, synchronizing check for that).
void validate_step_values(const StepInputs& step, const StepContract& contract, int64_t rows) {
  const int64_t num_pages = step.cache.shape[0];
  const int64_t num_requests = step.block_table.shape[0];
  const int64_t max_pages = step.block_table.shape[1];
  const auto* lengths = step.lengths.as<const int32_t>();
  const auto* totals = step.totals.present() ? step.totals.as<const int32_t>() : nullptr;
  const auto* block_table = step.block_table.as<const int32_t>();
  const auto* slots = step.slots.as<const int64_t>();

  for (int64_t b = 0; b < num_requests; ++b) {
    const int64_t length = lengths[b];
    if (length < 0 || length > max_pages * kPageSize) {
      throw_bad_argument(indexed("lengths", b),
                         "in [0, " + std::to_string(max_pages * kPageSize) + "] (block_table holds " +
                             std::to_string(max_pages) + " pages of 64)",
                         std::to_string(length));
    }
    const int64_t total = totals ? int64_t{totals[b]} : length;
    const std::string bounded = totals ? indexed("totals", b) : indexed("lengths", b);
    if (total < 0 || (contract.max_context > 0 && total > contract.max_context)) {
      throw_bad_argument(bounded, "in [0, max_context = " + std::to_string(contract.max_context) + "]",
                         std::to_string(total));
    }
    if (totals && local_length(total, contract.dcp) != length) {
      throw_bad_argument(indexed("lengths", b),
                         "the " + std::to_string(local_length(total, contract.dcp)) + " tokens that rank " +
                             std::to_string(contract.dcp.rank) + " of " + std::to_string(contract.dcp.size) +
                             " (interleave " + std::to_string(contract.dcp.interleave) + ") holds of totals[" +
                             std::to_string(b) + "] = " + std::to_string(total),
                         std::to_string(length));
    }
    const int64_t used_pages = (length + kPageSize - 1) / kPageSize;
    for (int64_t p = 0; p < used_pages; ++p) {
      const int64_t page = block_table[b * step.block_table.stride[0] + p];
      if (page < 0 || page >= num_pages) {
        throw_bad_argument("block_table[" + std::to_string(b) + "][" + std::to_string(p) + "]",
                           "a page index in [0, " + std::to_string(num_pages) + ")", std::to_string(page));
      }
    }
  }
  // Two rows writing one slot would store both rows' bytes into one cache row at once (16-byte pieces of either).
  std::unordered_map<int64_t, int64_t> row_of_slot;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot = slots[r];
    if (slot < -1 || slot >= num_pages * kPageSize) {
      throw_bad_argument(indexed("slots", r),
                         "-1 or a slot in [0, " + std::to_string(num_pages * kPageSize) + ")",
                         std::to_string(slot));
    }
    if (slot == -1) continue;
    const auto [first, inserted] = row_of_slot.emplace(slot, r);
    if (!inserted) {
      throw_bad_argument(indexed("slots", r),
                         "a slot no other row writes (" + indexed("slots", first->second) + " is " +
                             std::to_string(slot) + " too)",
                         std::to_string(slot));
    }
  }
}

}  // namespace

void validate_dims(const LayerDims& dims) {
  if (dims.num_heads < 1 || dims.num_heads > kMaxHeads) {
    throw_bad_argument("num_heads", "in [1, " + std::to_string(kMaxHeads) + "]", std::to_string(dims.num_heads));
  }
  require_positive_finite("rms_eps", dims.rms_eps);
}

void validate_weights(const Weights& weights, const LayerDims& dims, Memory memory, int device_index) {
  validate_dims(dims);
  const int64_t heads = dims.num_heads;
  require_tensor("q_a_norm", weights.q_a_norm, DType::kBF16, {kQLoraRank}, memory, device_index);
  require_tensor("kv_a_norm", weights.kv_a_norm, DType::kBF16, {kKvLoraRank}, memory, device_index);
  require_tensor("q_b_proj", weights.q_b_proj, DType::kBF16, {heads * kQkHeadDim, kQLoraRank}, memory,
                 device_index);
  require_tensor("w_uk_t", weights.w_uk_t, DType::kBF16, {heads, kNopeDim, kKvLoraRank}, memory, device_index);
  require_tensor("w_uv", weights.w_uv, DType::kBF16, {heads, kKvLoraRank, kVHeadDim}, memory, device_index);
  // Every weight is read in 16-byte vectors (loads, cp.async): a view at an odd element offset would
  // fault inside a kernel instead of failing here.
  require_16_byte_aligned("q_a_norm", weights.q_a_norm);
  require_16_byte_aligned("kv_a_norm", weights.kv_a_norm);
  require_16_byte_aligned("q_b_proj", weights.q_b_proj);
  require_16_byte_aligned("w_uk_t", weights.w_uk_t);
  require_16_byte_aligned("w_uv", weights.w_uv);
  require_positive_finite("q_scale", weights.q_scale);
  require_positive_finite("k_scale", weights.k_scale);
}

void validate_query_scratch(const TensorView& scratch, int64_t rows, int heads, Memory memory, int device_index) {
  require_present("query_scratch", scratch);
  require_memory("query_scratch", scratch, memory, device_index);
  require_fp8("query_scratch", scratch);
  require_shape("query_scratch", scratch, {-1, heads, kKeyDim});
  require_contiguous("query_scratch", scratch);
  require_16_byte_aligned("query_scratch", scratch);  // the query kernels store 16-byte vectors
  if (scratch.shape[0] < rows) {
    throw_bad_argument("query_scratch", "at least " + std::to_string(rows) + " rows (the largest batch)",
                       scratch.describe());
  }
}

void validate_cache(const TensorView& cache, Memory memory, int device_index) {
  require_present("cache", cache);
  require_memory("cache", cache, memory, device_index);
  require_fp8("cache", cache);
  require_shape("cache", cache, {-1, kPageSize, kKeyDim});
  if (cache.shape[0] < 1 || cache.stride[2] != 1 || cache.stride[1] != kKeyDim ||
      cache.stride[0] < int64_t{kPageSize} * kKeyDim || cache.stride[0] % 16 != 0) {
    throw_bad_argument("cache", "at least one page, token stride 576 and page stride >= 36864, a multiple of 16",
                       cache.describe());
  }
  require_16_byte_aligned("cache", cache);  // pages move by 16-byte and bulk copies
}

void validate_workspace(const TensorView& workspace, int device_index) {
  require_memory("workspace", workspace, Memory::kDevice, device_index);
  require_dtype("workspace", workspace, DType::kU8);
  require_shape("workspace", workspace, {-1});
  require_contiguous("workspace", workspace);
  require_aligned("workspace", workspace, 256, "cuBLAS's workspace is in it");
}

void validate_step(const StepInputs& step, const StepContract& contract) {
  const Memory memory = contract.memory;
  const int device = contract.device_index;
  const int heads = contract.num_heads;
  validate_dcp(contract.dcp);

  // q first: every row count below depends on it.
  if (step.q < 1 || step.q > kMaxQueries) {
    throw_bad_argument("q", "in [1, " + std::to_string(kMaxQueries) + "]", std::to_string(step.q));
  }
  if (!contract.queries.empty()) {
    bool known = false;
    std::string allowed;
    for (int q : contract.queries) {
      known = known || q == step.q;
      allowed += (allowed.empty() ? "" : ", ") + std::to_string(q);
    }
    if (!known) throw_bad_argument("q", "one of the prepared queries {" + allowed + "}", std::to_string(step.q));
  }

  require_present("projected", step.projected);
  require_memory("projected", step.projected, memory, device);
  require_dtype("projected", step.projected, DType::kBF16);
  require_shape("projected", step.projected, {-1, -1});
  const int64_t rows = step.projected.shape[0];
  if (rows < 1) throw_bad_argument("projected", "at least one row", step.projected.describe());
  if (step.projected.shape[1] < projected_width(heads)) {
    throw_bad_argument("projected", "at least " + std::to_string(projected_width(heads)) + " columns (2112 + " +
                                        std::to_string(heads) + " heads * 128)",
                       step.projected.describe());
  }
  require_rows("projected", step.projected);
  require_16_byte_aligned("projected", step.projected);
  if (contract.pitch > 0 && step.projected.stride[0] != contract.pitch) {
    throw_bad_argument("projected", "row stride " + std::to_string(contract.pitch) + " (the pitch prepared for " +
                                        std::to_string(rows) + " rows)",
                       step.projected.describe());
  }
  if (rows % step.q != 0) {
    throw_bad_argument("projected", "a row count divisible by q = " + std::to_string(step.q),
                       step.projected.describe());
  }
  const int64_t max_requests = rows / step.q;

  require_tensor("out", step.out, DType::kBF16, {rows, int64_t{heads} * kVHeadDim}, memory, device);
  require_16_byte_aligned("out", step.out);

  validate_cache(step.cache, memory, device);

  require_tensor("slots", step.slots, DType::kI64, {rows}, memory, device);

  require_present("block_table", step.block_table);
  require_memory("block_table", step.block_table, memory, device);
  require_dtype("block_table", step.block_table, DType::kI32);
  require_shape("block_table", step.block_table, {-1, -1});
  require_rows("block_table", step.block_table);
  const int64_t num_requests = step.block_table.shape[0];
  if (num_requests > max_requests) {
    throw_bad_argument("block_table", "at most rows / q = " + std::to_string(max_requests) + " requests",
                       step.block_table.describe());
  }
  require_tensor("lengths", step.lengths, DType::kI32, {num_requests}, memory, device);

  if (contract.dcp.size > 1) {
    require_tensor("totals", step.totals, DType::kI32, {num_requests}, memory, device);
  } else if (step.totals.present()) {
    throw_bad_argument("totals", "absent without a DCP group (lengths are the global lengths)", step.totals.describe());
  }

  if (contract.check_values) {
    if (memory != Memory::kHost) {
      throw_bad_argument("check_values", "host tensors (device values are checked by PreparedMla::check_step)",
                         "device tensors");
    }
    validate_step_values(step, contract, rows);
  }
}

}  // namespace mla::detail
