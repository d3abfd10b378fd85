#!/usr/bin/env bash
# Batch 1 with the decode GEMMs' L2 weight prefetch before the PDL wait (kernels/skinny_gemm.py
# `prefetch`, `late_trigger`): the step by graph replay at 256 keys (bench/forward_levers.py), 1B and
# 8B, against the shipped plan in the same call. Usage: bash bench/b1_prefetch.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
pf() { local v="prod"; for p in qkv16 o16 gate_up16 down16; do v="$v+$p.prefetch=$1"; done; echo "$v"; }
late="+gate_up16.late_trigger=1+o16.late_trigger=1+qkv16.late_trigger=1"
variants="prod,$(pf 256),$(pf 512),$(pf 256)$late,$(pf 512)$late,$(pf 1024)$late,prod"
for model in ${MODELS:-llama-3.2-1b llama-3.1-8b}; do
  python3 bench/forward_levers.py --out "$out/prefetch-$model" --model $model --buckets 8 --decodes 1 \
    --variants "$variants" --profile none > "$out/prefetch-$model.log" 2>&1; sed -n "/^## /,\$p;/Error/p" "$out/prefetch-$model.log"
done
