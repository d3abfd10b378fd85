"""Tensor parallelism over two GPUs (issue 27): the sharded forward's step against one GPU's.

    PYTHONPATH=. python3 bench/tp_forward.py --model llama-3.1-8b --buckets 1,8,128 --out $OUT/tp.json
    (or bash bench/tp_check.sh $OUT: the tests first, then this)

On a host with two GPUs with peer access (nvidia-h100-x2). Random weights with the model's real
shapes and random K/V (bench_forward's workload: `--decodes` sequences of `--context` keys, the rest
of a bucket padding), bf16. Per bucket, by graph replay:
- TP=1: the forward as it ships (`decode_gemms`, atomics) and with `deterministic_gemms` (the plan
  the ranks run: O and down write partials);
- TP=2: both ranks' graphs launched back to back each step (model/tensor_parallel.py), timed by wall
  clock over both GPUs, and rank 0's logits against TP=1's (relative difference, argmax per row).
Then `--greedy` tokens of greedy decoding at batch 1 (the 1-token bucket) by TP=1 (both plans)
and TP=2 from the same prompt token and cache, and how many leading tokens agree.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import BLOCK_SIZE, DECODE_CONTEXT, MAX_SEQS, Batcher, Workload, load_workload  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from blink_appliance.engine.loop.forward_graphs import ForwardGraphs  # noqa: E402
from blink_appliance.engine.loop.graph import poll_until_ended  # noqa: E402
from blink_appliance.model.gpu_forward import GpuForward  # noqa: E402
from blink_appliance.model.gpu_weights import GpuWeights  # noqa: E402
from blink_appliance.model.kv_cache import PagedKVCache  # noqa: E402
from blink_appliance.model.launch_plans import decode_gemms, deterministic_gemms  # noqa: E402
from blink_appliance.model.presets import preset_config  # noqa: E402
from blink_appliance.model.tensor_parallel import (  # noqa: E402
    connect,
    shard_config,
    shard_kv_heads,
    shard_weights,
    warm_alone,
)


class TwoRanks:
    """Both ranks' graphs per bucket; a step launches rank 0's then rank 1's and waits for both."""

    def __init__(
        self, ranks: list[GpuForward], buckets: tuple[int, ...], eager: bool = False, watch_s: float = 60
    ) -> None:
        self.ranks = ranks
        self.eager = eager
        self.watch_s = watch_s
        # Allocated now: pinning memory once a rank hangs might itself wait on the device.
        self._host = [torch.empty(1 + f.tp.flags.numel(), dtype=torch.int32, pin_memory=True) for f in ranks]
        self._side = []
        for f in ranks:
            with torch.cuda.device(f.device):
                self._side.append(torch.cuda.Stream())
        for T in buckets:  # every kernel loaded on both GPUs before a rank can wait on the other
            warm_alone(ranks, lambda fwd, T=T: fwd.step(T))
        for _ in range(2):  # compile and warm: both ranks launched before either is waited for
            for T in buckets:
                self._eager(T)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        for T in () if eager else buckets:
            graphs = []
            for fwd in ranks:
                with torch.cuda.device(fwd.device):
                    g = torch.cuda.CUDAGraph()
                    # Not torch's default capture stream: that one lives on cuda:0 for both ranks.
                    with torch.cuda.graph(g, stream=torch.cuda.Stream(fwd.device)):
                        fwd.step(T)
                graphs.append(g)
            self.graphs[T] = graphs

    def _eager(self, T: int) -> None:
        for fwd in self.ranks:
            with torch.cuda.device(fwd.device):
                fwd.step(T)
        self.sync()

    def sync(self) -> None:
        """Wait for both GPUs; past watch_s, print where each rank's exchange stands and exit."""
        events = []
        for fwd in self.ranks:
            with torch.cuda.device(fwd.device):
                events.append(torch.cuda.Event())
                events[-1].record()
        if not poll_until_ended(lambda: not all(e.query() for e in events), self.watch_s, 1e-4):
            self.dump_and_exit()

    def dump_and_exit(self) -> None:
        """Each rank's epoch and flags, read on a side stream while its step spins (a hang)."""
        finished = [self._done(f) for f in self.ranks]
        for fwd, host, side, done in zip(self.ranks, self._host, self._side, finished, strict=True):
            with torch.cuda.device(fwd.device):
                with torch.cuda.stream(side):
                    host[:1].copy_(fwd.tp.epoch, non_blocking=True)
                    host[1:].copy_(fwd.tp.flags, non_blocking=True)
                side.synchronize()
            print(
                f"HANG rank {fwd.tp.rank}: done={done} epoch={int(host[0])} flags={host[1:].tolist()}",
                flush=True,
            )
        os._exit(3)

    @staticmethod
    def _done(fwd: GpuForward) -> bool:
        with torch.cuda.device(fwd.device):
            e = torch.cuda.Event()
            e.record()
            return e.query()

    def launch(self, T: int) -> None:
        if self.eager:
            for fwd in self.ranks:
                with torch.cuda.device(fwd.device):
                    fwd.step(T)
            return
        for g, fwd in zip(self.graphs[T], self.ranks, strict=True):
            with torch.cuda.device(fwd.device):
                g.replay()

    def step(self, T: int) -> torch.Tensor:
        self.launch(T)
        self.sync()
        return self.ranks[0].logits

    def time_ms(self, T: int, steps: int = 300) -> float:
        for _ in range(20):
            self.launch(T)
        self.sync()
        t = time.perf_counter()
        for _ in range(steps):
            self.launch(T)
        self.sync()
        return (time.perf_counter() - t) / steps * 1e3

    def load(self, batch, T: int) -> None:
        for fwd in self.ranks:
            fwd.load_batch(batch, T)


def greedy(load, step, num_blocks: int, max_blocks: int, vocab: int, context: int, tokens: int) -> list[int]:
    """Greedy decoding of one sequence whose first `context - 1` keys are cached."""
    b = Batcher(num_blocks, max_blocks, seed=99)
    b.lens[0] = context - 1
    out: list[int] = []
    for _ in range(tokens):
        batch = b.batch([(0, 1)], vocab)
        if out:
            batch = replace(batch, input_ids=torch.tensor([out[-1]], dtype=torch.int64))
        load(batch, 1)
        out.append(int(step(1)[0].argmax()))
    return out


def logits_diff(a: torch.Tensor, ref: torch.Tensor, n: int) -> dict:
    """How far the first n rows of logits `a` are from `ref`: relative norm, rows with the same argmax."""
    a, ref = a[:n], ref[:n]
    rel = ((a - ref).norm() / ref.norm()).item()
    return dict(rel=rel, argmax_equal=int((a.argmax(-1) == ref.argmax(-1)).sum()), rows=n)


def agree(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--buckets", default="1,8,128")
    ap.add_argument("--decodes", type=int, default=1, help="decoding sequences per step (1: batch 1)")
    ap.add_argument("--context", type=int, default=DECODE_CONTEXT)
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens compared at batch 1 (0: none)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--hang-s", type=float, default=300, help="past this, print every thread's stack and exit"
    )
    ap.add_argument("--eager", action="store_true", help="TP=2 launched kernel by kernel, no graphs")
    ap.add_argument("--no-pdl", action="store_true", help="TP=2 ranks without programmatic dependent launch")
    ap.add_argument("--tp-only", action="store_true", help="skip the TP=1 runs (no comparison)")
    ap.add_argument("--watch-s", type=float, default=60, help="a TP=2 step longer than this is a hang")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="float32: the two splits' sums differ only in fp32 order, no bf16 rounding")  # fmt: skip
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a rank waiting forever shows where
    buckets = tuple(int(b) for b in args.buckets.split(","))
    if torch.cuda.device_count() < 2:
        sys.exit("tp_forward needs two GPUs")
    cfg = preset_config(args.model)
    env = dict(gpus=[torch.cuda.get_device_name(i) for i in range(2)], torch=torch.__version__, model=args.model,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), decodes=args.decodes, context=args.context, dtype=args.dtype)  # fmt: skip
    print(json.dumps(env), flush=True)
    weights = GpuWeights.random(cfg, dtype, "cuda:0", seed=0)
    max_blocks = (args.context + args.greedy + max(buckets)) // BLOCK_SIZE + 2
    num_blocks = MAX_SEQS * (args.context // BLOCK_SIZE + 1) + 2 * max_blocks + 8
    kv = PagedKVCache.allocate(cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype, "cuda:0")  # fmt: skip
    g = torch.Generator(device="cuda:0").manual_seed(5)
    kv.k.normal_(0, 1, generator=g)
    kv.v.normal_(0, 1, generator=g)
    rank_kv = [
        PagedKVCache(k=shard_kv_heads(kv.k, r, 2, f"cuda:{r}"), v=shard_kv_heads(kv.v, r, 2, f"cuda:{r}")) for r in (0, 1)
    ]  # fmt: skip

    def workload(T: int) -> Workload:
        return Workload(T, decodes=min(args.decodes, T), prefill=0, context=args.context)

    rows, tokens, logits1 = [], {}, {}
    plans = () if args.tp_only else (("tp1", decode_gemms), ("tp1-deterministic", deterministic_gemms))
    for plan_name, plan in plans:
        fwd = GpuForward(cfg, weights, kv, max_tokens=max(buckets), max_seqs=MAX_SEQS, max_blocks_per_seq=max_blocks,
                         gemm_plan=plan)  # fmt: skip
        graphs = ForwardGraphs(fwd, buckets)
        graphs.capture()
        for T in buckets:
            load_workload(fwd, workload(T), cfg.vocab_size, num_blocks, max_blocks)
            logits1[plan_name, T] = graphs.replay(T)[: min(T, MAX_SEQS)].clone()
            ms = do_bench(graphs.graphs[T].replay, warmup=50, rep=400, return_mode="median")
            rows.append(dict(variant=plan_name, bucket=T, step_ms=ms))
            print(json.dumps(rows[-1]), flush=True)
        if args.greedy:
            tokens[plan_name] = greedy(fwd.load_batch, graphs.replay, num_blocks, max_blocks, cfg.vocab_size,
                                       args.context, args.greedy)  # fmt: skip
        del graphs, fwd
        torch.cuda.empty_cache()

    local = shard_config(cfg, 2)
    ranks = []
    for r in (0, 1):
        with torch.cuda.device(r):
            ranks.append(
                GpuForward(local, shard_weights(weights, cfg, r, 2, f"cuda:{r}"), rank_kv[r], max_tokens=max(buckets),
                           max_seqs=MAX_SEQS, max_blocks_per_seq=max_blocks, gemm_plan=deterministic_gemms, tp_rank=r,
                           pdl=False if args.no_pdl else None)
            )  # fmt: skip
    connect(*ranks)
    t = time.time()
    two = TwoRanks(ranks, buckets, eager=args.eager, watch_s=args.watch_s)
    print(f"tp2: warm-up + capture {time.time() - t:.1f} s", flush=True)
    diffs = {}
    for T in buckets:
        batch = Batcher(num_blocks, max_blocks, seed=T)
        for s in range(workload(T).decodes):
            batch.lens[s] = args.context - 1 - (s % 7)  # as load_workload does
        fb = batch.batch([(s, 1) for s in range(workload(T).decodes)], cfg.vocab_size)
        two.load(fb, T)
        got = two.step(T)[: min(T, MAX_SEQS)].clone()
        n = fb.sample_rows.shape[0]
        for plan_name, _ in plans:
            diffs[f"{plan_name}/{T}"] = logits_diff(got, logits1[plan_name, T], n)
        if plans:  # the noise floor: TP=1's two plans differ only in the order of fp32 sums
            diffs[f"tp1-deterministic vs tp1/{T}"] = logits_diff(
                logits1["tp1-deterministic", T], logits1["tp1", T], n
            )
        ms = two.time_ms(T)
        rows.append(dict(variant="tp2", bucket=T, step_ms=ms))
        print(
            json.dumps(rows[-1]),
            json.dumps({k: v for k, v in diffs.items() if k.endswith(f"/{T}")}),
            flush=True,
        )
    if args.greedy:
        tokens["tp2"] = greedy(
            two.load, two.step, num_blocks, max_blocks, cfg.vocab_size, args.context, args.greedy
        )
    agreement = {f"tp2 vs {k}": agree(tokens["tp2"], tokens[k]) for k, _ in plans if tokens}
    if plans and tokens:
        agreement["tp1 vs tp1-deterministic"] = agree(tokens["tp1"], tokens["tp1-deterministic"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(dict(env=env, rows=rows, logits=diffs, greedy=tokens, agreement=agreement), indent=1)
    )
    print(
        f"\n## {args.model} bf16, {args.decodes} decoding sequence(s) of {args.context} keys, graph replay (ms)"
    )
    print("| bucket | TP=1 | TP=1 deterministic | TP=2 | TP=2 / TP=1 | rank 0 logits vs TP=1: rel, argmax |")
    print("|---|---|---|---|---|---|")
    for T in buckets if plans else ():
        ms = {r["variant"]: r["step_ms"] for r in rows if r["bucket"] == T}
        d = diffs[f"tp1/{T}"]
        print(f"| {T} | {ms['tp1']:.3f} | {ms['tp1-deterministic']:.3f} | {ms['tp2']:.3f} | "
              f"{ms['tp2'] / ms['tp1']:.3f} | {d['rel']:.1e}, {d['argmax_equal']}/{d['rows']} |")  # fmt: skip
    print(f"greedy agreement over {args.greedy} tokens (leading tokens equal): {agreement}")


if __name__ == "__main__":
    main()
