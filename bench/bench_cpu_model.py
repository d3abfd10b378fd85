"""CPU tokens/s of SmolLM2-135M-Instruct (GGUF) with the reference engine vs HF transformers.

Measures, on this machine, in fp32, greedy, ignore_eos so every run generates the same count:
- load time: our GGUF loader + tokenizer vs transformers' own GGUF loading (model + tokenizer);
- decode throughput at batch 1 and batch 8 (generated tokens / wall time, prefill included).

    .venv/bin/python bench/bench_cpu_model.py [--new-tokens 128] [--out bench/results/FILE.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import time

import torch

from blink_appliance.engine.llm_engine import EngineConfig, LLMEngine
from blink_appliance.engine.request import Request, SamplingParams
from blink_appliance.model.loaders import build_model, load_checkpoint
from blink_appliance.model.loaders.model_registry import resolve

PROMPT = "Explain, step by step, how a paged KV cache lets an LLM server batch many requests at once."


def ours(path, new_tokens: int) -> dict[str, float]:
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
        reqs = [Request(i, list(ids), params) for i in range(batch)]
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        dt_s = time.perf_counter() - t0
        assert all(len(v) == new_tokens for v in out.values())
        result[f"tok_s_b{batch}"] = batch * new_tokens / dt_s
    return result


def hf(path, new_tokens: int) -> dict[str, float]:
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
            t0 = time.perf_counter()
            model.generate(x, attention_mask=torch.ones_like(x), **kw)
            result[f"tok_s_b{batch}"] = batch * new_tokens / (time.perf_counter() - t0)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = resolve("smollm2-135m-instruct")
    torch.manual_seed(0)
    rows = {
        "blink-appliance (reference engine)": ours(path, args.new_tokens),
        f"transformers {__import__('transformers').__version__} generate()": hf(path, args.new_tokens),
    }
    lines = [
        "# CPU reference engine vs transformers: SmolLM2-135M-Instruct (Q4_1 GGUF, fp32)",
        "",
        f"- date: {dt.date.today()}; machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        f"- command: `.venv/bin/python bench/bench_cpu_model.py --new-tokens {args.new_tokens}`",
        f"- greedy, ignore_eos, {args.new_tokens} new tokens per request, prompt of {PROMPT.count(' ') + 1} words; "
        "tok/s = generated tokens / wall time (prefill included)",
        "",
        "| implementation | load (s) | tok/s batch 1 | tok/s batch 8 |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['load_s']:.1f} | {r['tok_s_b1']:.1f} | {r['tok_s_b8']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
