// Device-side helpers of the DCP GPU tests (in-process and multi-process): a rank step's tensors on
// the device (test::DeviceStep), and a sequence of rank steps with fixed buffer sizes and changing lengths.
#pragma once

#include <algorithm>
#include <vector>

#include "dcp_test_util.h"
#include "gpu_test_util.h"
#include "mla/mla.h"
#include "synthetic.h"

namespace mla::test {

// A rank step's tensors on the device; later steps must have the same sizes.
using DeviceRankStep = DeviceStep<RankStep>;

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
