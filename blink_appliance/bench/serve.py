"""`bench serve`: build the prompts once, then one measured run per request rate.

Each run: (optionally) start the co-located interference, read the cost counters, send the load,
read the counters again, stop the interference, compute the metrics. Warm-up requests go first,
one at a time, and are not measured. The result is printed as a table and, with a path, written
as JSON (report.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from blink_appliance.bench.accounting import RunCost, RunMeter, ServerProcesses, find_server_processes
from blink_appliance.bench.datasets import BenchRequest, BenchTokenizer, DatasetSpec, LengthRange
from blink_appliance.bench.interference import Interference, InterferenceSpec, WorkerReport
from blink_appliance.bench.load_generator import LoadConfig, LoadRun, run_load
from blink_appliance.bench.serving_metrics import SLO, ServingMetrics, compute_metrics


@dataclass(frozen=True)
class ServeOptions:
    load: LoadConfig  # its request_rate is replaced by each of `rates`
    rates: tuple[float, ...]
    dataset: DatasetSpec
    num_prompts: int
    input_len: LengthRange
    output_len: LengthRange | None  # None: from the data (ShareGPT)
    tokenizer: str | None = None  # a model source; None: the model name, when the dataset needs one
    vocab_size: int | None = None
    max_model_len: int | None = None
    slo: SLO = field(default_factory=SLO)
    warmup: int = 1
    server_pids: tuple[int, ...] | None = None  # None: found from the URL
    gpu_index: int | tuple[int, ...] | None = 0  # NVML index or indices (energy summed); None: none
    interference: InterferenceSpec | None = None  # runs during every measured run
    save_detailed: bool = False
    result_json: Path | None = None


@dataclass
class RateRun:
    rate: float
    load: LoadRun
    metrics: ServingMetrics
    cost: RunCost
    interference: list[WorkerReport] | None


@dataclass
class ServeResult:
    options: ServeOptions
    runs: list[RateRun]
    warmup_failures: list[str]
    argv: list[str] | None = None

    @property
    def all_failed_runs(self) -> list[RateRun]:
        return [r for r in self.runs if r.metrics.completed == 0]


def parse_rates(text: str) -> tuple[float, ...]:
    """Rates from "4", "1,2,4" or "inf" (all at once)."""
    rates = []
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--request-rate: expected numbers or inf, got {part!r}") from None
        if not rate > 0 or math.isnan(rate):
            raise ValueError(f"--request-rate: rates must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("--request-rate: no rate given")
    return tuple(rates)


def _needs_tokenizer(options: ServeOptions) -> bool:
    kind = options.dataset.kind
    if kind == "synthetic":
        return True
    if kind == "random":
        return options.vocab_size is None
    return options.output_len is None


def resolve_tokenizer(options: ServeOptions) -> BenchTokenizer | None:
    from blink_appliance.bench.datasets import load_bench_tokenizer

    if options.tokenizer is not None:
        return load_bench_tokenizer(options.tokenizer)
    if not _needs_tokenizer(options):
        return None
    try:
        return load_bench_tokenizer(options.load.model)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(
            f"--dataset {options.dataset} needs the model's tokenizer and --model {options.load.model!r} "
            f"is not a model source ({e}); pass --tokenizer (a named model, gguf:FILE or hf:DIR)"
        ) from None


def build_dataset(options: ServeOptions) -> list[BenchRequest]:
    from blink_appliance.bench.datasets import build_requests

    return build_requests(
        options.dataset,
        options.num_prompts,
        seed=options.load.seed,
        input_len=options.input_len,
        output_len=options.output_len,
        tokenizer=resolve_tokenizer(options),
        vocab_size=options.vocab_size,
        max_model_len=options.max_model_len,
    )


def _server_processes(options: ServeOptions) -> ServerProcesses:
    if options.server_pids is not None:
        return ServerProcesses(list(options.server_pids), "given (--server-pids)")
    return find_server_processes(options.load.base_url)


async def _warm_up(options: ServeOptions, requests: list[BenchRequest]) -> list[str]:
    if options.warmup <= 0:
        return []
    config = dataclasses.replace(options.load, request_rate=math.inf, max_concurrency=1)
    warm = [requests[i % len(requests)] for i in range(options.warmup)]
    run = await run_load(warm, config)
    return [r.error or "unknown" for r in run.records if not r.ok]


def _measure(
    options: ServeOptions, requests: list[BenchRequest], rate: float, server: ServerProcesses
) -> RateRun:
    config = dataclasses.replace(options.load, request_rate=rate)
    meter = RunMeter(server, gpu_index=options.gpu_index)
    load = Interference(options.interference) if options.interference is not None else None
    reports = None
    if load is not None:
        load.start()
    try:
        meter.start()
        run = asyncio.run(run_load(requests, config))
        metrics = compute_metrics(run, options.slo)
        cost = meter.finish(metrics.total_output_tokens)
    finally:
        if load is not None:
            reports = load.stop()
    return RateRun(rate, run, metrics, cost, reports)


def run_serve(
    options: ServeOptions,
    *,
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    argv: list[str] | None = None,
) -> ServeResult:
    requests = build_dataset(options)
    server = _server_processes(options)
    if not server.pids:
        say(f"host CPU accounting unavailable: {server.reason}")
    warmup_failures = asyncio.run(_warm_up(options, requests))
    if warmup_failures:
        say(f"warm-up: {len(warmup_failures)}/{options.warmup} failed: {warmup_failures[0]}")
    runs = []
    for rate in options.rates:
        rate_text = "inf" if math.isinf(rate) else f"{rate:g}/s"
        where = (
            f" under interference ({options.interference.describe_workers()})" if options.interference else ""
        )
        say(f"rate {rate_text}: {len(requests)} requests to {options.load.url}{where}")
        runs.append(_measure(options, requests, rate, server))
        m = runs[-1].metrics
        say(f"rate {rate_text}: {m.completed} completed, {m.failed} failed in {m.duration_s:.2f} s")
    return ServeResult(options, runs, warmup_failures, argv)


def pin_client(cpus: tuple[int, ...]) -> None:
    """Keep this load generator on its own cores, away from the interference it measures."""
    try:
        os.sched_setaffinity(0, set(cpus))
    except (OSError, ValueError) as e:
        raise ValueError(f"--client-cpus {cpus}: {e}") from None
