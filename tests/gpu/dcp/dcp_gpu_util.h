// Device-side helpers of the DCP GPU tests (in-process and multi-process): a rank step's tensors on
// the device, and a sequence of rank steps with fixed buffer sizes and changing lengths.
#pragma once

#include <algorithm>
#include <vector>

#include "dcp_test_util.h"
#include "gpu_test_util.h"
#include "mla/mla.h"
#include "synthetic.h"

namespace mla::test {

// A rank step's tensors on the device; later steps must have the same sizes.
struct DeviceRankStep {
  DeviceBuffer<uint16_t> projected, out;
  DeviceBuffer<uint8_t> cache;
  DeviceBuffer<int64_t> slots;
  DeviceBuffer<int32_t> block_table, lengths, totals;

  explicit DeviceRankStep(const RankStep& s)
      : projected(s.projected.size()), out(s.out.size()), cache(s.cache.size()), slots(s.slots.size()),
        block_table(std::max<size_t>(1, s.block_table.size())), lengths(std::max<size_t>(1, s.lengths.size())),
        totals(std::max<size_t>(1, s.totals.size())) {}
  void upload(const RankStep& s) {
    ASSERT_EQ(s.cache.size(), cache.size());
    ASSERT_EQ(s.block_table.size() == 0 ? 1 : s.block_table.size(), block_table.size());
    projected.upload(s.projected);
    cache.upload(s.cache);
    slots.upload(s.slots);
    if (!s.block_table.empty()) block_table.upload(s.block_table);
    if (!s.lengths.empty()) lengths.upload(s.lengths);
    if (!s.totals.empty()) totals.upload(s.totals);
    out.poison(0xff);
  }
  StepInputs inputs(RankStep& host) {
    StepInputs s = host.inputs();  // same shapes and strides
    s.projected.data = projected.get();
    s.out.data = out.get();
    s.cache.data = cache.get();
    s.slots.data = slots.get();
    s.block_table.data = block_table.get();
    s.lengths.data = lengths.get();
    s.totals.data = totals.get();
    for (TensorView* v : {&s.projected, &s.out, &s.cache, &s.slots, &s.block_table, &s.lengths, &s.totals}) {
      v->memory = Memory::kDevice;
    }
    return s;
  }
};

// Buffers of a fixed size for a sequence of steps with changing lengths.
struct StepSequence {
  const synth::SyntheticLayer& layer;
  int size, interleave, heads, q, requests, max_length;
  int64_t num_pages() const { return int64_t{requests} * max_pages() + 1; }
  int max_pages() const { return (max_length + kPageSize - 1) / kPageSize; }
  // Random lengths in [0, max_length], or the given ones.
  std::vector<RankStep> make(uint64_t seed, std::vector<int> lengths = {}) const {
    synth::StepSpec spec;
    spec.q = q;
    spec.lengths = lengths.empty() ? synth::random_lengths(requests, 0, max_length, seed) : lengths;
    spec.max_pages = max_pages();
    spec.cache_fill = synth::CacheFill::kFast;
    spec.seed = seed;
    return shard_all(synth::make_step(layer, spec), size, interleave, heads, num_pages());
  }
};

}  // namespace mla::test
