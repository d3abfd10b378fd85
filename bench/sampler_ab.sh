#!/usr/bin/env bash
# The device sampler, this tree against a base tree, in one call (the base is `git archive` of a
# commit packed as .whl/base.tar.gz, as for bench/loop_ab.sh): bench/sampler_profile.py per tree
# (every mix checked against the reference, then timed), and with a second argument `step`, the
# host-driven step at batch 64, greedy and sampled (t0.7, top_p 0.9), at the shipped geometry.
# CAPACITY=256 allocates the sampler's rows as the loop does at the shipped max_seqs (this tree's
# bench/sampler_profile.py is copied into the base for it).
# MIXES='top_k 50;top_k 1000' times only those of bench/sampler_profile.py's MIXES.
# Usage, on the GPU host: [CAPACITY=256] [PROFILE_TIMEOUT=240] [MIXES=...] bash bench/sampler_ab.sh OUT_DIR [step] [ROWS]
set -uo pipefail
out=${1:?OUT_DIR}
mode=${2:-sampler}
rows=${3:-1,64}
source bench/ab_trees.sh
cp bench/sampler_profile.py /tmp/base/bench/
for tree in ${AB_ORDER:-base new}; do  # AB_ORDER="new base" to see whether the order moves the numbers
  dir=$here; [ $tree = base ] && dir=/tmp/base
  install "$dir"
  if [ "$mode" = step ]; then
    (cd "$dir" && PYTHONPATH=. timeout 200 python3 bench/loop_profile.py --geometries 8192/1024/256/2048 \
      --batches 64 --sampled 0 1 --steps 30 --no-loop --out "$out/step-$tree.json" 2>&1 \
      | grep -v -i warn | grep "^| 8192" | sed "s/^/$tree /")
  else
    (cd "$dir" && PYTHONPATH=. timeout "${PROFILE_TIMEOUT:-240}" python3 bench/sampler_profile.py --rows "$rows" --capacity "${CAPACITY:-0}" ${MIXES:+--mixes "$MIXES"} \
      --out "$out/$tree" 2>&1 \
      | grep -v -i warn | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip()); continue
    if "mix" in r:
        full = f" full {r["full_ms"]:.4f}" if "full_ms" in r else ""  # trees before the sorting variant went
        print(f"'$tree' {r["rows"]:>3} {r["shape"]:<6} {r["mix"]:<28} {r["variant"]:<9} mism {r["mismatches"]} "
              f"greedy {r["greedy_ms"]:.4f} picked {r["picked_ms"]:.4f}{full}")
    else:
        print(line.rstrip())
')
  fi
done
install "$here"
