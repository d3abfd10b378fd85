"""TokenLatencyTracker: percentiles, windows, throughput and history from recorded timestamps."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from blink_appliance.telemetry.latency import TokenLatencyTracker, percentile

MS = 1_000_000
S = 1_000_000_000


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy(n: int) -> None:
    rng = random.Random(n)
    values = sorted(rng.uniform(0, 50) for _ in range(n))
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) is None


class Clock:
    def __init__(self, start_ns: int = 1000 * S) -> None:
        self.now = start_ns

    def __call__(self) -> int:
        return self.now


def test_ttft_itl_tpot_percentiles() -> None:
    clock = Clock()
    tracker = TokenLatencyTracker(clock=clock, window_s=10.0)
    start = clock.now
    first = start + 80 * MS
    tracker.record_first_token(start, first)
    prev = first
    gaps_ms = [10.0] * 98 + [50.0, 200.0]
    for gap in gaps_ms:
        now = prev + int(gap * MS)
        tracker.record_token(prev, now)
        prev = now
    tracker.record_request_done(first, prev, num_tokens=len(gaps_ms) + 1)
    clock.now = prev
    stats = tracker.stats()
    assert stats.ttft_p50_ms == pytest.approx(80.0)
    assert stats.itl_p50_ms == pytest.approx(10.0)
    assert stats.itl_p99_ms == pytest.approx(np.percentile(gaps_ms, 99))
    assert stats.tpot_p50_ms == pytest.approx(sum(gaps_ms) / len(gaps_ms))
    assert stats.total_tokens == 101


def test_samples_leave_the_window() -> None:
    clock = Clock()
    tracker = TokenLatencyTracker(clock=clock, window_s=5.0)
    tracker.record_token(clock.now - 30 * MS, clock.now)
    assert tracker.stats().itl_p50_ms == pytest.approx(30.0)
    clock.now += 6 * S
    stats = tracker.stats()
    assert stats.itl_p50_ms is None and stats.itl_p99_ms is None
    assert stats.tokens_per_s == 0.0
    assert stats.total_tokens == 1  # the lifetime count stays


def test_tokens_per_second_and_history() -> None:
    clock = Clock()
    tracker = TokenLatencyTracker(clock=clock, window_s=4.0, history_len=8)
    base = clock.now
    # 3 s at 100 tokens/s (10 ms apart), then 2 s at 20 tokens/s, then 0.5 s of silence.
    t = base - 10 * MS
    for _ in range(300):
        tracker.record_token(t, t + 10 * MS)
        t += 10 * MS
    for _ in range(40):
        tracker.record_token(t, t + 50 * MS)
        t += 50 * MS
    clock.now = base + 5 * S + 500 * MS
    stats = tracker.stats()
    # The 4 s window: whole seconds 2, 3, 4 (100 + 20 + 20 tokens) and half of second 5 (none).
    assert stats.tokens_per_s == pytest.approx(140 / 3.5)
    rates = stats.tokens_per_s_history
    assert len(rates) == 8 and len(stats.itl_history_ms) == 8
    assert rates[-5:-2] == [100.0, 100.0, 100.0]
    assert rates[-2:] == [20.0, 20.0]
    assert stats.itl_history_ms[-2] == pytest.approx(50.0)
    assert stats.itl_history_ms[-4] == pytest.approx(10.0)


def test_memory_is_bounded() -> None:
    clock = Clock()
    tracker = TokenLatencyTracker(clock=clock, max_samples=100, window_s=1e6)
    for i in range(1000):
        tracker.record_token(clock.now, clock.now + (i + 1) * MS)
    stats = tracker.stats()
    # Only the newest 100 ITLs (901..1000 ms) are kept.
    assert stats.itl_p50_ms == pytest.approx(950.5)


def test_a_batch_of_tokens_records_what_its_tokens_one_by_one_record() -> None:
    """The front end's batched path (RequestTimer.tokens -> record_tokens) sees the same TTFT, ITL,
    TPOT and throughput as one call per token, a stamp that goes backwards taken as the last."""
    from frontend.metrics import ServingMetrics

    start = 1000 * S
    arrivals = [start + k * 7 * MS for k in range(1, 40)]
    arrivals[10] = arrivals[9] - MS  # out of order: counts at arrivals[9]
    clock = Clock(arrivals[-1])
    trackers = [TokenLatencyTracker(clock=clock), TokenLatencyTracker(clock=clock)]
    texts = []
    for tracker, batched in zip(trackers, (False, True), strict=True):
        metrics = ServingMetrics("m", engine_telemetry=dict, engine_alive=lambda: True, tracker=tracker)
        timer = metrics.request_timer(3)
        timer.start_ns = start
        if batched:
            timer.tokens(arrivals[:1])
            timer.tokens(arrivals[1:25])
            timer.tokens(arrivals[25:])
        else:
            for t in arrivals:
                timer.token(t)
        timer.finish("length")
        lines = metrics.render().decode().splitlines()
        # Not the end-to-end series: it ends at the wall clock's now.
        texts.append([line for line in lines if line.startswith("blink_") and "e2e" not in line])
    one, batch = (t.stats() for t in trackers)
    assert one == batch and one.total_tokens == len(arrivals) and one.itl_p50_ms == pytest.approx(7.0)
    assert one.ttft_p50_ms == pytest.approx(7.0) and one.itl_p99_ms == pytest.approx(
        np.percentile([7] * 36 + [0, 14], 99)
    )
    assert texts[0] == texts[1]
    assert f'blink_generation_tokens_total{{model_name="m"}} {len(arrivals)}.0' in texts[0]


def test_the_front_end_times_its_garbage_collections() -> None:
    """MetricsRegistry.watch_gc: each collection is one observation of its generation, until stopped."""
    import gc

    from frontend.metrics import MetricsRegistry

    registry = MetricsRegistry()
    stop = registry.watch_gc()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        stop()
    gc.collect()
    text = registry.render().decode()
    # Other collections may run meanwhile (allocations trigger them): at least ours are there.
    assert float(re.search(r'gc_pause_seconds_count\{generation="2"\} (\S+)', text)[1]) >= 1
    assert float(re.search(r'gc_pause_seconds_count\{generation="0"\} (\S+)', text)[1]) >= 1
    full = float(re.search(r'gc_pause_seconds_count\{generation="2"\} (\S+)', text)[1])
    assert full == float(
        re.search(r'gc_pause_seconds_count\{generation="2"\} (\S+)', registry.render().decode())[1]
    )
