"""Host CPU time of the engine process per 1,000 generated tokens, and TPOT, for each engine mode.

The engine runs as `up` runs it (`python -m blink_appliance.engine.process PROFILE`, its own process,
on a shared region this script creates as the daemon does); this process is the front end
(EngineClient). Per mode and batch size B: B greedy requests (16-token prompts, ignore_eos,
`--tokens` each) submitted together; the steady-state window runs from the moment every request
has produced `--skip` tokens to the moment the first one is `--skip` tokens from its end. Inside it:

- CPU: user + system seconds of the engine process (psutil, sampled every 5 ms by a thread here and
  interpolated at the window's ends) per 1,000 tokens stamped in the window;
- TPOT: differences between consecutive token stamps of one request (the engine's stamps from the
  ring: the device clock moved to host CLOCK_MONOTONIC for the loop), P50 / P99 over all requests.

Also the engine's CPU time while idle (2 s, no requests) and how long shutdown takes.

On the H100 (after `python3 -m pip install --no-deps --no-build-isolation -e .`):
    PYTHONUNBUFFERED=1 python3 bench/loop_cpu_time.py --out $OUT
CPU check of the harness itself (reference engine, tiny random model):
    .venv/bin/python bench/loop_cpu_time.py --device cpu --modes reference --model dummy:tiny \
        --batches 1 4 --tokens 48 --max-model-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blink_appliance.profile import load_profile, ring_geometry  # noqa: E402
from blink_appliance.wire.client import EngineClient  # noqa: E402
from blink_appliance.wire.region import RingRegion  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402
from blink_appliance.wire.ring_layout import EngineState, region_size  # noqa: E402
from blink_appliance.wire.shm_transport import ShmTransport  # noqa: E402

PROMPT_LEN = 16


def profile_text(args: argparse.Namespace, mode: str, shm_name: str) -> str:
    max_seqs = max(args.batches)
    return textwrap.dedent(
        f"""
        [appliance]
        shm_name = "{shm_name}"
        log_level = "warning"
        [[models]]
        name = "bench"
        source = "{args.model}"
        dtype = "{args.dtype}"
        device = "{args.device}"
        max_seqs = {max_seqs}
        max_model_len = {args.max_model_len}
        max_num_batched_tokens = {args.max_num_batched_tokens}
        kv_budget_gib = {args.kv_gib}
        [engine]
        mode = "{mode}"
        {"deterministic = true" if args.deterministic else ""}
        [frontend]
        max_inflight = {max(2 * max_seqs, 16)}
        """
    )


class CpuSampler:
    """(monotonic ns, user + system s) of one process every `period_s`, from a thread."""

    def __init__(self, pid: int, period_s: float = 0.005) -> None:
        self.proc = psutil.Process(pid)
        self.period_s = period_s
        self.samples: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        times = self.proc.cpu_times()
        self.samples.append((time.monotonic_ns(), times.user + times.system))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period_s)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def at(self, t_ns: int) -> float:
        """CPU seconds at t_ns, linear between the samples around it."""
        ts = [t for t, _ in self.samples]
        i = int(np.searchsorted(ts, t_ns))
        if i == 0 or i == len(ts):
            raise ValueError("time outside the sampled span")
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (t_ns - t0) / max(t1 - t0, 1)


def start_engine(profile_path: Path, region: RingRegion, timeout_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "blink_appliance.engine.process", str(profile_path)])
    deadline = time.monotonic() + timeout_s
    while not (region.load("engine_epoch") >= 1 and region.load("engine_state") == EngineState.RUNNING):
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with code {proc.returncode} while starting")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"engine did not start within {timeout_s:.0f}s")
        time.sleep(0.05)
    return proc


def prompt_id_limit(source: str) -> int:
    """Prompt token ids are drawn below this (inside any real vocabulary; dummy presets are smaller)."""
    if source.startswith("dummy:"):
        from blink_appliance.model.presets import preset_config

        return min(1000, preset_config(source.removeprefix("dummy:")).vocab_size)
    return 1000


async def generate(
    client: EngineClient,
    batch: int,
    tokens: int,
    seed: int,
    id_limit: int,
    constrained: int = 0,
    model: str = "",
) -> list[list[int]]:
    """`batch` requests at once; the engine's token stamps (ns) of each. `constrained` > 0: each
    request follows a one-state automaton allowing that many tokens (bench/structured_output.py)."""
    rng = np.random.default_rng(seed)
    params = [SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)] * batch
    if constrained:
        from bench.structured_output import automaton
        from blink_appliance.model.presets import preset_config

        config = preset_config(model.partition(":")[2])
        params = [
            SamplingParams(temperature=0.0, max_tokens=tokens, constraint=automaton(
                config.vocab_size, set(config.eos_token_ids), constrained, seed=seed * 1000 + i))
            for i in range(batch)
        ]  # fmt: skip
    ids = [client.submit(rng.integers(10, id_limit, PROMPT_LEN).tolist(), p) for p in params]

    async def stamps(rid: int) -> list[int]:
        out, token_ids = [], []
        async for event in client.stream(rid):
            if event.token_id is not None:
                out.append(event.timestamp_ns)
                token_ids.append(event.token_id)
            if event.finished and event.error:
                raise RuntimeError(f"request {rid} failed: {event.error}")
        check_stamps(rid, out, token_ids, tokens)
        return out

    return list(await asyncio.gather(*(stamps(rid) for rid in ids)))


def check_stamps(rid: int, stamps: list[int], token_ids: list[int], expected: int) -> None:
    """Every token of an ignore_eos request arrives, stamped, in time order: a zero or backwards stamp
    means the client read an output slot the engine had not written yet (seen intermittently at batch
    64 on 2026-11-23: a 157 s "gap", the host's uptime, from a stamp read as 0). The client now holds
    back a token until its stamp is there and counts that in `payload_waits`, which the run reports."""
    bad = [i for i, s in enumerate(stamps) if s == 0 or (i and s < stamps[i - 1])]
    if len(stamps) != expected or bad:
        shown = [(i, stamps[i], token_ids[i]) for i in bad[:8]]
        raise RuntimeError(
            f"request {rid}: {len(stamps)} of {expected} tokens, {len(bad)} zero or backwards stamps "
            f"(index, stamp ns, token id): {shown}"
        )


def steady_window(per_request: list[list[int]], skip: int) -> tuple[int, int, int]:
    """(start ns, end ns, tokens stamped inside) of the window where every request decodes."""
    start = max(s[skip] for s in per_request)
    end = min(s[-1 - skip] for s in per_request)
    if end <= start:
        raise ValueError("no steady state: raise --tokens or lower --skip")
    inside = sum(int(np.sum((np.asarray(s) >= start) & (np.asarray(s) <= end))) for s in per_request)
    return start, end, inside


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


async def measure_mode(args: argparse.Namespace, mode: str) -> dict:
    shm_name = f"blink-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    workdir = Path(tempfile.mkdtemp(prefix="blink-bench-"))
    profile_path = workdir / "profile.toml"
    profile_path.write_text(profile_text(args, mode, shm_name))
    profile = load_profile(profile_path)
    geometry = ring_geometry(profile)
    transport = ShmTransport.create(shm_name, region_size(geometry))
    region = RingRegion.create(transport, geometry)
    result: dict = {"mode": mode, "batches": {}}
    t0 = time.monotonic()
    proc = start_engine(profile_path, region, args.start_timeout)
    result["start_s"] = round(time.monotonic() - t0, 1)
    client = EngineClient(region)
    try:
        await client.start()
        id_limit = prompt_id_limit(args.model)
        await generate(client, 1, 8, seed=0, id_limit=id_limit)  # warm up the path once
        pid = proc.pid
        for batch in args.batches:
            waits_before = client.payload_waits
            with CpuSampler(pid) as cpu:
                per_request = await generate(
                    client, batch, args.tokens, seed=batch, id_limit=id_limit, constrained=args.constrained,
                    model=args.model,
                )  # fmt: skip
            start, end, inside = steady_window(per_request, args.skip)
            cpu_s = cpu.at(end) - cpu.at(start)
            gaps = [(b - a) / 1e6 for s in per_request for a, b in zip(s[1:], s[2:], strict=False)]
            result["batches"][batch] = {
                "tokens_in_window": inside,
                "window_s": (end - start) / 1e9,
                "cpu_s_in_window": cpu_s,
                "cpu_s_per_1000_tokens": 1000 * cpu_s / inside,
                "cpu_util_in_window": cpu_s / ((end - start) / 1e9),
                "tokens_per_s": inside / ((end - start) / 1e9),
                "tpot_p50_ms": percentile(gaps, 50),
                "tpot_p99_ms": percentile(gaps, 99),
                # Counts seen ahead of their tokens (the client held those back): an ordering bug.
                "payload_waits": client.payload_waits - waits_before,
            }
            print(f"[{mode}] batch {batch}: {result['batches'][batch]}", flush=True)
        with CpuSampler(pid) as cpu:
            await asyncio.sleep(args.idle_s)
        result["idle_cpu_util"] = (cpu.samples[-1][1] - cpu.samples[0][1]) / args.idle_s
        t_stop = time.monotonic()
        region.store("shutdown", 1)
        code = proc.wait(30)
        result["shutdown_s"] = round(time.monotonic() - t_stop, 3)
        result["exit_code"] = code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await client.close()
        transport.close()
        profile_path.unlink()
        workdir.rmdir()
    return result


def table(results: list[dict], batches: list[int]) -> str:
    lines = [
        "| mode | batch | CPU s / 1000 tokens | engine CPU util | tokens/s | TPOT P50 (ms) | TPOT P99 (ms) "
        "| payload waits |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for b in batches:
            m = r["batches"][b]
            lines.append(
                f"| {r['mode']} | {b} | {m['cpu_s_per_1000_tokens']:.4f} | {m['cpu_util_in_window']:.1%} | "
                f"{m['tokens_per_s']:.0f} | {m['tpot_p50_ms']:.3f} | {m['tpot_p99_ms']:.3f} | "
                f"{m['payload_waits']} |"
            )
    lines.append("")
    lines.append("| mode | idle CPU util | shutdown (s) | start (s) |")
    lines.append("| --- | --- | --- | --- |")
    for r in results:
        lines.append(f"| {r['mode']} | {r['idle_cpu_util']:.2%} | {r['shutdown_s']} | {r['start_s']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="dummy:llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--modes", nargs="+", default=["loop", "host"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--tokens", type=int, default=256, help="generated tokens per request")
    parser.add_argument("--skip", type=int, default=16, help="tokens left out at each end of the window")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-gib", type=float, default=4.0)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--deterministic", action="store_true", help="engine.deterministic = true")
    parser.add_argument(
        "--constrained",
        type=int,
        default=0,
        help="every request constrained to this many tokens (structured output)",
    )
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None, help="folder for loop_cpu_time.json / .md")
    args = parser.parse_args()

    results = [asyncio.run(measure_mode(args, mode)) for mode in args.modes]
    text = table(results, args.batches)
    header = (
        f"model {args.model} {args.dtype} on {args.device}; {PROMPT_LEN}-token prompts, {args.tokens} tokens "
        f"each, greedy, window skips {args.skip} tokens at each end; host {platform.node()} "
        f"({psutil.cpu_count()} CPUs)"
    )
    print(header)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "loop_cpu_time.json").write_text(
            json.dumps(
                {"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=1, default=str
            )
        )
        (args.out / "loop_cpu_time.md").write_text(header + "\n\n" + text + "\n")
    waits = sum(m["payload_waits"] for r in results for m in r["batches"].values())
    if waits:
        sys.exit(f"FAILED: {waits} times a published count was seen before the tokens it covers")


if __name__ == "__main__":
    main()
