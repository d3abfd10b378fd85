"""Structured output: what a constrained step costs in the GPU loop, and what compiling a constraint
costs the front end.

On the H100 (one command; `dummy:llama-3.2-1b` bf16, random weights with the real shapes):
    python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/structured_output.py loop --out $OUT/structured_output.json
On the CPU (the front end's compile, SmolLM2's tokenizer):
    .venv/bin/python bench/structured_output.py compile

`loop`: the shipped geometry (8192/1024/256/2048) in the device loop, batch-64 greedy decode
(128-token prompts), TPOT P50/P99 from the ring's stamps: unconstrained, then every row constrained
by a one-state automaton that allows `--wide` tokens (a JSON string's state allows most of a
vocabulary) or 16 (a structural state) and never accepts. The model has no tokenizer, so the
automata are random ones over its vocabulary (the masks' cost follows the edges per state, not
what they spell); each stream is checked to follow its automaton.
`compile`: cold (a fresh compiler) and cached compile time of each test schema and of json_object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from blink_appliance.wire.automaton import TokenAutomaton  # noqa: E402
from blink_appliance.wire.request import SamplingParams  # noqa: E402


def automaton(vocab: int, eos: set[int], width: int, seed: int) -> TokenAutomaton:
    """One state that allows `width` random tokens and leads back to itself, never accepting: the
    row is masked every step and decodes to its max_tokens."""
    pool = [t for t in range(vocab) if t not in eos]
    return TokenAutomaton.from_transitions(
        0, {0: dict.fromkeys(random.Random(seed).sample(pool, width), 0)}, set(), eos
    )


async def loop_cases(args) -> dict:
    import torch

    from bench.prompt_scoring import drive, prompt, shipped_loop, stream
    from blink_appliance.model.loaders import load_checkpoint
    from blink_appliance.wire.ring_layout import EngineState

    ckpt = load_checkpoint(args.model, seed=0)
    # 64 wide automata in flight at once: a larger constraint area than the default
    rig = shipped_loop(ckpt, args.model, {}, {"constraint_words": 1 << 24})
    geometry = rig.step.geometry
    client = rig.client()
    eos, vocab = set(geometry.eos_token_ids), geometry.vocab_size
    out: dict = {
        "device": torch.cuda.get_device_name(0),
        "geometry": "8192/1024/256/2048",
        "batch": 64,
        "cases": {},
    }
    try:
        rig.heartbeat()
        rig.region.store("engine_state", EngineState.RUNNING)
        await client.start()
        rig.loop.launch()
        plain = SamplingParams(temperature=0.0, max_tokens=args.tokens)
        cases = [("plain", None), ("wide", args.wide), ("narrow", 16)] * args.repeats
        for name, width in cases:
            automata = [None] * 64
            if width is not None:
                automata = [automaton(vocab, eos, width, seed=i) for i in range(64)]
            jobs = [
                stream(client, prompt(10 + i, 128), dataclasses.replace(plain, constraint=automata[i]))
                for i in range(64)
            ]
            results = await drive(rig, asyncio.gather(*jobs))
            gaps = []
            for (_, events), a in zip(results, automata, strict=True):
                tokens = [e.token_id for e in events if e.token_id is not None]
                if a is not None:  # each token is an edge of the chain, so the stream follows it
                    state = a.initial
                    for t in tokens:
                        state = a.advance(state, t)
                        assert state is not None, f"{name}: token {t} outside the automaton"
                stamps = [e.timestamp_ns for e in events if e.token_id is not None][4:]
                gaps += [(b - a_) / 1e6 for a_, b in zip(stamps, stamps[1:], strict=False)]
            case = out["cases"].setdefault(name, {"p50": [], "p99": []})
            case["p50"].append(statistics.median(gaps))
            case["p99"].append(statistics.quantiles(gaps, n=100)[-1])
            print(f"{name}: TPOT P50 {case['p50'][-1]:.3f} ms, P99 {case['p99'][-1]:.3f} ms")
    finally:
        await client.close()
        rig.shut_down()
        gc.collect()
    base = statistics.median(out["cases"]["plain"]["p50"])
    for case in out["cases"].values():
        case["ratio_p50"] = statistics.median(case["p50"]) / base
    return out


def compile_times() -> dict:
    from blink_appliance.frontend.structured_output import ConstraintCompiler, constraint_regex

    from blink_appliance.model import registry
    from blink_appliance.model.tokenizer import Tokenizer
    from tests.test_structured_output import SCHEMAS

    tok = Tokenizer.from_gguf(registry.resolve("smollm2-135m-instruct"))
    formats = {name: {"type": "json_schema", "json_schema": {"schema": s}} for name, s in SCHEMAS.items()}
    formats["json_object"] = {"type": "json_object"}
    out = {"tokenizer": "SmolLM2-135M-Instruct (49152 tokens)", "schemas": {}}
    for name, fmt in formats.items():
        compiler = ConstraintCompiler(tok, tok.eos_token_ids, 1 << 24)
        compiler._vocab()  # the vocabulary is built once per model, at the first constraint
        t0 = time.perf_counter()
        regex, param = constraint_regex(fmt, None, None, None)
        a = compiler.compile(regex, param)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile(*constraint_regex(fmt, None, None, None))
        cached = time.perf_counter() - t0
        out["schemas"][name] = {
            "cold_s": cold,
            "cached_s": cached,
            "states": a.num_states,
            "words": a.num_words,
        }
        print(
            f"{name}: cold {cold:.3f} s, cached {cached * 1e3:.3f} ms, {a.num_states} states, {a.num_words} words"
        )
    t0 = time.perf_counter()
    ConstraintCompiler(tok, tok.eos_token_ids, 1 << 24)._vocab()
    out["vocabulary_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("loop", "compile"))
    ap.add_argument("--model", default="dummy:llama-3.2-1b")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--wide", type=int, default=60_000, help="tokens a wide state allows")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "structured_output.json")
    args = ap.parse_args()
    report = asyncio.run(loop_cases(args)) if args.what == "loop" else compile_times()
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
