#!/usr/bin/env bash
# The device sampler's picked variant for a few mixes: the base tree (.whl/base.tar.gz, as for
# bench/sampler_ab.sh) with its defaults, then this tree under each DeviceSampler knob set given
# (JSON, '{}' for the defaults), in one call. Prints one line per case; JSON files under OUT_DIR.
# Usage, on the GPU host: MIXES='top_k 50;top_k 1000' bash bench/sampler_knobs_ab.sh OUT_DIR '{}' '{"rejection_gather_cap": 0}'
set -uo pipefail
out=${1:?OUT_DIR}
shift
source bench/ab_trees.sh
cp bench/sampler_profile.py /tmp/base/bench/
summary='
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if "mix" in r:
        print(f"{sys.argv[1]:<40} {r["rows"]:>3} {r["shape"]:<6} {r["mix"]:<24} mism {r["mismatches"]} "
              f"greedy {r["greedy_ms"] * 1e3:5.1f} picked {r["picked_ms"] * 1e3:6.1f} us  kernels {[(k[:16], round(v, 1)) for k, v in r["top_kernels_us"]]}")
'
run() {  # DIR NAME [--knobs JSON]
  (cd "$1" && PYTHONPATH=. timeout 200 python3 bench/sampler_profile.py --rows "${ROWS:-1,64}" --capacity 256 \
    --mixes "${MIXES:-top_k 50;top_k 1000;top_p 0.95, top_k 40}" "${@:3}" --out "$out/$2" 2>&1 \
    | python3 -c "$summary" "$2 ${4:-}")
}
install /tmp/base
run /tmp/base base
install "$here"
i=0
for knobs in "$@"; do
  run "$here" "new-$i" --knobs "$knobs"
  i=$((i + 1))
done
