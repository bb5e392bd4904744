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
#   here:   scripts/pack_builds.sh main=main new=my-branch && write plan.txt && scripts/device_plan.sh --check plan.txt
#   there:  scripts/device_plan.sh build-pack/plan.txt
# --check (here, before the call; no GPU needed): every line names folders and binaries the pack holds, its test
# families exist, and every benchmark accepts its arguments (run from CHECK_BUILD, default build: the benchmarks parse
# their arguments before any CUDA call and exit 2 on a bad one). Exits 1 if a line would fail for either reason.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
if [[ ${1:-} == --check ]]; then
  plan=${2:?usage: scripts/device_plan.sh --check PLAN_FILE}
  local_build=${CHECK_BUILD:-build}
  packed=$(tar -tJf build-pack/builds.tar.xz 2>/dev/null) || { echo "device_plan: no build-pack/builds.tar.xz"; exit 1; }
  bad=0
  fail() { echo "device_plan --check: line '$line': $*"; bad=1; }
  in_pack() { grep -qxF "$1" <<< "$packed" || grep -qxF "./$1" <<< "$packed"; }
  accepts() {  # BENCH ARGS...: the local build's benchmark does not reject the arguments (rc 2)
    local bench=$1; shift
    [[ -x $local_build/bench/$bench ]] || { fail "no $local_build/bench/$bench to check its arguments"; return; }
    local err
    err=$(timeout 30 "$local_build/bench/$bench" "$@" 2>&1 >/dev/null)
    (($? == 2)) && fail "$bench rejects its arguments: $(head -n 1 <<< "$err")"
  }
  while read -r line; do
    read -r kind name rest <<< "$line"
    [[ -z $kind || $kind == \#* ]] && continue
    case "$kind" in
      tests)
        in_pack "$name/tests/mla_tests" || fail "the pack has no $name/tests/mla_tests (a stripped build)"
        for family in $rest; do
          in_pack "$name/tests/mla_gpu_${family}_tests" || fail "the pack has no $name/tests/mla_gpu_${family}_tests"
        done
        ;;
      ab)
        read -r base new bench args <<< "$rest"
        for b in "$base" "$new"; do in_pack "$b/bench/$bench" || fail "the pack has no $b/bench/$bench"; done
        # shellcheck disable=SC2086  # the benchmark's arguments are words
        accepts "$bench" $args
        ;;
      run)
        read -r command args <<< "$rest"
        if [[ $command == build-*/bench/* ]]; then  # a packed benchmark: checked like an A/B's
          in_pack "$command" || fail "the pack has no $command"
          # shellcheck disable=SC2086  # the benchmark's arguments are words; $OUT names a folder there, /tmp here
          accepts "$(basename "$command")" ${args//\$OUT//tmp}
        fi
        ;;
      *) fail "unknown step '$kind' (tests, ab, run)" ;;
    esac
  done < "$plan"
  ((bad)) || echo "device_plan --check: $plan is fine"
  exit "$bad"
fi
plan=${1:?usage: scripts/device_plan.sh [--check] PLAN_FILE}
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
      grep -qE ' rc=[1-9]' "$out/logs/$name.log" && rc=1  # a benchmark run that failed fails the step
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
