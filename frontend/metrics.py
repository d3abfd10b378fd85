"""Prometheus metrics of the front end (/metrics), in prometheus-client's text format.

Latencies are what the client sees (stamped when the front end reads a token from the ring).
Engine gauges (running, waiting, KV usage) are read from each engine's telemetry words at scrape
time, so a scrape costs nothing while nobody scrapes. One `MetricsRegistry` holds every served
model's series, told apart by the `model_name` label (vLLM's name for it); each app gets its own
registry so several front ends in one process (tests) do not collide.

Per priority class: the latency histograms and the request counters also carry a `priority` label,
the effective priority the request ran at (docs/api.md, "Priority"). A model's first
MAX_PRIORITY_CLASSES classes get a label each; requests of any further class share
`priority="other"`, so clients choosing numbers cannot grow the series without bound.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from blink_appliance.telemetry.latency import MAX_PRIORITY_CLASSES, TokenLatencyTracker
from blink_appliance.telemetry.snapshot import engine_counters_from
from blink_appliance.wire.request import OutputEvent, TokenRun
from blink_appliance.wire.ring_layout import STEP_TIME_BOUNDS_US, STEP_TIME_FIELDS

log = logging.getLogger(__name__)

# The *_created series double the output and no dashboard here reads them.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_GC_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25)
_PART_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0, 10.0)
_LABELS = ["model_name"]
_CLASS_LABELS = ["model_name", "priority"]
OTHER_CLASS = "other"  # the label of classes beyond a model's first MAX_PRIORITY_CLASSES
_GAUGES = (
    ("blink_num_requests_running", "Requests the engine is running", "running"),
    ("blink_num_requests_waiting", "Requests admitted and waiting in the engine", "waiting"),
    ("blink_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", "kv_usage"),
    (
        "blink_kv_cache_cached_blocks",
        "KV blocks no request holds that keep a cached prefix",
        "kv_blocks_cached",
    ),
)
# Telemetry counters exposed as they are (prefix cache: tokens, like vLLM's).
_COUNTERS = (
    ("blink_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
    ("blink_prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_cache_hits"),
)


@dataclass(frozen=True)
class _Engine:
    """How to read one model's engine at scrape time."""

    model: str
    read: Callable[[], Mapping[str, Any]]
    alive: Callable[[], bool]


class _EngineGauges(Collector):
    """Every model's engine gauges; each family is yielded once with one sample per model (a
    family repeated in one scrape is invalid exposition text)."""

    def __init__(self) -> None:
        self.engines: list[_Engine] = []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        alive = GaugeMetricFamily(
            "blink_engine_alive", "1 while the engine answers on the ring", labels=_LABELS
        )
        gauges = {attr: GaugeMetricFamily(name, doc, labels=_LABELS) for name, doc, attr in _GAUGES}
        totals = {attr: CounterMetricFamily(name, doc, labels=_LABELS) for name, doc, attr in _COUNTERS}
        waits = CounterMetricFamily(
            "blink_ring_payload_waits",
            "Times the front end saw a published token count before the tokens it covers",
            labels=_LABELS,
        )
        steps = HistogramMetricFamily(
            "blink_engine_step_seconds",
            "Engine step time: schedule to commit on the GPU loop, one engine step on the CPU",
            labels=_LABELS,
        )
        bounds = [floatToGoString(b / 1e6) for b in STEP_TIME_BOUNDS_US] + ["+Inf"]
        for engine in self.engines:
            alive.add_metric([engine.model], 1.0 if engine.alive() else 0.0)
            try:
                raw = engine.read()
                counters = engine_counters_from(raw)
            except Exception as e:  # engine restarting: report liveness only, never invented numbers
                log.debug("engine telemetry of %s unavailable: %s", engine.model, e)
                continue
            for attr, family in gauges.items():
                value = getattr(counters, attr, None)
                if value is not None:
                    family.add_metric([engine.model], float(value))
            for attr, family in totals.items():
                if (value := raw.get(attr)) is not None:
                    family.add_metric([engine.model], float(value))
            if (n := raw.get("payload_waits")) is not None:  # any is an engine write-ordering bug
                waits.add_metric([engine.model], float(n))
            counts = [raw.get(name) for name in STEP_TIME_FIELDS]
            if all(c is not None for c in counts):  # the engine's own step-time histogram
                cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
                steps.add_metric([engine.model], list(zip(bounds, cumulative, strict=True)), None)
        yield alive
        # A family with no sample is left out, as before: no engine reported that counter.
        yield from (f for f in (*gauges.values(), *totals.values(), waits, steps) if f.samples)


class MetricsRegistry:
    """The one Prometheus registry of a front end and its metric families, shared by every model."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "blink_time_to_first_token_seconds", "Time to first token", _CLASS_LABELS,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "blink_time_per_output_token_seconds", "Time per output token after the first", _CLASS_LABELS,
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.first_token_parts = Histogram(
            "blink_first_token_part_seconds",
            "Time to first token in parts: frontend (from the HTTP handler's start to the submission), "
            "engine (from there to the engine's stamp of the first token) and delivery (from that stamp "
            "to the front end handing it on)",
            [*_CLASS_LABELS, "part"], buckets=_PART_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "blink_e2e_request_latency_seconds", "Request latency, arrival to last token", _CLASS_LABELS,
            buckets=_E2E_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt = Counter("blink_prompt_tokens", "Prompt tokens processed", _LABELS, registry=r)
        self.generation = Counter("blink_generation_tokens", "Tokens generated", _LABELS, registry=r)
        self.finished = Counter(
            "blink_request_success", "Requests finished, by finish reason",
            [*_CLASS_LABELS, "finished_reason"], registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "blink_request_errors",
            "Requests that ended in an error, by cause",
            [*_CLASS_LABELS, "cause"],
            registry=r,
        )
        self.gc_pause = Histogram(
            "blink_frontend_gc_pause_seconds", "The front end's garbage-collection pauses, by generation",
            ["generation"], buckets=_GC_BUCKETS, registry=r,
        )  # fmt: skip
        self.loop_lag = Histogram(
            "blink_frontend_loop_lag_seconds",
            "How late the front end's event loop ran a timer due every 2 ms (every stream waits that long)",
            buckets=_GC_BUCKETS, registry=r,
        )  # fmt: skip
        self._engines = _EngineGauges()
        r.register(self._engines)

    def watch_gc(self) -> Callable[[], None]:
        """Time this process's garbage collections into `gc_pause` (every stream waits out a pause);
        returns what stops it."""
        started = [0.0]

        def callback(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                self.gc_pause.labels(str(info["generation"])).observe(time.perf_counter() - started[0])

        gc.callbacks.append(callback)
        return lambda: gc.callbacks.remove(callback)

    @property
    def models(self) -> list[str]:
        return [e.model for e in self._engines.engines]

    def add_engine(
        self, model: str, read: Callable[[], Mapping[str, Any]], alive: Callable[[], bool]
    ) -> None:
        if model in self.models:  # two services under one name would merge their series
            raise ValueError(f"model {model!r} already has metrics in this registry")
        self._engines.engines.append(_Engine(model, read, alive))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ClassSeries:
    """One priority class of one model: its latency children (looked up once: labels() per token
    cost 5% of a saturated front end, H100 batch 64) and its telemetry tracker."""

    def __init__(
        self, families: MetricsRegistry, model: str, label: str, tracker: TokenLatencyTracker | None
    ) -> None:
        self.label = label
        self.ttft = families.ttft.labels(model, label)
        self.tpot = families.tpot.labels(model, label)
        self.e2e = families.e2e.labels(model, label)
        self.frontend_part = families.first_token_parts.labels(model, label, "frontend")
        self.engine_part = families.first_token_parts.labels(model, label, "engine")
        self.delivery_part = families.first_token_parts.labels(model, label, "delivery")
        self.tracker = tracker


class ServingMetrics:
    """One model's per-request observations -> its Prometheus series (and the TUI's latency
    trackers, when given: the model's, and one per priority class from `class_tracker(priority)`,
    None for the classes past MAX_PRIORITY_CLASSES). Pass the front end's `registry` to share it
    with the other models."""

    def __init__(
        self,
        model: str,
        *,
        engine_telemetry: Callable[[], Mapping[str, Any]],
        engine_alive: Callable[[], bool],
        tracker: TokenLatencyTracker | None = None,
        class_tracker: Callable[[int | None], TokenLatencyTracker] | None = None,
        registry: MetricsRegistry | None = None,
    ) -> None:
        self.model = model
        self.families = families = registry if registry is not None else MetricsRegistry()
        families.add_engine(model, engine_telemetry, engine_alive)
        self._tracker = tracker
        self._class_tracker = class_tracker
        self._classes: dict[int, _ClassSeries] = {}
        self._other: _ClassSeries | None = None
        self._prompt_child = families.prompt.labels(model)
        self._generation_child = families.generation.labels(model)

    @property
    def registry(self) -> CollectorRegistry:
        return self.families.registry

    def series(self, priority: int) -> _ClassSeries:
        """The series of class `priority` (created on its first request), or the shared "other"."""
        found = self._classes.get(priority)
        if found is not None:
            return found
        if len(self._classes) < MAX_PRIORITY_CLASSES:
            found = self._classes[priority] = self._new_series(str(priority), priority)
            return found
        if self._other is None:
            self._other = self._new_series(OTHER_CLASS, None)
        return self._other

    def _new_series(self, label: str, priority: int | None) -> _ClassSeries:
        tracker = self._class_tracker(priority) if self._class_tracker is not None else None
        return _ClassSeries(self.families, self.model, label, tracker)

    def request_timer(
        self, prompt_tokens: int, priority: int = 0, arrived_ns: int = 0, submitted_ns: int = 0
    ) -> RequestTimer:
        """A request's timer; `arrived_ns` and `submitted_ns` (when its handler began and when it
        went to the engine; 0: not known) time its first token's parts."""
        self._prompt_child.inc(prompt_tokens)
        return RequestTimer(self, self.series(priority), arrived_ns, submitted_ns)

    def error(self, cause: str, priority: int = 0) -> None:
        self.families.errors.labels(self.model, self.series(priority).label, cause).inc()

    def finished(self, reason: str, priority: int = 0) -> None:
        self.families.finished.labels(self.model, self.series(priority).label, reason).inc()

    def render(self) -> bytes:
        """Every model's series in the shared registry, not only this model's."""
        return self.families.render()


def arrivals(batch: list[OutputEvent], now: int) -> list[int]:
    """When each token of `batch` arrived, as the latency tracker sees it: the engine's spacing
    within the batch, ending now (its cadence, not one arrival for all of them)."""
    last = batch[-1]
    end = last.timestamps_ns[-1] if isinstance(last, TokenRun) else last.timestamp_ns
    out: list[int] = []
    for ev in batch:
        if isinstance(ev, TokenRun):
            out += [now - max(0, end - stamp) for stamp in ev.timestamps_ns]
        elif ev.token_id is not None:
            out.append(now - max(0, end - ev.timestamp_ns))
    return out


class RequestTimer:
    """Timestamps of one request's tokens (monotonic ns, the latency tracker's clock)."""

    def __init__(
        self, metrics: ServingMetrics, series: _ClassSeries, arrived_ns: int = 0, submitted_ns: int = 0
    ) -> None:
        self._m = metrics
        self._series = series
        self.submitted_ns = submitted_ns
        if arrived_ns and submitted_ns:
            series.frontend_part.observe(max(0, submitted_ns - arrived_ns) / 1e9)
        self.start_ns = time.monotonic_ns()
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self.tokens_seen = 0

    def token(self, now: int | None = None) -> None:
        """A token delivered at `now` (monotonic ns; default: this moment)."""
        self.tokens([time.monotonic_ns() if now is None else now])

    def batch(self, batch: list[OutputEvent]) -> None:
        """The tokens of `batch`, delivered now; with the first, the engine's and the delivery's
        parts of the time to it (the engine stamps tokens on the host's monotonic clock)."""
        now = time.monotonic_ns()
        if self.first_ns is None and self.submitted_ns:
            first = next((ev for ev in batch if isinstance(ev, TokenRun) or ev.token_id is not None), None)
            if first is not None:
                stamp = first.timestamps_ns[0] if isinstance(first, TokenRun) else first.timestamp_ns
                self._series.engine_part.observe(max(0, stamp - self.submitted_ns) / 1e9)
                self._series.delivery_part.observe(max(0, now - stamp) / 1e9)
        self.tokens(arrivals(batch, now))

    def tokens(self, arrivals: list[int]) -> None:
        """Tokens delivered at `arrivals` (monotonic ns, in order; a stamp before the last is taken as
        the last), recorded together: per-token calls were a tenth of a saturated front end."""
        if not arrivals:
            return
        m, c = self._m, self._series
        stamps = list(itertools.accumulate(arrivals, max, initial=self.last_ns or arrivals[0]))[1:]
        prev = self.last_ns
        if prev is None:
            prev = self.first_ns = stamps[0]
            c.ttft.observe((prev - self.start_ns) / 1e9)
            for tracker in (m._tracker, c.tracker):
                if tracker is not None:
                    tracker.record_first_token(self.start_ns, prev)
            rest = stamps[1:]
        else:
            rest = stamps
        for tracker in (m._tracker, c.tracker):
            if tracker is not None and rest:
                tracker.record_tokens(prev, rest)
        self.last_ns = stamps[-1]
        self.tokens_seen += len(stamps)
        m._generation_child.inc(len(stamps))

    def error(self, cause: str) -> None:
        """The request ended in an error (no finish reason): counted under its class."""
        self._m.families.errors.labels(self._m.model, self._series.label, cause).inc()

    def finish(self, reason: str) -> None:
        m, c = self._m, self._series
        now = time.monotonic_ns()
        c.e2e.observe((now - self.start_ns) / 1e9)
        m.families.finished.labels(m.model, c.label, reason).inc()
        if self.first_ns is not None and self.last_ns is not None and self.tokens_seen > 1:
            c.tpot.observe((self.last_ns - self.first_ns) / 1e9 / (self.tokens_seen - 1))
        if self.first_ns is not None and self.last_ns is not None:
            for tracker in (m._tracker, c.tracker):
                if tracker is not None:
                    tracker.record_request_done(self.first_ns, self.last_ns, self.tokens_seen)
