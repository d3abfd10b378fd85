"""Telemetry: what the appliance measures about itself and serves to `blink-appliance top`.

Samplers (host CPU per appliance process, others' load, run-queue delay, scheduling latency,
NVML), the per-model token-latency tracker, and the snapshot that goes over the wire (`GET /telemetry`, `GET /telemetry/stream`).
"""

from blink_appliance.telemetry.gpu import GpuSampler
from blink_appliance.telemetry.host import HostSampler
from blink_appliance.telemetry.interference import interference_verdict
from blink_appliance.telemetry.latency import TokenLatencyTracker
from blink_appliance.telemetry.sched_probe import SchedLatencyProbe
from blink_appliance.telemetry.sm_share import sm_shares
from blink_appliance.telemetry.snapshot import (
    ClassLatency,
    EngineCounters,
    GpuStats,
    HostStats,
    LatencyStats,
    ModelTelemetry,
    ProcessStats,
    SmShare,
    TelemetrySnapshot,
)
from blink_appliance.telemetry.source import TelemetrySource

__all__ = [
    "ClassLatency",
    "EngineCounters",
    "GpuSampler",
    "GpuStats",
    "HostSampler",
    "HostStats",
    "LatencyStats",
    "ModelTelemetry",
    "ProcessStats",
    "SchedLatencyProbe",
    "SmShare",
    "TelemetrySnapshot",
    "TelemetrySource",
    "TokenLatencyTracker",
    "interference_verdict",
    "sm_shares",
]
