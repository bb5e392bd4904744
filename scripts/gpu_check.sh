#!/usr/bin/env bash
# One device call: every GPU test binary, the main job, the PyTorch binding's tests, then the
# benchmarks (core, value, DCP, whole step), from binaries built here (BUILD_DIR, default build). Results go to OUT (default
# ./gpu-out): the logs packed into logs.tgz (the device tool returns at most 8 files), the step
# benchmark's table, CSV and plot beside it; a short table of test results is printed last.
#   scripts/gpu_check.sh [tests|python|bench|all]
# FAMILIES (tests mode): the GPU test families to run, e.g. "core pipeline dcp value" (default: every
# mla_gpu_*_tests binary, then mla_tests).
set -uo pipefail
build=${BUILD_DIR:-build}
out=${OUT:-gpu-out}
mode=${1:-all}
logs="$out/logs"
mkdir -p "$logs"
summary=()
if [[ $mode == tests || $mode == all ]]; then
  tests=("$build"/tests/mla_gpu_*_tests "$build"/tests/mla_tests)
  if [[ -n ${FAMILIES:-} ]]; then
    tests=()
    for family in $FAMILIES; do tests+=("$build/tests/mla_gpu_${family}_tests"); done
  fi
  for t in "${tests[@]}"; do
    name=$(basename "$t")
    if [[ ! -x $t ]]; then  # a FAMILIES name without a binary: say so instead of a bare rc=127
      summary+=("$(printf '%-26s missing: no %s (FAMILIES=%s)' "$name" "$t" "${FAMILIES:-}")")
      continue
    fi
    start=$SECONDS
    timeout "${TEST_TIMEOUT:-300}" "$t" --gtest_brief=1 > "$logs/$name.log" 2>&1  # a hang cannot eat the device call
    rc=$?
    summary+=("$(printf '%-26s rc=%d %4d s  %s' "$name" $rc $((SECONDS - start)) \
                 "$(grep -E '^\[  (PASSED|FAILED)  \]' "$logs/$name.log" | tr '\n' ' ')")")
  done
  "$build"/mla-decode run > "$logs/mla-decode-run.log" 2>&1
  summary+=("$(printf '%-26s rc=%d' mla-decode-run $?)")
fi
if [[ $mode == python || $mode == all ]]; then
  # The binding needs PIC libraries and the device's torch: its own build dir (TORCH_BUILD_DIR), so the
  # main build is untouched. Configure finds torch through python3; pytest prints every skip reason and
  # the output of passed tests too (-rP: each step's worst error, the DCP ranks' summaries).
  # A binding built elsewhere against the same torch (MLA_DECODE_TORCH_LIBRARY) skips the build.
  torch_build=${TORCH_BUILD_DIR:-build-torch}
  { if [[ -z ${MLA_DECODE_TORCH_LIBRARY:-} ]]; then
      cmake -S . -B "$torch_build" -G Ninja -DMLA_BUILD_TORCH=ON -DMLA_BUILD_TESTS=OFF -DMLA_BUILD_BENCH=OFF \
        && cmake --build "$torch_build" --target mla_decode_torch \
        && export MLA_DECODE_TORCH_LIBRARY="$torch_build/python/libmla_decode_torch.so"
    fi && python3 -m pytest -rsP -v python/tests
  } > "$logs/pytest.log" 2>&1
  summary+=("$(printf '%-26s rc=%d  %s' pytest $? "$(tail -n 1 "$logs/pytest.log")")")
fi
if [[ $mode == bench || $mode == all ]]; then
  # The core, value and DCP benchmarks are short; the whole-step sweep takes ~3 minutes (STEP_BENCH=0 skips it).
  "$build"/bench/core_bench --out "$out/core.md" > "$logs/core_bench.log" 2>&1
  summary+=("$(printf '%-26s rc=%d' core_bench $?)")
  "$build"/bench/value_bench --out "$out/value.md" > "$logs/value_bench.log" 2>&1
  summary+=("$(printf '%-26s rc=%d' value_bench $?)")
  "$build"/bench/dcp_bench > "$out/dcp_bench.md" 2>&1
  summary+=("$(printf '%-26s rc=%d' dcp_bench $?)")
  if [[ ${STEP_BENCH:-1} == 1 ]]; then
    "$build"/bench/step_bench --csv "$out/step.csv" > "$out/step_bench.md" 2>&1
    summary+=("$(printf '%-26s rc=%d' step_bench $?)")
    # The plot's title names the GPU it ran on (plot_step.py's default says H200).
    device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | sed 's/NVIDIA //')
    python3 bench/plot_step.py "$out/step.csv" "$out/step.png" "${device:-H200}" > "$logs/plot.log" 2>&1
  fi
fi
tail -n 12 "$logs/mla-decode-run.log" 2>/dev/null
tar -czf "$out/logs.tgz" -C "$out" logs && rm -rf "$logs"
printf '%s\n' "${summary[@]}"
