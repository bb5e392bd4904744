#!/usr/bin/env python3
"""bench/step_timeline.py on a made-up Nsight Systems trace whose answer is known: 40 steps of a query kernel, a split
kernel starting under it (PDL), a combine and a value kernel, with a cuBLAS kernel before them and a memset inside each
step, both to be left out. The summary must give each kernel's start, end and span relative to its step's query
kernel, and the step period.

usage: step_timeline_test.py STEP_TIMELINE_PY
"""
import os
import subprocess
import sys
import tempfile

# (name as nsys prints it, start after the step's query start, duration), ns.
STEP = [
    ("void mla::query::fused_query_kernel<8, 8, false>(mla::query::QueryParams)", 0, 7000),
    ("void mla::core::core_split_kernel<2, 2, 0>(mla::core::CoreParams)", 3000, 9500),
    ("void mla::core::core_combine_kernel<0>(mla::core::CombineParams)", 11000, 3000),
    ("void mla::value::value_kernel<false, false>(mla::value::ValueParams)", 13000, 4250),
]
PERIOD_NS = 20500


def main():
    script = sys.argv[1]
    with tempfile.TemporaryDirectory() as work:
        trace = os.path.join(work, "trace.csv")
        with open(trace, "w") as f:
            f.write('"Start (ns)","Duration (ns)","Name"\n')
            f.write('900000,5000,"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"\n')  # a ceiling's GEMM
            f.write('950000,1000,"[CUDA memset]"\n')
            for i in range(40):
                t0 = 1_000_000 + i * PERIOD_NS
                for name, offset, duration in STEP:
                    f.write(f'{t0 + offset},{duration},"{name}"\n')
                f.write(f'{t0 + 12000},500,"[CUDA memset]"\n')  # another stream's work inside the step
        out = subprocess.run([sys.executable, script, trace], capture_output=True, text=True, check=True).stdout
    print(out)
    lines = out.splitlines()
    expect = {  # kernel -> start, end, span, end - previous end (us, as printed)
        "fused_query_kernel": ["0.00", "7.00", "7.00"],
        "core_split_kernel": ["3.00", "12.50", "9.50", "5.50"],
        "core_combine_kernel": ["11.00", "14.00", "3.00", "1.50"],
        "value_kernel": ["13.00", "17.25", "4.25", "3.25"],
    }
    failures = []
    for kernel, fields in expect.items():
        row = next((l.split() for l in lines if l.split()[:1] == [kernel]), None)
        if row is None or row[1:] != fields:
            failures.append(f"{kernel}: expected {fields}, got {row}")
    if "20 steps of 40; step period median 20.50 us" not in out:
        failures.append("the step count or period line is wrong")
    if "first start to last end 17.25 us; last end to the next step's query start, median 3.25 us" not in out:
        failures.append("the closing line is wrong")
    if "gemm" in out or "memset" in out:
        failures.append("a kernel that is not the step's was counted")
    for f in failures:
        print("FAILED: " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
