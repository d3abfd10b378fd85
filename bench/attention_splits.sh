#!/usr/bin/env bash
# Batch 1's attention split count, in one call: the attention kernel's tests on the GPU, then the 1B
# forward by graph replay (bench/forward_levers.py, one decoding sequence) in the 1-, 2- and 4-token
# buckets at 256, 1024 and 4096 keys: this tree with the plan's splits and with 32 of them, and the
# base tree (.whl/base.tar.gz, bench/ab_trees.sh) with the plan's.
# With `tests`: the attention kernel's tests beside the loop's greedy streams against the reference
# engine (which run the plan's bucket 1), nothing else; with `forward`: the forward's timings alone.
# MODEL (default llama-3.2-1b) and VARIANTS (this tree's, default prod,prod+attn.splits=32,prod) may be
# set in the environment; the base tree runs prod. TREES=new skips the base tree.
# Usage, on the GPU host: [MODEL=...] [VARIANTS=...] [TREES=new] bash bench/attention_splits.sh OUT_DIR [tests|forward]
set -uo pipefail
out=${1:?OUT_DIR}
model=${MODEL:-llama-3.2-1b}
source bench/ab_trees.sh
if [ "${2:-}" != forward ]; then
  timeout 280 python3 -m pytest -q -p no:cacheprovider \
    "tests/test_device_loop.py::test_engine_loop_greedy_streams_equal_host_steps_and_the_reference_engine" \
    > "$out/gpu-loop-test.log" 2>&1 &
  loop_test=$!
  timeout 280 python3 -m pytest -q -n 12 tests/test_kernels_attention.py > "$out/gpu-tests.log" 2>&1
  echo "attention tests rc=$?"; tail -1 "$out/gpu-tests.log"
  wait $loop_test; echo "greedy loop test rc=$?"; tail -1 "$out/gpu-loop-test.log"
fi
[ "${2:-}" = tests ] && exit 0
for tree in ${TREES:-new base}; do
  dir=$here; [ $tree = base ] && dir=/tmp/base
  variants=${VARIANTS:-prod,prod+attn.splits=32,prod}; [ $tree = base ] && variants=prod
  install "$dir"
  for ctx in 256 1024 4096; do
    (cd "$dir" && PYTHONPATH=. timeout 100 python3 bench/forward_levers.py --model "$model" --buckets 1,2,4 \
      --decodes 1 --context $ctx --variants $variants --profile none --out "$out/$tree-$ctx" 2>&1 \
      | grep -v -i warn | grep "^| prod" | sed "s/^/$tree keys=$ctx /")
  done
done
install "$here"
