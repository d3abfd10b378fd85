"""Telemetry: what the appliance measures about itself and serves to `blink-appliance top`.

Samplers (host CPU and scheduling latency, NVML), the per-model token-latency tracker, and the
snapshot that goes over the wire (`GET /telemetry`, `GET /telemetry/stream`).
"""

from blink_appliance.telemetry.gpu import GpuSampler
from blink_appliance.telemetry.host import HostSampler
from blink_appliance.telemetry.latency import TokenLatencyTracker
from blink_appliance.telemetry.sched_probe import SchedLatencyProbe
from blink_appliance.telemetry.snapshot import (
    EngineCounters,
    GpuStats,
    HostStats,
    LatencyStats,
    ModelTelemetry,
    TelemetrySnapshot,
)
from blink_appliance.telemetry.source import TelemetrySource

__all__ = [
    "EngineCounters",
    "GpuSampler",
    "GpuStats",
    "HostSampler",
    "HostStats",
    "LatencyStats",
    "ModelTelemetry",
    "SchedLatencyProbe",
    "TelemetrySnapshot",
    "TelemetrySource",
    "TokenLatencyTracker",
]
