#!/usr/bin/env bash
# bench/sampler_stress.py over several trees in one device call: this tree (`here`) and each
# `git archive` tarball named, unpacked and installed in turn, each run REPEAT times with a time limit.
# A hung run ends by `timeout` (rc 124), which is the result, not a failure of the script.
# STRESS_ARGS: more arguments for every run (e.g. "--check 200").
# Usage, on the GPU host: bash bench/stress_trees.sh OUT_DIR BUDGET_S REPEAT [here | NAME=TARBALL ...]
set -uo pipefail
out=${1:?OUT_DIR}; budget=${2:?BUDGET_S}; repeat=${3:?REPEAT}; shift 3
source bench/device_tree.sh
here=$PWD
run_tree() {  # name dir
  install "$2"
  for i in $(seq 1 "$repeat"); do
    (cd "$2" && PYTHONPATH=. timeout $((budget + 40)) python3 bench/sampler_stress.py --budget-s "$budget" \
      --verify 250 ${STRESS_ARGS:-} --out "$out/stress-$1-$i.json" > "$out/stress-$1-$i.log" 2>&1)
    echo "$1 run $i rc=$? $(tail -c 300 "$out/stress-$1-$i.json" 2>/dev/null || tail -n 2 "$out/stress-$1-$i.log")"
  done
}
for spec in "$@"; do
  if [ "$spec" = here ]; then run_tree here "$here"; continue; fi
  name=${spec%%=*}; tarball=${spec#*=}
  rm -rf "/tmp/tree-$name" && mkdir -p "/tmp/tree-$name" && tar xzf "$tarball" -C "/tmp/tree-$name"
  cp "$here/bench/sampler_stress.py" "/tmp/tree-$name/bench/"  # one harness for every tree
  run_tree "$name" "/tmp/tree-$name"
done
install "$here"
