#!/usr/bin/env bash
# Seconds from `blink-appliance up PROFILE` to its ready line, then SIGINT and the drain waited for.
# Run from a set-up checkout (make up once): bash bench/time_to_ready.sh [PROFILE] [RUNS]
set -uo pipefail
profile=${1:-profiles/default.toml}; runs=${2:-3}
log=$(mktemp)
for _ in $(seq "$runs"); do
    start=$(date +%s.%N)
    setsid .venv/bin/blink-appliance up "$profile" >"$log" 2>&1 &
    pid=$!
    until grep -q "ready: http" "$log"; do
        kill -0 "$pid" 2>/dev/null || { echo "exited before ready:"; tail -5 "$log"; exit 1; }
        sleep 0.05
    done
    echo "ready in $(echo "$(date +%s.%N) - $start" | bc) s"
    kill -INT -- "-$pid"
    wait "$pid"
done
rm -f "$log"
