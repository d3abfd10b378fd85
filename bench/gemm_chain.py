"""Decode GEMMs measured the way the step runs them: 16 back-to-back launches in one CUDA graph.

    PYTHONPATH=. python3 bench/gemm_chain.py [--out DIR] [--model llama-3.2-1b] [--tokens 8,128]

Isolated timings of decode GEMMs predicted the step badly (docs/gpu_forward.md: a Triton GEMM that
won alone lost in the step), so every candidate here is timed as a graph of one launch per layer
(16 different weight matrices, L2 flushed before each replay), next to cuBLAS doing the same:

- cublas_tn: torch.mm(x, W.t()) with W [out, in] row-major (what the forward ships).
- cublas_nn: the same values stored [in, out] (torch.mm(x, Wt)).
- swap_ab: a Triton kernel that puts the weight rows on the MMA's M side and the few tokens on its
  N side (acc[BLOCK_N, tokens] = W_tile @ x_tile^T), optionally split over K into fp32 partials
  (the forward's add+RMSNorm already sums such partials for O and down). Its best three configs are
  timed again as programmatic dependent launches, and for down with SiLU*up in the prologue.
Every candidate's result is checked against torch in fp32 before it is timed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from blink_appliance.kernels.skinny_gemm import skinny_gemm
from triton.testing import do_bench

from blink_appliance.model.presets import preset_config


def swap_ab(x, w, out, block_n, block_k, split_k, warps, stages, pdl=False, silu=False):
    skinny_gemm(
        x, w, out, split_k=split_k, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
        pdl=pdl, silu_gate=silu,
    )  # fmt: skip


def launches(x, mats, target, cfg, **kw) -> list:
    """One swap-AB launch per layer's matrix, all into the same output."""
    return [lambda w=w: swap_ab(x, w, target, *cfg, **kw) for w in mats]


def configs(tokens: int) -> list[tuple]:
    """(layout, block_n, block_k, split, warps, stages); "kn" reads the [K, N] storage (NN layout)."""
    if tokens <= 16:
        grid = [("nk", bn, 128, sp, wp, st) for bn in (32, 64) for sp in (1, 2, 4, 8)
                for wp, st in ((4, 4), (4, 6), (8, 4))]  # fmt: skip
        return grid + [("kn", bn, bk, sp, 4, 4) for bn in (64, 128) for bk in (64, 128) for sp in (1, 2, 4)]
    # All the tokens in one tile: the weight tile is the MMA's M side (64 or 128 rows), K tiles deep.
    return [("kn", bn, bk, sp, wp, st) for bn in (64, 128) for bk in (64, 128) for sp in (1, 2, 4, 8)
            for wp, st in ((4, 3), (8, 3), (8, 4))]  # fmt: skip


def chain_ms(fns) -> float:
    """Median replay time of one graph that runs `fns` in order (L2 flushed between replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    return do_bench(g.replay, warmup=20, rep=200, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--tokens", default="8,16")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    c = preset_config(args.model)
    L = c.num_layers
    shapes = {
        "qkv": (c.q_size + 2 * c.kv_size, c.hidden_size),
        "o": (c.hidden_size, c.q_size),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    t_start = time.time()
    for M in (int(t) for t in args.tokens.split(",")):
        for what, (N, K) in shapes.items():
            ws = [
                torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(L)
            ]
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            nbytes = L * N * K * 2
            ref = x.float() @ ws[0].float().t()
            row = dict(tokens=M, gemm=what, N=N, K=K, floor_us=nbytes / 3.0e12 * 1e6)
            row["cublas_tn_us"] = (
                chain_ms([lambda w=w, x=x, out=out: torch.mm(x, w.t(), out=out) for w in ws]) * 1e3
            )
            wts = [w.t().contiguous() for w in ws]
            row["cublas_nn_us"] = (
                chain_ms([lambda w=w, x=x, out=out: torch.mm(x, w, out=out) for w in wts]) * 1e3
            )
            best = []
            for layout, block_n, block_k, split, warps, stages in configs(M):
                if N % block_n or K % (block_k * split):
                    continue
                programs = N // block_n * split
                if programs < 32 or programs > 1100:
                    continue
                mats = ws if layout == "nk" else [w.t() for w in wts]
                target = out if split == 1 else torch.empty(split * M * N, device="cuda")
                cfg = (block_n, block_k, split, warps, stages)
                try:
                    swap_ab(x, mats[0], target, *cfg)
                    got = target.float() if split == 1 else target.view(split, M, N).sum(0)
                    err = ((got - ref).norm() / ref.norm()).item()
                    if err > 2e-2:
                        print(f"{what} M={M} {layout} {cfg}: WRONG err {err:.2e}", flush=True)
                        continue
                    us = chain_ms(launches(x, mats, target, cfg)) * 1e3
                except Exception as e:  # a config the compiler refuses
                    print(f"{what} M={M} {layout} {cfg}: skip {type(e).__name__}", flush=True)
                    continue
                best.append((us, (layout,) + cfg))
            best.sort()
            # The best three again as programmatic dependent launches (how the forward runs them), and
            # for down the best with SiLU*up in its prologue (the input is then gate|up, [M, 2K]).
            variants = [(cfg, dict(pdl=True), "pdl") for _, cfg in best[:3]]
            if what == "down" and best:  # two pipeline stages too: the extra up tile needs shared memory
                variants += [
                    (best[0][1], dict(silu=True), "silu"),
                    ((*best[0][1][:5], 2), dict(silu=True), "silu"),
                ]
            gate_up = torch.randn(M, 2 * K, device="cuda", dtype=torch.bfloat16, generator=gen)
            for (layout, *cfg), kw, tag in variants:
                mats = ws if layout == "nk" else [w.t() for w in wts]
                target = out if cfg[2] == 1 else torch.empty(cfg[2] * M * N, device="cuda")
                try:
                    us = chain_ms(launches(gate_up if tag == "silu" else x, mats, target, cfg, **kw)) * 1e3
                except Exception as e:  # e.g. the SiLU prologue's extra tile does not fit shared memory
                    print(f"{what} M={M} {layout} {cfg} {tag}: skip {type(e).__name__}", flush=True)
                    continue
                best.append((us, (layout, *cfg, tag)))
            best.sort()
            del wts
            row["swap_ab_best"] = [dict(us=u, cfg=cfg) for u, cfg in best[:4]]
            row["swap_ab_pdl_silu"] = [dict(us=u, cfg=cfg) for u, cfg in best if cfg[-1] in ("pdl", "silu")]
            results.append(row)
            b = best[0] if best else (float("nan"), None)
            print(
                f"M={M} {what} N={N} K={K}: floor {row['floor_us']:.0f} us | cuBLAS TN {row['cublas_tn_us']:.0f} "
                f"| NN {row['cublas_nn_us']:.0f} | swap_ab {b[0]:.0f} {b[1]}  ({time.time() - t_start:.0f}s)",
                flush=True,
            )
            del ws
            torch.cuda.empty_cache()
    (out_dir / "gemm_chain.json").write_text(json.dumps(results, indent=1))
    print(
        "\n| tokens | gemm | floor us | cuBLAS TN | cuBLAS NN | swap_ab best (layout, BN, BK, split, warps, stages) |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        b = r["swap_ab_best"][0] if r["swap_ab_best"] else dict(us=float("nan"), cfg=None)
        print(f"| {r['tokens']} | {r['gemm']} | {r['floor_us']:.0f} | {r['cublas_tn_us']:.0f} | "
              f"{r['cublas_nn_us']:.0f} | {b['us']:.0f} {b['cfg']} |")  # fmt: skip
    for r in results:
        extra = ", ".join(f"{v['cfg']} {v['us']:.0f}" for v in r["swap_ab_pdl_silu"])
        print(f"{r['tokens']} {r['gemm']}: {extra}")


if __name__ == "__main__":
    main()
