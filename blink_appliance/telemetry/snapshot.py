"""The telemetry wire format: one `TelemetrySnapshot` per sample, served as JSON and over SSE.

Every measured field is optional: None means "this source is missing here" (no GPU, no NVML,
an engine that does not report the counter) and the dashboard renders it as "n/a". A number is
only ever a measurement, never a placeholder.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

SNAPSHOT_VERSION = 1


class EngineCounters(BaseModel):
    """Counters one engine publishes (the GPU loop writes them into mapped memory).

    Accepts the key spellings engines use; counters this model does not know pass through
    unchanged (extra="allow") so a newer engine's counters still reach the wire.
    """

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    running: int | None = Field(None, validation_alias=AliasChoices("running", "num_running", "batch_size"))
    waiting: int | None = Field(None, validation_alias=AliasChoices("waiting", "num_waiting", "queue_depth"))
    kv_blocks_used: int | None = Field(
        None, validation_alias=AliasChoices("kv_blocks_used", "kv_used_blocks")
    )
    kv_blocks_total: int | None = Field(
        None, validation_alias=AliasChoices("kv_blocks_total", "kv_total_blocks", "num_kv_blocks")
    )
    steps: int | None = None
    generated_tokens: int | None = Field(
        None, validation_alias=AliasChoices("generated_tokens", "tokens_generated", "output_tokens")
    )
    last_step_ns: int | None = None  # duration of the engine's latest step
    kv_blocks_cached: int | None = None  # blocks no request holds that keep a cached prefix
    prefix_cache_queries: int | None = None  # tokens admissions looked up in the prefix cache
    prefix_cache_hits: int | None = None  # of those, tokens found cached
    sm_partition: int | None = Field(None, validation_alias=AliasChoices("sm_partition", "num_sms", "sms"))
    device: str | None = None

    @property
    def prefix_hit_rate(self) -> float | None:
        """Fraction of looked-up prompt tokens found cached, or None before any lookup."""
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def kv_usage(self) -> float | None:
        """Fraction of KV blocks in use, or None when the engine does not report both counters."""
        if self.kv_blocks_used is None or not self.kv_blocks_total:
            return None
        return self.kv_blocks_used / self.kv_blocks_total


class LatencyStats(BaseModel):
    """Token latencies seen by the front end for one model, over the tracker's window."""

    window_s: float
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    tokens_per_s: float = 0.0
    total_tokens: int = 0
    # One value per history bucket, oldest first (sparklines). 0.0 = no tokens in that bucket.
    history_bucket_s: float = 1.0
    itl_history_ms: list[float] = Field(default_factory=list)
    tokens_per_s_history: list[float] = Field(default_factory=list)


class ClassLatency(BaseModel):
    """Token latencies of one priority class of one model (the effective priority its requests ran
    at), over the same window as the model's LatencyStats. `priority` None: the classes past the
    first MAX_PRIORITY_CLASSES of the model, together."""

    priority: int | None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    tokens_per_s: float = 0.0
    total_tokens: int = 0

    @classmethod
    def of(cls, priority: int | None, stats: LatencyStats) -> ClassLatency:
        return cls(priority=priority, **stats.model_dump(include=_CLASS_FIELDS))

    @property
    def label(self) -> str:
        return "other" if self.priority is None else str(self.priority)


_CLASS_FIELDS = {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "tokens_per_s", "total_tokens"}


class SmShare(BaseModel):
    """The part of its GPU a model's engine gets by the profile (`[[models]] sm_count`).

    "partition": `sm_count` SMs of its own; "rest": no sm_count, it shares the SMs the other
    models on its GPU leave; "whole": no sm_count and no other model partitions its GPU.
    """

    kind: Literal["partition", "rest", "whole"]
    sm_count: int | None = None  # set for "partition" only

    @property
    def label(self) -> str:
        if self.kind == "partition":
            return f"{self.sm_count} SMs"
        return "rest of the GPU" if self.kind == "rest" else "whole GPU"


class ModelTelemetry(BaseModel):
    name: str
    engine: EngineCounters | None = None  # None: the engine's counters could not be read
    engine_error: str | None = None
    latency: LatencyStats
    # The profile's SM share; None on a CPU engine, or from a front end that does not say.
    sm_share: SmShare | None = None
    # One entry per priority class seen since the front end started, lowest number (first to run)
    # first; empty from a front end that does not track classes.
    classes: list[ClassLatency] = Field(default_factory=list)


class ProcessStats(BaseModel):
    """One of the appliance's processes: the daemon, the front end or the engine."""

    role: str
    pid: int
    cpu_percent: float | None = None  # 100.0 = one core fully busy; None before a second reading
    cpu_seconds: float | None = None  # user + system since the process started
    # ms per second its threads were ready to run but waited for a core (telemetry/runqueue.py)
    runqueue_ms_per_s: float | None = None


class HostStats(BaseModel):
    cpu_percent_per_core: list[float]
    cpu_percent_total: float
    appliance_pids: list[int] = Field(default_factory=list)
    # Each of the appliance's processes apart (daemon, front end, engine, as found).
    processes: list[ProcessStats] = Field(default_factory=list)
    # Sum over the appliance's processes: 100.0 = one core fully busy.
    appliance_cpu_percent: float | None = None
    # The same as a share of the whole machine (all cores), 0-100.
    appliance_share_percent: float | None = None
    appliance_cpu_seconds: float | None = None  # user + system since the processes started
    # What everything else on the host takes: host busy minus the appliance (100.0 = one core) ...
    others_cpu_percent: float | None = None
    others_share_percent: float | None = None  # ... and as a share of the whole machine, 0-100
    # Run-queue delay summed over the appliance's threads, ms per second of wall time.
    runqueue_ms_per_s: float | None = None
    # quiet | busy | contended, from the two above (telemetry/interference.py); None: no rate yet
    interference: str | None = None
    # Scheduling-latency probe: how late a 1 ms sleep wakes up, over the last second.
    sched_p50_us: float | None = None
    sched_p99_us: float | None = None
    sched_max_us: float | None = None
    sched_samples: int = 0


class GpuStats(BaseModel):
    available: bool = False
    reason: str | None = None  # why not available (no NVML library, no GPU, ...)
    name: str | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    energy_j: float | None = None  # NVML total energy counter, converted from mJ
    gpu_util_percent: float | None = None
    mem_util_percent: float | None = None
    sm_clock_mhz: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None


class TelemetrySnapshot(BaseModel):
    version: int = SNAPSHOT_VERSION
    time_unix: float  # wall clock when sampled
    uptime_s: float  # since the telemetry source started
    models: list[ModelTelemetry]
    host: HostStats
    gpu: GpuStats
    # NVML energy delta over generated-token delta across all models; None without NVML or idle.
    energy_per_token_j: float | None = None

    def model(self, name: str) -> ModelTelemetry | None:
        return next((m for m in self.models if m.name == name), None)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> TelemetrySnapshot:
        return cls.model_validate_json(data)


def engine_counters_from(raw: Any) -> EngineCounters:
    """Validate whatever an engine-counter callable returned for one model."""
    if isinstance(raw, EngineCounters):
        return raw
    return EngineCounters.model_validate(dict(raw))
