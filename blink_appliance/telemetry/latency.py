"""Per-model token latencies as the client sees them, recorded by the front end.

The front end stamps every token it streams with `time.monotonic_ns()` and reports:
  - `record_first_token(request_start_ns, now_ns)` for a request's first token (TTFT),
  - `record_token(prev_token_ns, now_ns)` for every later token (inter-token latency, ITL), or
    `record_tokens(prev_token_ns, stamps)` for several at once,
  - `record_request_done(first_token_ns, last_token_ns, num_tokens)` when a request ends (TPOT).
All timestamps must come from the tracker's clock (monotonic_ns unless one is passed in).
Memory is bounded: samples live in fixed-size deques, token counts in per-second buckets.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from blink_appliance.telemetry.snapshot import LatencyStats

# Priority classes followed apart per model (the /metrics label and the telemetry); requests of any
# further class are counted together ("other" in /metrics, priority null in the snapshot).
MAX_PRIORITY_CLASSES = 16

_NS_PER_MS = 1_000_000
_NS_PER_S = 1_000_000_000


def percentile(sorted_values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) of already sorted values; None if empty."""
    if len(sorted_values) == 0:
        return None
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    rank = (len(sorted_values) - 1) * q / 100.0
    lo = int(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = rank - lo
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac)


class _Samples:
    """(stamp ns, value ms) pairs, newest last, at most `size`: two deques, so a snapshot reads
    them into arrays in one call each instead of a Python step per sample (a snapshot of full
    windows took milliseconds of the front end's loop)."""

    def __init__(self, size: int) -> None:
        self.stamps: deque[int] = deque(maxlen=size)
        self.values: deque[float] = deque(maxlen=size)

    def extend(self, stamps: Sequence[int], values: Sequence[float]) -> None:
        self.stamps.extend(stamps)
        self.values.extend(values)

    def since(self, since_ns: int) -> np.ndarray:
        """The values stamped at or after `since_ns`, sorted. Stamps come in order, nearly (each
        request's are; requests interleave by microseconds), so the window's start is a bisection."""
        start = bisect.bisect_left(self.stamps, since_ns) if self.stamps and self.stamps[0] < since_ns else 0
        values = np.fromiter(itertools.islice(self.values, start, None), np.float64, len(self.values) - start)
        values.sort()
        return values


@dataclass
class _Bucket:
    index: int  # timestamp_ns // bucket_ns
    tokens: int = 0
    itl_sum_ms: float = 0.0
    itl_count: int = 0


class TokenLatencyTracker:
    """Recent TTFT / ITL / TPOT samples and token throughput for one model. Thread-safe."""

    def __init__(
        self,
        *,
        window_s: float = 10.0,
        max_samples: int = 4096,
        history_len: int = 60,
        bucket_s: float = 1.0,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.window_s = window_s
        self.history_len = history_len
        self.bucket_s = bucket_s
        self._clock = clock
        self._bucket_ns = int(bucket_s * _NS_PER_S)
        self._window_ns = int(window_s * _NS_PER_S)
        self._lock = threading.Lock()
        self._ttft = _Samples(max_samples)
        self._itl = _Samples(max_samples)
        self._tpot = _Samples(max_samples)
        window_buckets = int(window_s / bucket_s) + 1
        self._buckets: deque[_Bucket] = deque(maxlen=history_len + window_buckets + 2)
        self._total_tokens = 0
        self._first_ns: int | None = None

    @property
    def total_tokens(self) -> int:
        return self._total_tokens

    def record_first_token(self, request_start_ns: int, now_ns: int) -> None:
        with self._lock:
            self._ttft.extend((now_ns,), ((now_ns - request_start_ns) / _NS_PER_MS,))
            self._count_tokens((now_ns,), (None,))

    def record_token(self, prev_token_ns: int, now_ns: int) -> None:
        self.record_tokens(prev_token_ns, (now_ns,))

    def record_tokens(self, prev_token_ns: int, stamps: Sequence[int]) -> None:
        """`record_token` for each of `stamps` in turn, the first after `prev_token_ns` (one lock for
        a whole batch: the front end records every token it delivers)."""
        itls = [(now_ns - prev) / _NS_PER_MS for prev, now_ns in pairwise((prev_token_ns, *stamps))]
        with self._lock:
            self._itl.extend(stamps, itls)
            self._count_tokens(stamps, itls)

    def record_request_done(self, first_token_ns: int, last_token_ns: int, num_tokens: int) -> None:
        """TPOT of a finished request: decode time over the tokens after the first."""
        if num_tokens < 2:
            return
        with self._lock:
            tpot_ms = (last_token_ns - first_token_ns) / _NS_PER_MS / (num_tokens - 1)
            self._tpot.extend((last_token_ns,), (tpot_ms,))

    def _count_tokens(self, stamps: Sequence[int], itls: Sequence[float | None]) -> None:
        """Tokens at `stamps`, with their ITL ms (None for a first token), into their per-second buckets."""
        self._total_tokens += len(stamps)
        if not stamps:
            return
        if self._first_ns is None:
            self._first_ns = stamps[0]
        if stamps[0] // self._bucket_ns == stamps[-1] // self._bucket_ns:
            # One bucket for the whole batch (stamps come in order): a whole response's hundreds
            # of tokens cost the same few steps as one.
            bucket = self._bucket_for(stamps[0] // self._bucket_ns)
            if bucket is not None:
                known = [itl for itl in itls if itl is not None]
                bucket.tokens += len(stamps)
                bucket.itl_sum_ms += sum(known)
                bucket.itl_count += len(known)
            return
        index, bucket = None, None
        for now_ns, itl_ms in zip(stamps, itls, strict=True):
            if now_ns // self._bucket_ns != index:
                index = now_ns // self._bucket_ns
                bucket = self._bucket_for(index)
            if bucket is not None:
                bucket.tokens += 1
                if itl_ms is not None:
                    bucket.itl_sum_ms += itl_ms
                    bucket.itl_count += 1

    def _bucket_for(self, index: int) -> _Bucket | None:
        if not self._buckets or self._buckets[-1].index < index:
            self._buckets.append(_Bucket(index))
            return self._buckets[-1]
        # A slightly out-of-order stamp (another thread got there first): find its bucket.
        for bucket in reversed(self._buckets):
            if bucket.index == index:
                return bucket
            if bucket.index < index:
                break
        return None  # older than anything kept, or a gap: not worth a bucket of its own

    def stats(self, now_ns: int | None = None) -> LatencyStats:
        now_ns = self._clock() if now_ns is None else now_ns
        since = now_ns - self._window_ns
        with self._lock:
            ttft, itl, tpot = (samples.since(since) for samples in (self._ttft, self._itl, self._tpot))
            buckets = {b.index: b for b in self._buckets}
            total = self._total_tokens
            first_ns = self._first_ns

        now_index = now_ns // self._bucket_ns
        # Throughput over the window, counting the current (partial) bucket and its elapsed part.
        window_buckets = max(1, int(self.window_s / self.bucket_s))
        window_tokens = sum(
            buckets[i].tokens for i in range(now_index - window_buckets + 1, now_index + 1) if i in buckets
        )
        elapsed_ns = (window_buckets - 1) * self._bucket_ns + (now_ns - now_index * self._bucket_ns)
        if first_ns is not None:
            elapsed_ns = min(elapsed_ns, now_ns - first_ns)
        elapsed_ns = max(elapsed_ns, self._bucket_ns)
        tokens_per_s = window_tokens * _NS_PER_S / elapsed_ns

        # History over complete buckets only, so the newest bar is not a partial one.
        itl_history: list[float] = []
        rate_history: list[float] = []
        for i in range(now_index - self.history_len, now_index):
            b = buckets.get(i)
            rate_history.append(b.tokens / self.bucket_s if b else 0.0)
            itl_history.append(b.itl_sum_ms / b.itl_count if b and b.itl_count else 0.0)

        return LatencyStats(
            window_s=self.window_s,
            ttft_p50_ms=percentile(ttft, 50),
            ttft_p99_ms=percentile(ttft, 99),
            itl_p50_ms=percentile(itl, 50),
            itl_p99_ms=percentile(itl, 99),
            tpot_p50_ms=percentile(tpot, 50),
            tpot_p99_ms=percentile(tpot, 99),
            tokens_per_s=tokens_per_s,
            total_tokens=total,
            history_bucket_s=self.bucket_s,
            itl_history_ms=itl_history,
            tokens_per_s_history=rate_history,
        )
