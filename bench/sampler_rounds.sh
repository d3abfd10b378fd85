#!/usr/bin/env bash
# The rejection variant's rounds as one queued launch (kernels/sampling_rounds.py) against the launch
# per pass before it, same call: the sampler alone (sampler_profile.py: tokens against the reference,
# graph replay) and/or the step at the shipped geometry, batch 64, greedy and sampled (loop_profile.py,
# host-driven). The old kernels come from .ab/old, carried (ignored through .git/info/exclude), made with
#   mkdir -p .ab/old; for f in kernels/sampling_rejection.py blink_appliance/engine/loop/sampler.py \
#     tests/test_device_sampler.py; do git show 4fed321:$f > .ab/old/$(basename $f); done
# Usage, on the GPU host with the tree installed: bash bench/sampler_rounds.sh OUT_DIR [sampler|loop]...
set -uo pipefail
out=${1:?OUT_DIR}
shift
parts=${*:-sampler loop}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
run() {  # name, rows, sampler_profile's other options
  if [[ $parts == *sampler* ]]; then
    timeout 420 python3 bench/sampler_profile.py --rows "$2" --out "$out/$1-sampler" $3 2>&1 | grep -v -i warn \
      | grep "^|\|ticket_chunks" | grep -v "full ms"
  fi
  if [[ $parts == *loop* ]]; then
    timeout 300 python3 bench/loop_profile.py --geometries 8192/1024/256/2048 --batches 64 --sampled 0 1 --steps 30 \
      --no-loop --out "$out/$1-loop.json" 2>&1 | grep -v -i warn | tail -6
  fi
}
run queue 64 --tune
cp kernels/sampling_rejection.py blink_appliance/engine/loop/sampler.py tests/test_device_sampler.py "$out/"
cp .ab/old/sampling_rejection.py kernels/ && cp .ab/old/sampler.py blink_appliance/engine/loop/ \
  && cp .ab/old/test_device_sampler.py tests/ && echo "--- before (a launch per pass)"
run passes 64 ""
cp "$out/sampling_rejection.py" kernels/ && cp "$out/sampler.py" blink_appliance/engine/loop/ \
  && cp "$out/test_device_sampler.py" tests/
