#!/usr/bin/env bash
# The loop's host-driven step by piece and the DeviceLoop's TPOT (bench/loop_profile.py, batch 1 greedy
# at the shipped geometry) over several trees in one device call, for bisecting a few µs: each
# `git archive` tarball named is unpacked and installed in turn, with its own harness; `here` is this
# tree. Name a tree twice to see the call's drift. BATCHES (default 1) may name more batch sizes, e.g.
# "1 8 32" for the 8- and 32-token buckets.
# Usage, on the GPU host: [BATCHES="1 8"] bash bench/profile_trees.sh OUT_DIR [here | NAME=TARBALL ...]
set -uo pipefail
out=${1:?OUT_DIR}; shift
source bench/device_tree.sh
here=$PWD
declare -A runs
for spec in "$@"; do
  name=${spec%%=*}; dir=$here
  if [ "$spec" != here ]; then
    dir=/tmp/tree-$name
    [ -d "$dir" ] || { mkdir -p "$dir" && tar xzf "${spec#*=}" -C "$dir"; }
  fi
  runs[$name]=$(( ${runs[$name]:-0} + 1 ))
  install "$dir"
  (cd "$dir" && PYTHONPATH=. timeout 150 python3 bench/loop_profile.py --geometries 8192/1024/256/2048 \
    --batches ${BATCHES:-1} --sampled 0 --steps 40 --out "$out/profile-$name-${runs[$name]}.json" 2>&1 \
    | grep -v -i warn | grep "^| 8192" | sed "s/^/$name ${runs[$name]} /")
done
install "$here"
