"""CPU tokens/s of SmolLM2-135M-Instruct (GGUF) with the reference engine vs HF transformers.

Measures, on this machine, in fp32, greedy, ignore_eos so every run generates the same count:
- load time: our GGUF loader + tokenizer vs transformers' own GGUF loading (model + tokenizer);
- decode throughput at batch 1 and batch 8 (generated tokens / wall time, prefill included).

The machine may be shared: each timed run also measures how many cores other processes kept busy
meanwhile (from /proc), and the table shows the worst. With 2 OpenMP threads on 2 cores, one busy
core from elsewhere slows every parallel op by up to a scheduler time slice, so a run is only fair
when that number is near 0.

    .venv/bin/python bench/bench_cpu_model.py [--new-tokens 128] [--repeat N] [--threads N] [--out bench/results/FILE.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine
from blink_appliance.model.loaders import build_model, load_checkpoint
from blink_appliance.model.registry import resolve
from blink_appliance.wire.request import Request, SamplingParams

T = TypeVar("T")


def _busy_ticks() -> tuple[int, int]:
    """(clock ticks every CPU spent busy, ticks this process spent) so far; Linux /proc."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    with open("/proc/self/stat") as f:
        mine = f.read().rsplit(")", 1)[1].split()
    # Busy = all minus idle and iowait; this process = utime + stime (fields 14 and 15 of stat).
    return sum(ticks) - ticks[3] - ticks[4], int(mine[11]) + int(mine[12])


def timed(fn: Callable[..., T], *args, **kwargs) -> tuple[T, float, float]:
    """fn(*args, **kwargs), its wall seconds, and the cores other processes kept busy meanwhile."""
    all0, mine0 = _busy_ticks()
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    wall = time.perf_counter() - t0
    all1, mine1 = _busy_ticks()
    others = ((all1 - all0) - (mine1 - mine0)) / os.sysconf("SC_CLK_TCK") / wall
    return result, wall, max(others, 0.0)


PROMPT = "Explain, step by step, how a paged KV cache lets an LLM server batch many requests at once."


def ours(path, new_tokens: int, repeat: int) -> dict[str, float]:
    t0 = time.perf_counter()
    ckpt = load_checkpoint(f"gguf:{path}")
    model = build_model(ckpt, torch.float32, "cpu")
    load_s = time.perf_counter() - t0
    ids = ckpt.tokenizer.encode(PROMPT)
    result = {"load_s": load_s}
    for batch in (1, 8):
        engine = LLMEngine(
            model,
            EngineConfig(
                block_size=16,
                num_kv_blocks=512,
                max_num_seqs=16,
                max_num_batched_tokens=512,
                max_model_len=1024,
                eos_token_ids=ckpt.config.eos_token_ids,
            ),
        )
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        engine.generate([Request(1000 + i, list(ids), params) for i in range(2)])  # warm-up
        runs = []
        for r in range(repeat):
            reqs = [Request(r * batch + i, list(ids), params) for i in range(batch)]
            out, dt_s, others = timed(engine.generate, reqs)
            assert all(len(v) == new_tokens for v in out.values())
            runs.append(batch * new_tokens / dt_s)
            result["others"] = max(result.get("others", 0.0), others)
        result[f"tok_s_b{batch}"] = statistics.median(runs)
    return result


def hf(path, new_tokens: int, repeat: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    ids = tok(PROMPT, return_tensors="pt").input_ids
    result = {"load_s": load_s}
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        for batch in (1, 8):
            x = ids.repeat(batch, 1)
            runs = []
            for _ in range(repeat):
                _, dt_s, others = timed(model.generate, x, attention_mask=torch.ones_like(x), **kw)
                runs.append(batch * new_tokens / dt_s)
                result["others"] = max(result.get("others", 0.0), others)
            result[f"tok_s_b{batch}"] = statistics.median(runs)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per batch size; the median is shown")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's own)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_avg = os.getloadavg()[0]
    path = resolve("smollm2-135m-instruct")
    torch.manual_seed(0)
    rows = {
        "blink-appliance (reference engine)": ours(path, args.new_tokens, args.repeat),
        f"transformers {__import__('transformers').__version__} generate()": hf(
            path, args.new_tokens, args.repeat
        ),
    }
    lines = [
        "# CPU reference engine vs transformers: SmolLM2-135M-Instruct (Q4_1 GGUF, fp32)",
        "",
        f"- date: {dt.date.today()}; machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        f"- command: `.venv/bin/python bench/bench_cpu_model.py --new-tokens {args.new_tokens}"
        f"{'' if args.repeat == 1 else f' --repeat {args.repeat}'}"
        f"{'' if args.threads is None else f' --threads {args.threads}'}`",
        f"- load average (1 min) at the start: {load_avg:.2f}; other processes' busy cores during the timed runs: "
        "worst per implementation in the table",
        f"- greedy, ignore_eos, {args.new_tokens} new tokens per request, prompt of {PROMPT.count(' ') + 1} words; "
        "tok/s = generated tokens / wall time (prefill included)"
        f"{'' if args.repeat == 1 else f', median of {args.repeat} runs'}",
        "",
        "| implementation | load (s) | tok/s batch 1 | tok/s batch 8 | other processes (cores) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['load_s']:.1f} | {r['tok_s_b1']:.1f} | {r['tok_s_b8']:.1f} | {r['others']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
