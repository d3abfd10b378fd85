"""Serving metrics of one load run, as `vllm bench serve` defines them.

- request throughput: completed requests / run duration; output tok/s: output tokens of completed
  requests / duration; total tok/s adds their prompt tokens.
- TTFT: send -> first chunk with output text.  E2E: send -> end of the stream.
- TPOT (per request): (E2E - TTFT) / (output tokens - 1), for requests with 2+ output tokens.
- ITL: the gap between consecutive text chunks, over all chunks of all completed requests.
- goodput: completed requests per second that met every SLO given (TTFT <= slo_ttft_ms,
  TPOT <= slo_tpot_ms; a one-token request has no TPOT and meets that SLO).
- failures: requests that did not complete, counted by reason.
Percentiles interpolate linearly between samples (numpy's default), like the front end's tracker.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from blink_appliance.bench.load_generator import LoadRun, RequestRecord
from blink_appliance.telemetry.latency import percentile

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Distribution:
    """Summary of latency samples in milliseconds; every field None when there are none."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of_seconds(cls, values_s: list[float]) -> Distribution:
        ms = sorted(v * 1000.0 for v in values_s)
        if not ms:
            return cls(0, None, None, None, None, None)
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(len(ms), sum(ms) / len(ms), p50, p90, p99, ms[-1])


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        ttft, tpot = record.ttft_s, record.tpot_s
        if self.ttft_ms is not None and (ttft is None or ttft * 1000.0 > self.ttft_ms):
            return False
        return not (self.tpot_ms is not None and tpot is not None and tpot * 1000.0 > self.tpot_ms)


@dataclass(frozen=True)
class ServingMetrics:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int | None  # None when some completed request's prompt count is unknown
    total_output_tokens: int
    output_tokens_from_usage: bool  # False: at least one count is text chunks, not the server's usage
    output_len_mismatches: int  # completed requests whose output tokens differ from max_tokens asked
    request_throughput: float
    output_throughput: float
    total_token_throughput: float | None
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    slo: SLO
    good_requests: int | None
    goodput: float | None  # requests/s meeting the SLO; None without an SLO
    failure_reasons: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _prompt_tokens(record: RequestRecord) -> int | None:
    return record.prompt_tokens if record.prompt_tokens is not None else record.input_len_expected


def compute_metrics(run: LoadRun, slo: SLO | None = None) -> ServingMetrics:
    slo = slo or SLO()
    done = [r for r in run.records if r.ok]
    failed = [r for r in run.records if not r.ok]
    duration = max(run.duration_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in done)
    prompts = [_prompt_tokens(r) for r in done]
    input_tokens = None if any(p is None for p in prompts) else sum(p for p in prompts if p is not None)
    good = sum(1 for r in done if slo.met_by(r)) if slo.given else None
    return ServingMetrics(
        num_requests=len(run.records),
        completed=len(done),
        failed=len(failed),
        duration_s=run.duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        output_tokens_from_usage=all(r.usage_reported for r in done),
        output_len_mismatches=sum(1 for r in done if r.output_tokens != r.output_len_requested),
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration
        if input_tokens is not None
        else None,
        ttft_ms=Distribution.of_seconds([t for r in done if (t := r.ttft_s) is not None]),
        tpot_ms=Distribution.of_seconds([t for r in done if (t := r.tpot_s) is not None]),
        itl_ms=Distribution.of_seconds([gap for r in done for gap in r.itls_s]),
        e2e_ms=Distribution.of_seconds([t for r in done if (t := r.e2e_s) is not None]),
        slo=slo,
        good_requests=good,
        goodput=good / duration if good is not None else None,
        failure_reasons=dict(Counter(r.error or "unknown" for r in failed).most_common()),
    )
