#!/usr/bin/env bash
# Packs the stripped builds of several revisions for one device call (the device tool carries at most 64 MiB
# of git-ignored paths): each NAME=REV is built in a worktree and stripped into build-NAME/ (scripts/strip_build.sh
# --rev; skipped where build-NAME/REVISION already names REV's commit), then all of them go into
# build-pack/builds.tar.xz. On the device: `tar -xJf build-pack/builds.tar.xz`, then e.g.
# `FAMILIES="core pipeline" BUILD_DIR=build-NAME scripts/gpu_check.sh tests` or
# `BUILD_DIR=build-B BASE=build-A/bench scripts/bench_compare.sh run core_bench ...`.
#   scripts/pack_builds.sh NAME=REV...        e.g. main=main pages=core-prewait-pages
# EXTRA: more folders to pack as they are (a hand-made build, e.g. a mutant for a test's power).
set -euo pipefail
cd "$(dirname "$0")/.."
(($# > 0)) || { echo "usage: scripts/pack_builds.sh NAME=REV... (EXTRA=\"DIR...\")" >&2; exit 2; }
folders=()
for spec in "$@"; do
  [[ $spec == *=* ]] || { echo "pack_builds: '$spec' is not NAME=REV" >&2; exit 2; }
  name=${spec%%=*} rev=${spec#*=}
  commit=$(git rev-parse --short "$rev^{commit}")
  dest=build-$name
  if [[ $(cut -d' ' -f1 "$dest/REVISION" 2>/dev/null) != "$commit" ]]; then
    scripts/strip_build.sh --rev "$commit" "$dest"
    echo "$commit $rev" > "$dest/REVISION"
  else
    echo "pack_builds: $dest is $commit already"
  fi
  folders+=("$dest")
done
for extra in ${EXTRA:-}; do
  [[ -d $extra ]] || { echo "pack_builds: no folder $extra" >&2; exit 1; }
  folders+=("$extra")
done
mkdir -p build-pack
tar -cJf build-pack/builds.tar.xz "${folders[@]}"
size=$(stat -c %s build-pack/builds.tar.xz)
echo "pack_builds: ${folders[*]} -> build-pack/builds.tar.xz ($((size / 1048576)) MiB of the 64 MiB the device carries)"
((size <= 64 * 1048576)) || { echo "pack_builds: too large for one call: pack fewer builds" >&2; exit 1; }
