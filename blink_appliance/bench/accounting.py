"""What a run cost: GPU energy per output token, and the server's host CPU seconds per 1,000 tokens.

Reads the counters before and after a run with the telemetry samplers the appliance already uses:
- GPU: NVML's total-energy counter (GpuSampler), summed over the server's GPUs (`--gpu-index 0,1`
  for a tensor-parallel engine). It is the whole boards' energy, idle power included, over the run's
  wall time. Without NVML or a GPU the result says why.
- host CPU: user + system seconds of the server's processes (HostSampler over a fixed pid set):
  given pids, or found from the URL: the process listening on its port and its children, and when
  that is a blink-appliance front end, its daemon and all the daemon's children (the engine).
  A server on another machine, or a process that exits mid-run, makes the figure unavailable with
  the reason, never a wrong number. Also the whole machine's CPU use over the run, and this load
  generator's own (near a full core, its timestamps carry its own delays).
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import psutil

from blink_appliance.telemetry.gpu import GpuSampler
from blink_appliance.telemetry.host import HostSampler

_OUR_FRONTEND = "blink_appliance.frontend"  # the front end's module in its command line


@dataclass(frozen=True)
class ServerProcesses:
    pids: list[int]
    how: str  # how they were found, for the report
    reason: str | None = None  # why none were found


def _is_local_host(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    for address in addresses:
        try:
            if ipaddress.ip_address(address.split("%")[0]).is_loopback or address in local:
                return True
        except ValueError:
            continue
    return False


def _process_tree(root: psutil.Process) -> list[int]:
    try:
        return sorted({root.pid, *(c.pid for c in root.children(recursive=True))})
    except psutil.Error:
        return [root.pid]


def find_server_processes(base_url: str) -> ServerProcesses:
    """The processes serving `base_url` on this machine (see the module docstring)."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not _is_local_host(host):
        return ServerProcesses([], "", f"the server ({host}) is not on this machine")
    try:
        listeners = [
            c.pid
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
        ]
    except psutil.AccessDenied:
        return ServerProcesses([], "", "not allowed to list sockets here; pass --server-pids")
    if not listeners:
        return ServerProcesses([], "", f"no process of this user listens on port {port}; pass --server-pids")
    try:
        listener = psutil.Process(listeners[0])
        cmdline = " ".join(listener.cmdline())
        parent = listener.parent()
    except psutil.Error as e:
        return ServerProcesses([], "", f"the process on port {port} went away: {e}")
    if _OUR_FRONTEND in cmdline and parent is not None:
        return ServerProcesses(_process_tree(parent), f"blink-appliance daemon {parent.pid} and its children")
    return ServerProcesses(
        _process_tree(listener), f"listener {listener.pid} on port {port} and its children"
    )


@dataclass(frozen=True)
class RunCost:
    wall_s: float
    gpu_name: str | None
    gpu_energy_j: float | None
    gpu_unavailable: str | None  # why there is no energy figure
    server_pids: list[int]
    server_found_by: str
    server_cpu_s: float | None
    server_cpu_unavailable: str | None
    machine_cpu_percent: float | None  # all cores together, 0-100, over the run
    client_cpu_percent: float  # this process (the load generator); 100 = one core
    output_tokens: int

    @property
    def joules_per_output_token(self) -> float | None:
        if self.gpu_energy_j is None or self.output_tokens <= 0:
            return None
        return self.gpu_energy_j / self.output_tokens

    @property
    def server_cpu_s_per_1k_tokens(self) -> float | None:
        if self.server_cpu_s is None or self.output_tokens <= 0:
            return None
        return self.server_cpu_s / self.output_tokens * 1000.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "joules_per_output_token": self.joules_per_output_token,
            "server_cpu_s_per_1k_tokens": self.server_cpu_s_per_1k_tokens,
        }


class RunMeter:
    """`start()` before a run, `finish(output_tokens)` after it."""

    def __init__(self, server: ServerProcesses, *, gpu_index: int | Sequence[int] | None = 0) -> None:
        self.server = server
        self._gpu = GpuSampler(gpu_index) if gpu_index is not None else None
        self._host = HostSampler({f"server-{i}": pid for i, pid in enumerate(server.pids)})
        self._t0 = 0.0
        self._energy0: float | None = None
        self._cpu0: float | None = None
        self._alive0: set[int] = set()
        self._client = psutil.Process()
        self._client_cpu0 = 0.0

    def start(self) -> None:
        if self._gpu is not None:
            self._gpu.start()
            self._energy0 = self._gpu.sample().energy_j
        # This sample also resets the sampler's per-core deltas, so finish() covers the run only.
        self._cpu0 = self._host.sample().appliance_cpu_seconds
        self._alive0 = {p for p in self.server.pids if psutil.pid_exists(p)}
        self._client_cpu0 = self._client_cpu_s()
        self._t0 = time.monotonic()

    def _client_cpu_s(self) -> float:
        t = self._client.cpu_times()
        return t.user + t.system

    def _gpu_result(self) -> tuple[str | None, float | None, str | None]:
        if self._gpu is None:
            return None, None, "GPU energy not measured (no GPU index)"
        stats = self._gpu.sample()
        self._gpu.stop()
        if not stats.available:
            return None, None, stats.reason or "no GPU"
        if stats.energy_j is None or self._energy0 is None:
            return stats.name, None, "this GPU does not report its total energy counter"
        return stats.name, stats.energy_j - self._energy0, None

    def _cpu_result(self, after: float | None) -> tuple[float | None, str | None]:
        if not self.server.pids:
            return None, self.server.reason or "no server processes"
        gone = sorted(p for p in self._alive0 if not psutil.pid_exists(p))
        if gone or len(self._alive0) != len(self.server.pids):
            lost = gone or sorted(set(self.server.pids) - self._alive0)
            return None, f"server process(es) {lost} exited during the run: their CPU time is lost"
        if after is None or self._cpu0 is None:
            return None, "could not read the server processes' CPU times"
        return after - self._cpu0, None

    def finish(self, output_tokens: int) -> RunCost:
        wall = time.monotonic() - self._t0
        client_cpu = self._client_cpu_s() - self._client_cpu0
        host = self._host.sample()
        gpu_name, energy, gpu_reason = self._gpu_result()
        cpu_s, cpu_reason = self._cpu_result(host.appliance_cpu_seconds)
        return RunCost(
            wall_s=wall,
            gpu_name=gpu_name,
            gpu_energy_j=energy,
            gpu_unavailable=gpu_reason,
            server_pids=list(self.server.pids),
            server_found_by=self.server.how,
            server_cpu_s=cpu_s,
            server_cpu_unavailable=cpu_reason,
            machine_cpu_percent=host.cpu_percent_total,
            client_cpu_percent=client_cpu / wall * 100.0 if wall > 0 else 0.0,
            output_tokens=output_tokens,
        )
