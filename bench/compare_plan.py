"""bench/compare's plan: the core layout, the run sizes, the generated appliance profiles and the
systems to run (loop, host or reference mode of the appliance, and the HF transformers baseline).

Core layout, on a host with 8 or more cores (the design's argument: the front end has reserved
cores, everything else is shared with the co-located work):
  client (this load generator)   the first core
  appliance front end            the next two (frontend.cpus); the HF baseline server gets these
                                 and the engine's core
  engine process                 the fourth core (appliance.engine_cpus)
  interference                   every core but the client's and the front end's, the engine's
                                 included: one spinner per core, 2 memory thrashers, 2 syscall pairs
With fewer cores nothing is pinned (a CPU machine running the toy path).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blink_appliance.bench.interference import InterferenceSpec

APPLIANCE_MODES = ("loop", "host", "reference")
HF_SYSTEM = "hf"
_INTERFERENCE_START_S = 3.0  # spawning and readying the workers, per colocated run
_MIN_PINNED_CORES = 8


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
    from blink_appliance.model.presets import preset_config

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
        # The shipped small buckets, and decode batches up to max_seqs get a bucket of their own;
        # prefill chunks fill the rest.
        sizes = (1, 2, 4, 8, 32, cfg.max_seqs, 128, cfg.step_tokens)
        buckets = sorted({b for b in sizes if b <= cfg.step_tokens})
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


@dataclass
class SystemPlan:
    name: str  # "loop" | "host" | "reference" | "hf"
    label: str
    rates: tuple[float, ...]
    shape: RunShape
    argv: list[str]
    profile_text: str | None = None
    unavailable: str | None = None  # why it cannot run here at all


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
        argv = [
            py,
            str(Path(__file__).with_name("hf_baseline.py")),
            "--model",
            cfg.model,
            "--name",
            cfg.preset,
        ]
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
