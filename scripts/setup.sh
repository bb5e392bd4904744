#!/usr/bin/env bash
# Installs what the build needs beyond the CUDA toolkit into project-local, git-ignored folders:
#   .deps/cutlass  CUTLASS/CuTe C++ headers from the pinned PyPI package nvidia-cutlass
# and, where the machine lets us, ccache (optional: the build works without it). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

CUTLASS_VERSION=4.2.0.0
CUTLASS_DIR=.deps/cutlass
stamp="$CUTLASS_DIR/.version"

if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$CUTLASS_VERSION" ]]; then
  echo "setup: installing nvidia-cutlass==$CUTLASS_VERSION headers into $CUTLASS_DIR"
  rm -rf "$CUTLASS_DIR"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
    --target "$CUTLASS_DIR" "nvidia-cutlass==$CUTLASS_VERSION"
  test -f "$CUTLASS_DIR/cutlass_library/source/include/cute/tensor.hpp" \
    || { echo "setup: nvidia-cutlass installed but its headers are missing" >&2; exit 1; }
  echo "$CUTLASS_VERSION" > "$stamp"
fi

for tool in cmake ninja nvcc; do
  command -v "$tool" >/dev/null || { echo "setup: '$tool' not found on PATH (needed to build)" >&2; exit 1; }
done

if ! command -v ccache >/dev/null && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  echo "setup: installing ccache (optional)"
  apt-get install -y -qq ccache >/dev/null 2>&1 || echo "setup: ccache not installed; building without it"
fi
