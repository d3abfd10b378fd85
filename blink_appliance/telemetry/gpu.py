"""GPU power, energy, utilization and clocks through NVML (the nvidia-ml-py package, `pynvml`).

Without the package, the NVML library, or a GPU, `sample()` returns GpuStats(available=False)
with a reason and every measurement None. A single query the GPU does not support (energy on
older boards, say) leaves just that field None.

NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES: pass the NVML index.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from blink_appliance.telemetry.snapshot import GpuStats

log = logging.getLogger(__name__)

T = TypeVar("T")


class GpuSampler:
    def __init__(self, device_index: int = 0) -> None:
        self.device_index = device_index
        self._nvml: Any = None  # the pynvml module once initialized
        self._handle: Any = None
        self._name: str | None = None
        self.reason: str | None = "not started"
        # A sample runs in a worker thread and may still be querying when stop() shuts NVML down:
        # NVML calls on a handle after nvmlShutdown are undefined, so the two never overlap.
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        if self._handle is not None:
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
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except pynvml.NVMLError as e:
            self.reason = f"no GPU {self.device_index}: {e}"
            pynvml.nvmlShutdown()
            return
        self._nvml, self._handle, self.reason = pynvml, handle, None
        name = self._query(lambda: pynvml.nvmlDeviceGetName(handle))
        self._name = name.decode() if isinstance(name, bytes) else name
        log.info("NVML: sampling GPU %d (%s)", self.device_index, self._name)

    def stop(self) -> None:
        with self._lock:
            if self._nvml is not None:
                try:
                    self._nvml.nvmlShutdown()
                except self._nvml.NVMLError:
                    pass
            self._nvml = self._handle = None
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
        if self._handle is None:
            return GpuStats(available=False, reason=self.reason)
        nv, h = self._nvml, self._handle
        power_mw = self._query(lambda: nv.nvmlDeviceGetPowerUsage(h))
        limit_mw = self._query(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))
        energy_mj = self._query(lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h))
        util = self._query(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        sm_clock = self._query(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        mem = self._query(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        return GpuStats(
            available=True,
            name=self._name,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            energy_j=energy_mj / 1000.0 if energy_mj is not None else None,
            gpu_util_percent=float(util.gpu) if util is not None else None,
            mem_util_percent=float(util.memory) if util is not None else None,
            sm_clock_mhz=float(sm_clock) if sm_clock is not None else None,
            memory_used_mib=mem.used / 2**20 if mem is not None else None,
            memory_total_mib=mem.total / 2**20 if mem is not None else None,
        )
