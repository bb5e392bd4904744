#!/usr/bin/env bash
# One entry point for a fresh machine with the CUDA toolkit:
#   scripts/dev.sh run [mla-decode run flags]   set up, build, run the main job
#   scripts/dev.sh test                          set up, build, run the whole test suite
#   scripts/dev.sh build                         set up and build only
#   scripts/dev.sh sanitize                      the CPU test binary under AddressSanitizer + UBSan
#                                                (SANITIZE_BUILD_DIR, default build-sanitize)
# BUILD_DIR (default build) and JOBS (default: all cores) may be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-build}
shift || true

scripts/setup.sh
build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}

if [[ $mode == sanitize ]]; then
  # Host code only (validation, plans, the reference, bootstrap, record packing): nvcc's device code is not
  # instrumented. Any report fails the run (-fno-sanitize-recover, halt_on_error).
  sanitize_dir=${SANITIZE_BUILD_DIR:-build-sanitize}
  flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -O1"
  cmake -S . -B "$sanitize_dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMLA_BUILD_BENCH=OFF -DMLA_BUILD_TORCH=OFF \
        -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
  cmake --build "$sanitize_dir" -j "$jobs" --target mla_tests
  # protect_shadow_gap=0: the CUDA runtime maps memory where ASan's shadow gap would be.
  ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$sanitize_dir/tests/mla_tests" --gtest_brief=1 "$@"
  exit
fi

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build_dir" -j "$jobs"

case "$mode" in
  build) ;;
  run) "$build_dir/mla-decode" run "$@" ;;
  test) ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" "$@" ;;
  *) echo "usage: scripts/dev.sh {run|test|build|sanitize} [args]" >&2; exit 2 ;;
esac
