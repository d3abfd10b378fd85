"""Prometheus metrics of the front end (/metrics), in prometheus-client's text format.

Latencies are what the client sees (stamped when the front end reads a token from the ring).
Engine gauges (running, waiting, KV usage) are read from the engine's telemetry words at scrape
time, so a scrape costs nothing while nobody scrapes. Each app gets its own registry so several
front ends in one process (tests) do not collide.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from blink_appliance.telemetry.latency import TokenLatencyTracker
from blink_appliance.telemetry.snapshot import engine_counters_from
from blink_appliance.wire.ring_layout import STEP_TIME_BOUNDS_US, STEP_TIME_FIELDS

log = logging.getLogger(__name__)

# The *_created series double the output and no dashboard here reads them.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class _EngineGauges(Collector):
    def __init__(self, model: str, read: Callable[[], Mapping[str, Any]], alive: Callable[[], bool]) -> None:
        self._model = model
        self._read = read
        self._alive = alive

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        alive = GaugeMetricFamily(
            "blink_engine_alive", "1 while the engine answers on the ring", labels=["model_name"]
        )
        alive.add_metric([self._model], 1.0 if self._alive() else 0.0)
        yield alive
        try:
            raw = self._read()
            counters = engine_counters_from(raw)
        except Exception as e:  # engine restarting: report liveness only, never invented numbers
            log.debug("engine telemetry unavailable: %s", e)
            return
        for name, doc, value in (
            ("blink_num_requests_running", "Requests the engine is running", counters.running),
            ("blink_num_requests_waiting", "Requests admitted and waiting in the engine", counters.waiting),
            ("blink_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", counters.kv_usage),
        ):
            if value is not None:
                g = GaugeMetricFamily(name, doc, labels=["model_name"])
                g.add_metric([self._model], float(value))
                yield g
        waits = raw.get("payload_waits")
        if waits is not None:  # the ring client's count; any is an engine write-ordering bug
            c = CounterMetricFamily(
                "blink_ring_payload_waits",
                "Times the front end saw a published token count before the tokens it covers",
                labels=["model_name"],
            )
            c.add_metric([self._model], float(waits))
            yield c
        counts = [raw.get(name) for name in STEP_TIME_FIELDS]
        if all(c is not None for c in counts):  # the engine's own step-time histogram (ring telemetry)
            h = HistogramMetricFamily(
                "blink_engine_step_seconds",
                "Engine step time: schedule to commit on the GPU loop, one engine step on the CPU",
                labels=["model_name"],
            )
            bounds = [floatToGoString(b / 1e6) for b in STEP_TIME_BOUNDS_US] + ["+Inf"]
            cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
            h.add_metric([self._model], list(zip(bounds, cumulative, strict=True)), None)
            yield h


class ServingMetrics:
    """Per-request observations -> Prometheus series (and the TUI's latency tracker, when given)."""

    def __init__(
        self,
        model: str,
        *,
        engine_telemetry: Callable[[], Mapping[str, Any]],
        engine_alive: Callable[[], bool],
        tracker: TokenLatencyTracker | None = None,
    ) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self._tracker = tracker
        labels = ["model_name"]
        r = self.registry
        self._ttft = Histogram(
            "blink_time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._tpot = Histogram(
            "blink_time_per_output_token_seconds",
            "Time per output token after the first",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._e2e = Histogram(
            "blink_e2e_request_latency_seconds",
            "Request latency, arrival to last token",
            labels,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self._prompt = Counter("blink_prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self._generation = Counter("blink_generation_tokens", "Tokens generated", labels, registry=r)
        self._finished = Counter(
            "blink_request_success",
            "Requests finished, by finish reason",
            [*labels, "finished_reason"],
            registry=r,
        )
        self._errors = Counter(
            "blink_request_errors",
            "Requests that ended in an error, by cause",
            [*labels, "cause"],
            registry=r,
        )
        r.register(_EngineGauges(model, engine_telemetry, engine_alive))
        # Children looked up once: labels() per token cost 5% of a saturated front end (H100, batch 64).
        self._ttft_child = self._ttft.labels(model)
        self._generation_child = self._generation.labels(model)

    def request_timer(self, prompt_tokens: int) -> RequestTimer:
        self._prompt.labels(self.model).inc(prompt_tokens)
        return RequestTimer(self)

    def error(self, cause: str) -> None:
        self._errors.labels(self.model, cause).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Timestamps of one request's tokens (monotonic ns, the latency tracker's clock)."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self._m = metrics
        self.start_ns = time.monotonic_ns()
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self.tokens = 0

    def token(self, now: int | None = None) -> None:
        """A token delivered at `now` (monotonic ns; default: this moment)."""
        now = time.monotonic_ns() if now is None else max(now, self.last_ns or now)
        m = self._m
        if self.first_ns is None:
            self.first_ns = now
            m._ttft_child.observe((now - self.start_ns) / 1e9)
            if m._tracker is not None:
                m._tracker.record_first_token(self.start_ns, now)
        elif m._tracker is not None and self.last_ns is not None:
            m._tracker.record_token(self.last_ns, now)
        self.last_ns = now
        self.tokens += 1
        m._generation_child.inc()

    def finish(self, reason: str) -> None:
        m = self._m
        now = time.monotonic_ns()
        m._e2e.labels(m.model).observe((now - self.start_ns) / 1e9)
        m._finished.labels(m.model, reason).inc()
        if self.first_ns is not None and self.last_ns is not None and self.tokens > 1:
            m._tpot.labels(m.model).observe((self.last_ns - self.first_ns) / 1e9 / (self.tokens - 1))
        if m._tracker is not None and self.first_ns is not None and self.last_ns is not None:
            m._tracker.record_request_done(self.first_ns, self.last_ns, self.tokens)
