// A small non-owning tensor view: enough for the library to validate what it is given
// (pointer, dtype, where the memory lives, shape, strides) without depending on PyTorch.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace mla {

enum class DType : uint8_t {
  kBF16,     // bfloat16, stored as its 16 bits
  kF32,      // float
  kI32,      // int32_t
  kI64,      // int64_t
  kFP8E4M3,  // OCP FP8 e4m3fn, one byte
  kU8,       // raw bytes; accepted wherever FP8 bytes are (engines often keep FP8 caches as uint8)
};

enum class Memory : uint8_t {
  kHost,    // CPU memory (the reference path; also pinned host memory)
  kDevice,  // CUDA device memory of `device_index`
};

int64_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

struct TensorView {
  static constexpr int kMaxRank = 4;

  void* data = nullptr;              // nullptr = absent (only optional arguments may be absent)
  DType dtype = DType::kU8;
  Memory memory = Memory::kHost;
  int device_index = 0;              // CUDA ordinal; ignored for host memory
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};   // elements per dimension
  std::array<int64_t, kMaxRank> stride{};  // in elements, not bytes

  bool present() const { return data != nullptr; }
  int64_t numel() const;
  bool is_contiguous() const;        // row-major, densely packed
  std::string describe() const;      // "bf16[4, 2112] strides [2112, 1] on cuda:0", for error messages

  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

// A row-major contiguous view.
TensorView make_view(void* data, DType dtype, Memory memory, std::initializer_list<int64_t> shape,
                     int device_index = 0);
// A view with explicit strides (elements).
TensorView make_strided_view(void* data, DType dtype, Memory memory, std::initializer_list<int64_t> shape,
                             std::initializer_list<int64_t> stride, int device_index = 0);

}  // namespace mla
