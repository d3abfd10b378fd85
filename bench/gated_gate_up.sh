#!/usr/bin/env bash
# Batch 1 through HTTP with the decode buckets' SiLU in the gate+up GEMM's epilogue (launch_plans,
# since 2026-11-28) against the plan before it (SiLU in the down GEMM's prologue, gate+up in 128-row
# tiles), same call: 1B and 8B at the shipped geometry. The old plan is put back by a patch of the
# device's copy between the runs.
# Usage, on the GPU host with the tree installed: bash bench/gated_gate_up.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
plan=blink_appliance/model/launch_plans.py
sweep() {  # name, extra args
  local name=$1; shift
  timeout 200 python3 bench/http_sweep.py --cases b1-greedy b1-t1.0 --requests-per-case 5 --budget-s 170 \
    --geometries 8192/1024/256/2048 --out "$out/$name.json" "$@" 2>&1 | grep -v -i warn | grep "^|" | tail -2
}
swap() {  # from, to: the <= 16-token plan's activation
  python3 - "$plan" "$1" <<'PY'
import sys
path, to_old = sys.argv[1], sys.argv[2] == "old"
new = ("gate_up=GemmLaunch(block_n=_tile(config.intermediate_size if config else None, 128), block_k=64),",
       "            silu_in_gate_up=True,\n        )\n    if num_tokens > 128:")
old = ("gate_up=GemmLaunch(block_n=128, block_k=64),", "            silu_in_down=True,\n        )\n    if num_tokens > 128:")
src, dst = (new, old) if to_old else (old, new)
text = open(path).read()
for a, b in zip(src, dst):
    assert text.count(a) == 1, a
    text = text.replace(a, b)
open(path, "w").write(text)
PY
}
sweep new-1b
sweep new-8b --model dummy:llama-3.1-8b
swap old && python3 -c "from blink_appliance.model.launch_plans import decode_gemms; print('old plan:', decode_gemms(1).silu_in_down)"
sweep old-1b
sweep old-8b --model dummy:llama-3.1-8b
swap new
