#include "cli_args.h"

#include <charconv>
#include <limits>

namespace mla::cli {
namespace {

// The value of `flag` as an integer in [lo, hi]; the whole string must be the number.
template <class T>
T parse_integer(const std::string& flag, const std::string& text, T lo, T hi) {
  T value{};
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end || value < lo || value > hi) {
    throw UsageError(flag + ": expected an integer in " + std::to_string(lo) + ".." + std::to_string(hi) +
                     ", got '" + text + "'");
  }
  return value;
}

bool is_help(const std::string& arg) { return arg == "--help" || arg == "-h"; }

RunOptions parse_run(const std::vector<std::string>& args) {
  RunOptions run;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + arg + "'");
    std::string flag = arg, value;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    } else {
      const bool known = flag == "--heads" || flag == "--batch" || flag == "--context" || flag == "--q" ||
                         flag == "--seed" || flag == "--steps";
      if (!known) throw UsageError("unknown flag '" + flag + "'");
      if (i + 1 == args.size()) throw UsageError(flag + ": missing value");
      value = args[++i];
    }
    if (flag == "--heads") {
      run.heads = parse_integer(flag, value, 1, 128);
    } else if (flag == "--batch") {
      run.batch = parse_integer(flag, value, 1, kMaxBatch);
    } else if (flag == "--context") {
      run.context = parse_integer(flag, value, 0, kMaxContext);
    } else if (flag == "--q") {
      run.q = parse_integer(flag, value, 1, 8);
    } else if (flag == "--seed") {
      run.seed = parse_integer<uint64_t>(flag, value, 0, std::numeric_limits<uint64_t>::max());
    } else if (flag == "--steps") {
      run.steps = parse_integer(flag, value, 1, kMaxSteps);
    } else {
      throw UsageError("unknown flag '" + flag + "'");
    }
  }
  return run;
}

}  // namespace

Invocation parse_args(const std::vector<std::string>& args) {
  Invocation invocation;
  if (args.empty()) throw UsageError("missing command (try 'run')");
  for (const std::string& arg : args) {
    if (is_help(arg)) return invocation;  // kHelp wins over everything else on the line
  }
  const std::string& command = args[0];
  if (command == "help") return invocation;
  if (command != "run") throw UsageError("unknown command '" + command + "' (try 'run')");
  invocation.command = Command::kRun;
  invocation.run = parse_run(std::vector<std::string>(args.begin() + 1, args.end()));
  return invocation;
}

std::string usage() {
  return "usage: mla-decode run [options]\n"
         "       mla-decode --help\n"
         "\n"
         "Runs the decode step of one synthetic Kimi K3 MLA layer (seeded random weights, a paged FP8\n"
         "KV cache, a batch of requests) and prints what it computed.\n"
         "\n"
         "options of 'run':\n"
         "  --heads N     heads on this GPU, 1..128 (default 12: K3 at TP8)\n"
         "  --batch B     requests, 1..4096 (default 4); rows = B * Q\n"
         "  --context L   tokens in each request's cache including the Q new ones, 0..131072 (default 4096)\n"
         "  --q Q         rows per request (1 + draft length), 1..8 (default 1)\n"
         "  --seed S      seed of the synthetic layer and step (default 1)\n"
         "  --steps N     times the step runs; the median time is reported, 1..100000 (default 1)\n"
         "\n"
         "Without a CUDA device the CPU reference runs, on a case clamped to finish in seconds.\n"
         "Exit codes: 0 success, 1 runtime error, 2 bad command line.\n";
}

}  // namespace mla::cli
