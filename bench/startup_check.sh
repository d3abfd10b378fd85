#!/usr/bin/env bash
# Issue 18's start-up times in one device call: `blink-appliance up` at the shipped geometry three
# times on one machine (cold, then warm twice: its compile caches filled), each log's "done in" stages
# printed; then the forward's GPU tests. Usage, on the GPU host: bash bench/startup_check.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source bench/device_tree.sh
for run in cold warm-1 warm-2; do
    timeout 160 python3 bench/http_sweep.py --out "$out/startup-$run.json" --geometries 8192/1024/256/2048 \
      --cases b1-greedy --requests-per-case 2 --budget-s 150 2>&1 | grep -v -i warn | grep "^|" | sed "s/^/$run /"
    grep -h "done in" "$out"/startup-"$run"-*.log | sed -e "s/^.*INFO[^:]*: //" -e "s/^/$run /"
done
python3 -m pytest -q -rs -p no:cacheprovider -n 4 --dist loadfile tests/test_gpu_forward.py \
  tests/test_launch_plans.py 2>&1 | tail -6
