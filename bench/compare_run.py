"""bench/compare's run loop: one system started, warmed up, measured at every (rate, isolated |
colocated) and stopped, its outcome kept in a `SystemRecord`.

Budget: --budget-s bounds the whole command. A run that would not fit what is left is skipped
and recorded as skipped (never silently dropped); request timeouts shrink to what is left.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.compare_plan import CompareConfig, CoreLayout, RunShape, SystemPlan
from bench.server_process import ServerProcess, ServerStartError
from blink_appliance.bench.datasets import DatasetSpec, LengthRange
from blink_appliance.bench.interference import InterferenceSpec
from blink_appliance.bench.load_generator import LoadConfig
from blink_appliance.bench.serve import RateRun, ServeOptions, run_serve

_STOP_RESERVE_S = 25.0  # kept back at every step for stopping the server and writing the report
_IDLE_WAIT_S = 20.0  # after a run, for the server's stragglers to finish or be cancelled


def say(message: str) -> None:
    print(f"[compare] {message}", file=sys.stderr, flush=True)


@dataclass
class RunRecord:
    rate: float
    load: str  # "isolated" | "colocated"
    num_prompts: int
    skipped: str | None = None
    result: dict[str, Any] | None = None  # report.run_dict of the bench serve run
    wall_s: float | None = None


@dataclass
class SystemRecord:
    plan: SystemPlan
    runs: list[RunRecord] = field(default_factory=list)
    startup_s: float | None = None
    warmup_s: float | None = None
    warmup_failures: list[str] = field(default_factory=list)
    error: str | None = None
    exit_code: int | None = None
    log_file: str | None = None
    log_tail: str | None = None


class Budget:
    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self._t0 = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0

    @property
    def left_s(self) -> float:
        return self.total_s - self.elapsed_s


def _serve_options(
    cfg: CompareConfig,
    url: str,
    rate: float,
    num_prompts: int,
    *,
    output_len: int,
    timeout_s: float,
    interference: InterferenceSpec | None,
    warmup: int = 0,
    gpu_index: int | None,
) -> ServeOptions:
    from blink_appliance.model.presets import preset_config

    load = LoadConfig(
        base_url=url,
        model=cfg.preset,
        max_concurrency=cfg.max_concurrency,
        arrivals="poisson",
        seed=cfg.seed,
        ignore_eos=True,
        temperature=0.0,
        request_timeout_s=timeout_s,
    )
    return ServeOptions(
        load=load,
        rates=(rate,),
        dataset=DatasetSpec("random"),
        num_prompts=num_prompts,
        input_len=LengthRange(cfg.input_len, cfg.input_len),
        output_len=LengthRange(output_len, output_len),
        vocab_size=preset_config(cfg.preset).vocab_size,
        warmup=warmup,
        gpu_index=gpu_index,
        interference=interference,
    )


def _warm_up(cfg: CompareConfig, shape: RunShape, server: ServerProcess, budget: Budget) -> list[str]:
    timeout = max(5.0, min(shape.request_timeout_s, budget.left_s - _STOP_RESERVE_S))
    options = _serve_options(
        cfg,
        server.url,
        math.inf,
        cfg.max_concurrency,
        output_len=min(cfg.output_len, 16),
        timeout_s=timeout,
        interference=None,
        warmup=1,
        gpu_index=None,
    )
    result = run_serve(options, say=lambda line: say(f"  warm-up: {line}"))
    failures = list(result.warmup_failures)
    failures += [r.error or "unknown" for r in result.runs[0].load.records if not r.ok]
    return failures


def _measure(
    cfg: CompareConfig,
    shape: RunShape,
    server: ServerProcess,
    record: RunRecord,
    interference: InterferenceSpec | None,
    budget: Budget,
) -> RateRun:
    span = shape.span_s(record.rate)
    timeout = max(5.0, min(shape.request_timeout_s, budget.left_s - _STOP_RESERVE_S - span))
    options = _serve_options(
        cfg,
        server.url,
        record.rate,
        record.num_prompts,
        output_len=cfg.output_len,
        timeout_s=timeout,
        interference=interference,
        gpu_index=cfg.gpu_index,
    )
    return run_serve(options, say=lambda line: say(f"  {line}")).runs[0]


def run_system(
    cfg: CompareConfig,
    rec: SystemRecord,
    layout: CoreLayout,
    interference: InterferenceSpec,
    budget: Budget,
    log_path: Path,
    on_progress: Callable[[], None],
) -> None:
    """Start, warm up, measure every (rate, isolated|colocated), stop, filling `rec` as it goes.

    Never raises for the server's faults: they end up in `rec` (error, skipped runs, log tail)."""
    from blink_appliance.bench.report import run_dict
    from blink_appliance.bench.serve import pin_client

    plan = rec.plan
    rec.log_file = log_path.name
    rec.runs = [
        RunRecord(rate, load, plan.shape.num_prompts(rate))
        for rate in plan.rates
        for load in ("isolated", "colocated")
    ]
    if plan.unavailable:
        rec.error = plan.unavailable
        for run in rec.runs:
            run.skipped = plan.unavailable
        return
    first_run_s = plan.shape.expected_run_s(plan.rates[0], False) if plan.rates else 0.0
    if budget.left_s < _STOP_RESERVE_S + first_run_s + 30.0:
        rec.error = f"not started: {budget.left_s:.0f} s of the budget left"
        for run in rec.runs:
            run.skipped = rec.error
        return
    server = ServerProcess(plan.name, plan.argv, log_path)
    startup_timeout = min(cfg.startup_timeout_s, budget.left_s - _STOP_RESERVE_S)
    say(f"{plan.name}: starting ({plan.label}); up to {startup_timeout:.0f} s")
    saved_affinity = os.sched_getaffinity(0)
    try:
        server.start(startup_timeout)
        rec.startup_s = server.ready_after_s
        say(f"{plan.name}: serving at {server.url} after {rec.startup_s:.1f} s")
        if layout.client is not None:
            pin_client(layout.client)
        t0 = time.monotonic()
        rec.warmup_failures = _warm_up(cfg, plan.shape, server, budget)
        rec.warmup_s = time.monotonic() - t0
        say(f"{plan.name}: warmed up in {rec.warmup_s:.1f} s ({len(rec.warmup_failures)} failed)")
        server.wait_idle(min(_IDLE_WAIT_S, max(1.0, budget.left_s - _STOP_RESERVE_S)))
        for run in rec.runs:
            colocated = run.load == "colocated"
            need = plan.shape.expected_run_s(run.rate, colocated) + _STOP_RESERVE_S
            if not server.alive:
                run.skipped = f"the server exited (code {server.proc.returncode if server.proc else None})"
                continue
            if budget.left_s < need:
                run.skipped = f"time budget: {budget.left_s:.0f} s left, the run needs about {need:.0f} s"
                say(f"{plan.name}: skipping rate {run.rate:g} {run.load}: {run.skipped}")
                continue
            t0 = time.monotonic()
            try:
                rate_run = _measure(cfg, plan.shape, server, run, interference if colocated else None, budget)
            except Exception as e:  # e.g. the interference did not start: keep the other runs going
                run.skipped = f"the run failed: {type(e).__name__}: {e}"
                say(f"{plan.name}: rate {run.rate:g} {run.load}: {run.skipped}")
                continue
            finally:
                run.wall_s = time.monotonic() - t0
            run.result = run_dict(rate_run, detailed=False)
            on_progress()
            if not server.wait_idle(min(_IDLE_WAIT_S, max(1.0, budget.left_s - _STOP_RESERVE_S))):
                say(f"{plan.name}: still busy {_IDLE_WAIT_S:.0f} s after the run; the next run starts anyway")
    except ServerStartError as e:
        rec.error = str(e).splitlines()[0]
        say(f"{plan.name}: {rec.error}")
        for run in rec.runs:
            run.skipped = run.skipped or f"the server did not start: {rec.error}"
    finally:
        os.sched_setaffinity(0, saved_affinity)
        rec.exit_code = server.stop(30.0)
        rec.log_tail = server.log_tail(60)
        say(
            f"{plan.name}: stopped (exit {rec.exit_code}); {budget.elapsed_s:.0f} s of {cfg.budget_s:.0f} used"
        )
