"""Probe: what one pass of per-chunk top-KP keys (tl.topk) and a per-row top-KP of their union cost on
the GPU, against the greedy argmax at the same rows (the floor of a sampler pass). It decides whether
a top-k row can be sampled from its chunks' candidates in two launches.

Usage, on the GPU host: PYTHONPATH=. python3 bench/topk_probe.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from blink_appliance.kernels.sampling import scaled
from blink_appliance.kernels.sampling_rejection import RejectionRows, argmax_rows
from blink_appliance.kernels.sampling_select import _order_key


@triton.jit
def _chunk_top_kernel(
    logits_ptr,
    stride,
    temp_ptr,
    cand_ptr,
    V,
    C,
    CHUNK: tl.constexpr,
    KP: tl.constexpr,
    PRECISE: tl.constexpr = True,
):
    item = tl.program_id(0)
    r = item // C
    c = item % C
    idx = c * CHUNK + tl.arange(0, CHUNK)
    inb = idx < V
    raw = tl.load(logits_ptr + tl.cast(r, tl.int64) * stride + idx, mask=inb, other=0.0)
    key = _order_key(scaled(raw, tl.load(temp_ptr + r), PRECISE))
    packed = tl.where(inb, (key.to(tl.uint64) << 32) | (4294967295 - idx.to(tl.int64)).to(tl.uint64), 0)
    top = tl.topk(packed, KP)
    tl.store(cand_ptr + tl.cast(item, tl.int64) * KP + tl.arange(0, KP), top.to(tl.int64, bitcast=True))


@triton.jit
def _row_top_kernel(cand_ptr, out_ptr, C, KP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    keys = tl.load(cand_ptr + tl.cast(r, tl.int64) * C * KP + offs, mask=offs < C * KP, other=0)
    top = tl.topk(keys.to(tl.uint64, bitcast=True), KP)
    tl.store(out_ptr + r * KP + tl.arange(0, KP), top.to(tl.int64, bitcast=True))


def _time(fn, reps: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps // 20):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps // 20 * 20) * 1e3  # us per call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    V, capacity = 128256, 256
    logits = torch.randn(capacity, V, device=dev)
    temp = torch.full((capacity,), 0.8, device=dev)
    results = []
    for rows in (1, 64):
        n_rows = torch.tensor([rows], dtype=torch.int32, device=dev)
        sampled = torch.zeros(capacity, dtype=torch.int64, device=dev)
        state = RejectionRows.allocate(capacity, triton.cdiv(V, 2048), dev)

        def argmax(n_rows=n_rows, state=state, sampled=sampled):
            argmax_rows(logits, n_rows, state, sampled, chunk=2048, programs=16 * 132)

        greedy = _time(argmax)
        results.append({"rows": rows, "what": "greedy argmax", "us": round(greedy, 2)})
        for chunk, kp, warps in ((2048, 64, 4), (2048, 64, 8), (2048, 32, 4), (4096, 64, 8), (1024, 64, 4)):
            C = triton.cdiv(V, chunk)
            cand = torch.zeros(rows * C * kp, dtype=torch.int64, device=dev)
            top = torch.zeros(rows * kp, dtype=torch.int64, device=dev)
            block = triton.next_power_of_2(C * kp)

            def chunks(C=C, cand=cand, chunk=chunk, kp=kp, warps=warps, rows=rows):
                _chunk_top_kernel[(rows * C,)](
                    logits, V, temp, cand, V, C, CHUNK=chunk, KP=kp, num_warps=warps
                )

            def finish(C=C, cand=cand, top=top, kp=kp, block=block, rows=rows):
                _row_top_kernel[(rows,)](cand, top, C, KP=kp, BLOCK=block, num_warps=8)

            a, b = _time(chunks), _time(finish)
            both = _time(lambda chunks=chunks, finish=finish: (chunks(), finish()))
            # Check: the row's top keys are the largest of the whole row.
            x = (logits[:rows] / 0.8).double()
            ref = torch.topk(x, kp, dim=1).indices
            got = (4294967295 - (top.view(rows, kp) & 4294967295)).to(torch.int64)
            ok = bool((ref.sort(1).values == got.sort(1).values).all())
            results.append({
                "rows": rows, "chunk": chunk, "kp": kp, "warps": warps, "chunks_us": round(a, 2),
                "finish_us": round(b, 2), "both_us": round(both, 2), "exact": ok,
            })  # fmt: skip
            print(json.dumps(results[-1]), flush=True)
        print(json.dumps(results[-6]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
