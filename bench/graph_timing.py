"""Time a piece of GPU work as the loop runs it: captured once into a CUDA graph, then replayed."""

from __future__ import annotations

from collections.abc import Callable

import torch


def replay_us(fn: Callable[[], object], reps: int = 200) -> float:
    """The best of 5 runs of `reps` replays, in µs a replay: fn runs once eagerly first (compilation,
    allocations), is captured, and is warmed by 20 replays."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(20):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps * 1000.0)
    return best
