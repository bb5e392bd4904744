#!/usr/bin/env bash
# One device call from a plan file: the packed builds (scripts/pack_builds.sh) are unpacked, then each line of the
# plan runs in order, and the logs come back as one archive ($OUT/all.tgz: the device tool returns at most 8 files).
# A line is one of
#   tests BUILD [FAMILY...]          scripts/gpu_check.sh tests with BUILD_DIR=BUILD (FAMILIES: those given, or all)
#   ab NAME BASE NEW BENCH [ARGS]    scripts/bench_compare.sh run BENCH ARGS, NEW's binaries against BASE's (RUNS,
#                                    default 2, interleaved); the before/after table is printed last
#   run NAME COMMAND...              any command (e.g. a core_bench sweep or ncu), its output in NAME.log
# Blank lines and lines starting with # are skipped; the steps read /dev/null (the plan itself is the loop's stdin).
# A step that would start after LIMIT seconds (default 500) is skipped and says so, so that a call under the
# device's time limit still brings back what it ran.
#   here:   scripts/pack_builds.sh main=main new=my-branch && write plan.txt
#   there:  scripts/device_plan.sh build-pack/plan.txt
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
plan=${1:?usage: scripts/device_plan.sh PLAN_FILE}
out=${OUT:-gpu-out}
limit=${LIMIT:-500}
mkdir -p "$out/logs"
[[ -f build-pack/builds.tar.xz ]] && tar -xJf build-pack/builds.tar.xz
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader 2>&1
summary=() tables=()
while read -r kind name rest; do
  [[ -z $kind || $kind == \#* ]] && continue
  if ((SECONDS > limit)); then
    summary+=("$(printf '%-6s %-24s skipped: %d s > LIMIT=%d' "$kind" "$name" "$SECONDS" "$limit")")
    continue
  fi
  start=$SECONDS
  case "$kind" in
    tests)
      FAMILIES="$rest" BUILD_DIR="$name" OUT="$out/logs/tests-$name" scripts/gpu_check.sh tests \
        < /dev/null > "$out/logs/tests-$name.log" 2>&1
      rc=$?
      tables+=("== tests $name" "$(grep -E 'rc=' "$out/logs/tests-$name.log")")
      ;;
    ab)
      read -r base new bench args <<< "$rest"
      # shellcheck disable=SC2086  # the benchmark's arguments are words
      BUILD_DIR="$new" BASE="$base/bench" TESTS=0 RUNS="${RUNS:-2}" OUT="$out/logs/$name" \
        scripts/bench_compare.sh run "$bench" $args < /dev/null > "$out/logs/$name.log" 2>&1
      rc=$?
      tables+=("== $name: $base -> $new ($bench; base/new of the medians, > 1: new is faster)"
               "$(grep -E ' = ' "$out/logs/$name.log")")
      ;;
    run)
      bash -c "$rest" < /dev/null > "$out/logs/$name.log" 2>&1
      rc=$?
      ;;
    *)
      rc=2
      echo "device_plan: unknown step '$kind' (tests, ab, run)" > "$out/logs/$name.log"
      ;;
  esac
  summary+=("$(printf '%-6s %-24s rc=%d %4d s' "$kind" "$name" "$rc" $((SECONDS - start)))")
done < "$plan"
tar -czf "$out/all.tgz" -C "$out" logs && rm -rf "$out/logs"
printf '%s\n' "${tables[@]}" "${summary[@]}"
echo "device_plan: ${SECONDS} s; logs in $out/all.tgz"
