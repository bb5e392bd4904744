#!/usr/bin/env bash
# Each attention-core kernel's own duration (split kernel, combine) under ncu, at the step's 128k plan
# (core_bench --max-context 131072): where a batch-1 core's time goes. ncu flushes the caches and fixes the clocks, so
# the numbers are slower than in a graph; compare them with each other. Device only.
#   scripts/core_kernel_times.sh [BUILD_DIR] [SHAPE...]     e.g. scripts/core_kernel_times.sh build-main 1x4096x12x1
set -uo pipefail
build=${1:-build}
shift || true
shapes=("$@")
((${#shapes[@]})) || shapes=(1x4096x12x1 1x32768x12x1 1x131072x16x1 4x4096x12x1 16x4096x12x4)
for s in "${shapes[@]}"; do
  echo "== $s"
  ncu --kernel-name-base demangled -k regex:"core_" -c 4 \
    --metrics gpu__time_duration.sum,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active \
    "$build/bench/core_bench" --shape "$s" --max-context 131072 2>&1 |
    grep -v "^==PROF==" | grep -E "core_|duration|grid_size|warps_active" | cut -c1-160
done
