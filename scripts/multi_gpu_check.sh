#!/usr/bin/env bash
# DCP on several real GPUs (issue 7): the one command for a machine of 2, 4 or 8 H200s.
#
#   BUILD_DIR=build-mgpu scripts/multi_gpu_check.sh        # binaries built beforehand (cmake --build)
#
# Runs mla_gpu_dcp_nccl_tests (DcpMultiGpu.*: D in {2, 4, 8} ranks, rank k on GPU k, NcclBootstrap,
# the same child and assertions as DcpMultiProcess; DcpNcclBootstrap: a 1-rank communicator; the
# FileBootstrap multi-process tests, now with rank k on GPU k % count) and mla_gpu_dcp_tests, then a
# summary. NCCL_NVLS_ENABLE=0 always (no NVLink multicast). libnccl.so.2: the binary links it
# dynamically; where the loader does not find it, this script adds the first folder that holds it
# among /usr/local/cuda*/lib{,64} and python3's nvidia/nccl/lib (PyTorch's NCCL wheel) to LD_LIBRARY_PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-mgpu}
LOG_DIR=${LOG_DIR:-${OUT:-/tmp}/multi_gpu_logs}
mkdir -p "$LOG_DIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

nccl_binary=$BUILD_DIR/tests/mla_gpu_dcp_nccl_tests
if [[ -x $nccl_binary ]] && ldd "$nccl_binary" | grep -q 'libnccl.so.2 => not found'; then
  for dir in /usr/local/cuda*/lib /usr/local/cuda*/lib64 \
             "$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"; do
    if [[ -n $dir && -e $dir/libnccl.so.2 ]]; then
      export LD_LIBRARY_PATH=$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
      break
    fi
  done
fi
[[ -x $nccl_binary ]] && { echo "libnccl:"; ldd "$nccl_binary" | grep nccl; }
nvidia-smi -L 2>/dev/null

summary=()
for binary in "$nccl_binary" "$BUILD_DIR/tests/mla_gpu_dcp_tests"; do
  name=$(basename "$binary")
  if [[ ! -x $binary ]]; then
    summary+=("$name: not built")
    continue
  fi
  timeout 900 "$binary" 2>&1 | tee "$LOG_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  passed=$(grep -c '^\[       OK \]' "$LOG_DIR/$name.log")
  failed=$(grep -c '^\[  FAILED  \] [A-Za-z]' "$LOG_DIR/$name.log")
  skipped=$(grep -c '^\[  SKIPPED \]' "$LOG_DIR/$name.log")
  summary+=("$name: rc $rc, $passed passed, $failed failed, $skipped skipped")
done

bench=$BUILD_DIR/bench/dcp_multi_bench
if [[ -x $bench ]]; then
  # D in {2, 4, 8} up to the visible GPU count (a larger D is skipped with a line saying so); the
  # table also goes to $LOG_DIR/dcp_multi_bench.md.
  timeout 600 "$bench" --out "$LOG_DIR/dcp_multi_bench.md" 2>&1 | tee "$LOG_DIR/dcp_multi_bench.log"
  summary+=("dcp_multi_bench: rc ${PIPESTATUS[0]}")
else
  summary+=("dcp_multi_bench: not built (needs NCCL at configure time, like mla_gpu_dcp_nccl_tests)")
fi

echo
echo "== multi_gpu_check summary =="
grep -h 'SKIPPED \]\|needs .* GPUs' "$LOG_DIR"/*.log | sort -u | head -20
printf '%s\n' "${summary[@]}"
