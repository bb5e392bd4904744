#!/usr/bin/env bash
# Where one kernel's warps wait, instruction by instruction: Nsight Compute's warp-state sampling of the first launch
# of KERNEL (a regex on its function name) in COMMAND, printed as the TOP instructions by stall samples with their SASS
# and the kernel's duration, memory throughput and stall breakdown. For a device call (scripts/device_plan.sh `run`
# line); ncu flushes the caches before the launch and locks the clocks at base, so times are longer than a bench's.
#   scripts/ncu_stalls.sh KERNEL OUTDIR COMMAND...
#   e.g. scripts/ncu_stalls.sh fused_query_kernel $OUT/ncu-h12 build-main/bench/query_bench --heads 12 --rows 1
# OUTDIR gets report.ncu-rep, details.txt (every section), raw.txt (every metric) and source.csv (per-instruction
# metrics); TOP (default 30). Also printed: each execution pipe's share of its peak over the active cycles (the raw
# sm__inst_executed_pipe_* / sm__pipe_* metrics the full set collects), to see which unit bounds a kernel (e.g. the
# conversion unit: src/core/README.md next step 14).
set -euo pipefail
(($# >= 3)) || { echo "usage: scripts/ncu_stalls.sh KERNEL OUTDIR COMMAND..." >&2; exit 2; }
kernel=$1 outdir=$2
shift 2
command -v ncu >/dev/null || { echo "ncu_stalls: no ncu on this machine" >&2; exit 1; }
mkdir -p "$outdir"
ncu --set full --import-source no -k "regex:$kernel" -c 1 -f -o "$outdir/report" "$@" >"$outdir/run.log" 2>&1 ||
  { tail -20 "$outdir/run.log" >&2; exit 1; }
ncu -i "$outdir/report.ncu-rep" --page details >"$outdir/details.txt"
ncu -i "$outdir/report.ncu-rep" --page source --print-source sass --csv >"$outdir/source.csv"
ncu -i "$outdir/report.ncu-rep" --page raw >"$outdir/raw.txt"
grep -E "^  [a-z_]|Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Eligible Warps|Warp Cycles Per Issued|Registers Per|Dynamic Shared|Grid Size|Cluster Size" \
  "$outdir/details.txt" | head -20 || true
python3 - "$outdir/source.csv" "${TOP:-30}" <<'EOF'
import csv, sys
path, top = sys.argv[1], int(sys.argv[2])
rows = list(csv.reader(open(path, newline='')))
# The header row is the one naming the sampling columns; ncu may print a kernel-name line before it.
head_at = next((i for i, r in enumerate(rows) if any('Warp Stall Sampling' in c for c in r)), None)
if head_at is None:
    sys.exit(f"ncu_stalls: no 'Warp Stall Sampling' column in {path}; its first rows: {rows[:2]}")
head, body = rows[head_at], [r for r in rows[head_at + 1:] if len(r) == len(rows[head_at])]
def col(name):
    return next((i for i, c in enumerate(head) if c.strip() == name), None)
src = col('Source')
addr = col('Address')
allc = col('Warp Stall Sampling (All Samples)')
def num(s):
    try:
        return float(s.replace(',', ''))
    except ValueError:
        return 0.0
total = sum(num(r[allc]) for r in body) or 1.0
print(f"\n{len(body)} SASS instructions, {total:.0f} stall samples; top {top} (share of all samples, address, SASS):")
order = sorted(range(len(body)), key=lambda i: -num(body[i][allc]))
for i in order[:top]:
    r = body[i]
    print(f"{100 * num(r[allc]) / total:5.1f}%  line {i:5d}  {r[addr] if addr is not None else '':>6}  {r[src].strip()[:90]}")
EOF
echo
echo "Execution pipes, % of peak over active cycles (raw metrics; the highest first):"
grep -E "sm__(inst_executed_pipe|pipe)_[a-z0-9_]+\.(avg|sum)\.pct_of_peak_sustained_active" "$outdir/raw.txt" |
  awk '{v = $NF; gsub(",", "", v); print v, $1}' | sort -t' ' -k1,1 -g -r | head -n 24 || true
