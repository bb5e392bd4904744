#!/usr/bin/env bash
# Packs the stripped builds of several revisions for one device call (the device tool carries at most 64 MiB
# of git-ignored paths): each NAME=REV is built in a worktree and stripped into build-NAME/ (scripts/strip_build.sh
# --rev; skipped where build-NAME/REVISION already names REV's commit), then all of them go into
# build-pack/builds.tar.xz. On the device: `tar -xJf build-pack/builds.tar.xz`, then e.g.
# `FAMILIES="core pipeline" BUILD_DIR=build-NAME scripts/gpu_check.sh tests` or
# `BUILD_DIR=build-B BASE=build-A/bench scripts/bench_compare.sh run core_bench ...`.
#   scripts/pack_builds.sh NAME=REV...        e.g. main=main pages=core-prewait-pages
#   NAME=REV+PATCH                             REV with a kept patch applied (e.g. main+bench/results/patches/X.patch):
#                                              built from a commit made here (fixed dates, so the same inputs give
#                                              the same commit and a repacked build is not rebuilt); no branch needed
# EXTRA: more folders to pack as they are (a hand-made build, e.g. a mutant for a test's power).
set -euo pipefail
cd "$(dirname "$0")/.."
(($# > 0)) || { echo "usage: scripts/pack_builds.sh NAME=REV... (EXTRA=\"DIR...\")" >&2; exit 2; }
folders=()
for spec in "$@"; do
  [[ $spec == *=* ]] || { echo "pack_builds: '$spec' is not NAME=REV" >&2; exit 2; }
  name=${spec%%=*} rev=${spec#*=}
  if [[ $rev == *+* ]]; then
    patch=${rev#*+} rev=${rev%%+*}
    [[ -f $patch ]] || { echo "pack_builds: no patch file $patch" >&2; exit 1; }
    index=$(mktemp)
    GIT_INDEX_FILE=$index git read-tree "$rev^{tree}"
    GIT_INDEX_FILE=$index git apply --cached "$patch" ||
      { rm -f "$index"; echo "pack_builds: $patch does not apply to $rev" >&2; exit 1; }
    tree=$(GIT_INDEX_FILE=$index git write-tree)
    rm -f "$index"
    who=pack_builds email=pack_builds@localhost
    commit=$(GIT_AUTHOR_NAME=$who GIT_AUTHOR_EMAIL=$email GIT_AUTHOR_DATE="2000-01-01T00:00:00+0000" \
             GIT_COMMITTER_NAME=$who GIT_COMMITTER_EMAIL=$email GIT_COMMITTER_DATE="2000-01-01T00:00:00+0000" \
             git commit-tree "$tree" -p "$(git rev-parse "$rev^{commit}")" -m "$rev + $patch")
    commit=$(git rev-parse --short "$commit") rev="$rev+$patch"
  else
    commit=$(git rev-parse --short "$rev^{commit}")
  fi
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
