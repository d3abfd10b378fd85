#!/usr/bin/env bash
# Batch-1 and batch-64 greedy TPOT through HTTP at the shipped geometry under co-located CPU load, in
# one device call: isolated; unpinned (`bench interfere` with a spinner per core, 2 memory thrashers and
# 2 syscall pairs, nothing pinned); pinned (client, front end and engine on cores 0-3 by taskset, the
# same load on the other cores).
# Usage, on the GPU host: bash bench/interference_http.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source bench/device_tree.sh
cores=$(nproc)
sweep() {  # $1: name; the rest: a command prefix (taskset)
  local name=$1; shift
  "$@" timeout 170 python3 bench/http_sweep.py --out "$out/$name.json" --geometries 8192/1024/256/2048 \
    --cases b1-greedy b64-greedy --requests-per-case 3 --budget-s 160 2>&1 \
    | grep -v -i warn | grep "^| 8192" | sed "s/^/$name /"
}
load() {  # $1: spinners; the rest: more bench interfere arguments. Prints the pid of the load, which runs
  # in the background until unload (its workers end with it).
  python3 -m blink_appliance.cli bench interfere --spin "$1" --memory 2 --syscall 2 --duration 300 "${@:2}" > "$out/interfere-$1.log" 2>&1 &
  echo $!
}
unload() { kill -INT "$1"; sleep 3; kill -KILL "$1" 2>/dev/null; }
sweep isolated
pid=$(load "$cores")
sweep unpinned; uptime
unload "$pid"
pid=$(load $((cores - 4)) --cpus "4-$((cores - 1))")
sweep pinned taskset -c 0-3; uptime
unload "$pid"
uptime
