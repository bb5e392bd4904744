#!/usr/bin/env bash
# Before/after measurement of a kernel change in one device call (DESIGN.md §6): both binaries in the
# same call, their runs interleaved, so clocks and the machine are the same.
#   scripts/bench_compare.sh build-base REV BENCH...  here: build REV's BENCH (core_bench, query_bench,
#                                                     value_bench, step_bench) in a git worktree
#                                                     (build-base-src/, git-ignored), strip to $BUILD_DIR/base/
#   scripts/bench_compare.sh run BENCH [args]        on the device: every GPU test (scripts/gpu_check.sh tests;
#                                                     TESTS=0 skips them), then base and new BENCH with the same
#                                                     args, alternately, RUNS times (default 2); a before/after
#                                                     table of the timing columns last
# BUILD_DIR (default build-final) holds the binaries to run; BASE (default $BUILD_DIR/base) the base ones, so a
# chain of builds (main -> branch A -> branch B) compares each against the previous without copies; OUT
# (default ./gpu-out) receives the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-final}
mode=${1:-}
shift || true
usage="usage: scripts/bench_compare.sh {build-base REV BENCH... | run BENCH [BENCH args]}"
case "$mode" in
  build-base)
    rev=${1:?$usage}
    shift
    (($# > 0)) || { echo "$usage" >&2; exit 2; }
    src=build-base-src
    git worktree remove --force "$src" 2>/dev/null
    git worktree add --detach "$src" "$rev" >/dev/null || exit 1
    ln -sfn "$PWD/.deps" "$src/.deps"  # the same pinned CUTLASS headers (scripts/setup.sh)
    cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null || exit 1
    cmake --build "$src/build" -j "${JOBS:-$(nproc)}" --target "$@" || exit 1
    mkdir -p "$build/base"
    for b in "$@"; do strip -o "$build/base/$b" "$src/build/bench/$b" || exit 1; done
    echo "base $* of $(git rev-parse --short "$rev") in $build/base/ (remove the worktree: git worktree remove --force $src)"
    ;;
  run)
    bench=${1:?$usage}
    shift
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    [[ ${TESTS:-1} == 0 ]] || BUILD_DIR="$build" OUT="$out" scripts/gpu_check.sh tests  # a summary table
    runs=${RUNS:-2}
    for ((i = 1; i <= runs; ++i)); do
      for side in base bench; do
        binary="$build/bench/$bench"
        [[ $side == base ]] && binary="${BASE:-$build/base}/$bench"
        timeout 300 "$binary" "$@" > "$out/${bench}_${side}_$i.log" 2>&1
        echo "$side $bench run $i rc=$?"
      done
    done
    python3 - "$bench" "$out" "$runs" <<'PY'
import statistics, sys
bench, out, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
# Per benchmark: the table columns (1-based after the leading '|') naming a shape, and the µs columns.
columns = {"core_bench": ([1, 2], [8]), "query_bench": ([1, 2], [3]), "value_bench": ([1, 2], [3, 4, 5]),
           "step_bench": ([1, 2, 3, 4], [5])}
if bench not in columns:
    sys.exit(f"bench_compare: no table layout for {bench} (known: {', '.join(columns)})")
key_cols, time_cols = columns[bench]
# value_bench also names the kernel its plan picks (column `planned`): that kernel's µs is one more column, so an A/B of
# a plan rule shows the change (the kernels' own columns stay the same when only the choice moves).
planned_column = bench == "value_bench"
def rows(side, run):
    table, header = {}, []
    for line in open(f"{out}/{bench}_{side}_{run}.log", encoding="utf-8", errors="replace"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and not cells[0][:1].isdigit() and "planned" in cells:
            header = cells
        if not line.startswith("| ") or not cells[0][:1].isdigit():
            continue
        try:
            times = [float(cells[c - 1]) for c in time_cols]
            if planned_column:
                times.append(float(cells[header.index(cells[header.index("planned")] + " µs")]))
            table[" | ".join(cells[c - 1] for c in key_cols)] = times
        except (ValueError, IndexError):
            continue  # a line of another table
    return table
base = [rows("base", r) for r in range(1, runs + 1)]
new = [rows("bench", r) for r in range(1, runs + 1)]
print(f"\n{bench}: µs per column, base runs / new runs, base/new of the medians"
      + ("; the last column: the planned kernel's" if planned_column else ""))
for shape, _ in new[0].items():
    cells = []
    for k in range(len(time_cols) + planned_column):
        b = [t[shape][k] for t in base if shape in t]
        n = [t[shape][k] for t in new if shape in t]
        ratio = statistics.median(b) / statistics.median(n) if b and n and statistics.median(n) > 0 else float("nan")
        cells.append(f"{' '.join(f'{x:.2f}' for x in b)} / {' '.join(f'{x:.2f}' for x in n)} = {ratio:.3f}")
    print(f"{shape} | " + " | ".join(cells))
PY
    ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
