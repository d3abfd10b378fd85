"""GPU forward benchmark, one device call: correctness, then step time per bucket beside the HBM floor.

    PYTHONPATH=. python3 bench/bench_forward.py [--out DIR] [--models llama-3.2-1b,llama-3.1-8b]
        [--check dummy:llama-3.2-1b,gguf:.realw/smollm2-8l.gguf]

1. Copy bandwidth (device-to-device, bytes read + written): the ceiling for the floor.
2. Per `--check` source (default `dummy:llama-3.2-1b`), bf16: the captured forward's logits vs the
   reference model (fp32, same weights, on the GPU) over three steps that go through three buckets
   (prefills; a prefill mixed with decodes; decodes only). Relative error must stay under 1e-2.
3. Per model and bucket: median step time by graph replay, the floor (weight bytes the step reads /
   copy bandwidth), their ratio; then a per-kernel breakdown from the torch profiler over eager steps.
   8B weights are drawn on the GPU in bf16 (no host copy); it is timed, not checked.
Kernel-level correctness at real shapes runs as pytest (tests/test_kernels_*.py) in the same call.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _ensure_kernels_importable() -> None:
    """`blink_appliance.kernels` is the top-level kernels/ folder, mapped there only when installed."""
    sys.path.insert(0, str(ROOT))
    try:
        import blink_appliance.kernels  # noqa: F401
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(
            "blink_appliance.kernels",
            ROOT / "kernels" / "__init__.py",
            submodule_search_locations=[str(ROOT / "kernels")],
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["blink_appliance.kernels"] = module
        spec.loader.exec_module(module)


_ensure_kernels_importable()

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from blink_appliance.engine.loop.forward_graphs import ForwardGraphs  # noqa: E402
from blink_appliance.model.gpu_forward import GpuForward  # noqa: E402
from blink_appliance.model.gpu_weights import GpuWeights  # noqa: E402
from blink_appliance.model.kv_cache import ForwardBatch, PagedKVCache  # noqa: E402
from blink_appliance.model.loaders import build_model, load_checkpoint  # noqa: E402
from blink_appliance.model.presets import preset_config  # noqa: E402

BUCKETS = (8, 32, 128, 512, 2048)
BLOCK_SIZE = 16
MAX_SEQS = 128
DECODE_CONTEXT = 256  # context of every decoding sequence in the timed steps


class Batcher:
    """Hands out KV blocks in scrambled order and builds ForwardBatches; sequences may start with a
    context already cached (the timed steps pretend it is there; its K/V are random)."""

    def __init__(self, num_blocks: int, max_blocks: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.max_blocks = max_blocks
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.gen = g

    def batch(self, runs: list[tuple[int, int]], vocab: int) -> ForwardBatch:
        """runs: (sequence id, new tokens); a new sequence id may be preset via `self.lens`."""
        ids, pos, slots, starts, ctx, tables, rows = [], [], [], [0], [], [], []
        for seq, n in runs:
            table = self.tables.setdefault(seq, [])
            start = self.lens.get(seq, 0)
            while (start + n - 1) // BLOCK_SIZE >= len(table):
                table.append(self.free.pop())
            for i in range(n):
                p = start + i
                pos.append(p)
                slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            ids += torch.randint(0, vocab, (n,), generator=self.gen).tolist()
            self.lens[seq] = start + n
            starts.append(len(ids))
            ctx.append(self.lens[seq])
            tables.append(table + [-1] * (self.max_blocks - len(table)))
            rows.append(len(ids) - 1)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start=torch.tensor(starts, dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            sample_rows=torch.tensor(rows, dtype=torch.int64),
        )


def to_device(batch: ForwardBatch, device: str) -> ForwardBatch:
    return replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in fields(batch)})


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting bytes read plus written."""
    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * n / (ms * 1e-3)


def check_against_reference(source: str, log: list[str]) -> list[dict]:
    """Three graph-replayed bf16 steps of `source` vs the reference model on the GPU.

    "Same weights": the reference gets the bf16-rounded weights, run in fp32 (the truth) and in bf16
    (how far the reference itself lands from the truth in bf16, for scale). `source` is any model
    source: dummy:llama-3.2-1b (random weights), or gguf:<file> for trained ones (bench/truncate_gguf.py
    cuts SmolLM2 to a size the device call can carry).
    """
    t = time.time()
    ckpt = load_checkpoint(source, seed=1)
    cfg = ckpt.config
    ckpt = replace(ckpt, weights={k: v.to(torch.bfloat16) for k, v in ckpt.weights.items()})
    log.append(f"{source} loaded in {time.time() - t:.1f}s")
    num_blocks, max_blocks = 256, 64

    def cache(dtype: torch.dtype) -> PagedKVCache:
        return PagedKVCache.allocate(
            cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype, "cuda"
        )

    refs = {
        torch.float32: build_model(ckpt, torch.float32, "cuda"),
        torch.bfloat16: build_model(ckpt, torch.bfloat16, "cuda"),
    }
    ref_kvs = {dt: cache(dt) for dt in refs}
    kv = cache(torch.bfloat16)
    weights = GpuWeights.from_hf(cfg, ckpt.weights, torch.bfloat16, "cuda")
    del ckpt
    fwd = GpuForward(cfg, weights, kv, max_tokens=512, max_seqs=16, max_blocks_per_seq=max_blocks)
    graphs = ForwardGraphs(fwd, buckets=(8, 128, 512))
    graphs.capture()
    b = Batcher(num_blocks, max_blocks, seed=2)
    steps = [
        [(0, 100), (1, 37), (2, 250)],  # prefills -> bucket 512
        [(0, 1), (3, 61), (1, 1), (2, 1)],  # a prefill among decodes -> bucket 128
        [(0, 1), (1, 1), (2, 1), (3, 1)],  # decodes -> bucket 8
    ]
    results = []
    for runs in steps:
        batch = b.batch(runs, cfg.vocab_size)
        truth = refs[torch.float32](to_device(batch, "cuda"), ref_kvs[torch.float32])
        ref_bf16 = refs[torch.bfloat16](to_device(batch, "cuda"), ref_kvs[torch.bfloat16])
        T = graphs.bucket_for(batch.num_tokens)
        fwd.logits.fill_(float("nan"))
        fwd.load_batch(batch, T)
        got = graphs.replay(T)[: len(runs)].clone()

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return ((a - b).norm() / b.norm()).item()

        # Run to run: the same step replayed (it rewrites the same cache slots); the split-K atomics
        # add in whatever order the slices finish.
        reruns = [graphs.replay(T)[: len(runs)].clone() for _ in range(5)]
        torch.cuda.synchronize()

        results.append(
            dict(
                model=source,
                tokens=batch.num_tokens,
                bucket=T,
                rel_err=rel(got, truth),
                ref_bf16_rel_err=rel(ref_bf16, truth),
                vs_ref_bf16=rel(got, ref_bf16),
                finite=bool(torch.isfinite(got).all()),
                argmax_agree=(got.argmax(-1) == truth.argmax(-1)).float().mean().item(),
                rerun_max_rel=max(rel(r, got) for r in reruns),
                rerun_argmax_agree=min(
                    (r.argmax(-1) == got.argmax(-1)).float().mean().item() for r in reruns
                ),
            )
        )
    del refs, ref_kvs, graphs, fwd, weights, kv
    torch.cuda.empty_cache()
    return results


def matmul_rate() -> float:
    """bf16 FLOP/s of an 8192^3 product on random data: the ceiling for prefill-heavy buckets."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3)


def step_flops(cfg, num_tokens: int, sample_rows: int, attended: int) -> float:
    """GEMM FLOPs of one step plus attention's QK and PV (attended = sum over tokens of keys seen)."""
    c = cfg
    per_token = (
        c.hidden_size * (c.q_size + 2 * c.kv_size)
        + c.q_size * c.hidden_size
        + 3 * c.hidden_size * c.intermediate_size
    )
    gemm = 2 * num_tokens * c.num_layers * per_token + 2 * sample_rows * c.hidden_size * c.vocab_size
    attn = 4 * attended * c.num_heads * c.head_dim * c.num_layers
    return gemm + attn


@dataclass
class Workload:
    bucket: int
    decodes: int
    prefill: int  # tokens of one prefill chunk starting at position 0
    context: int = DECODE_CONTEXT  # keys of every decoding sequence


def workload(T: int) -> Workload:
    if T <= MAX_SEQS:
        return Workload(T, decodes=T, prefill=0)
    return Workload(T, decodes=64, prefill=T - 64)


def load_workload(fwd: GpuForward, w: Workload, vocab: int, num_blocks: int, max_blocks: int) -> ForwardBatch:
    b = Batcher(num_blocks, max_blocks, seed=w.bucket)
    for s in range(w.decodes):
        b.lens[s] = w.context - 1 - (s % 7)  # slightly ragged contexts
    runs = [(s, 1) for s in range(w.decodes)] + ([(10_000, w.prefill)] if w.prefill else [])
    batch = b.batch(runs, vocab)
    fwd.load_batch(batch, w.bucket)
    return batch


KERNEL_GROUPS = [
    ("gemm (Triton swap-AB)", ("_skinny_gemm",)),
    ("attention", ("_paged_attention",)),
    ("rope+kv write", ("_rope_cache_write",)),
    ("add+rmsnorm", ("_add_rmsnorm",)),
    ("silu*mul", ("_silu_and_mul",)),
    ("embedding", ("index", "indexSelect", "index_select")),
    ("logits cast/copy", ("copy", "elementwise")),
]


def kernel_group(name: str) -> str:
    for group, keys in KERNEL_GROUPS:
        if any(k in name for k in keys):
            return group
    return (
        "gemm (cuBLAS)"
        if any(k in name.lower() for k in ("gemm", "nvjet", "cutlass", "sm90", "gemv", "splitk", "reduce"))
        else "other: " + name[:60]
    )


def profile_step(
    fwd: GpuForward, T: int, steps: int = 5, replay: Callable[[], object] | None = None
) -> tuple[dict[str, float], list[tuple[str, int, float]], dict[str, float]]:
    """Eager steps (same kernels as the graph), or `replay` (a captured step's replay), under the torch
    profiler, ms per step:
    - per kernel group, each kernel's own duration (with PDL a kernel starts while the one before
      drains and waits, so these overlap and add up to more than the step);
    - the top kernels by name: (name, launches per step, ms per step);
    - per role (the Triton GEMMs told apart by their place in the layer: qkv, o, gate_up, down), the
      time each kernel adds to the step's timeline past the end of the kernel before it; with `replay`
      the time no kernel of the step runs before a kernel starts is "idle before <role>", so the roles
      add up to the replays' device time; eagerly, gaps between host launches are left out."""
    from torch.profiler import ProfilerActivity, profile

    run = replay if replay is not None else (lambda: fwd.step(T))
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    groups: dict[str, float] = defaultdict(float)
    top = []
    for evt in prof.key_averages():
        dev_us = getattr(evt, "device_time_total", None)
        if dev_us is None:
            dev_us = evt.cuda_time_total
        if dev_us and evt.device_type == torch.autograd.DeviceType.CUDA:
            groups[kernel_group(evt.key)] += dev_us / 1000 / steps
            top.append((evt.key[:90], evt.count // steps, dev_us / 1000 / steps))
    top.sort(key=lambda r: -r[2])
    plan = fwd._gemms(T)
    order = [n for n in ("qkv", "o", "gate_up", "down") if getattr(plan, n)]
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    per_step = max(1, len(kernels) // steps)
    roles: dict[str, float] = defaultdict(float)
    end, gemms = None, 0
    for i, e in enumerate(kernels):
        role = kernel_group(e.name)
        if "skinny_gemm" in e.name:
            role, gemms = f"gemm {order[gemms % len(order)]}", gemms + 1
        if replay is not None and end is not None and i % per_step:  # not across two replays
            roles[f"idle before {role}"] += max(e.time_range.start - end, 0) / 1000 / steps
        start = e.time_range.start if end is None else max(e.time_range.start, end)
        roles[role] += max(e.time_range.end - start, 0) / 1000 / steps
        end = e.time_range.end if end is None else max(end, e.time_range.end)
    return (
        dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        top[:12],
        dict(sorted(roles.items(), key=lambda kv: -kv[1])),
    )


def bench_model(
    name: str, bandwidth: float, flops_rate: float, log: list[str], weights: GpuWeights | None = None
) -> tuple[list[dict], dict]:
    cfg = preset_config(name)
    if weights is None:
        weights = GpuWeights.random(cfg, torch.bfloat16, "cuda", seed=0)
    max_blocks = (DECODE_CONTEXT + max(BUCKETS)) // BLOCK_SIZE + 2
    num_blocks = MAX_SEQS * (DECODE_CONTEXT // BLOCK_SIZE + 1) + max(BUCKETS) // BLOCK_SIZE + 8
    kv = PagedKVCache.allocate(
        cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda"
    )
    kv.k.normal_(0, 1)
    kv.v.normal_(0, 1)
    fwd = GpuForward(
        cfg, weights, kv, max_tokens=max(BUCKETS), max_seqs=MAX_SEQS, max_blocks_per_seq=max_blocks
    )
    graphs = ForwardGraphs(fwd, buckets=BUCKETS)
    t = time.time()
    graphs.capture()
    log.append(
        f"{name}: captured {len(BUCKETS)} buckets in {time.time() - t:.1f}s; weights {weights.nbytes() / 1e9:.2f} GB"
    )
    rows = []
    breakdown = {}
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    for T in BUCKETS:
        w = workload(T)
        batch = load_workload(fwd, w, cfg.vocab_size, num_blocks, max_blocks)
        g = graphs.graphs[T]
        ms = do_bench(g.replay, warmup=50, rep=400, return_mode="median")
        ms2 = do_bench(g.replay, warmup=10, rep=200, return_mode="median")
        weight_bytes = weights.bytes_read_per_step(T)
        kv_read = int(batch.context_lens.sum()) * kv_bytes_per_token  # upper bound (prefill re-reads less)
        floor_ms = weight_bytes / bandwidth * 1e3
        floor_kv_ms = (weight_bytes + kv_read) / bandwidth * 1e3
        attended = w.decodes * DECODE_CONTEXT + w.prefill * (w.prefill + 1) // 2
        compute_ms = step_flops(cfg, T, fwd.num_sample_rows(T), attended) / flops_rate * 1e3
        rows.append(dict(model=name, bucket=T, decodes=w.decodes, prefill=w.prefill, step_ms=ms, repeat_ms=ms2,
                         floor_ms=floor_ms, floor_with_kv_ms=floor_kv_ms, compute_floor_ms=compute_ms,
                         ratio=ms / floor_ms, ratio_to_max_floor=ms / max(floor_kv_ms, compute_ms),
                         tokens_per_s=T / ms * 1e3))  # fmt: skip
        if T in (8, 128, 2048):
            breakdown[T] = profile_step(fwd, T)
            load_workload(fwd, w, cfg.vocab_size, num_blocks, max_blocks)
    del graphs, fwd, kv, weights
    torch.cuda.empty_cache()
    return rows, breakdown


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b", help="models to time ('' for none)")
    ap.add_argument(
        "--check",
        default="dummy:llama-3.2-1b",
        help="model sources whose bf16 logits are checked against the fp32 reference ('' for none)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    log: list[str] = []
    props = torch.cuda.get_device_properties(0)
    env = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
               cuda=torch.version.cuda, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))  # fmt: skip
    print(json.dumps(env), flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s", flush=True)
    rate = matmul_rate()
    print(f"bf16 8192^3 matmul: {rate / 1e12:.0f} TFLOP/s", flush=True)

    check = [
        c for source in filter(None, args.check.split(",")) for c in check_against_reference(source, log)
    ]
    for c in check:
        print(f"check bf16 vs fp32 reference: {c}", flush=True)

    all_rows, all_breakdown = [], {}
    for name in filter(None, args.models.split(",")):
        rows, breakdown = bench_model(name, bw, rate, log)
        all_rows += rows
        all_breakdown[name] = breakdown
        for r in rows:
            print(json.dumps(r), flush=True)
    (out / "bench_forward.json").write_text(
        json.dumps(
            dict(
                env=env,
                copy_bw=bw,
                matmul_flops=rate,
                check=check,
                rows=all_rows,
                breakdown=all_breakdown,
                log=log,
            ),
            indent=1,
        )
    )

    print("\n".join(log))
    print("\n## per-kernel device time, ms per step (eager steps, torch profiler)")
    for name, per_bucket in all_breakdown.items():
        for T, (groups, top, roles) in per_bucket.items():
            total = sum(groups.values())
            parts = ", ".join(f"{g} {v:.3f}" for g, v in groups.items())
            print(f"{name} T={T}: total {total:.3f} | {parts}")
            parts = ", ".join(f"{g} {v:.3f}" for g, v in roles.items())
            print(f"    timeline {sum(roles.values()):.3f} | {parts}")
            if name == "llama-3.2-1b" and T in (8, 128):
                for kname, count, ms in top:
                    print(f"    {ms:.3f} ms  x{count}  {kname}")
    print(
        f"\n## step time by graph replay (median), {env['gpu']}, copy {bw / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s"
    )
    print(
        "| model | T | decodes+prefill | step ms | weights floor ms | step/floor | floor+KV ms | compute floor ms | step/max floor | tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in all_rows:
        print(f"| {r['model']} | {r['bucket']} | {r['decodes']}+{r['prefill']} | {r['step_ms']:.3f} ({r['repeat_ms']:.3f}) | "
              f"{r['floor_ms']:.3f} | {r['ratio']:.2f} | {r['floor_with_kv_ms']:.3f} | {r['compute_floor_ms']:.3f} | "
              f"{r['ratio_to_max_floor']:.2f} | {r['tokens_per_s']:.0f} |")  # fmt: skip
    for c in check:
        print(f"check {c['model']} bucket {c['bucket']} ({c['tokens']} tok): ours vs fp32 truth {c['rel_err']:.4f}, reference-in-bf16 vs truth "
              f"{c['ref_bf16_rel_err']:.4f}, ours vs reference-in-bf16 {c['vs_ref_bf16']:.4f}, argmax agree {c['argmax_agree']:.2f}; "
              f"5 reruns: max diff {c['rerun_max_rel']:.1e}, argmax agree {c['rerun_argmax_agree']:.2f}")  # fmt: skip
    if not check:
        print("correctness check skipped (--check '')")
        return
    ok = all(c["rel_err"] < 1e-2 and c["finite"] for c in check)
    no_worse = all(c["rel_err"] <= c["ref_bf16_rel_err"] and c["finite"] for c in check)
    print(f"correctness, bf16 vs fp32 reference (same weights): < 1e-2 {'PASS' if ok else 'FAIL'}; "
          f"no worse than the reference model run in bf16: {'PASS' if no_worse else 'FAIL'}")  # fmt: skip


if __name__ == "__main__":
    main()
