#!/usr/bin/env bash
# One entry point for a fresh machine with the CUDA toolkit:
#   scripts/dev.sh run [mla-decode run flags]   set up, build, run the main job
#   scripts/dev.sh test                          set up, build, run the whole test suite
#   scripts/dev.sh build                         set up and build only
# BUILD_DIR (default build) and JOBS (default: all cores) may be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-build}
shift || true

scripts/setup.sh
build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build_dir" -j "$jobs"

case "$mode" in
  build) ;;
  run) "$build_dir/mla-decode" run "$@" ;;
  test) ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" "$@" ;;
  *) echo "usage: scripts/dev.sh {run|test|build} [args]" >&2; exit 2 ;;
esac
