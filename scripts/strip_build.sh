#!/usr/bin/env bash
# Copies a build's GPU test binaries, benchmarks and mla-decode, stripped, into DEST in the layout that
# scripts/gpu_check.sh and scripts/bench_compare.sh expect as BUILD_DIR (DEST/tests, DEST/bench,
# DEST/mla-decode), so a device call can carry them (the device tool carries at most 64 MiB of ignored
# paths: pack several DESTs with `tar -cJf`).
#   scripts/strip_build.sh [BUILD (default build)] DEST
#   scripts/strip_build.sh --rev REV DEST     # REV built first in a git worktree (build-rev-src/, git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/strip_build.sh [BUILD | --rev REV] DEST"
if [[ ${1:-} == --rev ]]; then
  (($# == 3)) || { echo "$usage" >&2; exit 2; }
  rev=$2 dest=$3 src=build-rev-src
  git worktree remove --force "$src" 2>/dev/null || true
  git worktree add --detach "$src" "$rev" >/dev/null
  ln -sfn "$PWD/.deps" "$src/.deps"  # the same pinned dependencies (scripts/setup.sh)
  cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$src/build" -j "${JOBS:-$(nproc)}"
  build=$src/build
else
  (($# == 1 || $# == 2)) || { echo "$usage" >&2; exit 2; }
  build=build dest=$1
  (($# == 2)) && build=$1 dest=$2
fi
[[ -d $build/tests ]] || { echo "strip_build: no $build/tests (build first: scripts/dev.sh build)" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest/tests" "$dest/bench"
for t in "$build"/tests/mla_gpu_*_tests "$build"/tests/mla_tests; do strip -o "$dest/tests/$(basename "$t")" "$t"; done
for b in "$build"/bench/*; do
  [[ -f $b && -x $b ]] && strip -o "$dest/bench/$(basename "$b")" "$b"
done
strip -o "$dest/mla-decode" "$build/mla-decode"
# The revision only where this script built it: a given BUILD may be of any checkout.
from="from $build"
[[ -n ${src:-} ]] && from=$(git -C "$src" rev-parse --short HEAD)
echo "strip_build: $(du -sh "$dest" | cut -f1) in $dest ($from)"
