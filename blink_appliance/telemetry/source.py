"""TelemetrySource: everything the appliance measures, sampled on one cadence into snapshots.

The front end owns one. It passes a callable that returns the engines' counters keyed by model
name (e.g. `lambda: {name: client.telemetry() for name, client in clients.items()}`), each
model's device and SM share, records token timestamps into `source.latency(model)`, and serves
the snapshots (frontend/telemetry_routes.py). One background task
samples every `interval_s`, however many clients watch, so host-CPU rates and the energy counter
are differenced over a steady period and watching adds no load per viewer.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from blink_appliance.telemetry.gpu import GpuSampler
from blink_appliance.telemetry.host import HostSampler
from blink_appliance.telemetry.latency import MAX_PRIORITY_CLASSES, TokenLatencyTracker
from blink_appliance.telemetry.snapshot import (
    ClassLatency,
    EngineCounters,
    GpuStats,
    HostStats,
    LatencyStats,
    ModelTelemetry,
    SmShare,
    TelemetrySnapshot,
    engine_counters_from,
)

log = logging.getLogger(__name__)

CountersByModel = Mapping[str, Mapping[str, Any] | EngineCounters]
EngineCounterSource = Callable[[], CountersByModel | Awaitable[CountersByModel]]


class TelemetrySource:
    def __init__(
        self,
        engine_counters: EngineCounterSource | None = None,
        *,
        models: Iterable[str] = (),
        host: HostSampler | None = None,
        gpu: GpuSampler | None = None,
        interval_s: float = 0.5,
        energy_window_s: float = 10.0,
        tracker_factory: Callable[[], TokenLatencyTracker] = TokenLatencyTracker,
        device: str | None = None,
        devices: Mapping[str, str] | None = None,
        sm_shares: Mapping[str, SmShare | None] | None = None,
    ) -> None:
        self._engine_counters = engine_counters
        # The profile's "cpu" or "cuda:N", shown where engines name none: per model, else `device`.
        self._device = device
        self._devices = dict(devices or {})
        self._sm_shares = dict(sm_shares or {})
        self.host = host if host is not None else HostSampler()
        self.gpu = gpu if gpu is not None else GpuSampler()
        self.interval_s = interval_s
        self._energy_window_s = energy_window_s
        self._tracker_factory = tracker_factory
        self._trackers: dict[str, TokenLatencyTracker] = {}
        # Per model, per priority class (None: the classes past MAX_PRIORITY_CLASSES, together).
        self._class_trackers: dict[str, dict[int | None, TokenLatencyTracker]] = {}
        for name in models:
            self.latency(name)
        self._started_at = time.monotonic()
        # (monotonic s, energy J, generated tokens) per sample, for J/token over a window.
        self._energy_points: deque[tuple[float, float, int]] = deque()
        self._latest: TelemetrySnapshot | None = None
        self._seq = 0
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def latency(self, model: str) -> TokenLatencyTracker:
        """The latency tracker of `model` (created on first use; the model then shows up)."""
        tracker = self._trackers.get(model)
        if tracker is None:
            tracker = self._trackers[model] = self._tracker_factory()
        return tracker

    def class_latency(self, model: str, priority: int | None) -> TokenLatencyTracker:
        """The latency tracker of one priority class of `model` (created on first use). A model's
        first MAX_PRIORITY_CLASSES classes get one each; later ones, and None, share one."""
        self.latency(model)
        classes = self._class_trackers.setdefault(model, {})
        tracker = classes.get(priority)
        if tracker is None:
            own = sum(p is not None for p in classes)
            key = priority if priority is not None and own < MAX_PRIORITY_CLASSES else None
            tracker = classes.get(key)
            if tracker is None:
                tracker = classes[key] = self._tracker_factory()
        return tracker

    async def _latencies(self, names: list[str]) -> dict[str, tuple[LatencyStats, list[ClassLatency]]]:
        """Each model's latency stats, and its classes', each in an event-loop iteration of its own:
        a full window takes a fraction of a millisecond to sum up, and every stream waits meanwhile."""
        out = {}
        for name in names:
            overall = self.latency(name).stats()
            classes = self._class_trackers.get(name, {})
            stats = []
            for p in sorted(classes, key=lambda p: (p is None, p or 0)):
                await asyncio.sleep(0)
                stats.append(ClassLatency.of(p, classes[p].stats()))
            out[name] = overall, stats
            await asyncio.sleep(0)
        return out

    @property
    def latest(self) -> TelemetrySnapshot | None:
        return self._latest

    @property
    def stopped(self) -> bool:
        return self._stopped

    async def start(self) -> None:
        """Start the sampler threads (host probe, NVML) and the sampling task."""
        if self._task is not None:
            return
        self._stopped = False
        self._started_at = time.monotonic()
        await asyncio.to_thread(self.host.start)
        await asyncio.to_thread(self.gpu.start)
        self._task = asyncio.create_task(self._run(), name="telemetry-sampler")

    async def stop(self) -> None:
        """Stop sampling; streams waiting in `next_snapshot` end."""
        self._stopped = True
        async with self._changed:
            self._changed.notify_all()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await asyncio.to_thread(self.host.stop)
        await asyncio.to_thread(self.gpu.stop)

    async def _run(self) -> None:
        while True:
            try:
                snap = await self.sample()
            except Exception:  # a broken sample must not end the stream for good
                log.exception("telemetry sample failed")
            else:
                async with self._changed:
                    self._latest = snap
                    self._seq += 1
                    self._changed.notify_all()
            await asyncio.sleep(self.interval_s)

    async def next_snapshot(self, after: int) -> tuple[int, TelemetrySnapshot] | None:
        """Wait for a snapshot newer than sequence number `after`; None once stopped."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._stopped or (self._seq > after and self._latest is not None)
            )
            if self._stopped or self._latest is None:
                return None
            return self._seq, self._latest

    async def _read_engines(self) -> tuple[dict[str, EngineCounters], str | None]:
        if self._engine_counters is None:
            return {}, None
        try:
            raw = self._engine_counters()
            if inspect.isawaitable(raw):
                raw = await raw
            return {name: engine_counters_from(c) for name, c in raw.items()}, None
        except Exception as e:  # engine gone or restarting: report, do not invent numbers
            return {}, f"{type(e).__name__}: {e}"

    def _device_label(self, model: str, gpu: GpuStats) -> str | None:
        """What `model`'s engine runs on, for people: "cpu", or the GPU's name (its "cuda:N" without
        NVML, or when it is not the GPU the sampler reads)."""
        device = self._devices.get(model, self._device)
        if device is None or device == "cpu":
            return device
        index = int(device.partition(":")[2] or 0)
        if not gpu.available or index not in self.gpu.device_indices:
            return device
        one = len(self.gpu.device_indices) == 1  # then the sample's name is that GPU's
        return self.gpu.device_names.get(index) or (gpu.name if one else None) or device

    def _sample_devices(self) -> tuple[HostStats, GpuStats]:
        return self.host.sample(), self.gpu.sample()

    async def sample(self) -> TelemetrySnapshot:
        """Read every source now and build a snapshot (also updates the J/token window)."""
        engines, engine_error = await self._read_engines()
        host, gpu = await asyncio.to_thread(self._sample_devices)
        now = time.monotonic()
        for name, counters in engines.items():
            device = self._device_label(name, gpu)
            if counters.device is None and device is not None:
                engines[name] = counters.model_copy(update={"device": device})

        names = list(self._trackers)
        names += [n for n in engines if n not in self._trackers]
        latencies = await self._latencies(names)
        models = [
            ModelTelemetry(
                name=name,
                engine=engines.get(name),
                engine_error=engine_error if name not in engines else None,
                latency=latencies[name][0],
                sm_share=self._sm_shares.get(name),
                classes=latencies[name][1],
            )
            for name in names
        ]
        return TelemetrySnapshot(
            time_unix=time.time(),
            uptime_s=now - self._started_at,
            models=models,
            host=host,
            gpu=gpu,
            energy_per_token_j=self._energy_per_token(now, gpu, engines),
        )

    def _energy_per_token(
        self, now: float, gpu: GpuStats, engines: Mapping[str, EngineCounters]
    ) -> float | None:
        if gpu.energy_j is None:
            return None
        # The engines' own token counters are authoritative; without them, the front end's count.
        engine_tokens = [c.generated_tokens for c in engines.values()]
        if engine_tokens and all(t is not None for t in engine_tokens):
            tokens = sum(t for t in engine_tokens if t is not None)
        else:
            tokens = sum(t.total_tokens for t in self._trackers.values())
        points = self._energy_points
        points.append((now, gpu.energy_j, tokens))
        while len(points) > 2 and now - points[1][0] >= self._energy_window_s:
            points.popleft()
        _, energy0, tokens0 = points[0]
        d_tokens = tokens - tokens0
        d_energy = gpu.energy_j - energy0
        if d_tokens <= 0 or d_energy < 0:  # idle, or a counter reset (engine/driver restart)
            if d_tokens < 0 or d_energy < 0:
                points.clear()
                points.append((now, gpu.energy_j, tokens))
            return None
        return d_energy / d_tokens
