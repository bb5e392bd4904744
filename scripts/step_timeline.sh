#!/usr/bin/env bash
# Where a whole step's time goes: step_bench --fused-only under Nsight Systems with per-node CUDA-graph tracing, then
# bench/step_timeline.py prints, per kernel of the step, when its first CTA started and when its last one ended,
# relative to the step's query kernel (median over the traced steps). With programmatic dependent launch a kernel starts
# before its producer ends; the gap between a producer's end and its dependent's end is what the dependent added.
# Device only (needs nsys; the tracing adds a little to each kernel, so compare the phases with each other).
#   scripts/step_timeline.sh [BUILD_DIR] [SHAPE...]   e.g. scripts/step_timeline.sh build-main 1x4096x12x1 4x4096x96x1
set -uo pipefail
build=${1:-build}
shift || true
shapes=("$@")
((${#shapes[@]})) || shapes=(1x4096x12x1 4x4096x12x1 1x4096x96x1 16x4096x12x4)
nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
[[ -n $nsys ]] || { echo "step_timeline: no nsys on this machine" >&2; exit 1; }
work=$(mktemp -d)
for s in "${shapes[@]}"; do
  echo "== $s"
  "$nsys" profile --trace=cuda --cuda-graph-trace=node --sample=none --cpuctxsw=none -o "$work/$s" -f true \
    "$build/bench/step_bench" --fused-only --shape "$s" > "$work/$s.bench.log" 2>&1 ||
    { echo "nsys failed:"; tail -5 "$work/$s.bench.log"; continue; }
  grep -E "^\| *[0-9]" "$work/$s.bench.log" | head -1
  "$nsys" stats --report cuda_gpu_trace --format csv --output "$work/$s" "$work/$s.nsys-rep" > /dev/null 2>&1
  python3 "$(dirname "$0")/../bench/step_timeline.py" "$work/${s}_cuda_gpu_trace.csv"
done
rm -rf "$work"
