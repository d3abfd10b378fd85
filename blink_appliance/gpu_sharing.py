"""Several models on one GPU: each GPU-loop model in an engine process of its own, under a private
MPS control daemon that limits each process to its share of the SMs; and the device's free memory,
read once before any of them starts, which their kv_fractions share.

Why MPS and not green contexts: a green context confines eager kernels and plain graphs to its SMs,
but the driver (580, CUDA 13.0) refuses to instantiate a graph whose WHILE or SWITCH body holds a
green context's kernels, and the loop is exactly such a graph (bench/sm_partition_probe.py,
bench/results/2026-11-26-h100-sm-partitions.md). Under MPS the loop's graph runs unchanged, and
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE caps the SMs each process's kernels use. Without MPS, kernels of
different processes never run at the same time on a GPU: two loops would take turns.

MPS limits how many SMs a process may use, not which: two shares that sum to at most the whole GPU
do not overlap in practice (measured), but nothing pins them the way a static partition would.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from blink_appliance.profile import Profile, ProfileError

CONTROL = "nvidia-cuda-mps-control"


class MpsError(RuntimeError):
    """The MPS control daemon could not be started or stopped; the message says why."""


@dataclass(frozen=True)
class SmShare:
    model_index: int
    device: str  # "cuda:N"
    percentage: int  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of its engine process
    sms: int  # the SMs that percentage gives on this device
    total: int  # the device's SMs
    requested: int | None  # models[i].sm_count; None: shares the rest

    def describe(self) -> str:
        ask = f"sm_count {self.requested}" if self.requested is not None else "shares the rest"
        return f"{self.sms} of {self.total} SMs ({ask}; MPS active thread percentage {self.percentage})"


def sms_for(percentage: int, total: int) -> int:
    """The SMs MPS gives an active thread percentage: its share of the SMs, down to whole TPCs (two
    SMs), as measured on an H100 (25% of 132 -> 32, 75% -> 98)."""
    return max(2, int(percentage * total / 100) // 2 * 2)


def loop_models_by_device(profile: Profile) -> dict[str, list[int]]:
    """The GPU-loop models of each CUDA device, in profile order."""
    out: dict[str, list[int]] = {}
    for i, m in enumerate(profile.models):
        if m.device != "cpu" and profile.engine_mode_of(i) == "loop":
            out.setdefault(m.device, []).append(i)
    return out


def mps_needed(profile: Profile) -> bool:
    """MPS runs when a CUDA device has two GPU loops (they must run at the same time) or an sm_count."""
    return any(
        len(indices) > 1 or any(profile.models[i].sm_count is not None for i in indices)
        for indices in loop_models_by_device(profile).values()
    )


def plan_shares(profile: Profile, device_sms: Callable[[str], int]) -> list[SmShare]:
    """Each GPU-loop model's share: sm_count rounded up to a percentage; the models without one share
    the rest. Raises ProfileError naming the keys when the shares do not fit."""
    shares = []
    for device, indices in loop_models_by_device(profile).items():
        total = device_sms(device)
        asked = {i: c for i in indices if (c := profile.models[i].sm_count) is not None}
        for i, count in asked.items():
            if count > total:
                raise ProfileError(
                    f"{profile.models[i].key('sm_count')}: {count}, but {device} has {total} SMs"
                )
        percent = {i: math.ceil(100 * count / total) for i, count in asked.items()}
        granted = {i: sms_for(p, total) for i, p in percent.items()}
        sharing = [i for i in indices if i not in asked]
        used = sum(granted.values())
        keys = " + ".join(profile.models[i].key("sm_count", replica=True) for i in asked)
        if used > total:
            raise ProfileError(f"{keys}: {used} SMs once rounded to whole TPCs; {device} has {total}")
        if sharing:
            # The models without sm_count share what is left: each may use all of it, as they would
            # share a whole GPU.
            rest = total - used
            each = 100 * rest // total
            if each < 1:
                names = ", ".join(profile.models[i].key(replica=True) for i in sharing)
                raise ProfileError(f"{keys}: leave {rest} of {device}'s {total} SMs for {names}")
            for i in sharing:
                percent[i], granted[i] = each, sms_for(each, total)
        shares += [SmShare(i, device, percent[i], granted[i], total, asked.get(i)) for i in indices]
    return sorted(shares, key=lambda s: s.model_index)


def device_sm_count(device: str) -> int:
    """SMs of a CUDA device through the driver alone: no context is created, so the daemon that
    asks does not become a GPU client itself."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise MpsError("SM shares need cuda-bindings (pip install 'blink-appliance[gpu]')") from exc
    index = int(device.partition(":")[2] or 0)
    (err,) = cu.cuInit(0)
    err2, dev = cu.cuDeviceGet(index)
    attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    err3, count = cu.cuDeviceGetAttribute(attribute, dev)
    if any(e != cu.CUresult.CUDA_SUCCESS for e in (err, err2, err3)):
        raise MpsError(f"{device}: the CUDA driver cannot report its SM count")
    return int(count)


def device_free_bytes(device: str) -> int:
    """Free memory of a CUDA device through NVML, without a CUDA context of this process."""
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise MpsError(
            "several models on one GPU need nvidia-ml-py (pip install 'blink-appliance[gpu]')"
        ) from exc
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(device.partition(":")[2] or 0))
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        raise MpsError(f"{device}: NVML cannot read its free memory ({e})") from None


def shared_devices(profile: Profile) -> set[str]:
    """CUDA devices that serve more than one model (their kv_fractions share one reading)."""
    devices = [m.device for m in profile.models if m.device != "cpu"]
    return {d for d in devices if devices.count(d) > 1}


class MpsControl:
    """A private MPS control daemon: its pipe and log directories are the appliance's own, so it
    never meets a system-wide MPS, and it goes when the appliance stops."""

    def __init__(self, workdir: Path) -> None:
        self.pipe_dir = workdir / "mps-pipe"
        self.log_dir = workdir / "mps-log"
        self.running = False

    @property
    def env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def client_env(self, share: SmShare) -> dict[str, str]:
        return {**self.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share.percentage)}

    def start(self) -> None:
        binary = shutil.which(CONTROL)
        if binary is None:
            raise MpsError(
                f"{CONTROL} is not on PATH: several GPU loops on one device, or sm_count, need CUDA MPS "
                "(it ships with the NVIDIA driver)"
            )
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([binary, "-d"], env={**os.environ, **self.env}, capture_output=True, text=True)
        if done.returncode != 0:
            raise MpsError(
                f"{CONTROL} -d exited with {done.returncode}: {(done.stderr or done.stdout).strip()}"
            )
        self.running = True

    def stop(self) -> None:
        """Quit the control daemon (and its server); the engine processes have stopped by now."""
        if self.running:
            binary = shutil.which(CONTROL) or CONTROL
            env = {**os.environ, **self.env}
            subprocess.run([binary], input="quit\n", env=env, capture_output=True, text=True)
            self.running = False
        for d in (self.pipe_dir, self.log_dir):
            shutil.rmtree(d, ignore_errors=True)
