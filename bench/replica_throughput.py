"""Aggregate decode throughput of `replicas = N` against one engine (issue 27: data-parallel replicas).

On a host with N GPUs (one command; `dummy:llama-3.2-1b` bf16 at the shipped geometry):
    python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/replica_throughput.py --replicas 1 2 --out $OUT/replica_throughput.json
CPU smoke check of the script itself (reference engine, dummy:tiny; timings meaningless):
    .venv/bin/python bench/replica_throughput.py --device cpu --geometry 512/16/8/64 --replicas 1 2 --concurrency-per-replica 4 --output-len 32 --seconds 4 --out /tmp/replicas.json

Per replica count: one `blink-appliance up` whose model section says `replicas = N` (the replicas take
the devices from --device on), then --concurrency-per-replica x N closed-loop clients, each sending
its next generation (--output-len tokens, ignore_eos, greedy) as the last one ends, for --seconds
after --warmup-s. Streamed or whole responses (--stream): whole ones keep the one front end's
per-token work out of the way, so the number is the engines'. Tokens per second come from the
engines' generated-token counter (summed over replicas) across the timed window; the front end's
CPU share over the window says when the one front end, not the GPUs, is the limit.
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

from bench.frontend_load import child_pid, cpu_s  # noqa: E402
from bench.http_sweep import (  # noqa: E402
    MODEL_NAME,
    Geometry,
    appliance_server,
    gpu_name,
    model_defaults,
    one_geometry_parser,
    run_record,
)
from bench.priority_load import generated_tokens, prompt  # noqa: E402
from blink_appliance.bench.load_generator import LoadConfig, RequestRecord, send_one  # noqa: E402


def say(message: str) -> None:
    print(f"[replica_throughput] {message}", file=sys.stderr, flush=True)


async def closed_loop(url: str, args: argparse.Namespace, clients: int) -> dict[str, Any]:
    """`clients` closed-loop clients for warm-up + --seconds; the engines' tokens over the timed part."""
    import aiohttp

    config = LoadConfig(base_url=url, model=MODEL_NAME, stream=args.stream, request_timeout_s=3600)
    stop, counts = asyncio.Event(), {"completed": 0, "failed": 0}

    async def client(k: int, session: aiohttp.ClientSession) -> None:
        rng, t0 = random.Random(args.seed + k), time.perf_counter()
        while not stop.is_set():
            record = RequestRecord(0, args.output_len, args.input_len)
            await send_one(session, config, prompt(args, rng, args.output_len), record, t0)
            counts["completed" if record.ok else "failed"] += 1

    frontend = child_pid("blink_appliance.frontend")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(client(k, session)) for k in range(clients)]
        await asyncio.sleep(args.warmup_s)
        tokens0, cpu0, t0 = await asyncio.to_thread(generated_tokens, url), cpu_s(frontend), time.monotonic()
        await asyncio.sleep(args.seconds)
        tokens1, cpu1, t1 = await asyncio.to_thread(generated_tokens, url), cpu_s(frontend), time.monotonic()
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "clients": clients, "seconds": round(t1 - t0, 2),
        "tokens_per_s": round((tokens1 - tokens0) / (t1 - t0), 1),
        "frontend_cpu_share": round((cpu1 - cpu0) / (t1 - t0), 3), **counts,
    }  # fmt: skip


def main() -> None:
    ap = one_geometry_parser(__doc__)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--concurrency-per-replica", type=int, default=None, help="default: the geometry's max_seqs"
    )
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--stream", action="store_true", help="streamed responses (default: whole ones)")
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = model_defaults(ap.parse_args())
    geo = Geometry.parse(args.geometry)
    per_replica = args.concurrency_per_replica or geo.max_seqs
    report: dict[str, Any] = {
        "gpu": gpu_name(args.device),
        **run_record(args),
        "runs": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for n in args.replicas:
        args.model_lines = [f"replicas = {n}"]
        server, profile = appliance_server(geo, args, args.out.parent / f"{args.out.stem}-r{n}.log")
        run: dict[str, Any] = {"replicas": n, "profile": profile}
        report["runs"].append(run)
        try:
            server.start(args.startup_timeout)
            run["startup_s"] = round(server.ready_after_s or 0.0, 1)
            run.update(asyncio.run(closed_loop(server.url, args, per_replica * n)))
            say(f"replicas {n}: {json.dumps({k: v for k, v in run.items() if k != 'profile'})}")
        except Exception as e:  # noqa: BLE001 - recorded, and the next count still runs
            run["error"] = f"{type(e).__name__}: {e}"
            say(f"replicas {n}: {run['error']}")
        finally:
            run["exit_code"] = server.stop(20.0)
            args.out.write_text(json.dumps(report, indent=1))
    base = next(
        (r["tokens_per_s"] for r in report["runs"] if r.get("replicas") == 1 and "tokens_per_s" in r), None
    )
    for r in report["runs"]:
        if base and "tokens_per_s" in r:
            r["speedup_vs_one"] = round(r["tokens_per_s"] / base, 2)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps([{k: v for k, v in r.items() if k != "profile"} for r in report["runs"]], indent=1))


if __name__ == "__main__":
    main()
