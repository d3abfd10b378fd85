"""bench/compare: loop mode vs host-driven mode vs HF transformers, isolated and under co-located load.

One command for one device call (under 10 minutes). For each system in turn:
  1. start it: `blink-appliance up` on a profile generated for its engine mode (`loop`, `host`, or
     `reference` on the CPU), or the HF transformers baseline server (hf_baseline.py);
  2. warm it up, unmeasured: one request alone, then a burst of --max-concurrency short requests;
  3. for each request rate: an isolated run, then the same requests again under `bench interfere`
     load (colocated). Each run is `bench serve` (serve.run_serve): random token-id prompts of
     --input-len tokens, --output-len tokens each (ignore_eos), greedy, Poisson arrivals at the
     rate for --duration seconds (rate inf: --inf-prompts released at once), at most
     --max-concurrency in flight; TTFT / TPOT / throughput, NVML energy, the server's host CPU;
  4. stop it (SIGTERM: the appliance drains).
The raw JSON is rewritten after every run, so a call cut off at its limit keeps what it measured;
the Markdown table and the PNG plot (compare_report.py) are rewritten after every system.

Core layout, on a host with 8 or more cores (the design's argument: the front end has reserved
cores, everything else is shared with the co-located work):
  client (this load generator)   the first core
  appliance front end            the next two (frontend.cpus); the HF baseline server gets these
                                 and the engine's core
  engine process                 the fourth core (appliance.engine_cpus)
  interference                   every core but the client's and the front end's, the engine's
                                 included: one spinner per core, 2 memory thrashers, 2 syscall pairs
With fewer cores nothing is pinned (a CPU machine running the toy path).

Budget: --budget-s bounds the whole command. A run that would not fit what is left is skipped
and recorded as skipped (never silently dropped); request timeouts shrink to what is left.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blink_appliance.bench.datasets import DatasetSpec, LengthRange
from blink_appliance.bench.interference import InterferenceSpec
from blink_appliance.bench.load_generator import LoadConfig
from blink_appliance.bench.serve import RateRun, ServeOptions, run_serve
from blink_appliance.bench.server_process import ServerProcess, ServerStartError

RESULT_VERSION = 1
APPLIANCE_MODES = ("loop", "host", "reference")
HF_SYSTEM = "hf"
_STOP_RESERVE_S = 25.0  # kept back at every step for stopping the server and writing the report
_INTERFERENCE_START_S = 3.0  # spawning and readying the workers, per colocated run
_IDLE_WAIT_S = 20.0  # after a run, for the server's stragglers to finish or be cancelled
_MIN_PINNED_CORES = 8


def say(message: str) -> None:
    print(f"[compare] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class CoreLayout:
    client: tuple[int, ...] | None  # None: nothing pinned
    frontend: tuple[int, ...]
    engine: tuple[int, ...]
    interference: tuple[int, ...] | None
    note: str

    @property
    def baseline(self) -> tuple[int, ...]:
        """The HF baseline server's cores: the front end's and the engine's (HTTP and generate in one)."""
        return self.frontend + self.engine


def core_layout(cpus: list[int]) -> CoreLayout:
    cpus = sorted(cpus)
    if len(cpus) < _MIN_PINNED_CORES:
        return CoreLayout(None, (), (), None, f"{len(cpus)} cores: too few to reserve any, nothing pinned")
    return CoreLayout(
        client=(cpus[0],),
        frontend=(cpus[1], cpus[2]),
        engine=(cpus[3],),
        interference=tuple(cpus[3:]),
        note=f"{len(cpus)} cores: client, front end and engine pinned; interference on the engine's "
        "core and every other core",
    )


def interference_spec(text: str, layout: CoreLayout, memory_mib: int) -> InterferenceSpec:
    """ "auto": one spinner per interference core (all cores unpinned), 2 memory, 2 syscall pairs."""
    if text == "auto":
        spin = len(layout.interference) if layout.interference else (os.cpu_count() or 1)
        text = f"spin={spin},memory=2,syscall=2"
    if "memory_mib" not in text:
        text += f",memory_mib={memory_mib}"
    # Long enough for any run; each run stops it as soon as the run ends.
    return InterferenceSpec.parse(text, duration_s=24 * 3600.0, cpus=layout.interference)


@dataclass(frozen=True)
class RunShape:
    """How big one measured run of a system is, and how long it may take."""

    duration_s: float  # seconds of arrivals at a finite rate: rate x duration requests
    inf_prompts: int  # requests of a rate-inf run (all released at once)
    drain_s: float  # expected time after the last arrival until the run ends (for the budget)
    request_timeout_s: float  # per request at most (shrunk further to what the budget has left)

    def num_prompts(self, rate: float) -> int:
        return self.inf_prompts if math.isinf(rate) else max(2, round(rate * self.duration_s))

    def span_s(self, rate: float) -> float:
        return 0.0 if math.isinf(rate) else self.num_prompts(rate) / rate

    def expected_run_s(self, rate: float, colocated: bool) -> float:
        return self.span_s(rate) + self.drain_s + (_INTERFERENCE_START_S if colocated else 0.0)


@dataclass(frozen=True)
class CompareConfig:
    device: str
    model: str  # a dummy: preset (random weights; no tokenizer: token-id prompts)
    dtype: str
    modes: tuple[str, ...]
    hf: bool
    rates: tuple[float, ...]
    hf_rates: tuple[float, ...]
    appliance_runs: RunShape
    hf_runs: RunShape
    input_len: int
    output_len: int
    max_concurrency: int
    max_seqs: int
    step_tokens: int  # max_num_batched_tokens of the appliance's step
    interfere: str
    memory_mib: int
    budget_s: float
    startup_timeout_s: float
    seed: int
    out_dir: Path
    stem: str | None

    @property
    def preset(self) -> str:
        kind, sep, preset = self.model.partition(":")
        if kind != "dummy" or not sep or not preset:
            raise ValueError(
                f"--model: expected a dummy: preset such as dummy:llama-3.2-1b, got {self.model!r}"
            )
        return preset

    @property
    def gpu_index(self) -> int | None:
        return int(self.device.split(":")[1]) if self.device.startswith("cuda:") else None

    @property
    def max_model_len(self) -> int:
        need = self.input_len + self.output_len + 1
        return -(-need // 128) * 128


def _kv_budget_gib(config: Any, cfg: CompareConfig) -> float:
    """Room for max_seqs sequences of max_model_len, plus a block each (the plan caps it there)."""
    itemsize = 4 if cfg.dtype == "float32" else 2
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize
    need = per_token * cfg.max_seqs * (cfg.max_model_len + 16)
    return round(need / 2**30 * 1.05 + 0.01, 3)


def appliance_profile(cfg: CompareConfig, mode: str, layout: CoreLayout, shm_name: str) -> str:
    """The TOML profile `blink-appliance up` runs for one engine mode."""
    from blink_appliance.model.loaders.dummy import preset_config

    config = preset_config(cfg.preset)
    lines = [
        "# generated by bench/compare",
        "[appliance]",
        f'name = "compare-{mode}"',
        f'shm_name = "{shm_name}"',
        f"engine_cpus = {list(layout.engine)}",
        "drain_timeout_s = 5",
        "",
        "[[models]]",
        f'name = "{cfg.preset}"',
        f'source = "{cfg.model}"',
        f'dtype = "{cfg.dtype}"',
        f'device = "{cfg.device}"',
        f"max_seqs = {cfg.max_seqs}",
        f"max_model_len = {cfg.max_model_len}",
        f"max_num_batched_tokens = {cfg.step_tokens}",
        "block_size = 16",
        f"kv_budget_gib = {_kv_budget_gib(config, cfg)}",
        "",
        "[engine]",
        f'mode = "{mode}"',
    ]
    if mode != "reference":
        # Decode batches up to max_seqs get a bucket of their own; prefill chunks fill the rest.
        buckets = sorted({b for b in (8, 32, cfg.max_seqs, 128, cfg.step_tokens) if b <= cfg.step_tokens})
        lines += [f"num_slots = {2 * cfg.max_seqs}", f"buckets = {buckets}"]
    lines += [
        "",
        "[frontend]",
        'host = "127.0.0.1"',
        "port = 0",
        f"cpus = {list(layout.frontend)}",
        f"max_inflight = {max(2 * cfg.max_seqs, cfg.max_concurrency)}",
        "",
        "[telemetry]",
        "enabled = true",
    ]
    return "\n".join(lines) + "\n"


# -- the systems -------------------------------------------------------------------------------


@dataclass
class SystemPlan:
    name: str  # "loop" | "host" | "reference" | "hf"
    label: str
    rates: tuple[float, ...]
    shape: RunShape
    argv: list[str]
    profile_text: str | None = None
    unavailable: str | None = None  # why it cannot run here at all


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


def plan_systems(cfg: CompareConfig, layout: CoreLayout, work_dir: Path) -> list[SystemPlan]:
    plans = []
    py = sys.executable
    for mode in cfg.modes:
        shm_name = f"blink-compare-{mode}-{os.getpid()}"
        text = appliance_profile(cfg, mode, layout, shm_name)
        path = work_dir / f"profile-{mode}.toml"
        path.write_text(text)
        label = {
            "loop": "blink loop mode (device-resident loop, launched once)",
            "host": "blink host mode (same kernels, one host call per step)",
            "reference": "blink reference engine (CPU)",
        }[mode]
        argv = [py, "-m", "blink_appliance.cli", "up", str(path)]
        plans.append(SystemPlan(mode, label, cfg.rates, cfg.appliance_runs, argv, text))
    if cfg.hf:
        argv = [py, "-m", "blink_appliance.bench.hf_baseline", "--model", cfg.model, "--name", cfg.preset]
        argv += ["--dtype", cfg.dtype, "--device", cfg.device, "--max-batch", str(cfg.max_concurrency)]
        argv += ["--max-model-len", str(cfg.max_model_len), "--port", "0", "--parent-pid", str(os.getpid())]
        if layout.client is not None:
            argv += ["--cpus", ",".join(map(str, layout.baseline))]
        unavailable = None
        if importlib.util.find_spec("transformers") is None:
            unavailable = "transformers is not installed here: the HF baseline was not run"
        label = f"HF transformers generate (static batches of up to {cfg.max_concurrency})"
        plans.append(SystemPlan(HF_SYSTEM, label, cfg.hf_rates, cfg.hf_runs, argv, unavailable=unavailable))
    return plans


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
    from blink_appliance.model.loaders.dummy import preset_config

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


# -- the document ------------------------------------------------------------------------------


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu_info(index: int | None) -> dict[str, Any]:
    if index is None:
        return {"name": None, "unavailable": "device cpu: no GPU measured"}
    from blink_appliance.telemetry.gpu import GpuSampler

    sampler = GpuSampler(index)
    sampler.start()
    stats = sampler.sample()
    driver = None
    if sampler.available:
        try:
            raw = sampler._nvml.nvmlSystemGetDriverVersion()  # type: ignore[union-attr]
            driver = raw.decode() if isinstance(raw, bytes) else raw
        except Exception:
            driver = None
    sampler.stop()
    return {"name": stats.name, "driver": driver, "unavailable": None if stats.available else stats.reason}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info(cfg: CompareConfig) -> dict[str, Any]:
    packages = ("torch", "triton", "transformers", "aiohttp", "nvidia-ml-py", "cupy-cuda13x", "cuda-bindings")
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "gpu": _gpu_info(cfg.gpu_index),
        "packages": {p: _version(p) for p in packages},
    }


def gpu_slug(machine: dict[str, Any]) -> str:
    """ "NVIDIA H100 80GB HBM3" -> "h100"; no GPU -> "cpu"."""
    name = machine["gpu"].get("name")
    if not name:
        return "cpu"
    words = [w for w in name.replace("NVIDIA", "").replace("GeForce", "").split() if w]
    slug = "".join(c for c in (words[0] if words else "gpu").lower() if c.isalnum())
    return slug or "gpu"


def system_dict(rec: SystemRecord) -> dict[str, Any]:
    return {
        "name": rec.plan.name,
        "label": rec.plan.label,
        "rates": [_rate_json(r) for r in rec.plan.rates],
        "profile": rec.plan.profile_text,
        "argv": rec.plan.argv,
        "startup_s": rec.startup_s,
        "warmup_s": rec.warmup_s,
        "warmup_failures": rec.warmup_failures,
        "error": rec.error,
        "exit_code": rec.exit_code,
        "log_file": rec.log_file,
        "log_tail": rec.log_tail,
        "runs": [
            {
                "rate": _rate_json(r.rate),
                "load": r.load,
                "num_prompts": r.num_prompts,
                "skipped": r.skipped,
                "wall_s": r.wall_s,
                "result": r.result,
            }
            for r in rec.runs
        ],
    }


def config_dict(cfg: CompareConfig) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    out["rates"] = [_rate_json(r) for r in cfg.rates]
    out["hf_rates"] = [_rate_json(r) for r in cfg.hf_rates]
    out["out_dir"] = str(cfg.out_dir)
    out["max_model_len"] = cfg.max_model_len
    return out


def build_document(
    cfg: CompareConfig,
    argv: list[str],
    machine: dict[str, Any],
    layout: CoreLayout,
    interference: InterferenceSpec,
    systems: list[SystemRecord],
    started_unix: float,
    elapsed_s: float,
) -> dict[str, Any]:
    return {
        "version": RESULT_VERSION,
        "kind": "blink-bench-compare",
        "started_unix": started_unix,
        "date": time.strftime("%Y-%m-%d", time.localtime(started_unix)),
        "elapsed_s": elapsed_s,
        "argv": argv,
        "config": config_dict(cfg),
        "machine": machine,
        "layout": dataclasses.asdict(layout),
        "interference": dataclasses.asdict(interference),
        "systems": [system_dict(s) for s in systems],
    }


# -- the command -------------------------------------------------------------------------------


def _rates(text: str) -> tuple[float, ...]:
    from blink_appliance.bench.serve import parse_rates

    return parse_rates(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/compare.py",
        description="Loop mode vs host mode vs HF transformers, isolated and under co-located CPU load: "
        "one command writing <out-dir>/<date>-<gpu>.{md,json,png}.",
    )
    p.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for the toy path (default cuda:0)")
    p.add_argument(
        "--model", default=None, help="dummy: preset (default dummy:llama-3.2-1b; cpu: dummy:tiny)"
    )
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument(
        "--modes", default=None, help="appliance engine modes, or none (default loop,host; cpu: reference)"
    )
    p.add_argument("--no-hf", dest="hf", action="store_false", help="leave out the HF transformers baseline")
    p.add_argument(
        "--rates", default="8,32,inf", help="request rates per run, inf = all at once (default 8,32,inf)"
    )
    p.add_argument(
        "--hf-rates", default=None, help="rates for the HF baseline (default: the first of --rates)"
    )
    p.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per run (default 15)")
    p.add_argument(
        "--inf-prompts", type=int, default=None, help="requests of a rate-inf run (4 x concurrency)"
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens, ignore_eos (default 128)")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most (default 64)")
    p.add_argument(
        "--max-seqs", type=int, default=None, help="appliance max_seqs (default: --max-concurrency)"
    )
    p.add_argument("--step-tokens", type=int, default=512, help="appliance max_num_batched_tokens (512)")
    p.add_argument(
        "--interfere",
        default="auto",
        help="co-located load: auto (a spinner per interference core, memory=2, syscall=2) or a "
        "bench interfere spec such as spin=4,memory=1,syscall=1",
    )
    p.add_argument("--memory-mib", type=int, default=128, help="each memory thrasher's buffers (128 MiB x2)")
    p.add_argument("--budget-s", type=float, default=510.0, help="the whole command's time (default 510)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to come up")
    p.add_argument("--request-timeout", type=float, default=120.0, help="per request at most (default 120)")
    p.add_argument("--drain-allowance", type=float, default=None, help="run time after the last arrival (10)")
    p.add_argument("--hf-duration", type=float, default=10.0, help="HF baseline: seconds of arrivals (10)")
    p.add_argument("--hf-request-timeout", type=float, default=60.0, help="HF baseline: per request (60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"), help="default bench/results")
    p.add_argument("--name", default=None, help="file stem (default <date>-<gpu>)")
    return p


def config_from_args(args: argparse.Namespace) -> CompareConfig:
    cpu = args.device == "cpu"
    if not cpu and not args.device.startswith("cuda:"):
        raise ValueError(f"--device: expected cuda:N or cpu, got {args.device!r}")
    text = args.modes if args.modes is not None else ("reference" if cpu else "loop,host")
    modes = () if text == "none" else tuple(m.strip() for m in text.split(",") if m.strip())
    if not modes and not args.hf:
        raise ValueError("nothing to run: --modes none with --no-hf")
    for mode in modes:
        if mode not in APPLIANCE_MODES:
            raise ValueError(f"--modes: {mode!r} is not one of {', '.join(APPLIANCE_MODES)}")
    if "loop" in modes and cpu:
        raise ValueError("--modes loop needs a CUDA device (the graph-resident loop cannot run on the CPU)")
    if "reference" in modes and not cpu:
        raise ValueError("--modes reference runs on --device cpu only")
    rates = _rates(args.rates)
    finite = [r for r in rates if not math.isinf(r)]
    hf_rates = _rates(args.hf_rates) if args.hf_rates else ((finite or list(rates))[0],)
    max_concurrency = args.max_concurrency
    if min(max_concurrency, args.input_len, args.output_len, args.duration, args.hf_duration) <= 0:
        raise ValueError("--max-concurrency, --input-len, --output-len and the durations must be positive")
    inf_prompts = args.inf_prompts or 4 * max_concurrency
    drain = args.drain_allowance if args.drain_allowance is not None else (5.0 if cpu else 10.0)
    cfg = CompareConfig(
        device=args.device,
        model=args.model or ("dummy:tiny" if cpu else "dummy:llama-3.2-1b"),
        dtype=args.dtype or ("float32" if cpu else "bfloat16"),
        modes=modes,
        hf=args.hf,
        rates=rates,
        hf_rates=hf_rates,
        appliance_runs=RunShape(args.duration, inf_prompts, drain, args.request_timeout),
        # generate() in static batches drains slower: a longer allowance, fewer requests, a tighter cap.
        hf_runs=RunShape(args.hf_duration, inf_prompts, 3 * drain, args.hf_request_timeout),
        input_len=args.input_len,
        output_len=args.output_len,
        max_concurrency=max_concurrency,
        max_seqs=args.max_seqs or max_concurrency,
        step_tokens=max(args.step_tokens, args.max_seqs or max_concurrency),
        interfere=args.interfere,
        memory_mib=args.memory_mib,
        budget_s=args.budget_s,
        startup_timeout_s=args.startup_timeout,
        seed=args.seed,
        out_dir=args.out_dir,
        stem=args.name,
    )
    _ = cfg.preset  # a bad --model fails here, before anything starts
    return cfg


def run_compare(cfg: CompareConfig, argv: list[str]) -> tuple[dict[str, Any], dict[str, Path]]:
    """Every system, every run; returns the document and the files written."""
    import tempfile

    from blink_appliance.bench.compare_report import write_outputs

    budget = Budget(cfg.budget_s)
    started_unix = time.time()
    layout = core_layout(sorted(os.sched_getaffinity(0)))
    interference = interference_spec(cfg.interfere, layout, cfg.memory_mib)
    machine = machine_info(cfg)
    stem = cfg.stem or f"{time.strftime('%Y-%m-%d', time.localtime(started_unix))}-{gpu_slug(machine)}"
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    say(f"{cfg.model} {cfg.dtype} on {cfg.device}; layout: {layout.note}")
    say(f"interference when colocated: {interference.describe_workers()}")
    work_dir = Path(tempfile.mkdtemp(prefix="blink-compare-"))
    plans = plan_systems(cfg, layout, work_dir)
    planned = sum(p.shape.expected_run_s(r, c) for p in plans for r in p.rates for c in (False, True))
    say(
        f"plan: {', '.join(p.name for p in plans)}; runs about {planned:.0f} s plus start-ups; budget {cfg.budget_s:.0f} s"
    )
    records: list[SystemRecord] = []
    files: dict[str, Path] = {}

    def document() -> dict[str, Any]:
        return build_document(
            cfg, argv, machine, layout, interference, records, started_unix, budget.elapsed_s
        )

    def write_json() -> None:
        path = cfg.out_dir / f"{stem}.json"
        path.write_text(json.dumps(document(), indent=1, allow_nan=False) + "\n")
        files["json"] = path

    for plan in plans:
        log_path = cfg.out_dir / f"{stem}-{plan.name}.log"
        rec = SystemRecord(plan)
        records.append(rec)
        run_system(cfg, rec, layout, interference, budget, log_path, write_json)
        write_json()
        files.update(write_outputs(document(), cfg.out_dir, stem))
    return document(), files


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc, files = run_compare(cfg, argv)
    if "md" in files:  # the whole report on stdout too: the device call's output shows it
        print(files["md"].read_text())
    for kind in ("md", "json", "png"):
        if kind in files:
            print(f"wrote {files[kind]}")
    measured = [r for s in doc["systems"] for r in s["runs"] if r["result"] is not None]
    return 0 if measured else 1
