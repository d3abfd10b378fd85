"""bench/compare's raw JSON document: the configuration, the machine, the core layout and every
system's runs (compare_report.py renders it).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

from bench.compare_plan import CompareConfig, CoreLayout
from bench.compare_run import SystemRecord
from blink_appliance.bench.interference import InterferenceSpec

RESULT_VERSION = 1


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
