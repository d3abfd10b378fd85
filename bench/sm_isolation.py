"""Two models on one GPU from one profile (issue 21): does each keep its latency when the other is busy?

On the GPU (one command; two `dummy:llama-3.2-1b` bf16 models, random weights with the real shapes):
    python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/sm_isolation.py --out $OUT/sm_isolation.json

Setups, each one `blink-appliance up` on a generated profile (the shipped geometry per model unless
--geometry says otherwise, kv_fraction split between the models):
  - "partitioned": models a and b with sm_count --sm-counts (e.g. 32 and 100);
  - "shared": the same two models without sm_count (both may use every SM);
  - "whole": model a alone on the GPU.
Per setup: each model's batch-1 greedy TPOT (P50/P99 over --requests streams of --output-len tokens)
alone, then while the other model is saturated (waves of --saturate-batch streams, back to back);
then both saturated together for --throughput-s seconds: tokens/s of each and their sum.
Correctness (--check): two small fp32 models (different seeds) served partitioned on the GPU and by
the CPU reference engine; their greedy completions must be equal, token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.http_sweep import ms, request_tpot_s  # noqa: E402
from bench.server_process import ServerProcess  # noqa: E402
from blink_appliance.bench.datasets import BenchRequest  # noqa: E402
from blink_appliance.bench.load_generator import LoadConfig, run_load  # noqa: E402

NAMES = ("a", "b")


def profile_text(setup: str, args: argparse.Namespace, shm: str) -> str:
    """The two-model (or, for "whole", one-model) profile of a setup."""
    mml, slots, seqs, budget = (int(x) for x in args.geometry.split("/"))
    names = NAMES[:1] if setup == "whole" else NAMES
    lines = ["[appliance]", f'name = "sm-isolation"\nshm_name = "{shm}"\ndrain_timeout_s = 5']
    for k, name in enumerate(names):
        lines += [
            "\n[[models]]",
            f'name = "{name}"\nsource = "{args.model}"\ndtype = "bfloat16"\ndevice = "cuda:0"\nseed = {k}',
            f"max_seqs = {seqs}\nmax_model_len = {mml}\nmax_num_batched_tokens = {budget}\nblock_size = 16",
            f"kv_fraction = {0.85 / len(names):.3f}",
        ]
        if setup == "partitioned":
            lines.append(f"sm_count = {args.sm_counts[k]}")
    lines += ["\n[engine]", 'mode = "loop"', f"num_slots = {slots}"]
    lines += ["\n[frontend]", 'host = "127.0.0.1"\nport = 0', f"max_inflight = {2 * slots}"]
    lines += ["\n[telemetry]", "interval_s = 0.1"]  # fresh engine step times for step_times()
    return "\n".join(lines) + "\n"


def check_profile_text(device: str, shm: str, sm_counts: list[int]) -> str:
    """Two small fp32 models (seeds 0 and 1): partitioned on the GPU, or on the CPU reference engine."""
    lines = ["[appliance]", f'name = "sm-check"\nshm_name = "{shm}"\ndrain_timeout_s = 5']
    for k, name in enumerate(NAMES):
        lines += [
            "\n[[models]]",
            f'name = "{name}"\nsource = "dummy:smollm2-135m"\ndtype = "float32"\ndevice = "{device}"',
            f"seed = {k}\nmax_seqs = 8\nmax_model_len = 512\nmax_num_batched_tokens = 256",
            "kv_budget_gib = 0.25",
        ]
        if device != "cpu":
            lines.append(f"sm_count = {sm_counts[k]}")
    lines += ["\n[frontend]", 'host = "127.0.0.1"\nport = 0']
    return "\n".join(lines) + "\n"


def server_for(text: str, label: str, out_dir: Path) -> ServerProcess:
    work = Path(tempfile.mkdtemp(prefix="blink-iso-"))
    (path := work / "profile.toml").write_text(text)
    argv = [sys.executable, "-m", "blink_appliance.cli", "up", str(path)]
    return ServerProcess(label, argv, out_dir / f"sm_isolation-{label}.log")


def say(message: str) -> None:
    print(f"[sm_isolation] {message}", file=sys.stderr, flush=True)


def requests(n: int, args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    return [
        BenchRequest([rng.randrange(3, 1000) for _ in range(args.input_len)], args.input_len, args.output_len)
        for _ in range(n)
    ]


async def step_times(url: str, model: str, stop: asyncio.Event) -> list[float]:
    """The engine's own step time (device clock, schedule to commit: `last_step_ns`) of `model`,
    read from /telemetry whenever its step count moved, until `stop`: what the GPU did, apart from
    how the front end and the client delivered it."""
    import aiohttp

    seen, out = None, []
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            async with session.get(f"{url}/telemetry") as r:
                snapshot = await r.json()
            engine = next((m["engine"] for m in snapshot["models"] if m["name"] == model), None) or {}
            if engine.get("steps") != seen and engine.get("last_step_ns"):
                seen = engine["steps"]
                out.append(engine["last_step_ns"] / 1e9)
            await asyncio.sleep(0.1)
    return out


async def b1_tpot(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """--requests batch-1 greedy streams one after another: TPOT P50 / P99 at the client, and the
    engine's step time sampled meanwhile."""
    rng, tpots, failed = random.Random(1), [], 0
    stop = asyncio.Event()
    sampler = asyncio.create_task(step_times(url, model, stop))
    for _ in range(args.requests):
        config = LoadConfig(base_url=url, model=model, ignore_eos=True)
        run = await run_load(requests(1, args, rng), config)
        failed += sum(not r.ok for r in run.records)
        tpots += [t for r in run.records if (t := request_tpot_s(r)) is not None]
    stop.set()
    steps = await sampler
    return {
        "tpot_p50_ms": ms(tpots, 50), "tpot_p99_ms": ms(tpots, 99), "streams": len(tpots), "failed": failed,
        "engine_step_p50_ms": ms(steps, 50), "engine_step_p99_ms": ms(steps, 99), "engine_step_samples": len(steps),
    }  # fmt: skip


async def saturate(url: str, model: str, args: argparse.Namespace, stop: asyncio.Event) -> dict[str, Any]:
    """Waves of --saturate-batch greedy streams until `stop`: tokens and seconds."""
    rng, tokens, failed, t0 = random.Random(2), 0, 0, time.monotonic()
    while not stop.is_set():
        config = LoadConfig(base_url=url, model=model, ignore_eos=True)
        run = await run_load(requests(args.saturate_batch, args, rng), config)
        tokens += sum(r.output_tokens for r in run.records if r.ok)
        failed += sum(not r.ok for r in run.records)
    seconds = time.monotonic() - t0
    return {
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "failed": failed,
    }


async def while_saturated(url: str, probe: str, busy: str, args: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    load = asyncio.create_task(saturate(url, busy, args, stop))
    await asyncio.sleep(1.0)  # the busy model's first wave is running before the probe starts
    result = await b1_tpot(url, probe, args)
    stop.set()
    result["other"] = await load
    return result


async def both_saturated(url: str, models: tuple[str, ...], args: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    loads = [asyncio.create_task(saturate(url, m, args, stop)) for m in models]
    await asyncio.sleep(args.throughput_s)
    stop.set()
    results = dict(zip(models, await asyncio.gather(*loads), strict=True))
    results["sum_tokens_per_s"] = round(sum(r["tokens_per_s"] for r in results.values()), 1)
    return results


async def measure(url: str, setup: str, args: argparse.Namespace) -> dict[str, Any]:
    models = NAMES[:1] if setup == "whole" else NAMES
    out: dict[str, Any] = {}
    await b1_tpot(url, models[0], args)  # warm-up
    for m in models:
        out[f"{m}_alone"] = await b1_tpot(url, m, args)
        say(f"{setup}: {m} alone {out[f'{m}_alone']}")
    if len(models) == 2:
        for m, other in (("a", "b"), ("b", "a")):
            out[f"{m}_with_{other}_saturated"] = r = await while_saturated(url, m, other, args)
            alone = out[f"{m}_alone"]
            r["p99_vs_alone"] = round(r["tpot_p99_ms"] / alone["tpot_p99_ms"], 3)
            if r["engine_step_p50_ms"] and alone["engine_step_p50_ms"]:
                r["engine_step_p50_vs_alone"] = round(
                    r["engine_step_p50_ms"] / alone["engine_step_p50_ms"], 3
                )
            say(f"{setup}: {m} with {other} saturated {r}")
    out["saturated"] = await both_saturated(url, models, args)
    say(f"{setup}: saturated {out['saturated']}")
    return out


async def completions(url: str, model: str, prompts: list[list[int]], n: int) -> list[str]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        texts = []
        for p in prompts:
            body = {"model": model, "prompt": p, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
            async with session.post(f"{url}/v1/completions", json=body) as r:
                texts.append((await r.json())["choices"][0]["text"])
        return texts


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Greedy completions of both models, partitioned on the GPU vs the CPU reference engine."""
    prompts = [[5, 17, 33, 2, 9, 100, 7], [44, 3, 8], list(range(10, 40))]
    got = {}
    for device in ("cuda:0", "cpu"):
        text = check_profile_text(device, f"blink-check-{os.getpid()}-{device[:3]}", args.sm_counts)
        server = server_for(text, f"check-{device[:3]}", args.out.parent)
        try:
            server.start(args.startup_timeout)
            got[device] = {m: asyncio.run(completions(server.url, m, prompts, 24)) for m in NAMES}
        finally:
            server.stop(15.0)
    equal = {m: got["cuda:0"][m] == got["cpu"][m] for m in NAMES}
    distinct = got["cpu"]["a"] != got["cpu"]["b"]  # the two models really are two models
    say(f"check: greedy equal to the CPU reference {equal}; the models differ: {distinct}")
    return {"equal": equal, "models_differ": distinct, "completions": got}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:llama-3.2-1b")
    p.add_argument("--geometry", default="8192/1024/256/2048", help="max_model_len/num_slots/max_seqs/budget")
    p.add_argument("--sm-counts", type=int, nargs=2, default=[32, 100])
    p.add_argument("--setups", nargs="+", default=["partitioned", "shared", "whole"])
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--saturate-batch", type=int, default=64)
    p.add_argument("--throughput-s", type=float, default=10.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--check", action="store_true")
    p.add_argument("--out", type=Path, default=Path("/tmp/sm_isolation.json"))
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "setups": {},
    }

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=1))

    if args.check:
        report["check"] = check(args)
        save()
    for setup in args.setups:
        text = profile_text(setup, args, f"blink-iso-{os.getpid()}-{setup}")
        server = server_for(text, setup, args.out.parent)
        entry: dict[str, Any] = {"profile": text}
        report["setups"][setup] = entry
        try:
            server.start(args.startup_timeout)
            entry["startup_s"] = round(server.ready_after_s or 0.0, 1)
            say(f"{setup}: serving after {entry['startup_s']} s")
            entry.update(asyncio.run(measure(server.url, setup, args)))
        except Exception as e:  # keep what the other setups measure
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["log_tail"] = server.log_tail(30)
            say(f"{setup}: {entry['error']}")
        finally:
            entry["exit_code"] = server.stop(20.0)
            save()


if __name__ == "__main__":
    main()
