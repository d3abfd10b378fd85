"""Latency-sensitive requests beside a best-effort load that fills the GPU (issue 22: priority classes).

On the GPU (one command; `dummy:llama-3.2-1b` bf16 at the shipped geometry):
    python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/priority_load.py --out $OUT/priority_load.json
CPU smoke check of the script itself (reference engine, dummy:tiny; timings meaningless):
    .venv/bin/python bench/priority_load.py --device cpu --geometry 512/16/8/64 --be-concurrency 8 --be-output-len 64 --ls-output-len 8 --seconds 4 --out /tmp/priority.json

One `blink-appliance up`. Latency-sensitive (LS) requests arrive by Poisson (--ls-rate per second for
--seconds; streamed, --ls-output-len tokens) with priority 0, in four phases:
  - "ls_alone": nothing else runs;
  - "priority": best-effort (BE) load runs meanwhile, --be-concurrency closed-loop clients of
    --be-output-len-token generations, not streamed (so the one front end stays off the critical path), priority 1;
  - "fcfs": the same BE load in the LS class (priority 0): one class, first come first served;
  - "be_alone": the BE load alone, for its throughput.
Per phase: LS TTFT and TPOT P50/P99, and the BE tokens per second (the engine's generated-token
counter over the phase, less the LS tokens). The report also gives the host's speed (`host_probe_s`)
and, per phase, the LS clients' own send time (`send_p50_ms`): tails compare only between runs on
hosts of like speed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blink_appliance.frontend.loop_lag import STACK_ENV  # noqa: E402

from bench.frontend_load import TICKS, child_pid, cpu_s, folded_summary  # noqa: E402
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
from blink_appliance.bench.load_generator import (  # noqa: E402
    LoadConfig,
    RequestRecord,  # noqa: E402
    run_load,
    send_one,
)


def say(message: str) -> None:
    print(f"[priority_load] {message}", file=sys.stderr, flush=True)


def generated_tokens(url: str) -> int:
    return int(engine_telemetry(url)["generated_tokens"])


def scheduling(pid: int | None) -> dict[str, float]:
    """What the OS did to the front end's event-loop thread (its main thread) so far: seconds it
    waited runnable for a CPU (/proc/<pid>/schedstat), its involuntary context switches, and the
    cgroup's CPU throttling (cpu.stat) and the CPUs' steal time, if the kernel shows them."""
    out: dict[str, float] = {}
    if pid is not None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            out["runqueue_wait_s"] = int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("nonvoluntary_ctxt_switches"):
                    out["involuntary_switches"] = int(line.split()[1])
    with contextlib.suppress(OSError, ValueError, IndexError):
        # The host's time taken from this machine's CPUs (a VM's steal), summed over them.
        ticks = Path("/proc/stat").read_text().splitlines()[0].split()
        out["steal_s"] = int(ticks[8]) / TICKS
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/sys/fs/cgroup/cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("nr_throttled", "throttled_usec"):
                out[f"cgroup_{key}"] = int(value)
    return out


_HISTOGRAMS = {  # the front end's histograms a phase reports, by the name it reports them under
    "blink_frontend_loop_lag_seconds": lambda labels: "loop_lag",
    "blink_frontend_gc_pause_seconds": lambda labels: f"frontend_gc_gen{labels['generation']}",
    "blink_first_token_part_seconds": lambda labels: f"ls_ttft_{labels['part']}",
}


def histograms(url: str) -> dict[str, dict[str, float]]:
    """The front end's histograms a phase reports, so far, from one read of /metrics: the
    event-loop lag, the garbage-collection pauses per generation, and the LS class's (priority 0)
    time to first token in parts. For each: how many, their total seconds, and how many went over
    each bucket's bound."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        name_of = _HISTOGRAMS.get(family.name)
        if name_of is None:
            continue
        for sample in family.samples:
            labels = sample.labels
            if labels.get("priority", "0") != "0":
                continue
            entry = out.setdefault(name_of(labels), {})
            if sample.name.endswith("_count"):
                entry["count"] = sample.value
            elif sample.name.endswith("_sum"):
                entry["seconds"] = sample.value
            elif sample.name.endswith("_bucket") and labels["le"] != "+Inf":
                entry[f"le_{float(labels['le']) * 1e3:g}ms"] = sample.value
    for entry in out.values():  # bucket counts -> how many were over each bound
        for key in [k for k in entry if k.startswith("le_")]:
            entry[f"over_{key[3:]}"] = entry.get("count", 0.0) - entry.pop(key)
    return out


def since(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """What `histograms` counted between two readings."""
    return {
        name: {k: v - before.get(name, {}).get(k, 0.0) for k, v in entry.items()}
        for name, entry in after.items()
    }


def stall_record() -> dict[str, Any]:
    """What the front end's stall watcher has counted so far (empty when not asked for)."""
    path = os.environ.get(STACK_ENV)
    try:
        return json.loads(Path(path).read_text()) if path else {}
    except (OSError, ValueError):
        return {}


def stalls_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The stall stacks and slow callbacks counted between two stall records, the largest first."""
    stacks = collections.Counter(after.get("stacks", {})) - collections.Counter(before.get("stacks", {}))
    slow = {}
    for key, (n, total, longest) in after.get("slow_callbacks", {}).items():
        n0, total0, _ = before.get("slow_callbacks", {}).get(key, (0, 0.0, 0.0))
        if n > n0:
            slow[key] = {
                "count": n - n0,
                "seconds": round(total - total0, 4),
                "longest_ms": round(longest * 1e3, 1),
            }
    top = sorted(slow.items(), key=lambda kv: -kv[1]["seconds"])[:15]
    others = collections.Counter(after.get("other_threads", {})) - collections.Counter(
        before.get("other_threads", {})
    )
    seen = {tuple(b) for b in before.get("late_beats", [])}
    late = [b for b in after.get("late_beats", []) if tuple(b) not in seen]
    return {
        "stacks": dict(stacks.most_common(15)), "slow_callbacks": dict(top),
        "other_threads": dict(others.most_common(10)), "late_beats": late_beats_summary(late),
    }  # fmt: skip


def host_probe_s() -> float:
    """Seconds this host's Python takes for a fixed loop: runs compare only on hosts of like speed."""
    started = time.perf_counter()
    sum(range(10**7))
    return round(time.perf_counter() - started, 3)


def late_beats_summary(late: list[list]) -> dict[str, Any]:
    """The front end's late beats (frontend/loop_lag.py): how much of their lateness callbacks
    account for (loop work) and how much the loop thread spent outside them."""
    if not late:
        return {"count": 0}
    lag = sum(b[1] for b in late)
    in_callbacks = sum(b[3] for b in late)
    longest = collections.Counter(b[4] for b in late if b[5] > 0.001)
    return {
        "count": len(late), "lag_s": round(lag, 4), "in_callbacks_s": round(in_callbacks, 4),
        "mostly_outside_callbacks": sum(b[3] < 0.5 * b[1] for b in late),
        "callbacks_per_late_beat_p50": sorted(b[2] for b in late)[len(late) // 2],
        "longest_callbacks": dict(longest.most_common(8)),
        "beats": late[:300],  # [time s, lag s, callbacks, their s, the longest's key, its s]
    }  # fmt: skip


def prompt(args: argparse.Namespace, rng: random.Random, output_len: int) -> BenchRequest:
    return BenchRequest(
        [rng.randrange(3, args.vocab) for _ in range(args.input_len)], args.input_len, output_len
    )


async def ls_phase(url: str, args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """Poisson LS arrivals for --seconds: TTFT / TPOT percentiles, and the LS tokens made."""
    rng = random.Random(args.seed)
    n = max(1, int(args.ls_rate * args.seconds))
    config = LoadConfig(
        base_url=url, model=MODEL_NAME, request_rate=args.ls_rate, seed=args.seed, priority=0,
        request_timeout_s=args.seconds + 120,
    )  # fmt: skip
    run = await run_load([prompt(args, rng, args.ls_output_len) for _ in range(n)], config)
    done = [r for r in run.records if r.ok]
    tpots = [t for r in done if (t := request_tpot_s(r)) is not None]
    ttfts = [t for r in done if (t := r.ttft_s) is not None]
    out = {
        "requests": n, "completed": len(done), "failed": n - len(done),
        "ttft_p50_ms": ms(ttfts, 50), "ttft_p99_ms": ms(ttfts, 99),
        "tpot_p50_ms": ms(tpots, 50), "tpot_p99_ms": ms(tpots, 99),
        "ttft_slowest_ms": [round(t * 1e3, 1) for t in sorted(ttfts)[-5:]],
        # The clients' own time to write a request: 0.05-0.1 ms on a quick host, 5-10x that on hosts
        # where every front-end callback also ran several times longer (2026-11-27-h100-last-batch-turns.md).
        "send_p50_ms": ms([r.sent_s - r.connected_s for r in done if r.sent_s and r.connected_s], 50),
        # Those five in parts: the client's connect and send, the server's reply up to the stream's
        # headers (parsed, prepared, submitted), then up to the first token.
        "ttft_slowest_parts_ms": [ttft_parts_ms(r) for r in sorted(done, key=lambda r: r.ttft_s or 0)[-5:]],
        "errors": sorted({r.error for r in run.records if r.error})[:3],
    }  # fmt: skip
    return out, sum(r.output_tokens for r in done)


def ttft_parts_ms(r: RequestRecord) -> dict[str, float]:
    """A request's time to first token in the parts the client saw, in ms."""
    marks = {
        "connect": r.connected_s,
        "send": r.sent_s,
        "headers": r.headers_s,
        "first_token": r.chunk_times_s[0],
    }
    out, before = {}, r.start_s
    for part, at in marks.items():
        out[part] = round((at - before) * 1e3, 2)
        before = at
    return out


def be_process(url: str, args: argparse.Namespace, priority: int, stop: Any, out: Any) -> None:
    """The BE load in a process of its own: its client work (256 responses of 2k tokens parsed at
    once) must not delay the LS clients' sends and reads, which the phase times."""

    async def until_stopped() -> dict[str, Any]:
        done = asyncio.Event()
        waiter = asyncio.create_task(asyncio.to_thread(stop.wait))
        waiter.add_done_callback(lambda _: done.set())
        return await be_load(url, args, priority, done)

    out.put(asyncio.run(until_stopped()))


async def be_load(url: str, args: argparse.Namespace, priority: int, stop: asyncio.Event) -> dict[str, Any]:
    """--be-concurrency clients, each sending its next BE generation as the last one ends, until
    `stop` (those in flight are then cancelled: the client disconnects)."""
    import aiohttp

    config = LoadConfig(
        base_url=url, model=MODEL_NAME, stream=False, priority=priority, request_timeout_s=3600,
    )  # fmt: skip
    counts = {"completed": 0, "failed": 0}

    async def client(k: int, session: aiohttp.ClientSession) -> None:
        rng, t0 = random.Random(1000 + k), time.perf_counter()
        while not stop.is_set():
            record = RequestRecord(0, args.be_output_len, args.input_len)
            await send_one(session, config, prompt(args, rng, args.be_output_len), record, t0)
            counts["completed" if record.ok else "failed"] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(client(k, session)) for k in range(args.be_concurrency)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return counts


async def health_latency(url: str, stop: asyncio.Event, every_s: float = 0.02) -> list[float]:
    """GET /health every `every_s` until `stop`: how long the front end's event loop takes to answer."""
    import aiohttp

    took: list[float] = []
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            t0 = time.perf_counter()
            async with session.get(f"{url}/health") as response:
                await response.read()
            took.append(time.perf_counter() - t0)
            await asyncio.sleep(every_s)
    return took


async def client_lag(stop: asyncio.Event, every_s: float = 0.002) -> dict[str, int]:
    """How late this process's event loop (the LS clients' and the /health probe's) ran a timer due
    every `every_s`, until `stop`: a client-side delay counts in the TTFT this bench measures."""
    late: list[float] = []
    while not stop.is_set():
        due = time.perf_counter() + every_s
        await asyncio.sleep(every_s)
        late.append(time.perf_counter() - due)
    return {"beats": len(late), **{f"over_{b}ms": sum(x > b / 1e3 for x in late) for b in (5, 10, 20)}}


async def phase(url: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    be_priority = {"priority": 1, "fcfs": 0, "be_alone": 1}.get(name)
    spawn = multiprocessing.get_context("spawn")
    stop, be_out = spawn.Event(), spawn.Queue()
    be = None
    if be_priority is not None:
        be = spawn.Process(target=be_process, args=(url, args, be_priority, stop, be_out), daemon=True)
        be.start()
        await asyncio.sleep(args.be_warmup_s)  # the BE clients fill the running batch first
    frontend = child_pid("blink_appliance.frontend")
    cpu0 = cpu_s(frontend) if frontend else 0.0
    probe_stop = asyncio.Event()
    probe = asyncio.create_task(health_latency(url, probe_stop))
    own_lag = asyncio.create_task(client_lag(probe_stop)) if args.client_lag else None
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    folded = args.out.parent / f"{args.out.stem}-{name}.folded"
    sampler = None
    if args.profile_frontend and spy and frontend:
        sampler = subprocess.Popen(
            [spy, "record", "-p", str(frontend), "-d", str(int(args.seconds)), "-r", "200", "-f", "raw",
             "-o", str(folded), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    tokens0, t0 = await asyncio.to_thread(generated_tokens, url), time.monotonic()
    sched0 = scheduling(frontend)
    hist0 = await asyncio.to_thread(histograms, url)
    stalls0 = stall_record()
    if name == "be_alone":
        await asyncio.sleep(args.seconds)
        result, ls_tokens = {}, 0
    else:
        result, ls_tokens = await ls_phase(url, args)
    tokens1, seconds = await asyncio.to_thread(generated_tokens, url), time.monotonic() - t0
    probe_stop.set()
    health = await probe
    if own_lag is not None:
        result["client_loop_lag"] = await own_lag
    # The one front end carries every stream: its CPU and how late it answers /health.
    result["frontend_cpu_share"] = round((cpu_s(frontend) - cpu0) / seconds, 3) if frontend else None
    result["health_p50_ms"], result["health_p99_ms"] = ms(health, 50), ms(health, 99)
    result.update(since(hist0, await asyncio.to_thread(histograms, url)))
    result["frontend_scheduling"] = {
        k: round(v - sched0.get(k, 0), 4) for k, v in scheduling(frontend).items()
    }
    if STACK_ENV in os.environ:
        await asyncio.sleep(1.2)  # the watcher rewrites its file once a second
        result["stalls"] = stalls_since(stalls0, stall_record())
    if sampler is not None:
        await asyncio.to_thread(sampler.wait, args.seconds + 60)
        if folded.exists():
            result["frontend_profile"] = folded_summary(folded, "frontend/", 12)
    stop.set()
    if be is not None:
        result["be"] = await asyncio.to_thread(be_out.get, True, 120)
        be.join(30)
        result["be_tokens_per_s"] = round((tokens1 - tokens0 - ls_tokens) / seconds, 1)
    result["seconds"] = round(seconds, 2)
    return result


def main() -> None:
    ap = one_geometry_parser(__doc__)
    ap.add_argument("--phases", nargs="+", default=["ls_alone", "priority", "fcfs", "be_alone"])
    ap.add_argument("--ls-rate", type=float, default=4.0, help="LS requests per second (Poisson)")
    ap.add_argument("--ls-output-len", type=int, default=128)
    ap.add_argument("--be-concurrency", type=int, default=256)
    ap.add_argument("--be-output-len", type=int, default=2048)
    ap.add_argument("--be-warmup-s", type=float, default=8.0)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument(
        "--lower-class-limit",
        type=int,
        default=None,
        help="[engine] lower_class_limit (0: pause; default: no cap)",
    )
    ap.add_argument("--aging-steps", type=int, default=0, help="[engine] priority_aging_steps (0: off)")
    ap.add_argument(
        "--best-effort-batch",
        type=int,
        default=None,
        help="[engine] best_effort_batch (default: unset, no turns)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-frontend", action="store_true", help="sample the front end with py-spy")
    ap.add_argument(
        "--client-lag", action="store_true",
        help="time this process's own event loop with a 2 ms timer (it also wakes the process that often)",
    )  # fmt: skip
    ap.add_argument(
        "--stall-stacks", action="store_true",
        help="count the front end's stacks while its event loop is late (frontend/loop_lag.py)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, required=True)
    args = model_defaults(ap.parse_args())
    args.engine_lines = [f"priority_aging_steps = {args.aging_steps}"]
    if args.lower_class_limit is not None:
        args.engine_lines.append(f"lower_class_limit = {args.lower_class_limit}")
    if args.best_effort_batch is not None:
        args.engine_lines.append(f"best_effort_batch = {args.best_effort_batch}")
    geo = Geometry.parse(args.geometry)
    report: dict[str, Any] = {
        **run_record(args),
        "phases": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.stall_stacks:
        os.environ[STACK_ENV] = str(args.out.parent / f"{args.out.stem}-stalls.json")
    server, report["profile"] = appliance_server(geo, args, args.out.parent / f"{args.out.stem}.log")
    try:
        server.start(args.startup_timeout)
        report["startup_s"] = round(server.ready_after_s or 0.0, 1)
        report["host_probe_s"] = host_probe_s()
        for name in args.phases:
            report["phases"][name] = result = asyncio.run(phase(server.url, name, args))
            say(f"{name}: {json.dumps(result)}")
            args.out.write_text(json.dumps(report, indent=1))
            server.wait_idle(60.0)  # the cancelled BE requests leave before the next phase
    finally:
        report["exit_code"] = server.stop(20.0)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
