"""Paged attention measured the way the step runs it: one launch per layer, 16 layers in one CUDA graph.

    PYTHONPATH=. python3 bench/attention_chain.py [--out DIR] [--tokens 8,128]

Decode buckets of dummy:llama-3.2-1b: T sequences, one new token each, DECODE_CONTEXT keys each
(as bench_forward.py times the step), every layer with its own K/V cache (so no layer finds the
previous one's keys in L2), blocks handed out in scrambled order. Each launch config (splits, keys
per tile, warps, pipeline stages) runs as programmatic dependent launches, as in the forward, and is
checked against the forward's current config before it is timed. The KV floor is the K+V bytes the
16 launches read over the copy rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import BLOCK_SIZE, DECODE_CONTEXT, MAX_SEQS, Batcher, copy_bandwidth, to_device  # noqa: E402
from blink_appliance.kernels.paged_attention import paged_attention  # noqa: E402
from blink_appliance.kernels.split_kv import split_partials  # noqa: E402
from gemm_chain import chain_ms  # noqa: E402

from blink_appliance.model.launch_plans import attention_config  # noqa: E402
from blink_appliance.model.presets import preset_config  # noqa: E402


def configs(tokens: int) -> list[tuple[int, int, int, int]]:
    """(splits, block_n, warps, stages) to try for a decode bucket of `tokens` sequences."""
    if tokens <= 8:
        return [(sp, bn, w, st) for sp in (8, 16) for bn in (16, 32) for w in (1, 2) for st in (2, 3)]
    if tokens <= 32:
        return [(sp, bn, w, 2) for sp in (2, 4, 8) for bn in (16, 32) for w in (1, 2)]
    grid = [(1, bn, w, st) for bn in (16, 32, 64, 128) for w in (1, 2, 4) for st in (2, 3)]
    return grid + [(2, bn, w, 2) for bn in (16, 32) for w in (1, 2)]


def time_bucket(T: int, bw: float) -> dict:
    """Every config of `configs(T)` (and the forward's current one) as a 16-layer chain."""
    c = preset_config("llama-3.2-1b")
    L = c.num_layers
    max_blocks = DECODE_CONTEXT // BLOCK_SIZE + 2
    num_blocks = (T + 1) * max_blocks
    b = Batcher(num_blocks, max_blocks, seed=T)
    for s in range(T):
        b.lens[s] = DECODE_CONTEXT - 1
    batch = to_device(b.batch([(s, 1) for s in range(T)], c.vocab_size), "cuda")
    pad = MAX_SEQS - T  # the forward's capacity: unused sequence slots
    qs = torch.cat([batch.query_start, batch.query_start[-1:].repeat(pad)])
    ctx = torch.cat([batch.context_lens, torch.zeros(pad, dtype=torch.int32, device="cuda")])
    tables = torch.cat(
        [batch.block_tables, torch.full((pad, max_blocks), -1, dtype=torch.int32, device="cuda")]
    )
    shape = (num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    caches = [
        (torch.randn(shape, device="cuda", dtype=torch.bfloat16), torch.randn(shape, device="cuda", dtype=torch.bfloat16))
        for _ in range(L)
    ]  # fmt: skip
    q = torch.randn(T, c.q_size, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = L * T * DECODE_CONTEXT * 2 * c.kv_size * 2
    floor_us = kv_bytes / bw * 1e6  # bytes read over the copy rate (as the weights floor counts)
    base = attention_config(T)

    def launches(splits, block_n, warps, stages, pdl=True):
        partials = split_partials(splits, T, c.num_heads, c.head_dim, "cuda") if splits > 1 else None
        # fmt: off
        return [
            lambda k=k, v=v: paged_attention(
                q, k, v, out, qs, ctx, tables, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim**-0.5,
                block_q=base.block_q, block_n=block_n, num_splits=splits, partials=partials,
                num_warps=warps, num_stages=stages, pdl=pdl,
            )
            for k, v in caches
        ]
        # fmt: on

    base_cfg = (base.splits, base.block_n, base.num_warps, base.num_stages)
    launches(*base_cfg)[0]()
    want = out.float().clone()

    def timed(fns, name) -> float | None:
        """Chain time in us, after checking one launch against the current config's output."""
        out.fill_(float("nan"))
        fns[0]()
        err = (out.float() - want).abs().max().item()
        if not err < 2e-2:
            print(f"T={T} {name}: WRONG max err {err:.2e}", flush=True)
            return None
        return chain_ms(fns) * 1e3

    rows = []
    for cfg in [base_cfg] + configs(T):
        try:
            us = timed(launches(*cfg), cfg)
            if us is None:
                continue
        except Exception as e:  # a config the compiler refuses (resources)
            print(f"T={T} {cfg}: skip {type(e).__name__}", flush=True)
            continue
        rows.append(dict(cfg=cfg, us=us))
    no_pdl = chain_ms(launches(*base_cfg, pdl=False)) * 1e3
    rows.sort(key=lambda r: r["us"])
    base_us = next(r["us"] for r in rows if r["cfg"] == base_cfg)
    result = dict(
        T=T, ctx=DECODE_CONTEXT, floor_us=floor_us, base=base_cfg, base_us=base_us, base_no_pdl_us=no_pdl,
        best=rows[:12],
    )  # fmt: skip
    print(f"T={T}: floor {floor_us:.0f} us | current {base_cfg} {base_us:.0f} (no PDL {no_pdl:.0f}) | "
          f"best {rows[0]['cfg']} {rows[0]['us']:.0f}", flush=True)  # fmt: skip
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", default="8,128")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    results = []
    for T in (int(t) for t in args.tokens.split(",")):
        results.append(time_bucket(T, bw))
        torch.cuda.empty_cache()
    (out_dir / "attention_chain.json").write_text(json.dumps(dict(copy_bw=bw, results=results), indent=1))
    print("\n| T | KV floor us | current (splits, keys, warps, stages) | best 4 |")
    print("|---|---|---|---|")
    for r in results:
        best = ", ".join(f"{tuple(x['cfg'])} {x['us']:.0f}" for x in r["best"][:4])
        print(f"| {r['T']} | {r['floor_us']:.0f} | {r['base']} {r['base_us']:.0f} | {best} |")


if __name__ == "__main__":
    main()
