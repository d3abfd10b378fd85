#!/usr/bin/env bash
# Issue 18's done-when in one device call, through `blink-appliance up` (bench/http_sweep.py) at the
# shipped geometry, the card named first: 1B from a cold start (batch 1 greedy and temperature 1.0,
# batch 64 greedy and temperature 0.7 / top_p 0.9); 1B at 32768 / 4096, then the shipped geometry again
# (its start-up is the warm start); 8B at batch 1; and the 8B forward against its floor (the weights at
# the copy rate measured in the same call, bench/forward_levers.py). The time limits add up to 580 s.
# Usage, on the GPU host: bash bench/issue18_check.sh OUT_DIR [1b]   (1b: the 1B parts alone, 330 s)
set -uo pipefail
out=${1:?OUT_DIR}
parts=${2:-all}
source bench/device_tree.sh
table() { grep -v -i warn | grep "^|" | sed "s/^/$1 /"; }
timeout 190 python3 bench/http_sweep.py --out "$out/1b.json" --geometries 8192/1024/256/2048 \
  --cases b1-greedy b1-t1.0 b64-greedy b64-t0.7-p0.9 --requests-per-case 5 --budget-s 180 2>&1 | table 1b
timeout 140 python3 bench/http_sweep.py --out "$out/1b-geometry.json" --geometries 32768/4096/256/2048 \
  8192/1024/256/2048 --cases b1-greedy --requests-per-case 3 --budget-s 130 2>&1 | table 1b-geometry
[ "$parts" = 1b ] && exit 0
timeout 170 python3 bench/http_sweep.py --out "$out/8b.json" --model dummy:llama-3.1-8b \
  --geometries 8192/1024/256/2048 --cases b1-greedy b1-t1.0 --requests-per-case 3 --budget-s 160 2>&1 | table 8b
timeout 80 python3 bench/forward_levers.py --model llama-3.1-8b --buckets 1 --decodes 1 --variants prod \
  --profile none --out "$out/8b-forward" 2>&1 | grep -v -i warn | grep -A3 "^## "
