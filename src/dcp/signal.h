// The epoch signal between the DCP stages of a non-stream-ordered group (include/mla/dcp.h,
// DcpPeerTable): one tiny kernel (1 block of 32 threads) that publishes this rank's epoch into one
// signal word of every rank's block and waits until D words of its own block reach the epoch.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>

#include "mla/dcp.h"

namespace mla::dcp {

struct SignalArgs {
  uint32_t* epoch = nullptr;  // this rank's epoch word of the parity (own block)
  bool advance = false;       // add 1 to it first (the signal after the query; the core's reuses it)
  std::array<uint32_t*, kMaxDcpRanks> targets{};  // rank p's signal word this rank writes, p < size
  const uint32_t* wait = nullptr;                 // size words of the own block to wait on
  int size = 0;                                   // D
  int rank = 0;                                   // for the timeout message
  int64_t timeout_ns = 0;                         // > 0: trap after spinning this long
};

// Launches the signal-and-wait kernel on `stream` (launch only; graph-capturable: the epoch lives in
// device memory and is advanced by the kernel, so each replay counts a step).
void launch_signal_wait(const SignalArgs& args, cudaStream_t stream);

}  // namespace mla::dcp
