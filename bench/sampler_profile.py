"""What the device sampler costs per sampling mix, logit shape and batch size. One device call.

    PYTHONPATH=. python3 bench/sampler_profile.py [--rows 1,64] [--capacity 256] [--vocab 128256] [--out DIR]
        [--mixes 'top_k 50;min_p 0.05'] [--knobs '{"rejection_gather_cap": 0}']

Per case (a logit shape, a sampling mix with every row the same, a row count), after checking the
tokens of the variant schedule picks against the reference sampler (engine/reference/sampler.py):
- `greedy()` and the picked variant, each captured as a CUDA graph (as the loop runs them), median
  replay time, and the picked variant's cost over greedy;
- the top kernels of a few eager calls of the picked variant under the torch profiler (us per call).

Logit shapes: `flat` (N(0, 1): what random weights give, where a 0.9 nucleus holds most of the
vocabulary) and `peaked` (N(0, 1) plus a Zipf-like head: a 0.9 nucleus of about 60 ranks, as a
trained model's next-token distribution usually has a small one).

Without a GPU it runs the same cases under the Triton interpreter at a small vocabulary (--vocab),
as a check of the harness: correctness only, no timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import _ensure_kernels_importable  # noqa: E402

_ensure_kernels_importable()

from blink_appliance.engine.loop.sampler import DeviceSampler  # noqa: E402
from blink_appliance.engine.reference.sampler import SamplingTensors, sample  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402
from tests.test_device_sampler import load_rows, make_state, variant_for  # noqa: E402  (as schedule does)

VARIANT_NAMES = ("greedy", "rejection", "rejection top-k", "rejection top-k top-p")

MIXES: dict[str, dict] = {
    "temperature 1.0": dict(temperature=1.0),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "top_p 0.95, top_k 40": dict(temperature=0.8, top_p=0.95, top_k=40),
    "top_k 50": dict(temperature=1.0, top_k=50),
    "top_k 1000": dict(temperature=0.8, top_k=1000),
    "top_k 20, top_p 0.8": dict(temperature=0.7, top_k=20, top_p=0.8),
    "top_k 1000, top_p 0.9": dict(temperature=1.0, top_k=1000, top_p=0.9),
    "min_p 0.05": dict(temperature=0.8, min_p=0.05),
}


def logits_of(shape: str, rows: int, vocab: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, vocab, generator=gen)
    if shape == "peaked":
        # A Zipf-like head (probability ~ rank^-1.5) over a random permutation of the vocabulary: a
        # 0.9 nucleus holds about 60 ranks; the N(0, 1) noise under it carries ~2% of the mass at 128k.
        ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
        head = 16.0 - 1.5 * torch.log(ranks)
        for r in range(rows):
            x[r, torch.randperm(vocab, generator=gen)] += head
    return x.to(device).contiguous()


def graph_ms(fn, device: str) -> float | None:
    if device != "cuda":
        return None
    from triton.testing import do_bench

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=20, rep=200, return_mode="median")


def top_kernels(fn, calls: int = 5, top: int = 8) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
        if us:
            rows.append((evt.key[:70], us / calls))
    return sorted(rows, key=lambda r: -r[1])[:top]


def run_case(
    shape: str, mix: str, rows: int, vocab: int, device: str, capacity: int = 0, knobs: dict | None = None
) -> dict:
    """`capacity`: the sampler's rows (the loop's max_seqs), of which the first `rows` are live; 0: rows.
    `knobs`: DeviceSampler keyword overrides."""
    capacity = max(capacity, rows)
    logits = torch.zeros(capacity, vocab, device=device)
    logits[:rows] = logits_of(shape, rows, vocab, device)
    params = [SamplingParams(seed=1000 + r, max_tokens=1, **MIXES[mix]) for r in range(rows)]
    output_index = [r % 7 for r in range(rows)]
    state = make_state(capacity, vocab)
    load_rows(state, params, output_index)
    sampler = DeviceSampler(state, logits, **(knobs or {}))
    variant = variant_for(params)
    picked = sampler.variants()[variant]

    picked()
    want = sample(
        logits[:rows].cpu(), SamplingTensors.build(params, [p.seed for p in params], output_index, "cpu")
    )
    mismatches = int((state.sampled[:rows].cpu() != want).sum())
    result = {
        "shape": shape,
        "mix": mix,
        "rows": rows,
        "capacity": capacity,
        "knobs": knobs or {},
        "variant": VARIANT_NAMES[variant],
        "mismatches": mismatches,
        "greedy_ms": graph_ms(sampler.greedy, device),
        "picked_ms": graph_ms(picked, device),
    }
    if device == "cuda":
        result["top_kernels_us"] = top_kernels(picked)
    return result


TUNE_KNOBS = (  # DeviceSampler keyword overrides, the shipped settings first
    {},
    {"rejection_max_registers": 48},
    {"rejection_max_registers": 56},
    {"rejection_max_registers": 72},
    {"rejection_rounds": 2},
    {"rejection_rounds": 4},
    {"programs_per_sm": 8},
    {"programs_per_sm": 24},
    {"rejection_chunk": 1024},
    {"rejection_ticket_chunks": 2},
)
# --tune quick: 16 against 8 programs an SM, twice. Since the queue kernel launches no more programs
# than fit (8 an SM at its register cap), only greedy's argmax differs between them.
QUICK_KNOBS = ({}, {"programs_per_sm": 8}, {}, {"programs_per_sm": 8})


def tune(vocab: int, device: str, knob_sets: tuple[dict, ...] = TUNE_KNOBS) -> list[dict]:
    """The rejection variant's knobs on flat logits, one at a time against the shipped settings
    (engine/loop/sampler.py, kernels/sampling_rounds.py): the queue kernel's register cap, the chunked
    rounds before the finisher, the persistent programs per SM (which greedy's argmax also uses, so
    it is timed too, at 64 rows and at 1). Tokens are checked against the shipped settings' (the knobs
    change only speed)."""
    out = []
    for rows, mixes in ((64, ("temperature 1.0", "temperature 0.7, top_p 0.9")), (1, ("temperature 1.0",))):
        logits = logits_of("flat", rows, vocab, device)
        for mix in mixes:
            params = [SamplingParams(seed=1000 + r, max_tokens=1, **MIXES[mix]) for r in range(rows)]
            state = make_state(rows, vocab)
            load_rows(state, params, [r % 7 for r in range(rows)])
            first = None
            for knobs in knob_sets:
                sampler = DeviceSampler(state, logits, **knobs)
                sampler.rejection()
                tokens = state.sampled.clone()
                first = tokens if first is None else first
                row = {"rows": rows, "mix": mix, **knobs, "ms": graph_ms(sampler.rejection, device),
                       "greedy_ms": graph_ms(sampler.greedy, device), "mismatches": int((tokens != first).sum())}  # fmt: skip
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,64", help="comma-separated row counts (empty: none)")
    ap.add_argument("--vocab", type=int, default=None, help="default: 128256 on a GPU, 2000 interpreted")
    ap.add_argument("--out", type=Path, default=None, help="folder for sampler_profile.json")
    ap.add_argument("--capacity", type=int, default=0,
                    help="sampler rows allocated, as the loop's max_seqs (the shipped 256); 0: the live rows")  # fmt: skip
    ap.add_argument("--mixes", default=None, help="only these MIXES, separated by ';' (default: all)")
    ap.add_argument("--knobs", default="{}", help="DeviceSampler keyword overrides, as JSON")
    ap.add_argument("--tune", nargs="?", const="all", choices=("all", "quick"),
                    help="also sweep the rejection variant's knobs (quick: the grid alone, twice)")  # fmt: skip
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = args.vocab or (128256 if device == "cuda" else 2000)
    row_counts = [int(n) if device == "cuda" else min(int(n), 8) for n in args.rows.split(",") if n]
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreted)",
           "torch": torch.__version__, "rows": row_counts, "vocab": vocab, "capacity": args.capacity}  # fmt: skip
    print(json.dumps(env), flush=True)
    results = []
    for rows in row_counts:
        for shape in ("flat", "peaked"):
            for mix in args.mixes.split(";") if args.mixes else MIXES:
                r = run_case(shape, mix, rows, vocab, device, args.capacity, json.loads(args.knobs))
                results.append(r)
                print(json.dumps(r), flush=True)
    tuning = tune(vocab, device, QUICK_KNOBS if args.tune == "quick" else TUNE_KNOBS) if args.tune else []
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        document = {"env": env, "results": results, "tuning": tuning}
        (args.out / "sampler_profile.json").write_text(json.dumps(document, indent=1))

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    def over(r: dict) -> str:
        return "-" if r["greedy_ms"] is None else f"+{r['picked_ms'] - r['greedy_ms']:.3f}"

    print(f"\nV = {vocab}, capacity {args.capacity or 'the live rows'}, {env['device']}")
    print("| rows | logits | mix | variant | greedy ms | variant ms | over greedy | mismatches |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['rows']} | {r['shape']} | {r['mix']} | {r['variant']} | {ms(r['greedy_ms'])} | {ms(r['picked_ms'])} "
            f"| {over(r)} | {r['mismatches']} |"
        )
    bad = sum(r["mismatches"] for r in results)
    if bad:
        sys.exit(f"FAILED: {bad} rows differ from the reference sampler")


if __name__ == "__main__":
    main()
