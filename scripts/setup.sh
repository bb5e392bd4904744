#!/usr/bin/env bash
# Installs what the build needs beyond the CUDA toolkit into project-local, git-ignored folders:
#   .deps/cutlass    CUTLASS/CuTe C++ headers from the pinned PyPI package nvidia-cutlass
#   .deps/sass-tools cuobjdump + nvdisasm (pinned PyPI packages; this toolkit image lacks them) for the SASS
#                    test tests/sass/kernel_sass.py (it skips, saying so, where they are missing)
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

SASS_TOOLS_VERSION=13.5.37
SASS_TOOLS_DIR=.deps/sass-tools
if [[ ! -f "$SASS_TOOLS_DIR/.version" || "$(cat "$SASS_TOOLS_DIR/.version")" != "$SASS_TOOLS_VERSION" ]]; then
  echo "setup: installing cuobjdump and nvdisasm $SASS_TOOLS_VERSION into $SASS_TOOLS_DIR"
  rm -rf "$SASS_TOOLS_DIR"
  if python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$SASS_TOOLS_DIR" \
       "nvidia-cuda-cuobjdump==$SASS_TOOLS_VERSION" "nvidia-cuda-nvdisasm==$SASS_TOOLS_VERSION"; then
    chmod +x "$SASS_TOOLS_DIR"/nvidia/cu13/bin/*
    echo "$SASS_TOOLS_VERSION" > "$SASS_TOOLS_DIR/.version"
  else
    echo "setup: cuobjdump/nvdisasm not installed; the SASS test will skip (say so)" >&2
  fi
fi

for tool in cmake ninja nvcc; do
  command -v "$tool" >/dev/null || { echo "setup: '$tool' not found on PATH (needed to build)" >&2; exit 1; }
done

if ! command -v ccache >/dev/null && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  echo "setup: installing ccache (optional)"
  apt-get install -y -qq ccache >/dev/null 2>&1 || echo "setup: ccache not installed; building without it"
fi
