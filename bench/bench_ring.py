"""Ring benchmark: round-trip latency of an empty request and admissions per second.

The engine runs in its own process (multiprocessing spawn) under EngineServer; the front end is
this process's EngineClient, as in the appliance. `--engine trivial` (default) is an engine that
answers every request with one token in one step and does no model work, so the numbers are the
ring, the server loop and the client pump; `--engine tiny` uses the reference engine on the random
dummy:tiny model (needs blink_appliance.engine.reference.engine).

    .venv/bin/python bench/bench_ring.py [--engine trivial|tiny] [--requests 2000] [--burst 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass

from blink_appliance.engine.reference.server import EngineServer
from blink_appliance.wire.client import EngineBusyError, EngineClient
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.request import FinishReason, Request, SamplingParams, TokenEvent
from blink_appliance.wire.ring_layout import RingGeometry, region_size
from blink_appliance.wire.shm_transport import ShmTransport

GEOMETRY = RingGeometry(
    request_slots=1024,
    arena_tokens=1 << 16,
    max_prompt_tokens=64,
    max_inflight=4096,
    max_output_tokens=8,
    max_stop_ids=4,
)


@dataclass
class _TrivialStats:
    running: int = 0
    waiting: int = 0
    steps: int = 0
    generated_tokens: int = 0


class TrivialEngine:
    """One token (the prompt's first) per request, finished in the step after admission."""

    vocab_size = 1 << 20

    def __init__(self) -> None:
        self.pending: list[Request] = []
        self.stats_ = _TrivialStats()

    def add_request(self, request: Request) -> None:
        self.pending.append(request)

    def abort(self, request_id: int) -> None:
        self.pending = [r for r in self.pending if r.request_id != request_id]

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[TokenEvent]:
        done, self.pending = self.pending, []
        self.stats_.steps += 1
        self.stats_.generated_tokens += len(done)
        return [TokenEvent(r.request_id, r.prompt_token_ids[0], FinishReason.LENGTH) for r in done]

    def stats(self) -> _TrivialStats:
        return self.stats_


def _make_engine(kind: str):
    if kind == "trivial":
        return TrivialEngine()
    import torch

    from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine
    from blink_appliance.model.loaders import build_model, load_checkpoint

    return LLMEngine(build_model(load_checkpoint("dummy:tiny"), torch.float32, "cpu"), EngineConfig())


def _engine_main(name: str, kind: str) -> None:
    transport = ShmTransport.open(name)
    try:
        EngineServer(_make_engine(kind), transport, GEOMETRY).run(threading.Event())
    finally:
        transport.close()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _bench(name: str, transport: ShmTransport, args: argparse.Namespace) -> dict[str, float]:
    client = EngineClient.attach(transport, GEOMETRY)
    await client.start()
    deadline = time.monotonic() + 120
    while not client.engine_alive:
        if time.monotonic() > deadline:
            raise SystemExit("engine did not start")
        await asyncio.sleep(0.01)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = [1]

    async def round_trip() -> float:
        t0 = time.perf_counter_ns()
        async for _ in client.stream(client.submit(prompt, params)):
            pass
        return (time.perf_counter_ns() - t0) / 1e3

    for _ in range(200):  # warm up
        await round_trip()
    latencies = [await round_trip() for _ in range(args.requests)]

    # Admissions: a burst of empty requests, submitted as fast as the ring takes them.
    t0 = time.perf_counter()
    ids, busy = [], 0
    while len(ids) < args.burst:
        try:
            ids.append(client.submit(prompt, params))
        except EngineBusyError:
            busy += 1
            await asyncio.sleep(0)
    submitted = time.perf_counter() - t0
    for rid in ids:
        async for _ in client.stream(rid):
            pass
    completed = time.perf_counter() - t0
    await client.close()
    return {
        "rt_p50_us": statistics.median(latencies),
        "rt_p99_us": _pct(latencies, 0.99),
        "rt_mean_us": statistics.fmean(latencies),
        "rt_min_us": min(latencies),
        "burst": args.burst,
        "burst_busy_retries": busy,
        "admitted_per_s": args.burst / submitted,
        "completed_per_s": args.burst / completed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("trivial", "tiny"), default="trivial")
    parser.add_argument("--requests", type=int, default=2000, help="sequential round trips to time")
    parser.add_argument("--burst", type=int, default=5000, help="requests in the admissions burst")
    args = parser.parse_args()
    name = f"blink-bench-{os.getpid()}"
    transport = ShmTransport.create(name, region_size(GEOMETRY))
    RingRegion.create(transport, GEOMETRY)
    proc = mp.get_context("spawn").Process(target=_engine_main, args=(name, args.engine), daemon=True)
    proc.start()
    try:
        result = asyncio.run(_bench(name, transport, args))
        transport.store_u64(RingRegion(transport, GEOMETRY).layout.control("shutdown"), 1)
        proc.join(20)
    finally:
        if proc.is_alive():
            proc.kill()
        transport.close()
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} python={platform.python_version()}"
    )
    print(f"engine: {args.engine}; round trips: {args.requests}; geometry: {GEOMETRY}")
    for key, value in result.items():
        print(f"{key:>22}: {value:,.1f}" if isinstance(value, float) else f"{key:>22}: {value}")


if __name__ == "__main__":
    main()
