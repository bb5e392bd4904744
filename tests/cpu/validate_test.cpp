// Validation shared by every path: each bad input is a clear error naming the argument, what was
// expected and what came. The step below is valid; every test breaks exactly one thing.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "host/validate.h"
#include "mla/mla.h"

namespace mla {
namespace {

using detail::StepContract;

constexpr int kHeads = 2;
constexpr int kRows = 4;   // 2 requests x q = 2
constexpr int kQ = 2;
constexpr int kPages = 4;
constexpr int kMaxPages = 2;

// Owning host storage for one valid step and its weights.
struct HostStep {
  std::vector<uint16_t> projected = std::vector<uint16_t>(kRows * projected_width(kHeads), 0x3f80);
  std::vector<uint16_t> out = std::vector<uint16_t>(kRows * kHeads * kVHeadDim);
  std::vector<uint8_t> cache = std::vector<uint8_t>(kPages * kPageSize * kKeyDim);
  std::vector<int64_t> slots = {5, 6, 64 + 9, -1};
  std::vector<int32_t> block_table = {0, 3, 1, 2};
  std::vector<int32_t> lengths = {7, 70};
  std::vector<int32_t> totals = {7, 70};
  std::vector<uint16_t> q_a_norm = std::vector<uint16_t>(kQLoraRank);
  std::vector<uint16_t> kv_a_norm = std::vector<uint16_t>(kKvLoraRank);
  std::vector<uint16_t> q_b_proj = std::vector<uint16_t>(kHeads * kQkHeadDim * kQLoraRank);
  std::vector<uint16_t> w_uk_t = std::vector<uint16_t>(kHeads * kNopeDim * kKvLoraRank);
  std::vector<uint16_t> w_uv = std::vector<uint16_t>(kHeads * kKvLoraRank * kVHeadDim);

  StepInputs step() {
    StepInputs s;
    s.projected = make_view(projected.data(), DType::kBF16, Memory::kHost, {kRows, projected_width(kHeads)});
    s.out = make_view(out.data(), DType::kBF16, Memory::kHost, {kRows, kHeads * kVHeadDim});
    s.cache = make_view(cache.data(), DType::kFP8E4M3, Memory::kHost, {kPages, kPageSize, kKeyDim});
    s.slots = make_view(slots.data(), DType::kI64, Memory::kHost, {kRows});
    s.block_table = make_view(block_table.data(), DType::kI32, Memory::kHost, {kRows / kQ, kMaxPages});
    s.lengths = make_view(lengths.data(), DType::kI32, Memory::kHost, {kRows / kQ});
    s.q = kQ;
    return s;
  }
  Weights weights() {
    Weights w;
    w.q_a_norm = make_view(q_a_norm.data(), DType::kBF16, Memory::kHost, {kQLoraRank});
    w.kv_a_norm = make_view(kv_a_norm.data(), DType::kBF16, Memory::kHost, {kKvLoraRank});
    w.q_b_proj = make_view(q_b_proj.data(), DType::kBF16, Memory::kHost, {kHeads * kQkHeadDim, kQLoraRank});
    w.w_uk_t = make_view(w_uk_t.data(), DType::kBF16, Memory::kHost, {kHeads, kNopeDim, kKvLoraRank});
    w.w_uv = make_view(w_uv.data(), DType::kBF16, Memory::kHost, {kHeads, kKvLoraRank, kVHeadDim});
    w.q_scale = 0.5f;
    w.k_scale = 0.25f;
    return w;
  }
};

StepContract host_contract() {
  StepContract c;
  c.num_heads = kHeads;
  c.max_context = 1 << 17;
  c.memory = Memory::kHost;
  c.check_values = true;
  return c;
}

// Expects `check` to throw an mla::Error whose message holds every one of `parts`.
void expect_error(const std::function<void()>& check, const std::vector<std::string>& parts) {
  try {
    check();
    ADD_FAILURE() << "no error; expected one mentioning '" << parts.front() << "'";
  } catch (const Error& e) {
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << "message: " << e.what() << "\nlacks: " << part;
    }
  }
}

void expect_step_error(const StepInputs& step, const StepContract& contract, const std::vector<std::string>& parts) {
  expect_error([&] { detail::validate_step(step, contract); }, parts);
}

TEST(Validate, ValidStepPasses) {
  HostStep h;
  EXPECT_NO_THROW(detail::validate_step(h.step(), host_contract()));
  EXPECT_NO_THROW(detail::validate_weights(h.weights(), LayerDims{kHeads, 1e-5f}, Memory::kHost, 0));
}

TEST(Validate, PaddedRequestsAndStridedInputsPass) {
  HostStep h;
  StepInputs s = h.step();
  s.block_table.shape[0] = 1;  // one request of two: the second is graph padding
  s.lengths.shape[0] = 1;
  EXPECT_NO_THROW(detail::validate_step(s, host_contract()));
  // A larger page stride and a padded projected row are legal layouts.
  std::vector<uint8_t> wide_cache(kPages * (kPageSize * kKeyDim + 128));
  s.cache = make_strided_view(wide_cache.data(), DType::kU8, Memory::kHost, {kPages, kPageSize, kKeyDim},
                              {kPageSize * kKeyDim + 128, kKeyDim, 1});
  EXPECT_NO_THROW(detail::validate_step(s, host_contract()));
}

TEST(Validate, ProjectedWrongDtype) {
  HostStep h;
  StepInputs s = h.step();
  s.projected.dtype = DType::kF32;
  expect_step_error(s, host_contract(), {"projected", "bf16", "f32"});
}

TEST(Validate, ProjectedTooNarrow) {
  HostStep h;
  StepInputs s = h.step();
  s.projected.shape[1] = projected_width(kHeads) - 1;
  expect_step_error(s, host_contract(), {"projected", "2368", "2367"});
}

TEST(Validate, ProjectedPitchMustMatchThePreparedOne) {
  HostStep h;
  StepInputs s = h.step();
  StepContract c = host_contract();
  c.pitch = 4096;
  expect_step_error(s, c, {"projected", "row stride 4096", "2368"});
}

TEST(Validate, ProjectedInnerStride) {
  HostStep h;
  StepInputs s = h.step();
  s.projected.stride[1] = 2;
  expect_step_error(s, host_contract(), {"projected", "inner stride 1"});
}

TEST(Validate, RowsNotDivisibleByQ) {
  HostStep h;
  StepInputs s = h.step();
  s.q = 3;
  expect_step_error(s, host_contract(), {"projected", "divisible by q = 3"});
}

TEST(Validate, QOutOfRangeAndUnprepared) {
  HostStep h;
  StepInputs s = h.step();
  s.q = 9;
  expect_step_error(s, host_contract(), {"q", "[1, 8]", "9"});
  s.q = 2;
  StepContract c = host_contract();
  c.queries = {1, 4};
  expect_step_error(s, c, {"q", "{1, 4}", "2"});
}

TEST(Validate, OutWrongShape) {
  HostStep h;
  StepInputs s = h.step();
  s.out.shape[1] = 255;
  expect_step_error(s, host_contract(), {"out", "[4, 256]", "bf16[4, 255]"});
}

TEST(Validate, OutNotContiguous) {
  HostStep h;
  StepInputs s = h.step();
  s.out.stride[0] = 300;
  expect_step_error(s, host_contract(), {"out", "contiguous"});
}

// The kernels move projected and out in 16-byte vectors: an 8-byte offset view is rejected up front.
TEST(Validate, ProjectedAndOutMustBe16ByteAligned) {
  HostStep h;
  h.projected.resize(h.projected.size() + 4);
  h.out.resize(h.out.size() + 4);
  StepInputs s = h.step();
  s.projected.data = h.projected.data() + 4;
  expect_step_error(s, host_contract(), {"projected", "16-byte aligned"});
  s = h.step();
  s.out.data = h.out.data() + 4;
  expect_step_error(s, host_contract(), {"out", "16-byte aligned"});
}

TEST(Validate, CacheWrongPageShapeAndStride) {
  HostStep h;
  StepInputs s = h.step();
  s.cache.shape[2] = 512;
  expect_step_error(s, host_contract(), {"cache", "576", "512"});
  s = h.step();
  s.cache.stride[0] = 100;
  expect_step_error(s, host_contract(), {"cache", "page stride >= 36864"});
  s = h.step();
  s.cache.dtype = DType::kBF16;
  expect_step_error(s, host_contract(), {"cache", "fp8_e4m3 or u8", "bf16"});
}

// Pages move by 16-byte and bulk copies: the base and the page stride must keep every page aligned.
TEST(Validate, CacheMustBe16ByteAligned) {
  HostStep h;
  std::vector<uint8_t> wide(kPages * (kPageSize * kKeyDim + 8) + 16);
  StepInputs s = h.step();
  s.cache = make_strided_view(wide.data(), DType::kU8, Memory::kHost, {kPages, kPageSize, kKeyDim},
                              {kPageSize * kKeyDim + 8, kKeyDim, 1});
  expect_step_error(s, host_contract(), {"cache", "a multiple of 16"});
  s.cache = make_view(wide.data() + 8, DType::kU8, Memory::kHost, {kPages, kPageSize, kKeyDim});
  expect_step_error(s, host_contract(), {"cache", "16-byte aligned"});
}

TEST(Validate, SlotsWrongDtype) {
  HostStep h;
  StepInputs s = h.step();
  s.slots.dtype = DType::kI32;
  expect_step_error(s, host_contract(), {"slots", "i64", "i32"});
}

TEST(Validate, SlotOutOfRange) {
  HostStep h;
  h.slots[2] = kPages * kPageSize;
  expect_step_error(h.step(), host_contract(), {"slots[2]", "[0, 256)", "256"});
  h.slots[2] = -2;
  expect_step_error(h.step(), host_contract(), {"slots[2]", "-2"});
}

TEST(Validate, TwoRowsWritingOneSlot) {
  HostStep h;
  h.slots[3] = h.slots[1];
  expect_step_error(h.step(), host_contract(), {"slots[3]", "slots[1] is 6 too", "6"});
  h.slots[1] = -1;  // -1 writes nothing, so any number of rows may carry it
  h.slots[3] = -1;
  EXPECT_NO_THROW(detail::validate_step(h.step(), host_contract()));
}

TEST(Validate, MoreRequestsThanRowsOverQ) {
  HostStep h;
  h.block_table.resize(6);
  h.lengths = {1, 1, 1};
  StepInputs s = h.step();
  s.block_table.shape[0] = 3;
  s.lengths.shape[0] = 3;
  expect_step_error(s, host_contract(), {"block_table", "at most rows / q = 2"});
}

TEST(Validate, LengthsDisagreeWithBlockTable) {
  HostStep h;
  StepInputs s = h.step();
  s.lengths.shape[0] = 1;
  expect_step_error(s, host_contract(), {"lengths", "[2]", "i32[1]"});
}

TEST(Validate, LengthBeyondBlockTableCapacity) {
  HostStep h;
  h.lengths[1] = kMaxPages * kPageSize + 1;
  expect_step_error(h.step(), host_contract(), {"lengths[1]", "[0, 128]", "129"});
}

TEST(Validate, NegativeLength) {
  HostStep h;
  h.lengths[0] = -1;
  expect_step_error(h.step(), host_contract(), {"lengths[0]", "-1"});
}

TEST(Validate, LengthBeyondMaxContext) {
  HostStep h;
  StepContract c = host_contract();
  c.max_context = 64;
  expect_step_error(h.step(), c, {"lengths[1]", "max_context = 64", "70"});
}

TEST(Validate, PageIndexOutOfRange) {
  HostStep h;
  h.block_table[3] = kPages;  // request 1, page 1 (used: length 70 needs 2 pages)
  expect_step_error(h.step(), host_contract(), {"block_table[1][1]", "[0, 4)", "4"});
}

TEST(Validate, UnusedBlockTableEntriesAreNotChecked) {
  HostStep h;
  h.block_table[1] = -1;  // request 0 has 7 tokens: its second page entry is never read
  EXPECT_NO_THROW(detail::validate_step(h.step(), host_contract()));
}

TEST(Validate, TotalsWithoutDcpAreRejected) {
  HostStep h;
  StepInputs s = h.step();
  s.totals = make_view(h.totals.data(), DType::kI32, Memory::kHost, {2});
  expect_step_error(s, host_contract(), {"totals", "absent without a DCP group"});
}

TEST(Validate, DcpNeedsTotalsAndConsistentLocalLengths) {
  HostStep h;
  StepContract c = host_contract();
  c.dcp = DcpLayout{1, 2, 64};  // rank 1 of 2, interleave 64
  expect_step_error(h.step(), c, {"totals", "a tensor", "absent"});
  // Totals 7 and 134: rank 1 holds none of 0..6, and positions 64..127 of 0..133 (128.. is rank 0's).
  h.totals = {7, 134};
  h.lengths = {0, 64};
  StepInputs s = h.step();
  s.totals = make_view(h.totals.data(), DType::kI32, Memory::kHost, {2});
  EXPECT_NO_THROW(detail::validate_step(s, c));
  h.lengths = {0, 70};
  expect_step_error(s, c, {"lengths[1]", "the 64 tokens that rank 1 of 2", "70"});
}

TEST(Validate, DcpLayoutItself) {
  HostStep h;
  StepContract c = host_contract();
  c.dcp = DcpLayout{2, 2, 1};
  expect_step_error(h.step(), c, {"dcp.rank", "[0, 2)", "2"});
  c.dcp = DcpLayout{0, 2, 0};
  expect_step_error(h.step(), c, {"dcp.interleave", ">= 1", "0"});
}

TEST(Validate, MemoryMustMatch) {
  HostStep h;
  StepInputs s = h.step();
  s.lengths.memory = Memory::kDevice;
  expect_step_error(s, host_contract(), {"lengths", "host", "cuda:0"});
  StepContract c = host_contract();
  c.memory = Memory::kDevice;
  c.check_values = false;
  expect_step_error(h.step(), c, {"projected", "cuda:0", "host"});
}

TEST(Validate, AbsentTensor) {
  HostStep h;
  StepInputs s = h.step();
  s.slots = TensorView{};
  expect_step_error(s, host_contract(), {"slots", "absent"});
}

// ---- Weights ---------------------------------------------------------------------------------------

void expect_weights_error(const Weights& w, const LayerDims& dims, const std::vector<std::string>& parts) {
  expect_error([&] { detail::validate_weights(w, dims, Memory::kHost, 0); }, parts);
}

TEST(ValidateWeights, WrongShapes) {
  HostStep h;
  const LayerDims dims{kHeads, 1e-5f};
  Weights w = h.weights();
  w.q_b_proj.shape[0] = 383;
  expect_weights_error(w, dims, {"q_b_proj", "[384, 1536]", "[383, 1536]"});
  w = h.weights();
  w.w_uk_t.shape[1] = 512;
  w.w_uk_t.shape[2] = 128;
  expect_weights_error(w, dims, {"w_uk_t", "[2, 128, 512]"});
  w = h.weights();
  w.w_uv.dtype = DType::kF32;
  expect_weights_error(w, dims, {"w_uv", "bf16", "f32"});
  w = h.weights();
  w.kv_a_norm.shape[0] = 1536;
  expect_weights_error(w, dims, {"kv_a_norm", "[512]", "[1536]"});
}

// A weight view at an odd element offset (e.g. a slice of a larger buffer) is rejected by name.
TEST(ValidateWeights, MustBe16ByteAligned) {
  HostStep h;
  const LayerDims dims{kHeads, 1e-5f};
  for (const char* name : {"q_a_norm", "kv_a_norm", "q_b_proj", "w_uk_t", "w_uv"}) {
    Weights w = h.weights();
    TensorView& view = name == std::string("q_a_norm")    ? w.q_a_norm
                       : name == std::string("kv_a_norm") ? w.kv_a_norm
                       : name == std::string("q_b_proj")  ? w.q_b_proj
                       : name == std::string("w_uk_t")    ? w.w_uk_t
                                                          : w.w_uv;
    view.data = static_cast<uint16_t*>(view.data) + 1;  // validation never dereferences it
    expect_weights_error(w, dims, {name, "16-byte aligned"});
  }
}

TEST(Validate, QueryScratchMustBe16ByteAligned) {
  std::vector<uint8_t> bytes(2 * kHeads * kKeyDim + 16);
  const TensorView scratch = make_view(bytes.data() + 8, DType::kFP8E4M3, Memory::kHost, {2, kHeads, kKeyDim});
  expect_error([&] { detail::validate_query_scratch(scratch, 2, kHeads, Memory::kHost, 0); },
               {"query_scratch", "16-byte aligned"});
}

TEST(ValidateWeights, ScalesAndDims) {
  HostStep h;
  Weights w = h.weights();
  w.q_scale = 0;
  expect_weights_error(w, LayerDims{kHeads, 1e-5f}, {"q_scale", "> 0", "0"});
  w = h.weights();
  w.k_scale = -1;
  expect_weights_error(w, LayerDims{kHeads, 1e-5f}, {"k_scale", "-1"});
  expect_weights_error(h.weights(), LayerDims{0, 1e-5f}, {"num_heads", "[1, 128]", "0"});
  expect_weights_error(h.weights(), LayerDims{129, 1e-5f}, {"num_heads", "129"});
  expect_weights_error(h.weights(), LayerDims{kHeads, 0.0f}, {"rms_eps", "> 0"});
}

TEST(ValidateQueryScratch, ShapeAndRows) {
  std::vector<uint8_t> bytes(8 * kHeads * kKeyDim);
  TensorView scratch = make_view(bytes.data(), DType::kFP8E4M3, Memory::kHost, {8, kHeads, kKeyDim});
  EXPECT_NO_THROW(detail::validate_query_scratch(scratch, 8, kHeads, Memory::kHost, 0));
  try {
    detail::validate_query_scratch(scratch, 16, kHeads, Memory::kHost, 0);
    ADD_FAILURE() << "no error for a scratch smaller than the largest batch";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("at least 16 rows"), std::string::npos) << e.what();
  }
  EXPECT_THROW(detail::validate_query_scratch(scratch, 8, kHeads + 1, Memory::kHost, 0), Error);
}

}  // namespace
}  // namespace mla
