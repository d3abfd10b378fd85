#!/usr/bin/env bash
# The loop's own pieces, this tree against a base tree, in one call: the base is `git archive` of a
# commit packed as .whl/base.tar.gz (carried with the wheels), installed in turn with this tree:
#   git archive --format=tar.gz -o .whl/base.tar.gz <base commit>
# Per tree: the host-driven step by piece with the schedule's phases and the DeviceLoop's TPOT from
# the ring's stamps (bench/loop_profile.py, b1 and b64 greedy), then batch-1 TPOT through HTTP at the
# shipped geometry, the trees alternated twice; with a second argument `profile`, the profiles alone.
# Usage, on the GPU host: bash bench/loop_ab.sh OUT_DIR [profile]
set -uo pipefail
out=${1:?OUT_DIR}
mode=${2:-all}
source bench/ab_trees.sh
rounds="1 2"; [ "$mode" = profile ] && rounds=1
for round in $rounds; do
  for tree in base new; do
    dir=$here; [ $tree = base ] && dir=/tmp/base
    install "$dir"
    if [ $round = 1 ]; then
      (cd "$dir" && PYTHONPATH=. timeout 150 python3 bench/loop_profile.py --geometries 8192/1024/256/2048 \
        --batches 1 64 --sampled 0 --steps 30 --schedule-phases --out "$out/profile-$tree.json" 2>&1 \
        | grep -v -i warn | grep "^| 8192\|phases" | sed "s/^/$tree /")
    fi
    [ "$mode" = profile ] && continue
    (cd "$dir" && PYTHONPATH=. timeout 150 python3 bench/http_sweep.py --cases b1-greedy --requests-per-case 5 \
      --budget-s 100 --geometries 8192/1024/256/2048 --out "$out/http-$tree-$round.json" 2>&1 \
      | grep -v -i warn | grep "^| 8192" | sed "s/^/$tree $round /")
  done
done
install "$here"
