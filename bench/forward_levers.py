"""Which GEMM-side levers shorten the decode step? One device call, graph replay per variant.

    PYTHONPATH=. python3 bench/forward_levers.py [--out DIR] [--model llama-3.2-1b] [--buckets 8,32,128]

The decode step of the 1B model spends ~77% of its time in cuBLAS GEMMs that run at 1.6-2.8 TB/s
(bench/results/2026-11-22-h100-forward.md). Each variant below changes only how those GEMMs are
issued, captures the same buckets and times graph replay the way bench_forward.py does (median of
do_bench, L2 flushed), on the same decode workload:

A variant is a "+"-joined set of levers on top of the forward with every option off (row-major
weights, cuBLAS everywhere, bf16 logits plus a cast):
- skinny: decode buckets (<= 16 tokens) run O, gate+up and down through the swap-AB Triton GEMM.
- skinny64, skinny128: Triton GEMMs up to 64 or 128 tokens, as `decode_gemms` gives them.
- tqkv: with skinny, QKV through the Triton GEMM too where `decode_gemms` gives it a launch (RoPE sums
  its split-K partials).
- lmfp32: the LM head writes fp32 logits itself (mm out_dtype) instead of bf16 plus a cast kernel.
- nn: projection weights stored [in, out] contiguous (`in_major`, now the default), so cuBLAS runs
  NN, not TN.
- cublaslt: torch.backends.cuda.preferred_blas_library("cublaslt").
- pdl: programmatic dependent launch of the Triton norms and few-row GEMMs (each launches while the
  kernel before drains, and waits for it with griddepcontrol.wait).
- tunable: TunableOp picks each GEMM's algorithm by timing cuBLAS/cuBLASLt candidates (cold-cache
  rotating buffer) during the eager warm-up, before capture.
- prod: the forward as it ships (skinny128+nn+lmfp32+pdl+tqkv).
- fp32p: split-K partials in fp32 instead of the weights' dtype.
- siluk: at 65-128 tokens SiLU*up in its own kernel instead of the gate+up GEMM's epilogue.
- silud16: up to 16 tokens the down GEMM computes silu(gate)*up in its prologue from the gate+up
  GEMM's output (128-row tiles), the plan before 2026-11-28 (now the gate+up GEMM's epilogue writes it).
- parts: `deterministic_gemms` (profile engine.deterministic): O and down write split-K partials that
  the next norm sums (O at 65-128 tokens on cuBLAS) instead of adding into the fp32 residual stream.
- <proj>.<field>=<int> (proj qkv, o, gate_up, down; a GemmLaunch field): that launch shape changed
  in the 17-128-token buckets; <proj>16.<field>=<int> in the buckets up to 16 tokens.
- attn128.<field>=<int> (an AttentionConfig field): the attention launch shape at 33-128 tokens;
  attn.<field>=<int> in every bucket (attn.fused_rope=1: RoPE and the cache write in the attention).
(The levers this file had at commit 98cc562, gu128 / qkv128 / bfp / attn1w / down8 / lmt / qkv4 /
gubk128 / gu4w / attn16k, built today's `decode_gemms` and `attention_config` from the older ones;
bench/results/2026-11-23-h100-forward-gated-gemm.md, where o128 is too; oacc, dacc, dacc8, o2x, d2x,
obk, qkv32 and tma, measured on the way to today's plan and then removed, are described in
2026-11-23-h100-forward-accumulate.md.)
A name given twice runs twice (the second as "name (run 2)"). "base" is none of them. Each variant's logits are compared with the first variant's on the same step
(they must agree to bf16 rounding).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import (  # noqa: E402
    BLOCK_SIZE,
    DECODE_CONTEXT,
    MAX_SEQS,
    Workload,
    copy_bandwidth,
    load_workload,
    profile_step,
    workload,
)
from triton.testing import do_bench  # noqa: E402

from blink_appliance.engine.loop.forward_graphs import ForwardGraphs  # noqa: E402
from blink_appliance.model.gpu_forward import GpuForward  # noqa: E402
from blink_appliance.model.gpu_weights import GpuWeights  # noqa: E402
from blink_appliance.model.kv_cache import PagedKVCache  # noqa: E402
from blink_appliance.model.launch_plans import (  # noqa: E402
    AttentionConfig,
    DecodeGemms,
    attention_config,
    decode_gemms,
    deterministic_gemms,
)
from blink_appliance.model.presets import preset_config  # noqa: E402

SKINNY = {"skinny": 16, "skinny64": 64, "skinny128": 128}  # lever -> triton_gemm_max_tokens
PROD = {"skinny128", "nn", "lmfp32", "pdl", "tqkv"}
PLAN_LEVERS = {"fp32p", "siluk", "parts", "silud16"}


def plans(levers: set[str]):
    """The per-bucket GEMM and attention launch plans of a variant: `decode_gemms` and
    `attention_config`, with the plan levers applied."""

    def gemm_plan(t: int, config=None) -> DecodeGemms:
        g = (deterministic_gemms if "parts" in levers else decode_gemms)(t, config)
        if "fp32p" in levers:
            split = [n for n in ("qkv", "o", "down") if getattr(g, n) and getattr(g, n).split_k > 1]
            g = replace(g, **{n: replace(getattr(g, n), fp32_partials=True) for n in split})
        if "siluk" in levers and g.silu_in_gate_up:
            g = replace(g, silu_in_gate_up=False)
        if "silud16" in levers and t <= 16 and g.silu_in_gate_up:
            g = replace(g, silu_in_down=True, silu_in_gate_up=False, gate_up=replace(g.gate_up, block_n=128))
        for lever in levers:
            if "=" in lever and not lever.startswith("attn"):
                (proj, field), value = lever.split("=")[0].split("."), int(lever.split("=")[1])
                small = proj.endswith("16")
                proj = proj.removesuffix("16")
                if (t <= 16) == small and t <= 128 and getattr(g, proj):
                    g = replace(g, **{proj: replace(getattr(g, proj), **{field: value})})
        return g

    def attention_plan(t: int, config=None) -> AttentionConfig:
        a = attention_config(t, config)
        for lever in levers:
            if (lever.startswith("attn128.") and 32 < t <= 128) or lever.startswith("attn."):
                field, value = lever.split(".", 1)[1].split("=")
                a = replace(a, **{field: int(value)})
        return a

    return gemm_plan, attention_plan


def row_major(weights: GpuWeights) -> GpuWeights:
    """Same values, each projection stored [out, in] row-major (the layout before `in_major`)."""

    def rm(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.contiguous()

    layers = [
        replace(
            layer, qkv=rm(layer.qkv), o_proj=rm(layer.o_proj), gate_up=rm(layer.gate_up), down=rm(layer.down)
        )
        for layer in weights.layers
    ]
    lm = weights.lm_head if weights.lm_head is weights.embed else rm(weights.lm_head)
    return GpuWeights(embed=weights.embed, layers=layers, norm=weights.norm, lm_head=lm)


def run_variant(
    name: str,
    cfg,
    weights: GpuWeights,
    buckets: tuple[int, ...],
    bw: float,
    log: list[str],
    profile: bool = True,
    prefill: int = 0,
    decodes: int = 0,
    context: int = DECODE_CONTEXT,
    graph_profile: bool = False,
):
    max_blocks = (context + max(buckets)) // BLOCK_SIZE + 2
    num_blocks = (decodes or MAX_SEQS) * (context // BLOCK_SIZE + 1) + max(buckets) // BLOCK_SIZE + 8
    kv = PagedKVCache.allocate(
        cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda"
    )
    g = torch.Generator(device="cuda").manual_seed(5)
    kv.k.normal_(0, 1, generator=g)
    kv.v.normal_(0, 1, generator=g)
    levers = set(name.split("+")) - {"base"}
    if "prod" in levers:
        levers = (levers - {"prod"}) | PROD
    known = set(SKINNY) | {"lmfp32", "nn", "cublaslt", "tunable", "pdl", "tqkv"} | PLAN_LEVERS
    unknown = {lever for lever in levers - known if "=" not in lever}
    if unknown:
        raise ValueError(f"unknown levers {sorted(unknown)}")
    gemm_plan, attention_plan = plans(levers)
    floor_weights = weights
    if "nn" not in levers:
        weights = row_major(weights)
    fwd = GpuForward(
        cfg, weights, kv, max_tokens=max(buckets), max_seqs=MAX_SEQS, max_blocks_per_seq=max_blocks,
        lm_head_fp32_out="lmfp32" in levers,
        triton_gemm_max_tokens=max([0] + [n for lever, n in SKINNY.items() if lever in levers]),
        pdl="pdl" in levers, triton_qkv="tqkv" in levers,
        gemm_plan=gemm_plan, attention_plan=attention_plan,
    )  # fmt: skip
    if "cublaslt" in levers:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    if "tunable" in levers:
        tun = torch.cuda.tunable
        tun.enable(True)
        tun.tuning_enable(True)
        tun.set_max_tuning_duration(40)
        tun.set_max_tuning_iterations(60)
        if hasattr(tun, "set_rotating_buffer_size"):
            tun.set_rotating_buffer_size(256)
        tun.set_filename(f"/tmp/tunableop_{name}.csv")
    t = time.time()
    graphs = ForwardGraphs(fwd, buckets=buckets)
    graphs.capture()
    if "tunable" in levers:
        torch.cuda.tunable.tuning_enable(False)
    log.append(f"{name}: warm-up + capture {time.time() - t:.1f}s")
    rows, logits, profiles = [], {}, {}
    for T in buckets:
        if prefill or decodes:
            w = Workload(T, decodes=decodes or T - prefill, prefill=prefill, context=context)
        else:
            w = replace(workload(T), context=context)
        load_workload(fwd, w, cfg.vocab_size, num_blocks, max_blocks)
        # One replay on the loaded step for the logits (the cache writes repeat the same slots).
        logits[T] = graphs.replay(T).clone()
        ms = do_bench(graphs.graphs[T].replay, warmup=50, rep=400, return_mode="median")
        ms2 = do_bench(graphs.graphs[T].replay, warmup=10, rep=200, return_mode="median")
        floor = floor_weights.bytes_read_per_step(T) / bw * 1e3
        rows.append(dict(variant=name, bucket=T, step_ms=ms, repeat_ms=ms2, floor_ms=floor, ratio=ms / floor))
        if profile and (T in (8, 128) or graph_profile):
            replay = graphs.graphs[T].replay if graph_profile else None
            groups, top, roles = profile_step(fwd, T, steps=20 if graph_profile else 5, replay=replay)
            profiles[T] = dict(groups=groups, top=top, roles=roles)
    if "cublaslt" in levers:
        torch.backends.cuda.preferred_blas_library("cublas")
    if "tunable" in levers:
        torch.cuda.tunable.enable(False)
    del graphs, fwd, kv
    torch.cuda.empty_cache()
    return rows, logits, profiles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--buckets", default="8,32,128")
    ap.add_argument("--variants", default="base,skinny,skinny+nn,skinny+lmfp32,skinny+nn+lmfp32")
    ap.add_argument("--profile", default="", help="comma-separated variants to profile (default: all)")
    ap.add_argument(
        "--prefill", type=int, default=0,
        help="a mixed step: one prefill chunk of this many tokens (from position 0) and decodes in the rest",
    )  # fmt: skip
    ap.add_argument(
        "--decodes", type=int, default=0,
        help="decoding sequences per step (the rest of the bucket is padding; 1: batch 1); default: the bucket",
    )  # fmt: skip
    ap.add_argument("--context", type=int, default=DECODE_CONTEXT, help="keys of every decoding sequence")
    ap.add_argument(
        "--graph-profile", action="store_true",
        help="profile every bucket's graph replay (idle time between kernels shown), not eager steps",
    )  # fmt: skip
    args = ap.parse_args()
    buckets = tuple(int(b) for b in args.buckets.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    env = dict(gpu=props.name, torch=torch.__version__, cuda=torch.version.cuda,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), model=args.model,
               prefill=args.prefill, decodes=args.decodes, context=args.context)  # fmt: skip
    print(json.dumps(env), flush=True)
    bw = copy_bandwidth()
    cfg = preset_config(args.model)
    weights = GpuWeights.random(cfg, torch.bfloat16, "cuda", seed=0)
    log: list[str] = []
    all_rows, base_logits, errs, profiles = [], None, {}, {}
    to_profile = set(args.profile.split(",")) if args.profile else None
    runs: dict[str, int] = {}
    for name in args.variants.split(","):
        # A name given twice runs twice, the second time as "name (run 2)": the plan first and last
        # shows the call's drift (the first variant ran 2-14 µs slow on the H200).
        runs[name] = runs.get(name, 0) + 1
        label = name if runs[name] == 1 else f"{name} (run {runs[name]})"
        try:
            profile = to_profile is None or name in to_profile
            rows, logits, prof = run_variant(
                name, cfg, weights, buckets, bw, log, profile, args.prefill, args.decodes, args.context,
                args.graph_profile,
            )  # fmt: skip
        except Exception as e:  # a lever this torch build lacks is reported, not fatal
            log.append(f"{name}: FAILED {type(e).__name__}: {e}")
            print(log[-1], flush=True)
            continue
        profiles[label] = prof
        for r in rows:
            r["variant"] = label
            print(json.dumps(r), flush=True)
        all_rows += rows
        if base_logits is None:
            base_logits = logits
        for T, lg in logits.items():
            ref = base_logits[T]
            errs[f"{label}/{T}"] = ((lg - ref).norm() / ref.norm()).item()
    (out / "forward_levers.json").write_text(
        json.dumps(
            dict(
                env=env, copy_bw=bw, rows=all_rows, logits_rel_diff_vs_base=errs, profiles=profiles, log=log
            ),
            indent=1,
        )  # fmt: skip
    )
    print("\n".join(log))
    for name, prof in profiles.items():
        for T, p in prof.items():
            parts = ", ".join(f"{g} {v:.3f}" for g, v in p["groups"].items())
            print(f"{name} T={T}: {parts}")
            print("    timeline: " + ", ".join(f"{g} {v:.3f}" for g, v in p["roles"].items()))
            if T == 8 or args.graph_profile:
                for kname, count, ms in p["top"][:6]:
                    print(f"    {ms:.3f} ms x{count} {kname}")
    print(f"\n## {args.model} bf16 step by graph replay (ms), copy {bw / 1e12:.2f} TB/s; logits diff vs base")
    print("| variant | " + " | ".join(f"T={T}" for T in buckets) + " |")
    print("|---|" + "---|" * len(buckets))
    for name in dict.fromkeys(r["variant"] for r in all_rows):
        cells = []
        for T in buckets:
            r = next(r for r in all_rows if r["variant"] == name and r["bucket"] == T)
            cells.append(f"{r['step_ms']:.3f} ({r['ratio']:.2f}x, d {errs[f'{name}/{T}']:.1e})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
