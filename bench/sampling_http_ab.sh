#!/usr/bin/env bash
# Sampled requests through HTTP, this tree against a base tree (.whl/base.tar.gz, as for
# bench/loop_ab.sh), in one call: `blink-appliance up` at the shipped geometry per tree, batch 1 and
# 64, greedy and top-k with top-p. Both trees run this tree's harness (bench/http_sweep.py and its load
# generator are copied into the base), so they send the same requests.
# CASES="..." names other bench/http_sweep.py cases.
# Usage, on the GPU host: [CASES="b1-greedy b1-t1.0"] bash bench/sampling_http_ab.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source bench/ab_trees.sh
cp bench/http_sweep.py /tmp/base/bench/ && cp blink_appliance/bench/load_generator.py /tmp/base/blink_appliance/bench/
for tree in base new; do
  dir=$here; [ $tree = base ] && dir=/tmp/base
  install "$dir"
  (cd "$dir" && PYTHONPATH=. timeout 220 python3 bench/http_sweep.py \
    --cases ${CASES:-b1-greedy b1-t0.8-k40-p0.95 b64-greedy b64-t0.8-k40-p0.95} --requests-per-case 3 --budget-s 200 --geometries 8192/1024/256/2048 \
    --out "$out/http-$tree.json" 2>&1 | grep -v -i warn | grep "^| 8192" | sed "s/^/$tree /")
done
install "$here"
