#include "mla/tensor.h"

#include <sstream>

#include "mla/error.h"

namespace mla {

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return 2;
    case DType::kF32: return 4;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kFP8E4M3: return 1;
    case DType::kU8: return 1;
  }
  throw Error("dtype_size: unknown dtype");
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kF32: return "f32";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kFP8E4M3: return "fp8_e4m3";
    case DType::kU8: return "u8";
  }
  return "unknown";
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  if (!present()) return "absent";
  std::ostringstream s;
  s << dtype_name(dtype) << "[";
  for (int d = 0; d < rank; ++d) s << (d ? ", " : "") << shape[d];
  s << "] strides [";
  for (int d = 0; d < rank; ++d) s << (d ? ", " : "") << stride[d];
  s << "] on " << (memory == Memory::kHost ? std::string("host") : "cuda:" + std::to_string(device_index));
  return s.str();
}

static TensorView make(void* data, DType dtype, Memory memory, std::initializer_list<int64_t> shape,
                       int device_index) {
  if (shape.size() > TensorView::kMaxRank) {
    throw_bad_argument("make_view: shape", "rank <= 4", "rank " + std::to_string(shape.size()));
  }
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.memory = memory;
  v.device_index = device_index;
  v.rank = static_cast<int>(shape.size());
  int d = 0;
  for (int64_t extent : shape) v.shape[d++] = extent;
  return v;
}

TensorView make_view(void* data, DType dtype, Memory memory, std::initializer_list<int64_t> shape,
                     int device_index) {
  TensorView v = make(data, dtype, memory, shape, device_index);
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.stride[d] = stride;
    stride *= v.shape[d];
  }
  return v;
}

TensorView make_strided_view(void* data, DType dtype, Memory memory, std::initializer_list<int64_t> shape,
                             std::initializer_list<int64_t> stride, int device_index) {
  if (stride.size() != shape.size()) {
    throw_bad_argument("make_strided_view: stride", "rank " + std::to_string(shape.size()),
                       "rank " + std::to_string(stride.size()));
  }
  TensorView v = make(data, dtype, memory, shape, device_index);
  int d = 0;
  for (int64_t s : stride) v.stride[d++] = s;
  return v;
}

}  // namespace mla
