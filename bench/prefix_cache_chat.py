"""Multi-turn chat with a shared system prompt, prefix cache on against off (issue 25).

On the GPU (one command; `dummy:llama-3.2-1b` bf16 at the shipped geometry):
    python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/prefix_cache_chat.py --out $OUT/prefix_cache_chat.json
CPU smoke check of the script itself (reference engine, dummy:tiny; timings meaningless):
    .venv/bin/python bench/prefix_cache_chat.py --device cpu --geometry 1024/16/8/128 --system-len 64 --conversations 4 --turns 3 --turn-len 16 --output-len 8 --out /tmp/chat.json

Per phase, one `blink-appliance up` with `[engine] prefix_cache` on or off. --conversations clients
run at once, each a conversation of --turns turns: turn k's prompt is the system prompt (--system-len
token ids, the same for every conversation), then each earlier turn's user message and reply, then
turn k's user message (--turn-len ids each). The reply appended to the history is --output-len random
ids rather than what the model said: generated tokens are never cached, so this changes no hit.
Each request streams --output-len tokens (greedy, ignore_eos). Reported: TTFT P50/P99 over all
turns and over turns after the first, TPOT P50, the engine's prefix cache counters (hit rate in
prompt tokens) and the wall time.

Phase "miss_only" gives every conversation its own system prompt and one turn: no lookup can hit,
so beside "off" it shows what lookups and registrations cost (with the engine's mean step time:
the step-time histogram's bucket midpoints are too coarse, so the loop's TPOT P50 stands for it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.http_sweep import (  # noqa: E402
    MODEL_NAME,
    Geometry,
    appliance_server,
    engine_telemetry,
    model_defaults,
    ms,
    one_geometry_parser,
    request_tpot_s,
    run_record,
)
from blink_appliance.bench.datasets import BenchRequest  # noqa: E402
from blink_appliance.bench.load_generator import LoadConfig, RequestRecord, send_one  # noqa: E402

PHASES = {"on": (True, True), "off": (False, True), "miss_only": (True, False)}  # cache, shared system


def say(message: str) -> None:
    print(f"[prefix_cache_chat] {message}", file=sys.stderr, flush=True)


def engine_counters(url: str) -> dict[str, int]:
    engine = engine_telemetry(url)
    return {k: int(engine.get(k) or 0) for k in ("prefix_cache_queries", "prefix_cache_hits", "steps")}


async def conversations(url: str, args: argparse.Namespace, shared: bool) -> list[tuple[int, RequestRecord]]:
    """Every conversation's turns, the conversations at once; (turn, record) per request."""
    import aiohttp

    config = LoadConfig(base_url=url, model=MODEL_NAME, request_timeout_s=600)
    system_rng = random.Random(args.seed)
    system = [system_rng.randrange(3, args.vocab) for _ in range(args.system_len)]
    turns = args.turns if shared else 1
    records: list[tuple[int, RequestRecord]] = []

    async def converse(k: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(args.seed * 1000 + k + 1)
        history = system if shared else [rng.randrange(3, args.vocab) for _ in range(args.system_len)]
        for turn in range(turns):
            history = history + [rng.randrange(3, args.vocab) for _ in range(args.turn_len)]
            record = RequestRecord(len(records), args.output_len, len(history))
            await send_one(session, config, BenchRequest(history, len(history), args.output_len), record, t0)
            records.append((turn, record))
            history = history + [rng.randrange(3, args.vocab) for _ in range(args.output_len)]

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(converse(k, session) for k in range(args.conversations)))
    return records


def summarize(records: list[tuple[int, RequestRecord]], counters: dict[str, int], wall_s: float) -> dict:
    done = [(turn, r) for turn, r in records if r.ok]
    ttft = [r.ttft_s for _, r in done if r.ttft_s is not None]
    later = [r.ttft_s for turn, r in done if turn > 0 and r.ttft_s is not None]
    tpot = [t for _, r in done if (t := request_tpot_s(r)) is not None]
    queries, hits = counters["prefix_cache_queries"], counters["prefix_cache_hits"]
    return {
        "requests": len(records), "failed": len(records) - len(done),
        "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
        "ttft_after_first_turn_p50_ms": ms(later, 50), "ttft_after_first_turn_p99_ms": ms(later, 99),
        "tpot_p50_ms": ms(tpot, 50), "tpot_p99_ms": ms(tpot, 99),
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "hit_rate": round(hits / queries, 4) if queries else None,
        "engine_steps": counters["steps"], "wall_s": round(wall_s, 2),
    }  # fmt: skip


def run_phase(name: str, args: argparse.Namespace, geo: Geometry) -> dict[str, Any]:
    cache, shared = PHASES[name]
    args.engine_lines = [f"prefix_cache = {'true' if cache else 'false'}"]
    server, profile = appliance_server(geo, args, args.out.parent / f"{args.out.stem}-{name}.log")
    try:
        server.start(args.startup_timeout)
        before, t0 = engine_counters(server.url), time.monotonic()
        records = asyncio.run(conversations(server.url, args, shared))
        wall = time.monotonic() - t0
        after = engine_counters(server.url)
        delta = {k: after[k] - before[k] for k in after}
        result = summarize(records, delta, wall)
        result["startup_s"] = round(server.ready_after_s or 0.0, 1)
    finally:
        exit_code = server.stop(20.0)
    return {**result, "exit_code": exit_code, "profile": profile}


def main() -> None:
    ap = one_geometry_parser(__doc__)
    ap.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES))
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--turn-len", type=int, default=64, help="token ids of each user message")
    ap.add_argument("--output-len", type=int, default=64, help="tokens generated per turn")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = model_defaults(ap.parse_args())
    geo = Geometry.parse(args.geometry)
    report: dict[str, Any] = {
        **run_record(args),
        "phases": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.phases:
        report["phases"][name] = result = run_phase(name, args, geo)
        say(f"{name}: {json.dumps({k: v for k, v in result.items() if k != 'profile'})}")
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
