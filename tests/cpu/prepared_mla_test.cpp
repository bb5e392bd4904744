// The prepared object's host side: argument validation at construction and the planned shapes.
// No CUDA call happens before validation, so all of this runs without a GPU. The views below point
// at host bytes but claim device memory: the constructor only inspects them.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "cpu/error_of.h"
#include "mla/mla.h"

namespace mla {
namespace {

constexpr int kHeads = 12;

struct FakeDeviceLayer {
  std::vector<uint8_t> bytes = std::vector<uint8_t>(64);  // never dereferenced
  Weights weights;
  TensorView query_scratch;

  FakeDeviceLayer() {
    void* p = bytes.data();
    weights.q_a_norm = make_view(p, DType::kBF16, Memory::kDevice, {kQLoraRank});
    weights.kv_a_norm = make_view(p, DType::kBF16, Memory::kDevice, {kKvLoraRank});
    weights.q_b_proj = make_view(p, DType::kBF16, Memory::kDevice, {kHeads * kQkHeadDim, kQLoraRank});
    weights.w_uk_t = make_view(p, DType::kBF16, Memory::kDevice, {kHeads, kNopeDim, kKvLoraRank});
    weights.w_uv = make_view(p, DType::kBF16, Memory::kDevice, {kHeads, kKvLoraRank, kVHeadDim});
    weights.q_scale = 0.05f;
    weights.k_scale = 0.02f;
    query_scratch = make_view(p, DType::kFP8E4M3, Memory::kDevice, {64, kHeads, kKeyDim});
  }
};

using test::error_of;

const LayerDims kDims{kHeads, 1e-5f};
const int64_t kWidth = projected_width(kHeads);

TEST(PreparedMla, PlansEveryShapeOfPitchesAndQueries) {
  FakeDeviceLayer layer;
  PreparedMla mla(layer.weights, kDims, {{1, kWidth}, {4, kWidth + 64}, {6, kWidth}, {64, 4096}}, layer.query_scratch,
                  {.queries = {1, 4}});
  std::vector<std::pair<int64_t, int>> planned;
  for (const PreparedShape& s : mla.shapes()) planned.emplace_back(s.rows, s.q);
  const std::vector<std::pair<int64_t, int>> expected = {{1, 1}, {4, 1}, {4, 4}, {6, 1}, {64, 1}, {64, 4}};
  EXPECT_EQ(planned, expected);
  EXPECT_EQ(mla.shape(4, 1).pitch, kWidth + 64);
  EXPECT_EQ(mla.shape(64, 4).pitch, 4096);
}

TEST(PreparedMla, HoldsNoDeviceMemoryBeforePrepare) {
  FakeDeviceLayer layer;
  PreparedMla mla(layer.weights, kDims, {{1, kWidth}, {64, kWidth}}, layer.query_scratch);
  EXPECT_EQ(mla.device_bytes(), 0u);
}

TEST(PreparedMla, UnknownShapeNamesThePreparedOnes) {
  FakeDeviceLayer layer;
  PreparedMla mla(layer.weights, kDims, {{4, kWidth}}, layer.query_scratch, {.queries = {1, 2}});
  const std::string message = error_of([&] { mla.shape(8, 1); });
  EXPECT_NE(message.find("(batch, q)"), std::string::npos) << message;
  EXPECT_NE(message.find("{(4, 1), (4, 2)}"), std::string::npos) << message;
  EXPECT_NE(message.find("(8, 1)"), std::string::npos) << message;
  EXPECT_NE(error_of([&] { mla.shape(4, 4); }).find("(4, 4)"), std::string::npos);
}

TEST(PreparedMla, RejectsBadPitches) {
  FakeDeviceLayer layer;
  EXPECT_NE(error_of([&] { PreparedMla(layer.weights, kDims, {{4, kWidth - 1}}, layer.query_scratch); })
                .find("pitches[4]: expected >= 3648"),
            std::string::npos);
  EXPECT_NE(error_of([&] { PreparedMla(layer.weights, kDims, {}, layer.query_scratch); }).find("pitches"),
            std::string::npos);
  EXPECT_NE(error_of([&] { PreparedMla(layer.weights, kDims, {{0, kWidth}}, layer.query_scratch); })
                .find("batch sizes >= 1"),
            std::string::npos);
  // Batch 3 with q = 2 only: no shape at all.
  EXPECT_NE(error_of([&] { PreparedMla(layer.weights, kDims, {{3, kWidth}}, layer.query_scratch, {.queries = {2}}); })
                .find("divisible"),
            std::string::npos);
}

TEST(PreparedMla, RejectsBadOptions) {
  FakeDeviceLayer layer;
  auto make = [&](PrepareOptions options) {
    return error_of([&] { PreparedMla(layer.weights, kDims, {{4, kWidth}}, layer.query_scratch, options); });
  };
  EXPECT_NE(make({.queries = {9}}).find("queries: expected values in [1, 8], got 9"), std::string::npos);
  EXPECT_NE(make({.queries = {}}).find("queries"), std::string::npos);
  EXPECT_NE(make({.queries = {2, 2}}).find("distinct"), std::string::npos);
  EXPECT_NE(make({.max_context = 0}).find("max_context"), std::string::npos);
  EXPECT_NE(make({.parity = 2}).find("parity: expected 0 or 1, got 2"), std::string::npos);
}

TEST(PreparedMla, RejectsHostWeightsAndSmallScratch) {
  FakeDeviceLayer layer;
  Weights host = layer.weights;
  host.w_uv.memory = Memory::kHost;
  EXPECT_NE(error_of([&] { PreparedMla(host, kDims, {{4, kWidth}}, layer.query_scratch); })
                .find("w_uv: expected memory on cuda:0, got host"),
            std::string::npos);
  EXPECT_NE(error_of([&] { PreparedMla(layer.weights, kDims, {{128, kWidth}}, layer.query_scratch); })
                .find("query_scratch: expected at least 128 rows"),
            std::string::npos);
  const TensorView scratch16 = make_view(layer.bytes.data(), DType::kFP8E4M3, Memory::kDevice, {64, 16, kKeyDim});
  EXPECT_NE(error_of([&] { PreparedMla(layer.weights, LayerDims{16, 1e-5f}, {{4, projected_width(16)}}, scratch16); })
                .find("q_b_proj"),
            std::string::npos);
}

// The device comes from the scratch (without DCP): a missing or host scratch is named as such, not reported as
// weights on the wrong device.
TEST(PreparedMla, NamesABadScratchBeforeTheWeights) {
  FakeDeviceLayer layer;
  EXPECT_NE(error_of([&] { PreparedMla(layer.weights, kDims, {{4, kWidth}}, TensorView{}); }).find("query_scratch"),
            std::string::npos);
  TensorView host = layer.query_scratch;
  host.memory = Memory::kHost;
  EXPECT_NE(error_of([&] { PreparedMla(layer.weights, kDims, {{4, kWidth}}, host); }).find("query_scratch"),
            std::string::npos);
}

// prepare() checks the cache like run() does (validate_cache) before any CUDA call.
TEST(PreparedMla, PrepareRejectsABadCache) {
  FakeDeviceLayer layer;
  PreparedMla mla(layer.weights, kDims, {{4, kWidth}}, layer.query_scratch);
  std::vector<uint8_t> bytes(64);  // never dereferenced
  auto cache = [&](int64_t page_stride, int64_t offset = 0) {
    return make_strided_view(bytes.data() + offset, DType::kFP8E4M3, Memory::kDevice, {4, kPageSize, kKeyDim},
                             {page_stride, kKeyDim, 1});
  };
  const int64_t dense = int64_t{kPageSize} * kKeyDim;
  EXPECT_NE(error_of([&] { mla.prepare(cache(dense + 8)); }).find("a multiple of 16"), std::string::npos);
  EXPECT_NE(error_of([&] { mla.prepare(cache(dense, 8)); }).find("cache: expected a 16-byte aligned"),
            std::string::npos);
  TensorView host = cache(dense);
  host.memory = Memory::kHost;
  EXPECT_NE(error_of([&] { mla.prepare(host); }).find("cache: expected memory on cuda:0, got host"), std::string::npos);
  TensorView bf16 = cache(dense);
  bf16.dtype = DType::kBF16;
  EXPECT_NE(error_of([&] { mla.prepare(bf16); }).find("cache"), std::string::npos);
}

// A caller's workspace is checked (before any CUDA call) for placement, dtype, rank and alignment;
// its size against the plan needs the device (tests/gpu/pipeline).
TEST(PreparedMla, PrepareRejectsABadWorkspace) {
  FakeDeviceLayer layer;
  PreparedMla mla(layer.weights, kDims, {{4, kWidth}}, layer.query_scratch);
  std::vector<uint8_t> cache_bytes(64), bytes(4096);  // never dereferenced
  const TensorView cache = make_view(cache_bytes.data(), DType::kFP8E4M3, Memory::kDevice, {4, kPageSize, kKeyDim});
  uint8_t* aligned = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bytes.data()) + 255) / 256 * 256);
  auto workspace = [&](uint8_t* data) { return make_view(data, DType::kU8, Memory::kDevice, {1024}); };
  TensorView host = workspace(aligned);
  host.memory = Memory::kHost;
  EXPECT_NE(error_of([&] { mla.prepare(cache, host); }).find("workspace: expected memory on cuda:0, got host"),
            std::string::npos);
  TensorView bf16 = workspace(aligned);
  bf16.dtype = DType::kBF16;
  EXPECT_NE(error_of([&] { mla.prepare(cache, bf16); }).find("workspace: expected dtype u8"), std::string::npos);
  const TensorView two_d = make_view(aligned, DType::kU8, Memory::kDevice, {2, 512});
  EXPECT_NE(error_of([&] { mla.prepare(cache, two_d); }).find("workspace"), std::string::npos);
  EXPECT_NE(error_of([&] { mla.prepare(cache, workspace(aligned + 16)); }).find("workspace: expected a 256-byte aligned"),
            std::string::npos);
}

TEST(PreparedMla, CoreKindNames) {
  EXPECT_EQ(parse_core_kind("auto"), CoreKind::kAuto);
  EXPECT_STREQ(core_kind_name(CoreKind::kAuto), "auto");
  EXPECT_NE(error_of([] { parse_core_kind("fastest"); }).find("core: expected one of {auto}, got 'fastest'"),
            std::string::npos);
}

TEST(PreparedMla, RunValidatesTheStepBeforeAnything) {
  FakeDeviceLayer layer;
  PreparedMla mla(layer.weights, kDims, {{4, kWidth}}, layer.query_scratch, {.queries = {1, 2}});
  StepInputs step;
  std::vector<uint8_t> bytes(64);
  step.projected = make_view(bytes.data(), DType::kBF16, Memory::kDevice, {4, kWidth});
  step.q = 4;  // (4, 4) was not prepared
  EXPECT_NE(error_of([&] { mla.run(step, nullptr); }).find("(4, 4)"), std::string::npos);
  step.q = 2;  // a prepared shape, but `out` is missing
  EXPECT_NE(error_of([&] { mla.run(step, nullptr); }).find("out: expected a tensor"), std::string::npos);
}

}  // namespace
}  // namespace mla
