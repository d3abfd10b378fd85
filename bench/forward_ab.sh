#!/usr/bin/env bash
# The forward's step by graph replay, this tree against a base tree, in one call: the base is
# `git archive` of a commit packed as .whl/base.tar.gz (carried with the wheels):
#   git archive --format=tar.gz -o .whl/base.tar.gz <base commit>
# Per tree, alternated twice: 1B's plan at buckets 1, 2, 4 and 8 with one decoding sequence and with the
# bucket full, at 256 and 4096 keys (bench/forward_levers.py, variant prod).
# Usage, on the GPU host: bash bench/forward_ab.sh OUT_DIR [MODEL]
set -uo pipefail
out=${1:?OUT_DIR}
model=${2:-llama-3.2-1b}
source bench/ab_trees.sh
for round in 1 2; do
  for tree in base new; do
    dir=$here; [ $tree = base ] && dir=/tmp/base
    install "$dir"
    for decodes in 1 0; do
      for ctx in 256 4096; do
        (cd "$dir" && PYTHONPATH=. timeout 120 python3 bench/forward_levers.py --model "$model" \
          --buckets 1,2,4,8 --decodes $decodes --context $ctx --variants prod --profile none \
          --out "$out/$tree-$round-d$decodes-$ctx" 2>&1 | grep -v -i warn | grep "^| prod" \
          | sed "s/^/$tree $round decodes=$decodes keys=$ctx /")
      done
    done
  done
done
install "$here"
