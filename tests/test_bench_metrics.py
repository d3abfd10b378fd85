"""bench serving metrics on hand-built request records, against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from blink_appliance.bench.load_generator import LoadRun, RequestRecord, arrival_offsets
from blink_appliance.bench.serving_metrics import SLO, Distribution, compute_metrics


def _record(
    index: int, start: float, chunks: list[float], end: float, *, tokens: int | None = None, prompt: int = 10
):
    r = RequestRecord(index, output_len_requested=len(chunks), input_len_expected=prompt, start_s=start)
    r.chunk_times_s = chunks
    r.end_s = end
    r.ok = True
    r.prompt_tokens = prompt
    r.completion_tokens = len(chunks) if tokens is None else tokens
    r.usage_reported = True
    return r


def _failed(index: int, error: str) -> RequestRecord:
    r = RequestRecord(index, output_len_requested=4, input_len_expected=10)
    r.error = error
    return r


def test_per_request_latencies():
    r = _record(0, 1.0, [1.2, 1.3, 1.5, 1.9], 2.0)
    assert r.ttft_s == pytest.approx(0.2)
    assert r.e2e_s == pytest.approx(1.0)
    # (E2E - TTFT) / (tokens - 1) = 0.8 / 3
    assert r.tpot_s == pytest.approx(0.8 / 3)
    assert r.itls_s == pytest.approx([0.1, 0.2, 0.4])
    one = _record(1, 0.0, [0.5], 0.6)
    assert one.tpot_s is None and one.itls_s == []
    # A server that sends two tokens in one chunk: TPOT uses its usage count, ITL the chunks.
    packed = _record(2, 0.0, [0.1, 0.5], 0.5, tokens=5)
    assert packed.tpot_s == pytest.approx(0.4 / 4)
    assert packed.itls_s == pytest.approx([0.4])


def test_failed_record_has_no_latencies():
    r = _failed(0, "HTTP 500: boom")
    r.chunk_times_s = [0.1, 0.2]
    r.end_s = 0.3
    assert r.ttft_s is None and r.e2e_s is None and r.tpot_s is None and r.itls_s == []


def test_distribution_percentiles_interpolate_linearly():
    d = Distribution.of_seconds([0.004, 0.001, 0.003, 0.002, 0.005])  # 1..5 ms
    assert d.count == 5
    assert d.mean == pytest.approx(3.0)
    assert d.p50 == pytest.approx(3.0)
    assert d.p90 == pytest.approx(4.6)  # rank 0.9 * 4 = 3.6 -> 4 + 0.6 * (5 - 4)
    assert d.p99 == pytest.approx(4.96)
    assert d.max == pytest.approx(5.0)
    empty = Distribution.of_seconds([])
    assert empty.count == 0 and empty.p99 is None and empty.mean is None


def test_compute_metrics_by_hand():
    records = [
        _record(0, 0.0, [0.1, 0.2, 0.3], 0.3, prompt=10),  # TTFT 100, TPOT 100, E2E 300
        _record(1, 0.5, [0.8, 0.9, 1.5], 1.6, prompt=20),  # TTFT 300, TPOT (1100 - 300) / 2 = 400, E2E 1100
        _failed(2, "HTTP 503: busy"),
        _failed(3, "HTTP 503: busy"),
        _failed(4, "stream error: engine died"),
    ]
    m = compute_metrics(LoadRun(records, duration_s=2.0, started_unix=0.0), SLO(ttft_ms=200, tpot_ms=500))
    assert (m.num_requests, m.completed, m.failed) == (5, 2, 3)
    assert m.total_output_tokens == 6 and m.total_input_tokens == 30
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.total_token_throughput == pytest.approx(18.0)
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.ttft_ms.p50 == pytest.approx(200.0) and m.ttft_ms.max == pytest.approx(300.0)
    assert m.tpot_ms.p50 == pytest.approx(250.0)  # (100 + 400) / 2
    assert m.e2e_ms.p99 == pytest.approx(300 + 0.99 * 800)
    # ITLs: 100, 100, 100, 600 ms -> p50 100, p90 rank 2.7 -> 100 + 0.7 * 500 = 450
    assert m.itl_ms.count == 4
    assert m.itl_ms.p50 == pytest.approx(100.0) and m.itl_ms.p90 == pytest.approx(450.0)
    # Only request 0 meets both SLOs.
    assert m.good_requests == 1 and m.goodput == pytest.approx(0.5)
    assert m.failure_reasons == {"HTTP 503: busy": 2, "stream error: engine died": 1}
    assert m.output_tokens_from_usage and m.output_len_mismatches == 0


def test_goodput_rules():
    fast_one_token = _record(0, 0.0, [0.05], 0.05)  # no TPOT: meets a TPOT SLO
    slow_decode = _record(1, 0.0, [0.05, 1.05], 1.05)  # TPOT 1000 ms
    run = LoadRun([fast_one_token, slow_decode], duration_s=1.0, started_unix=0.0)
    assert compute_metrics(run, SLO(tpot_ms=100)).good_requests == 1
    assert compute_metrics(run, SLO(ttft_ms=40)).good_requests == 0
    assert compute_metrics(run, SLO(ttft_ms=60, tpot_ms=1000)).good_requests == 2
    no_slo = compute_metrics(run)
    assert no_slo.good_requests is None and no_slo.goodput is None


def test_unknown_counts_are_flagged_not_invented():
    r = _record(0, 0.0, [0.1, 0.2], 0.2)
    r.usage_reported = False
    r.completion_tokens = None
    r.prompt_tokens = None
    r.input_len_expected = None
    short = _record(1, 0.0, [0.1], 0.2, tokens=1)
    short.output_len_requested = 4
    m = compute_metrics(LoadRun([r, short], duration_s=1.0, started_unix=0.0))
    assert not m.output_tokens_from_usage
    assert m.total_output_tokens == 3  # two chunks counted for r, the server's 1 for short
    assert m.total_input_tokens is None and m.total_token_throughput is None
    assert m.output_len_mismatches == 1


def test_arrival_offsets():
    import random

    assert arrival_offsets(3, math.inf, "poisson", random.Random(0)) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 2.0, "fixed", random.Random(0)) == pytest.approx([0.0, 0.5, 1.0, 1.5])
    poisson = arrival_offsets(4001, 50.0, "poisson", random.Random(1))
    gaps = [b - a for a, b in zip(poisson, poisson[1:], strict=False)]
    assert poisson[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50.0, rel=0.05)  # mean gap 1/rate
    # exponential gaps: standard deviation equals the mean
    mean = sum(gaps) / len(gaps)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert std == pytest.approx(mean, rel=0.1)
    assert arrival_offsets(5, 3.0, "poisson", random.Random(7)) == arrival_offsets(
        5, 3.0, "poisson", random.Random(7)
    )
