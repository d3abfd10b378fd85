"""Checks of a profile across its sections ("key.path: why" each), once each section is valid on its
own: the engine against every model's device, and the models against each other. Keys are named as
the file declares them (ModelSection.key), so a section with replicas is one section here too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class CheckedProfile(Protocol):
    """What the checks read of blink_appliance.profile.Profile (which calls them: no import back)."""

    models: Sequence[Any]
    engine: Any

    def engine_mode_of(self, index: int) -> str: ...
    def uses_loop_of(self, index: int) -> bool: ...
    def num_slots_of(self, index: int) -> int: ...


def engine_errors(p: CheckedProfile) -> list[str]:
    """The engine section against every model's device and mode."""
    errors = [line for i in range(len(p.models)) for line in _model_engine_errors(p, i)]
    if not any(p.uses_loop_of(i) for i in range(len(p.models))):
        errors += [
            f"engine.{key}: only the GPU loop uses it (engine.mode 'loop' or 'host')"
            for key in ("num_slots", "buckets", "deterministic")
            if getattr(p.engine, key) is not None
        ]
    return errors


def _tensor_parallel_errors(p: CheckedProfile, i: int) -> list[str]:
    """Tensor-parallel ranks: the GPU loop on CUDA devices no other model uses."""
    m, mode = p.models[i], p.engine_mode_of(i)
    if m.tensor_parallel == 1:
        return []
    key = m.key("tensor_parallel")
    if mode != "loop" or m.device == "cpu":
        return [f"{key}: the ranks run in the GPU loop only (engine.mode 'loop' on cuda:N devices)"]
    errors = []
    if m.sm_count is not None:
        errors.append(
            f"{m.key('sm_count')}: SM partitions of tensor-parallel ranks are not built; remove one"
        )
    ranks = m.rank_devices
    if any(not d.startswith("cuda:") for d in ranks):
        errors.append(f"{m.key('devices')}: every rank needs a cuda:N device, got {ranks}")
    for j, other in enumerate(p.models):
        shared = sorted(set(ranks) & set(other.rank_devices)) if j != i else []
        if shared:
            errors.append(
                f"{key}: its ranks' {', '.join(shared)} also hold {other.key()} ({other.name!r}); a "
                "tensor-parallel model takes its GPUs alone"
            )
    return errors


def _model_engine_errors(p: CheckedProfile, i: int) -> list[str]:
    m, e, mode = p.models[i], p.engine, p.engine_mode_of(i)
    if mode == "loop" and m.device == "cpu":
        return [
            f"engine.mode: 'loop' needs a CUDA device ({m.key('device')} is 'cpu'): the "
            "graph-resident loop cannot run on the CPU; use 'reference', or 'host' with TRITON_INTERPRET=1"
        ]
    if mode == "reference" and m.device != "cpu":
        return [
            f"engine.mode: 'reference' (the CPU reference engine) runs on device 'cpu' only, "
            f"not {m.device!r} ({m.key('device')}); use 'loop' or 'host'"
        ]
    errors = _tensor_parallel_errors(p, i)
    if m.cpu_weights == "quantized" and mode != "reference":
        errors.append(
            f"{m.key('cpu_weights')}: 'quantized' runs on the CPU reference engine only "
            f"(engine.mode is {mode!r}); remove the key or use 'dequantized'"
        )
    if m.sm_count is not None and (m.device == "cpu" or mode != "loop"):
        where = f"{m.key('device')} is 'cpu'" if m.device == "cpu" else f"engine.mode is {mode!r}"
        errors.append(
            f"{m.key('sm_count')}: SM partitions are for models the GPU loop serves on a cuda:N "
            f"device (engine.mode 'loop'), and {where}; remove the key"
        )
    if mode == "reference":
        return errors
    if e.buckets is not None and e.buckets[-1] != m.max_num_batched_tokens:
        errors.append(
            f"engine.buckets: must end at {m.key('max_num_batched_tokens')} "
            f"({m.max_num_batched_tokens}), got {e.buckets}"
        )
    if p.num_slots_of(i) < m.max_seqs:
        errors.append(
            f"engine.num_slots: ({p.num_slots_of(i)}) must be >= {m.key('max_seqs')} ({m.max_seqs})"
        )
    return errors


def model_set_errors(p: CheckedProfile) -> list[str]:
    """Unique names (the front end routes by name), and the KV fractions of one CUDA device (each
    is of the memory left after all of that device's weights)."""
    errors: list[str] = []
    first: dict[str, int] = {}
    for i, m in enumerate(p.models):
        if m.name in first and not m.replica:
            errors.append(
                f"models[{m.section}].name: duplicate of models[{p.models[first[m.name]].section}].name ({m.name!r})"
            )
        first.setdefault(m.name, i)
    by_device: dict[str, list[int]] = {}
    for i, m in enumerate(p.models):
        if m.device != "cpu" and m.kv_fraction is not None:
            by_device.setdefault(m.device, []).append(i)
    for device, indices in by_device.items():
        total = sum(p.models[i].kv_fraction or 0.0 for i in indices)
        if total > 1 + 1e-9:
            keys = " + ".join(f"models[{p.models[i].section}].kv_fraction" for i in indices)
            errors.append(
                f"{keys}: {total:g} on {device}; the fractions of one device share the memory "
                "left after all its models' weights, so they must sum to <= 1"
            )
    return errors
