#!/usr/bin/env bash
# One device call: every GPU test binary, the main job, then the benchmarks, from binaries built
# here (BUILD_DIR, default build). Logs and results go to OUT (default ./gpu-out); a short table of
# test results is printed last.
#   scripts/gpu_check.sh [tests|bench|all]
set -uo pipefail
build=${BUILD_DIR:-build}
out=${OUT:-gpu-out}
mode=${1:-all}
mkdir -p "$out"
summary=()
if [[ $mode == tests || $mode == all ]]; then
  for t in "$build"/tests/mla_gpu_*_tests "$build"/tests/mla_tests; do
    name=$(basename "$t")
    "$t" --gtest_brief=1 > "$out/$name.log" 2>&1
    rc=$?
    summary+=("$(printf '%-26s rc=%d  %s' "$name" $rc "$(grep -E '^\[  (PASSED|FAILED)  \]' "$out/$name.log" | tr '\n' ' ')")")
  done
  "$build"/mla-decode run > "$out/mla-decode-run.log" 2>&1
  summary+=("$(printf '%-26s rc=%d' mla-decode-run $?)")
fi
if [[ $mode == bench || $mode == all ]]; then
  "$build"/bench/step_bench --csv "$out/step.csv" > "$out/step_bench.md" 2>&1
  summary+=("$(printf '%-26s rc=%d' step_bench $?)")
  python3 bench/plot_step.py "$out/step.csv" "$out/step.png" > "$out/plot.log" 2>&1
fi
tail -n 12 "$out/mla-decode-run.log" 2>/dev/null
printf '%s\n' "${summary[@]}"
