#!/usr/bin/env bash
# Before/after measurement of an attention-core change in one device call (DESIGN.md §6: both binaries
# in the same call, so clocks and the machine are the same).
#   scripts/core_compare.sh build-base REV   here: build REV's core_bench in a git worktree (build-base-src/,
#                                            git-ignored) and strip it to $BUILD_DIR/base/core_bench
#   scripts/core_compare.sh run [args]       on the device: every GPU test (scripts/gpu_check.sh tests), then
#                                            $BUILD_DIR/bench/core_bench and the base one with the same
#                                            core_bench args; a before/after table last
# BUILD_DIR (default build-final) holds the binaries to run; OUT (default ./gpu-out) receives the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-final}
mode=${1:-}
shift || true
case "$mode" in
  build-base)
    rev=${1:?usage: scripts/core_compare.sh build-base REV}
    src=build-base-src
    git worktree remove --force "$src" 2>/dev/null
    git worktree add --detach "$src" "$rev" >/dev/null || exit 1
    ln -sfn "$PWD/.deps" "$src/.deps"  # the same pinned CUTLASS headers (scripts/setup.sh)
    cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null || exit 1
    cmake --build "$src/build" -j "${JOBS:-$(nproc)}" --target core_bench || exit 1
    mkdir -p "$build/base"
    strip -o "$build/base/core_bench" "$src/build/bench/core_bench"
    echo "base core_bench of $(git rev-parse --short "$rev") in $build/base/core_bench"
    ;;
  run)
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    BUILD_DIR="$build" OUT="$out" scripts/gpu_check.sh tests  # every GPU test binary, a summary table
    timeout 300 "$build/bench/core_bench" --out "$out/core_new.md" "$@" > "$out/core_new.log" 2>&1
    echo "new core_bench rc=$?"
    timeout 300 "$build/base/core_bench" --out "$out/core_base.md" "$@" > "$out/core_base.log" 2>&1
    echo "base core_bench rc=$?"
    # Rows of the two tables side by side: shape, variant, base µs, new µs, new % of copy bandwidth.
    paste -d'|' <(grep -E '^\| [0-9]' "$out/core_base.md" | cut -d'|' -f2,3,9) \
                <(grep -E '^\| [0-9]' "$out/core_new.md" | cut -d'|' -f9,11) |
      awk -F'|' 'BEGIN { print "shape | variant | base us | new us | new % copy BW | base/new" }
                 { printf "%s |%s |%s |%s |%s | %.3f\n", $1, $2, $3, $4, $5, $3 / $4 }'
    ;;
  *) echo "usage: scripts/core_compare.sh {build-base REV | run [core_bench args]}" >&2; exit 2 ;;
esac
