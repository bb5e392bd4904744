// Command-line arguments of the `mla-decode` CLI, parsed by a plain function so tests can drive it.
//
//   mla-decode --help
//   mla-decode run [--heads N] [--batch B] [--context L] [--q Q] [--seed S] [--steps N]
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mla::cli {

// A command line the CLI cannot run: the message says what was wrong; the CLI exits with code 2.
class UsageError : public std::runtime_error {
 public:
  explicit UsageError(const std::string& message) : std::runtime_error(message) {}
};

// `mla-decode run`: one synthetic K3 decode step (DESIGN.md), repeated `steps` times.
struct RunOptions {
  int heads = 12;        // H on this GPU, 1..128 (K3 at TP8: 12)
  int batch = 4;         // requests; rows = batch * q
  int context = 4096;    // tokens in each request's cache, including this step's q new ones
  int q = 1;             // rows per request (1 + draft length), 1..8
  uint64_t seed = 1;     // seed of the synthetic layer and step
  int steps = 1;         // times the step runs (timing reports the median)
};

enum class Command { kHelp, kRun };

struct Invocation {
  Command command = Command::kHelp;
  RunOptions run;
};

// Bounds the parser enforces (and the usage text states).
inline constexpr int kMaxBatch = 4096;
inline constexpr int kMaxContext = 1 << 17;
inline constexpr int kMaxSteps = 100000;

// `args` are the arguments after the program name. Accepts `--flag value` and `--flag=value`;
// `--help` / `-h` anywhere (or `help` as the command) asks for the usage text. Throws UsageError for
// a missing or unknown command, an unknown flag, a missing value and a value that is not an integer
// in range.
Invocation parse_args(const std::vector<std::string>& args);

// The --help text.
std::string usage();

}  // namespace mla::cli
