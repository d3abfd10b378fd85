"""Batch-1 CPU tokens/s on one GGUF: llama.cpp (llama-cpp-python) vs the reference engine, fp32 and quantized.

Side by side in one process, on the same file, the same prompt token ids, the same thread count,
greedy, a fixed number of new tokens (llama.cpp's generator and ours with ignore_eos never stop at
EOS). The three implementations take turns, `--repeat` rounds, and the table shows medians:

- llama.cpp: `Llama.generate(ids, temp=0, top_k=1)`, its own kernels on the file's quant types;
- reference fp32: the CPU reference engine, weights dequantized to fp32 (the spec);
- quantized: the same engine with `load_checkpoint(quantized=True)` (`[[models]] cpu_weights =
  "quantized"`): Q4_0/Q4_1/Q8_0 kept as codes, matmuls through torch's int4 kernel.

tok/s = new tokens / wall time of the whole request (prefill included). Each timed run also records
the cores other processes kept busy (bench_cpu_model.timed): near 0 means the run was fair. It also
says where each greedy stream first differs from the fp32 reference's.

    .venv/bin/python bench/cpu_vs_llamacpp.py [--threads 2] [--new-tokens 128] [--repeat 3] [--out FILE.md]

Needs `pip install llama-cpp-python` (builds llama.cpp from source: about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_cpu_model import PROMPT, timed  # noqa: E402
from blink_appliance.engine.reference.engine import EngineConfig, LLMEngine  # noqa: E402
from blink_appliance.model.loaders import build_model, load_checkpoint  # noqa: E402
from blink_appliance.model.registry import resolve  # noqa: E402
from blink_appliance.wire.request import Request, SamplingParams  # noqa: E402


class Ours:
    def __init__(self, path: Path, quantized: bool) -> None:
        t0 = time.perf_counter()
        ckpt = load_checkpoint(f"gguf:{path}", quantized=quantized)
        model = build_model(ckpt, torch.float32, "cpu")
        self.load_s = time.perf_counter() - t0
        self.engine = LLMEngine(
            model,
            EngineConfig(
                block_size=16,
                num_kv_blocks=256,
                max_num_seqs=4,
                max_num_batched_tokens=512,
                max_model_len=1024,
                eos_token_ids=ckpt.config.eos_token_ids,
            ),
        )
        self.tokenizer = ckpt.tokenizer
        self.next_id = 0

    def generate(self, ids: list[int], n: int) -> list[int]:
        self.next_id += 1
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return self.engine.generate([Request(self.next_id, list(ids), params)])[self.next_id]


class LlamaCpp:
    def __init__(self, path: Path, threads: int) -> None:
        from llama_cpp import Llama

        t0 = time.perf_counter()
        self.llm = Llama(
            model_path=str(path), n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads,
            verbose=False,
        )  # fmt: skip
        self.load_s = time.perf_counter() - t0

    def generate(self, ids: list[int], n: int) -> list[int]:
        out = []
        # reset=True (the default) starts from an empty KV cache, as a new request does in ours.
        for tok in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            out.append(int(tok))
            if len(out) == n:
                break
        return out


def first_difference(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return "none" if i is None else f"token {i}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import llama_cpp

    path = resolve("smollm2-135m-instruct")
    load_avg = os.getloadavg()[0]
    impls = {
        f"llama.cpp (llama-cpp-python {llama_cpp.__version__})": LlamaCpp(path, args.threads),
        "reference engine, fp32 (dequantized)": Ours(path, quantized=False),
        'reference engine, quantized (`cpu_weights = "quantized"`)': Ours(path, quantized=True),
    }
    ids = next(i for i in impls.values() if isinstance(i, Ours)).tokenizer.encode(PROMPT)
    for impl in impls.values():
        impl.generate(ids, 8)  # warm-up
    runs: dict[str, list[float]] = {k: [] for k in impls}
    others: dict[str, float] = dict.fromkeys(impls, 0.0)
    streams: dict[str, list[int]] = {}
    for _ in range(args.repeat):
        for name, impl in impls.items():
            out, wall, busy = timed(impl.generate, ids, args.new_tokens)
            assert len(out) == args.new_tokens, (name, len(out))
            runs[name].append(args.new_tokens / wall)
            others[name] = max(others[name], busy)
            streams[name] = out
    reference = streams["reference engine, fp32 (dequantized)"]
    best = statistics.median(runs[next(iter(impls))])
    lines = [
        f"# Batch-1 CPU decode: llama.cpp vs the reference engine ({path.name})",
        "",
        f"- date: {dt.date.today()}; machine: {platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
        f"{args.threads} threads for every implementation (torch intra-op, llama.cpp n_threads/n_threads_batch)",
        f"- command: `.venv/bin/python bench/cpu_vs_llamacpp.py --threads {args.threads} --new-tokens "
        f"{args.new_tokens} --repeat {args.repeat}`",
        f"- greedy, {args.new_tokens} new tokens, prompt of {len(ids)} tokens (same ids for all); tok/s = new tokens / "
        f"wall time, prefill included; median of {args.repeat} interleaved runs; load average at the start "
        f"{load_avg:.2f}",
        "",
        "| implementation | load (s) | tok/s batch 1 | runs | vs llama.cpp | greedy stream differs from fp32 at | "
        "other processes (cores) |",
        "| --- | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    for name, impl in impls.items():
        med = statistics.median(runs[name])
        lines.append(
            f"| {name} | {impl.load_s:.1f} | {med:.1f} | {', '.join(f'{r:.1f}' for r in runs[name])} | "
            f"{med / best:.2f}x | {first_difference(streams[name], reference)} | {others[name]:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
