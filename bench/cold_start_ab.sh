#!/usr/bin/env bash
# Cold start through `blink-appliance up`, this tree against a base tree, in one call (the base packed
# as .whl/base.tar.gz, bench/ab_trees.sh). Each tree starts with a Triton cache of its own, empty, so
# both starts are cold; bench/http_sweep.py then serves 3 batch-1 greedy waves to show the start
# works. Prints the sweep's row and the build log's stages per tree.
# Usage, on the GPU host: bash bench/cold_start_ab.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source bench/ab_trees.sh
for tree in new base; do
  dir=$here; [ $tree = base ] && dir=/tmp/base
  install "$dir"
  TRITON_CACHE_DIR=$(mktemp -d)
  export TRITON_CACHE_DIR
  (cd "$dir" && timeout 260 python3 bench/http_sweep.py --cases b1-greedy --requests-per-case 3 \
    --budget-s 240 --geometries 8192/1024/256/2048 --out "$out/cold-$tree.json" 2>&1 \
    | grep -v -i warn | grep "^| 8192" | sed "s/^/$tree /")
  grep -h "done in\|compiled in" "$out/cold-$tree-8192-1024-256-2048.log" | sed "s/^/$tree /"
done
install "$here"
