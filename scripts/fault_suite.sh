#!/usr/bin/env bash
# Issue 20's fault suite: the tests that keep the reliability defects found (docs/reliability.md).
# They run in `make test` (CI) too; this runs them alone, N times in a row, optionally with a busy
# process on every core for the whole run, as a loaded host would:
#   scripts/fault_suite.sh [--loaded] [--runs N]      (needs the dev venv: scripts/bootstrap.sh dev)
set -euo pipefail
cd "$(dirname "$0")/.."
loaded=0 runs=1
while [ $# -gt 0 ]; do
    case "$1" in
        --loaded) loaded=1 ;;
        --runs) runs="$2"; shift ;;
        *) echo "usage: $0 [--loaded] [--runs N]" >&2; exit 2 ;;
    esac
    shift
done
tests=(
    tests/test_http_fuzz.py tests/test_http_bad_bodies.py tests/test_http_stream_faults.py
    tests/test_http_read_timeouts.py tests/test_frontend_big_bodies.py tests/test_http_live_faults.py
    tests/test_http_lifecycle.py tests/test_ring_processes.py tests/test_ring_server_client.py
    tests/test_ring_malformed_records.py tests/test_daemon_supervision.py tests/test_ring_layout.py
    tests/test_ring_region_faults.py
)
hogs=()
if [ "$loaded" = 1 ]; then
    for _ in $(seq "$(nproc)"); do (while :; do :; done) & hogs+=($!); done
    trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
    echo "[fault suite] ${#hogs[@]} busy processes, one per core"
fi
for run in $(seq "$runs"); do
    echo "[fault suite] run $run of $runs"
    .venv/bin/python -m pytest -q -p no:cacheprovider "${tests[@]}"
done
