"""bench/compare: loop mode vs host-driven mode vs HF transformers, isolated and under co-located load.

One command for one device call (under 10 minutes). For each system in turn:
  1. start it: `blink-appliance up` on a profile generated for its engine mode (`loop`, `host`, or
     `reference` on the CPU), or the HF transformers baseline server (hf_baseline.py);
  2. warm it up, unmeasured: one request alone, then a burst of --max-concurrency short requests;
  3. for each request rate: an isolated run, then the same requests again under `bench interfere`
     load (colocated). Each run is `bench serve` (serve.run_serve): random token-id prompts of
     --input-len tokens, --output-len tokens each (ignore_eos), greedy, Poisson arrivals at the
     rate for --duration seconds (rate inf: --inf-prompts released at once), at most
     --max-concurrency in flight; TTFT / TPOT / throughput, NVML energy, the server's host CPU;
  4. stop it (SIGTERM: the appliance drains).
The raw JSON is rewritten after every run, so a call cut off at its limit keeps what it measured;
the Markdown table and the PNG plot (compare_report.py) are rewritten after every system.

The plan (core layout, profiles) is compare_plan.py, the run loop compare_run.py, the raw JSON
compare_document.py; this module is the command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: python3 bench/compare.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare_document import build_document, gpu_slug, machine_info  # noqa: E402
from bench.compare_plan import (  # noqa: E402
    APPLIANCE_MODES,
    CompareConfig,
    RunShape,
    core_layout,
    interference_spec,
    plan_systems,
)
from bench.compare_run import Budget, SystemRecord, run_system, say  # noqa: E402


def _rates(text: str) -> tuple[float, ...]:
    from blink_appliance.bench.serve import parse_rates

    return parse_rates(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/compare.py",
        description="Loop mode vs host mode vs HF transformers, isolated and under co-located CPU load: "
        "one command writing <out-dir>/<date>-<gpu>.{md,json,png}.",
    )
    p.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for the toy path (default cuda:0)")
    p.add_argument(
        "--model", default=None, help="dummy: preset (default dummy:llama-3.2-1b; cpu: dummy:tiny)"
    )
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument(
        "--modes", default=None, help="appliance engine modes, or none (default loop,host; cpu: reference)"
    )
    p.add_argument("--no-hf", dest="hf", action="store_false", help="leave out the HF transformers baseline")
    p.add_argument(
        "--rates", default="8,32,inf", help="request rates per run, inf = all at once (default 8,32,inf)"
    )
    p.add_argument(
        "--hf-rates", default=None, help="rates for the HF baseline (default: the first of --rates)"
    )
    p.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per run (default 15)")
    p.add_argument(
        "--inf-prompts", type=int, default=None, help="requests of a rate-inf run (4 x concurrency)"
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens, ignore_eos (default 128)")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most (default 64)")
    p.add_argument(
        "--max-seqs", type=int, default=None, help="appliance max_seqs (default: --max-concurrency)"
    )
    p.add_argument("--step-tokens", type=int, default=512, help="appliance max_num_batched_tokens (512)")
    p.add_argument(
        "--interfere",
        default="auto",
        help="co-located load: auto (a spinner per interference core, memory=2, syscall=2) or a "
        "bench interfere spec such as spin=4,memory=1,syscall=1",
    )
    p.add_argument("--memory-mib", type=int, default=128, help="each memory thrasher's buffers (128 MiB x2)")
    p.add_argument("--budget-s", type=float, default=510.0, help="the whole command's time (default 510)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to come up")
    p.add_argument("--request-timeout", type=float, default=120.0, help="per request at most (default 120)")
    p.add_argument("--drain-allowance", type=float, default=None, help="run time after the last arrival (10)")
    p.add_argument("--hf-duration", type=float, default=10.0, help="HF baseline: seconds of arrivals (10)")
    p.add_argument("--hf-request-timeout", type=float, default=60.0, help="HF baseline: per request (60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"), help="default bench/results")
    p.add_argument("--name", default=None, help="file stem (default <date>-<gpu>)")
    return p


def config_from_args(args: argparse.Namespace) -> CompareConfig:
    cpu = args.device == "cpu"
    if not cpu and not args.device.startswith("cuda:"):
        raise ValueError(f"--device: expected cuda:N or cpu, got {args.device!r}")
    text = args.modes if args.modes is not None else ("reference" if cpu else "loop,host")
    modes = () if text == "none" else tuple(m.strip() for m in text.split(",") if m.strip())
    if not modes and not args.hf:
        raise ValueError("nothing to run: --modes none with --no-hf")
    for mode in modes:
        if mode not in APPLIANCE_MODES:
            raise ValueError(f"--modes: {mode!r} is not one of {', '.join(APPLIANCE_MODES)}")
    if "loop" in modes and cpu:
        raise ValueError("--modes loop needs a CUDA device (the graph-resident loop cannot run on the CPU)")
    if "reference" in modes and not cpu:
        raise ValueError("--modes reference runs on --device cpu only")
    rates = _rates(args.rates)
    finite = [r for r in rates if not math.isinf(r)]
    hf_rates = _rates(args.hf_rates) if args.hf_rates else ((finite or list(rates))[0],)
    max_concurrency = args.max_concurrency
    if min(max_concurrency, args.input_len, args.output_len, args.duration, args.hf_duration) <= 0:
        raise ValueError("--max-concurrency, --input-len, --output-len and the durations must be positive")
    inf_prompts = args.inf_prompts or 4 * max_concurrency
    drain = args.drain_allowance if args.drain_allowance is not None else (5.0 if cpu else 10.0)
    cfg = CompareConfig(
        device=args.device,
        model=args.model or ("dummy:tiny" if cpu else "dummy:llama-3.2-1b"),
        dtype=args.dtype or ("float32" if cpu else "bfloat16"),
        modes=modes,
        hf=args.hf,
        rates=rates,
        hf_rates=hf_rates,
        appliance_runs=RunShape(args.duration, inf_prompts, drain, args.request_timeout),
        # generate() in static batches drains slower: a longer allowance, fewer requests, a tighter cap.
        hf_runs=RunShape(args.hf_duration, inf_prompts, 3 * drain, args.hf_request_timeout),
        input_len=args.input_len,
        output_len=args.output_len,
        max_concurrency=max_concurrency,
        max_seqs=args.max_seqs or max_concurrency,
        step_tokens=max(args.step_tokens, args.max_seqs or max_concurrency),
        interfere=args.interfere,
        memory_mib=args.memory_mib,
        budget_s=args.budget_s,
        startup_timeout_s=args.startup_timeout,
        seed=args.seed,
        out_dir=args.out_dir,
        stem=args.name,
    )
    _ = cfg.preset  # a bad --model fails here, before anything starts
    return cfg


def run_compare(cfg: CompareConfig, argv: list[str]) -> tuple[dict[str, Any], dict[str, Path]]:
    """Every system, every run; returns the document and the files written."""
    import tempfile

    from bench.compare_report import write_outputs

    budget = Budget(cfg.budget_s)
    started_unix = time.time()
    layout = core_layout(sorted(os.sched_getaffinity(0)))
    interference = interference_spec(cfg.interfere, layout, cfg.memory_mib)
    machine = machine_info(cfg)
    stem = cfg.stem or f"{time.strftime('%Y-%m-%d', time.localtime(started_unix))}-{gpu_slug(machine)}"
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    say(f"{cfg.model} {cfg.dtype} on {cfg.device}; layout: {layout.note}")
    say(f"interference when colocated: {interference.describe_workers()}")
    work_dir = Path(tempfile.mkdtemp(prefix="blink-compare-"))
    plans = plan_systems(cfg, layout, work_dir)
    planned = sum(p.shape.expected_run_s(r, c) for p in plans for r in p.rates for c in (False, True))
    say(
        f"plan: {', '.join(p.name for p in plans)}; runs about {planned:.0f} s plus start-ups; budget {cfg.budget_s:.0f} s"
    )
    records: list[SystemRecord] = []
    files: dict[str, Path] = {}

    def document() -> dict[str, Any]:
        return build_document(
            cfg, argv, machine, layout, interference, records, started_unix, budget.elapsed_s
        )

    def write_json() -> None:
        path = cfg.out_dir / f"{stem}.json"
        path.write_text(json.dumps(document(), indent=1, allow_nan=False) + "\n")
        files["json"] = path

    for plan in plans:
        log_path = cfg.out_dir / f"{stem}-{plan.name}.log"
        rec = SystemRecord(plan)
        records.append(rec)
        run_system(cfg, rec, layout, interference, budget, log_path, write_json)
        write_json()
        files.update(write_outputs(document(), cfg.out_dir, stem))
    return document(), files


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc, files = run_compare(cfg, argv)
    if "md" in files:  # the whole report on stdout too: the device call's output shows it
        print(files["md"].read_text())
    for kind in ("md", "json", "png"):
        if kind in files:
            print(f"wrote {files[kind]}")
    measured = [r for s in doc["systems"] for r in s["runs"] if r["result"] is not None]
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
