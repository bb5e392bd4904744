// DCP groups without a GPU: the buffer layout arithmetic, the in-process peer tables, validation of
// groups (through a test transport over fake pointers) and of PreparedMla under DCP. Every check here
// runs before any CUDA call; the views and pointers claim device memory but are never dereferenced.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mla/dcp.h"
#include "cpu/error_of.h"
#include "mla/mla.h"

namespace mla {
namespace {

using test::error_of;

// A transport over given peer tables: what a multi-GPU transport hands to the base class.
class FakeGroup final : public DcpGroup {
 public:
  FakeGroup(const DcpLayout& layout, int num_heads, int64_t max_rows, int device_index,
            const std::array<DcpPeerTable, 2>& peers, bool stream_ordered = false)
      : DcpGroup(layout, num_heads, max_rows, device_index, peers), stream_ordered_(stream_ordered) {}
  bool stream_ordered() const override { return stream_ordered_; }
  const char* transport() const override { return stream_ordered_ ? "fake-ordered" : "fake"; }

 private:
  bool stream_ordered_;
};

// A fake base address: only arithmetic is done on it.
void* fake_base() { return reinterpret_cast<void*>(uintptr_t{1} << 40); }

TEST(DcpLayout, BuffersFollowEachOtherAligned) {
  const DcpBufferLayout l = dcp_buffer_layout(/*size=*/4, /*num_heads=*/12, /*max_rows=*/63);
  const size_t entries = size_t{63} * 48;  // rows x D*H
  EXPECT_EQ(l.mailbox_offset, 0u);
  EXPECT_EQ(l.mailbox_bytes, entries * 576);
  EXPECT_EQ(l.latent_bytes, entries * 512 * 2);
  EXPECT_EQ(l.lse_bytes, entries * 4);
  EXPECT_EQ(l.signal_bytes, 2u * 4 * 4);
  EXPECT_EQ(l.epoch_offset, l.signal_offset + l.signal_bytes);  // the rank's own word after the signals
  for (size_t offset : {l.latent_offset, l.lse_offset, l.signal_offset, l.block_bytes}) {
    EXPECT_EQ(offset % kDcpAlignment, 0u) << offset;
  }
  // In order, not overlapping, with less than one alignment unit of padding between.
  EXPECT_GE(l.latent_offset, l.mailbox_offset + l.mailbox_bytes);
  EXPECT_LT(l.latent_offset, l.mailbox_offset + l.mailbox_bytes + kDcpAlignment);
  EXPECT_GE(l.lse_offset, l.latent_offset + l.latent_bytes);
  EXPECT_LT(l.lse_offset, l.latent_offset + l.latent_bytes + kDcpAlignment);
  EXPECT_GE(l.signal_offset, l.lse_offset + l.lse_bytes);
  EXPECT_GE(l.block_bytes, l.epoch_offset + 4);
  EXPECT_LT(l.block_bytes, l.epoch_offset + 4 + kDcpAlignment);
}

TEST(DcpLayout, RejectsBadSizes) {
  EXPECT_ERROR_HAS(dcp_buffer_layout(1, 12, 8), "dcp size: expected 2..8 ranks (no DCP: pass no group), got 1");
  EXPECT_ERROR_HAS(dcp_buffer_layout(9, 12, 8), "dcp size: expected 2..8 ranks");
  EXPECT_ERROR_HAS(dcp_buffer_layout(2, 0, 8), "dcp num_heads: expected in [1, 128] (heads per rank), got 0");
  EXPECT_ERROR_HAS(dcp_buffer_layout(2, 129, 8), "got 129");
  EXPECT_ERROR_HAS(dcp_buffer_layout(2, 12, 0), "dcp max_rows: expected >= 1, got 0");
}

TEST(DcpInProcess, PeerTablesPointIntoBlock2pPlusParity) {
  const DcpBufferLayout l = dcp_buffer_layout(3, 16, 8);
  const std::array<DcpPeerTable, 2> tables = InProcessDcp::peer_tables(fake_base(), l);
  const auto at = [&](const void* p) { return static_cast<const uint8_t*>(p) - static_cast<uint8_t*>(fake_base()); };
  for (int parity = 0; parity < 2; ++parity) {
    for (int p = 0; p < kMaxDcpRanks; ++p) {
      const DcpPeerTable& t = tables[parity];
      if (p >= 3) {
        EXPECT_EQ(t.mailbox[p], nullptr);
        EXPECT_EQ(t.latent[p], nullptr);
        EXPECT_EQ(t.lse[p], nullptr);
        EXPECT_EQ(t.signals[p], nullptr);
        continue;
      }
      const ptrdiff_t block = static_cast<ptrdiff_t>((2 * p + parity) * l.block_bytes);
      EXPECT_EQ(at(t.mailbox[p]), block + static_cast<ptrdiff_t>(l.mailbox_offset));
      EXPECT_EQ(at(t.latent[p]), block + static_cast<ptrdiff_t>(l.latent_offset));
      EXPECT_EQ(at(t.lse[p]), block + static_cast<ptrdiff_t>(l.lse_offset));
      EXPECT_EQ(at(t.signals[p]), block + static_cast<ptrdiff_t>(l.signal_offset));
    }
  }
}

TEST(DcpInProcess, RejectsBadArgumentsBeforeAllocating) {
  EXPECT_ERROR_HAS(InProcessDcp(1, 1, 12, 8), "dcp size: expected 2..8 ranks");
  EXPECT_ERROR_HAS(InProcessDcp(2, 0, 12, 8), "dcp interleave: expected >= 1, got 0");
  EXPECT_ERROR_HAS(InProcessDcp(2, 64, 12, 0), "dcp max_rows");
  EXPECT_ERROR_HAS(InProcessDcp(2, 64, 12, 8, -1), "dcp device_index: expected >= 0, got -1");
}

TEST(DcpGroup, ValidatesLayoutAndPeerTables) {
  const DcpBufferLayout l = dcp_buffer_layout(2, 12, 8);
  const std::array<DcpPeerTable, 2> good = InProcessDcp::peer_tables(fake_base(), l);
  const FakeGroup group({1, 2, 64}, 12, 8, 0, good);
  EXPECT_EQ(group.rank(), 1);
  EXPECT_EQ(group.size(), 2);
  EXPECT_EQ(group.interleave(), 64);
  EXPECT_EQ(group.core_heads(), 24);
  EXPECT_EQ(group.buffers().block_bytes, l.block_bytes);
  EXPECT_EQ(group.peers(1).latent[0], good[1].latent[0]);
  // The epoch word: in the rank's own block of that parity, right after its 2*D signal words.
  EXPECT_EQ(reinterpret_cast<uint8_t*>(group.epoch(1)),
            reinterpret_cast<uint8_t*>(good[1].signals[1]) + (l.epoch_offset - l.signal_offset));
  EXPECT_EQ(group.wait_timeout_ns(), 0);
  EXPECT_ERROR_HAS(group.peers(2), "dcp parity: expected 0 or 1, got 2");

  EXPECT_ERROR_HAS(FakeGroup({2, 2, 1}, 12, 8, 0, good), "dcp rank: expected in [0, 2), got 2");
  EXPECT_ERROR_HAS(FakeGroup({0, 2, 0}, 12, 8, 0, good), "dcp interleave");
  std::array<DcpPeerTable, 2> missing = good;
  missing[1].lse[1] = nullptr;
  EXPECT_ERROR_HAS(FakeGroup({0, 2, 1}, 12, 8, 0, missing),
                   "dcp peers(1).lse[1]: expected a device pointer (rank 1 of 2), got null");
  std::array<DcpPeerTable, 2> extra = good;
  extra[0].signals[2] = good[0].signals[0];
  EXPECT_ERROR_HAS(FakeGroup({0, 2, 1}, 12, 8, 0, extra), "dcp peers(0).signals[2]: expected null (the group has 2");
  std::array<DcpPeerTable, 2> shared = good;
  shared[1].mailbox[0] = good[0].mailbox[0];
  EXPECT_ERROR_HAS(FakeGroup({0, 2, 1}, 12, 8, 0, shared), "buffers distinct from parity 0's");
}

// ---- PreparedMla under DCP ------------------------------------------------------------------------

constexpr int kHeads = 12;
const LayerDims kDims{kHeads, 1e-5f};
const int64_t kWidth = projected_width(kHeads);

struct FakeDeviceWeights {
  std::vector<uint8_t> bytes = std::vector<uint8_t>(64);
  Weights weights;
  explicit FakeDeviceWeights(int device = 0) {
    void* p = bytes.data();
    weights.q_a_norm = make_view(p, DType::kBF16, Memory::kDevice, {kQLoraRank}, device);
    weights.kv_a_norm = make_view(p, DType::kBF16, Memory::kDevice, {kKvLoraRank}, device);
    weights.q_b_proj = make_view(p, DType::kBF16, Memory::kDevice, {kHeads * kQkHeadDim, kQLoraRank}, device);
    weights.w_uk_t = make_view(p, DType::kBF16, Memory::kDevice, {kHeads, kNopeDim, kKvLoraRank}, device);
    weights.w_uv = make_view(p, DType::kBF16, Memory::kDevice, {kHeads, kKvLoraRank, kVHeadDim}, device);
    weights.q_scale = 0.05f;
    weights.k_scale = 0.02f;
  }
};

FakeGroup make_group(int rank, int size, int heads, int64_t max_rows, int device = 0, bool stream_ordered = false) {
  return FakeGroup({rank, size, 64}, heads, max_rows, device,
                   InProcessDcp::peer_tables(fake_base(), dcp_buffer_layout(size, heads, max_rows)), stream_ordered);
}

TEST(PreparedMlaDcp, ConstructsWithAGroupInsteadOfQueryScratch) {
  FakeDeviceWeights layer;
  const FakeGroup group = make_group(1, 4, kHeads, 16);
  PreparedMla mla(layer.weights, kDims, {{4, kWidth}, {16, kWidth}}, TensorView{},
                  {.dcp = &group, .parity = 1, .queries = {1, 4}});
  EXPECT_EQ(mla.shapes().size(), 4u);
  EXPECT_EQ(mla.shape(16, 4).pitch, kWidth);
}

TEST(PreparedMlaDcp, RejectsAMismatchedGroup) {
  FakeDeviceWeights layer;
  const FakeGroup other_heads = make_group(0, 2, 16, 16);
  EXPECT_ERROR_HAS(PreparedMla(layer.weights, kDims, {{4, kWidth}}, TensorView{}, {.dcp = &other_heads}),
                   "dcp: expected a group of num_heads = 12 heads per rank, got 16 heads per rank");
  const FakeGroup small = make_group(0, 2, kHeads, 8);
  EXPECT_ERROR_HAS(PreparedMla(layer.weights, kDims, {{4, kWidth}, {16, kWidth}}, TensorView{}, {.dcp = &small}),
                   "pitches: expected batch sizes <= the DCP group's max_rows = 8, got 16");
  const FakeGroup group = make_group(0, 2, kHeads, 16);
  std::vector<uint8_t> scratch_bytes(64);
  const TensorView scratch =
      make_view(scratch_bytes.data(), DType::kFP8E4M3, Memory::kDevice, {16, 2 * kHeads, kKeyDim});
  EXPECT_ERROR_HAS(PreparedMla(layer.weights, kDims, {{4, kWidth}}, scratch, {.dcp = &group}),
                   "query_scratch: expected absent under DCP (the group's mailboxes hold the query)");
  const FakeGroup on_gpu1 = make_group(0, 2, kHeads, 16, /*device=*/1);
  EXPECT_ERROR_HAS(PreparedMla(layer.weights, kDims, {{4, kWidth}}, TensorView{}, {.dcp = &on_gpu1}),
                   "q_a_norm: expected memory on cuda:1, got cuda:0");
  EXPECT_ERROR_HAS(PreparedMla(layer.weights, kDims, {{4, kWidth}}, TensorView{}, {.dcp = &group, .parity = 2}),
                   "parity: expected 0 or 1, got 2");
}

// A well-formed step of 4 rows (q = 1) on fake device memory.
struct FakeDeviceStep {
  std::vector<uint8_t> bytes = std::vector<uint8_t>(64);
  StepInputs step;
  FakeDeviceStep() {
    void* p = bytes.data();
    step.projected = make_view(p, DType::kBF16, Memory::kDevice, {4, kWidth});
    step.out = make_view(p, DType::kBF16, Memory::kDevice, {4, kHeads * kVHeadDim});
    step.cache = make_view(p, DType::kFP8E4M3, Memory::kDevice, {2, kPageSize, kKeyDim});
    step.slots = make_view(p, DType::kI64, Memory::kDevice, {4});
    step.block_table = make_view(p, DType::kI32, Memory::kDevice, {4, 1});
    step.lengths = make_view(p, DType::kI32, Memory::kDevice, {4});
    step.totals = make_view(p, DType::kI32, Memory::kDevice, {4});
  }
};

TEST(PreparedMlaDcp, StreamOrderedGroupsRunPhasesOnly) {
  FakeDeviceWeights layer;
  const FakeGroup group = make_group(0, 2, kHeads, 16, 0, /*stream_ordered=*/true);
  PreparedMla mla(layer.weights, kDims, {{4, kWidth}}, TensorView{}, {.dcp = &group});
  FakeDeviceStep fake;
  EXPECT_ERROR_HAS(mla.run(fake.step, nullptr), "run: expected a group whose ranks signal each other");
  EXPECT_ERROR_HAS(mla.run(fake.step, nullptr), "got a group of transport 'fake-ordered'");
  EXPECT_ERROR_HAS(mla.run_profiled(fake.step, nullptr, {}), "run_profiled: expected a PreparedMla without a DCP group");
  EXPECT_ERROR_HAS(mla.run_phase(static_cast<DcpPhase>(7), fake.step, nullptr), "run_phase: phase");
  StepInputs no_totals = fake.step;
  no_totals.totals = TensorView{};
  EXPECT_ERROR_HAS(mla.run_phase(DcpPhase::kCore, no_totals, nullptr), "totals: expected a tensor");
  StepInputs wrong_q = fake.step;
  wrong_q.q = 2;
  EXPECT_ERROR_HAS(mla.run_phase(DcpPhase::kQuery, wrong_q, nullptr), "(4, 2)");
  // A valid step gets as far as the missing prepare().
  EXPECT_ERROR_HAS(mla.run_phase(DcpPhase::kValue, fake.step, nullptr), "prepare(cache) has not been called");
}

TEST(PreparedMlaDcp, SignallingGroupsRunWholeStepsOnly) {
  FakeDeviceWeights layer;
  const FakeGroup group = make_group(1, 2, kHeads, 16);
  PreparedMla mla(layer.weights, kDims, {{4, kWidth}}, TensorView{}, {.dcp = &group});
  FakeDeviceStep fake;
  EXPECT_ERROR_HAS(mla.run_phase(DcpPhase::kQuery, fake.step, nullptr),
                   "run_phase: expected a stream-ordered DCP group (this one signals between stages: use run()), "
                   "got a group of transport 'fake'");
  StepInputs no_totals = fake.step;
  no_totals.totals = TensorView{};
  EXPECT_ERROR_HAS(mla.run(no_totals, nullptr), "totals: expected a tensor");
  EXPECT_ERROR_HAS(mla.run(fake.step, nullptr), "run: prepare(cache) has not been called");
}

TEST(PreparedMlaDcp, PhasesNeedAGroup) {
  FakeDeviceWeights layer;
  std::vector<uint8_t> scratch_bytes(64);
  PreparedMla mla(layer.weights, kDims, {{4, kWidth}},
                  make_view(scratch_bytes.data(), DType::kFP8E4M3, Memory::kDevice, {4, kHeads, kKeyDim}));
  FakeDeviceStep fake;
  EXPECT_ERROR_HAS(mla.run_phase(DcpPhase::kQuery, fake.step, nullptr),
                   "run_phase: expected a PreparedMla prepared with a DCP group (without one, use run()), got no group");
}

}  // namespace
}  // namespace mla
