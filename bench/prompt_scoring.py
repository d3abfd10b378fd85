"""Prompt scoring (`echo` with `logprobs`) in the GPU loop: what a step that scores nothing pays for
it, and what scoring a prompt costs.

On the H100 (one command; `dummy:llama-3.2-1b` bf16, random weights with the real shapes):
    python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/prompt_scoring.py --out $OUT/prompt_scoring.json

1. `forward`: the captured forward graph of each bucket with the score gather (GpuForward
   score_rows = the first --score-chunk) and without (0), replayed alternately, CUDA-event medians: the
   final norm's extra programs are all a step that scores nothing pays in the forward.
2. `loop`: the shipped geometry (8192/1024/256/2048) in the device loop, once per --score-chunk
   (the loop's prompt_score_chunk). One request of a
   `--prompt-len` prompt, logprobs 5, max_tokens 1, with `echo` (prompt logprobs) and without:
   time from submit to its terminal event (median of `--repeats`; the cache is off so both prefill
   the whole prompt). Then batch-64 greedy decode TPOT alone and with one echo request scoring
   beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loop_rig import LoopRig  # noqa: E402
from blink_appliance.engine.loop.forward_graphs import DEFAULT_BUCKETS, ForwardGraphs  # noqa: E402
from blink_appliance.engine.loop.geometry import loop_geometry  # noqa: E402
from blink_appliance.engine.plan import resolve_plan  # noqa: E402
from blink_appliance.model.gpu_forward import GpuForward  # noqa: E402
from blink_appliance.model.gpu_weights import GpuWeights  # noqa: E402
from blink_appliance.model.kv_cache import PagedKVCache  # noqa: E402
from blink_appliance.model.loaders import load_checkpoint  # noqa: E402
from blink_appliance.profile import parse_profile, ring_geometry  # noqa: E402
from blink_appliance.wire.client import EngineClient  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402
from blink_appliance.wire.ring_layout import EngineState  # noqa: E402

SHIPPED = "8192/1024/256/2048"


def forward_cost(ckpt, weights: GpuWeights, score_rows: int, replays: int) -> dict[int, dict[str, float]]:
    """Median replay time of every bucket's graph, with and without the score gather."""
    c = ckpt.config
    kv = PagedKVCache.allocate(c.num_layers, 1024, 16, c.num_kv_heads, c.head_dim, torch.bfloat16, "cuda")
    runs = {}
    for rows in (0, score_rows):
        fwd = GpuForward(
            c,
            weights,
            kv,
            max_tokens=DEFAULT_BUCKETS[-1],
            max_seqs=256,
            max_blocks_per_seq=512,
            score_rows=rows,
        )
        graphs = ForwardGraphs(fwd, DEFAULT_BUCKETS)
        graphs.capture()
        runs[rows] = graphs
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    out: dict[int, dict[str, float]] = {}
    for T in DEFAULT_BUCKETS:
        times: dict[int, list[float]] = {rows: [] for rows in runs}
        for _ in range(replays):
            for rows, graphs in runs.items():  # alternately: clocks and neighbours hit both alike
                events[0].record()
                graphs.replay(T)
                events[1].record()
                torch.cuda.synchronize()
                times[rows].append(events[0].elapsed_time(events[1]))
        plain, scored = statistics.median(times[0]), statistics.median(times[score_rows])
        out[T] = {"plain_ms": plain, "with_gather_ms": scored, "ratio": scored / plain}
        print(
            f"forward bucket {T}: {plain:.4f} ms plain, {scored:.4f} ms with the gather ({scored / plain:.4f}x)"
        )
    return out


async def stream(client: EngineClient, tokens: list[int], params: SamplingParams) -> tuple[float, list]:
    t0 = time.perf_counter()
    rid = client.submit(tokens, params)
    events = [e async for e in client.stream(rid)]
    return (time.perf_counter() - t0) * 1e3, events


def prompt(i: int, n: int) -> list[int]:
    return [(i * 37 + j * 11) % 997 + 3 for j in range(n)]


async def drive(rig: LoopRig, coro):
    """Run `coro` while beating the rig's heartbeat."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        rig.beat()
        await asyncio.sleep(0.002)
    return task.result()


def shipped_loop(ckpt, model: str, engine: dict, frontend: dict, **geometry_changes) -> LoopRig:
    """A LoopRig in the device loop at the shipped geometry (8192/1024/256/2048, bf16 on cuda:0), its
    profile's [engine] and [frontend] given the extra keys; `geometry_changes` replace LoopGeometry
    fields."""
    mml, slots, seqs, budget = (int(x) for x in SHIPPED.split("/"))
    spec = {
        "name": "bench", "source": model, "dtype": "bfloat16", "device": "cuda:0", "max_seqs": seqs,
        "max_model_len": mml, "max_num_batched_tokens": budget, "block_size": 16, "kv_fraction": 0.85,
    }  # fmt: skip
    profile = parse_profile(
        {
            "models": [spec],
            "engine": {"num_slots": slots, **engine},
            "frontend": {"max_inflight": slots, **frontend},
        },
        origin=SHIPPED,
    )
    plan = resolve_plan(profile.model, ckpt.config)
    geometry, ring = loop_geometry(profile, plan, ckpt.config), ring_geometry(profile)
    gc.collect()  # the previous rig
    torch.cuda.empty_cache()
    return LoopRig.build(
        ring, dataclasses.replace(geometry, **geometry_changes), checkpoint=ckpt, dtype=torch.bfloat16,
        device="cuda:0", in_loop=True,
    )  # fmt: skip


async def loop_cost(ckpt, args, score_chunk: int) -> dict:
    rig = shipped_loop(ckpt, args.model, {"prefix_cache": False}, {}, prompt_score_chunk=score_chunk)
    geometry = rig.step.geometry
    client = rig.client()
    out: dict = {
        "geometry": SHIPPED,
        "prompt_len": args.prompt_len,
        "prompt_score_chunk": geometry.prompt_score_chunk,
    }
    try:
        rig.heartbeat()
        rig.region.store("engine_state", EngineState.RUNNING)
        await client.start()
        rig.loop.launch()
        tokens = prompt(1, args.prompt_len)
        plain = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
        echo = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, prompt_logprobs=True)
        times: dict[str, list[float]] = {"plain": [], "echo": []}
        for _ in range(args.repeats + 1):  # the first of each warms
            for name, params in (("plain", plain), ("echo", echo)):
                ms, events = await drive(rig, stream(client, tokens, params))
                assert events[-1].finished and events[-1].error is None, events[-1]
                if name == "echo":
                    scored = events[0].prompt_logprobs
                    assert [p.token_id for p in scored] == tokens[1:], "prompt rows name the prompt's tokens"
                    assert all(len(p.top) == 5 and p.logprob <= 0.0 for p in scored)
                times[name].append(ms)
        for name, ms in times.items():
            out[f"{name}_ms"] = statistics.median(ms[1:])
        print(
            f"one {args.prompt_len}-token prompt: {out['plain_ms']:.1f} ms without echo, {out['echo_ms']:.1f} ms with"
        )
        # Batch-64 decode alone, then with an echo request scoring beside it.
        for name, beside in (("b64", None), ("b64_beside_echo", echo)):
            params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
            jobs = [stream(client, prompt(10 + i, 128), params) for i in range(64)]
            if beside is not None:
                jobs.append(stream(client, prompt(2, args.prompt_len), beside))
            results = await drive(rig, asyncio.gather(*jobs))
            gaps = []
            for _, events in results[:64]:
                stamps = [e.timestamp_ns for e in events if e.token_id is not None][4:]
                gaps += [(b - a) / 1e6 for a, b in zip(stamps, stamps[1:], strict=False)]
            out[f"{name}_tpot_p50_ms"] = statistics.median(gaps)
            out[f"{name}_tpot_p99_ms"] = statistics.quantiles(gaps, n=100)[-1]
            print(
                f"{name}: TPOT P50 {out[f'{name}_tpot_p50_ms']:.3f} ms, P99 {out[f'{name}_tpot_p99_ms']:.3f} ms"
            )
    finally:
        await client.close()
        rig.shut_down()
    return out


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "."))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3.2-1b")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument(
        "--score-chunk", nargs="+", type=int, default=[512], help="prompt_score_chunk of the loop"
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=("forward", "loop"))
    ap.add_argument("--out", type=Path, default=out_dir / "prompt_scoring.json")
    args = ap.parse_args()
    ckpt = load_checkpoint(args.model, seed=0)
    report: dict = {
        "device": torch.cuda.get_device_name(0),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if "forward" not in args.skip:
        weights = GpuWeights.from_hf(ckpt.config, ckpt.weights, torch.bfloat16, "cuda:0")
        report["forward"] = forward_cost(ckpt, weights, args.score_chunk[0], args.replays)
        del weights
        gc.collect()  # the graphs' pools
        torch.cuda.empty_cache()
    if "loop" not in args.skip:
        report["loop"] = [asyncio.run(loop_cost(ckpt, args, chunk)) for chunk in args.score_chunk]
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
