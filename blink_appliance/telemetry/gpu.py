"""GPU power, energy, utilization and clocks through NVML (the nvidia-ml-py package, `pynvml`).

Without the package, the NVML library, or a GPU, `sample()` returns GpuStats(available=False)
with a reason and every measurement None. A single query the GPU does not support (energy on
older boards, say) leaves just that field None.

NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES: pass the NVML index. Given several
(a tensor-parallel engine's ranks, replicas, models on several GPUs), a sample is their sum: power,
energy and memory add up, utilization and clocks are the mean, so J/token counts every GPU that
served the tokens.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from blink_appliance.telemetry.snapshot import GpuStats

log = logging.getLogger(__name__)

T = TypeVar("T")


class GpuSampler:
    def __init__(self, device_index: int | Sequence[int] = 0) -> None:
        # Each GPU once: a board listed twice would count its energy twice.
        self.device_indices = list(
            dict.fromkeys([device_index] if isinstance(device_index, int) else device_index)
        )
        if not self.device_indices:
            raise ValueError("GpuSampler: no GPU index given")
        self._nvml: Any = None  # the pynvml module once initialized
        self._handles: list[Any] = []
        self._name: str | None = None  # the sample's: one GPU's name, or "2 x <name>"
        self.device_names: dict[int, str | None] = {}  # each sampled GPU's, by NVML index, once started
        self.reason: str | None = "not started"
        # A sample runs in a worker thread and may still be querying when stop() shuts NVML down:
        # NVML calls on a handle after nvmlShutdown are undefined, so the two never overlap.
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return bool(self._handles)

    def start(self) -> None:
        if self._handles:
            return
        try:
            import pynvml
        except ImportError:
            self.reason = "nvidia-ml-py not installed"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            self.reason = f"NVML unavailable: {e}"
            return
        handles = []
        for index in self.device_indices:
            try:
                handles.append(pynvml.nvmlDeviceGetHandleByIndex(index))
            except pynvml.NVMLError as e:
                self.reason = f"no GPU {index}: {e}"
                pynvml.nvmlShutdown()
                return
        self._nvml, self._handles, self.reason = pynvml, handles, None
        for index, h in zip(self.device_indices, handles, strict=True):
            name = self._query(lambda h=h: pynvml.nvmlDeviceGetName(h))
            self.device_names[index] = name.decode() if isinstance(name, bytes) else name
        names = list(self.device_names.values())
        self._name = names[0] if len(names) == 1 else (
            f"{len(names)} x {names[0]}" if len(set(names)) == 1 else " + ".join(str(n) for n in names)
        )  # fmt: skip
        log.info("NVML: sampling GPU %s (%s)", ", ".join(map(str, self.device_indices)), self._name)

    def stop(self) -> None:
        with self._lock:
            if self._nvml is not None:
                try:
                    self._nvml.nvmlShutdown()
                except self._nvml.NVMLError:
                    pass
            self._nvml, self._handles = None, []
            self.reason = "stopped"

    def _query(self, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except self._nvml.NVMLError:  # not supported on this board, or a transient failure
            return None

    def sample(self) -> GpuStats:
        with self._lock:
            return self._sample()

    def _sample(self) -> GpuStats:
        if not self._handles:
            return GpuStats(available=False, reason=self.reason)
        each = [self._read(h) for h in self._handles]

        def total(key: str) -> float | None:
            values = [r[key] for r in each]
            return None if any(v is None for v in values) else float(sum(values))

        def mean(key: str) -> float | None:
            value = total(key)
            return None if value is None else value / len(each)

        return GpuStats(
            available=True,
            name=self._name,
            power_w=_per(total("power_mw"), 1000.0),
            power_limit_w=_per(total("limit_mw"), 1000.0),
            energy_j=_per(total("energy_mj"), 1000.0),
            gpu_util_percent=mean("gpu_util"),
            mem_util_percent=mean("mem_util"),
            sm_clock_mhz=mean("sm_clock"),
            memory_used_mib=_per(total("mem_used"), 2**20),
            memory_total_mib=_per(total("mem_total"), 2**20),
        )

    def _read(self, h: Any) -> dict[str, float | None]:
        """One GPU's readings in NVML's units (None: not supported there, or a transient failure)."""
        nv = self._nvml
        util = self._query(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        mem = self._query(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        return dict(
            power_mw=self._query(lambda: nv.nvmlDeviceGetPowerUsage(h)),
            limit_mw=self._query(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h)),
            energy_mj=self._query(lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h)),
            gpu_util=util.gpu if util is not None else None,
            mem_util=util.memory if util is not None else None,
            sm_clock=self._query(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            mem_used=mem.used if mem is not None else None,
            mem_total=mem.total if mem is not None else None,
        )


def _per(value: float | None, unit: float) -> float | None:
    return None if value is None else value / unit
