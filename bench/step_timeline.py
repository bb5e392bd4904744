#!/usr/bin/env python3
"""Summarises an Nsight Systems cuda_gpu_trace CSV of step_bench --fused-only (scripts/step_timeline.sh): the step's
kernels in launch order, each one's start and end relative to the start of its step's query kernel, median over the
steps of the trace's last graph replays (the first replays warm up).

  python3 bench/step_timeline.py TRACE.csv
"""
import csv
import statistics
import sys

# The first kernel of a step: the fused query kernel, or the GEMM path's norm kernel.
STEP_STARTS = ("fused_query_kernel", "gemm_norm_kernel")
OURS = {"fused_query_kernel", "gemm_norm_kernel", "gemm_kernel", "gemm_absorb_kernel", "core_split_kernel",
        "core_wgmma_pp_kernel", "core_combine_kernel", "value_kernel", "value_mma_kernel"}


def short_name(name):
    """'void mla::core::core_split_kernel<...>(Params)' -> 'core_split_kernel'."""
    base = name.split("(")[0].split("<")[0].strip()
    return base.split()[-1].split("::")[-1] if base else name


def main(path):
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            name = short_name(r.get("Name", ""))
            if name not in OURS:
                continue  # the ceilings' copies and cuBLAS GEMMs, memsets
            start = int(r["Start (ns)"])
            rows.append((start, start + int(r["Duration (ns)"]), name))
    rows.sort()
    steps, current = [], None
    for start, end, name in rows:
        if name in STEP_STARTS:
            current = []
            steps.append(current)
        if current is not None:
            current.append((start, end, name))
    steps = [s for s in steps if s]
    if len(steps) < 4:
        print(f"step_timeline: {len(steps)} steps in {path}")
        return
    periods = [b[0][0] - a[0][0] for a, b in zip(steps, steps[1:])]
    layout = [k[2] for k in steps[-1]]
    tail = [s for s in steps[len(steps) // 2:] if [k[2] for k in s] == layout]
    period = statistics.median(periods[len(steps) // 2:]) / 1e3
    print(f"  {len(tail)} steps of {len(steps)}; step period median {period:.2f} us (includes the gaps between graph "
          f"replays)")
    print(f"  {'kernel':<24} {'start':>7} {'end':>7} {'span':>7} {'end - previous end':>19}   us")
    t0 = [s[0][0] for s in tail]  # each step's query start
    prev_end = None
    for i, name in enumerate(layout):
        start = statistics.median(s[i][0] - z for s, z in zip(tail, t0)) / 1e3
        end = statistics.median(s[i][1] - z for s, z in zip(tail, t0)) / 1e3
        span = statistics.median(s[i][1] - s[i][0] for s in tail) / 1e3
        added = "" if prev_end is None else f"{end - prev_end:19.2f}"
        print(f"  {name:<24} {start:7.2f} {end:7.2f} {span:7.2f} {added:>19}")
        prev_end = end
    within = statistics.median(s[-1][1] - s[0][0] for s in tail) / 1e3
    # The next step's query start against this step's last end: what the graph leaves between steps.
    gaps = [b[0][0] - a[-1][1] for a, b in zip(steps, steps[1:]) if a in tail]
    print(f"  first start to last end {within:.2f} us; last end to the next step's query start, median "
          f"{statistics.median(gaps) / 1e3:.2f} us (negative: the next query started early under PDL)")


if __name__ == "__main__":
    main(sys.argv[1])
