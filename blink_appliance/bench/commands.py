"""`blink-appliance bench serve|interfere`: arguments and the two command functions.

Only argparse at import time: the CLI builds its parser on every call.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def _numbers(text: str, what: str) -> tuple[int, ...]:
    """Numbers from "0-3,8,10-11" -> (0, 1, 2, 3, 8, 10, 11), each once."""
    numbers: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, sep, hi = part.partition("-")
            numbers.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < 0:
        raise argparse.ArgumentTypeError(f"expected {what} like 0-3,8, got {text!r}")
    return tuple(dict.fromkeys(numbers))


def _cpu_list(text: str) -> tuple[int, ...]:
    return _numbers(text, "CPU numbers")


def _gpu_list(text: str) -> tuple[int, ...]:
    return _numbers(text, "NVML GPU indices")


def _pid_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected pids like 1234,1240, got {text!r}") from None


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: serving load against an endpoint, co-located CPU load")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    serve = bsub.add_parser(
        "serve",
        help="load an OpenAI-compatible endpoint and report throughput, latency percentiles, cost",
        description="Send a dataset of streaming requests at one or more request rates to any "
        "OpenAI-compatible server and report request and token throughput, TTFT / TPOT / ITL / E2E "
        "percentiles, goodput under an SLO, failures, GPU J/token and the server's host CPU seconds.",
    )
    s = serve.add_argument_group("endpoint")
    s.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"server root (default {DEFAULT_BASE_URL})")
    s.add_argument("--model", required=True, help="model name sent in each request")
    s.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=["/v1/completions", "/v1/chat/completions"],
        help="default /v1/completions",
    )
    s.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY or $BLINK_API_KEY)")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    d = serve.add_argument_group("dataset")
    d.add_argument(
        "--dataset",
        default="synthetic",
        help="synthetic (text of exact token lengths), random (token-id prompts, /v1/completions), "
        "or sharegpt:PATH (default synthetic)",
    )
    d.add_argument("--num-prompts", type=int, default=100, help="requests per rate (default 100)")
    d.add_argument("--input-len", default="128", help="prompt tokens: N or LOW-HIGH (default 128)")
    d.add_argument(
        "--output-len",
        default=None,
        help="max_tokens: N or LOW-HIGH (default 128; sharegpt: the reply's length)",
    )
    d.add_argument(
        "--tokenizer",
        default=None,
        help="model source of the tokenizer (named model, gguf:FILE, hf:DIR; default: --model)",
    )
    d.add_argument("--vocab-size", type=int, default=None, help="random dataset without a tokenizer")
    d.add_argument("--max-model-len", type=int, default=None, help="sharegpt: skip longer conversations")
    d.add_argument("--seed", type=int, default=0, help="dataset and arrival seed (default 0)")
    g = serve.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        default="inf",
        help="requests/s; a comma list sweeps (e.g. 1,2,4); inf sends all at once (default inf)",
    )
    g.add_argument("--arrivals", default="poisson", choices=["poisson", "fixed"], help="default poisson")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent first (default 1)")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so outputs are exactly --output-len (default on)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    g.add_argument(
        "--interfere",
        default=None,
        metavar="SPEC",
        help="co-located load during each run, e.g. spin=4,memory=1,syscall=2 (see bench interfere)",
    )
    g.add_argument("--interfere-cpus", type=_cpu_list, default=None, help="pin the interference, e.g. 2-7")
    g.add_argument("--client-cpus", type=_cpu_list, default=None, help="pin this load generator, e.g. 0")
    r = serve.add_argument_group("results")
    r.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT limit")
    r.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT limit")
    r.add_argument("--server-pids", type=_pid_list, default=None, help="server processes for CPU accounting")
    r.add_argument(
        "--gpu-index", type=_gpu_list, default=(0,),
        help="NVML indices of the server's GPUs, e.g. 0,1 for two ranks; their energy adds up (default 0)",
    )  # fmt: skip
    r.add_argument("--no-gpu-energy", action="store_true", help="do not read the GPU energy counter")
    r.add_argument("--result-json", type=Path, default=None, help="write the full result here")
    r.add_argument("--save-detailed", action="store_true", help="per-request ITLs in the JSON")
    serve.set_defaults(func=cmd_bench_serve)

    interfere = bsub.add_parser(
        "interfere",
        help="bounded co-located CPU load (spinners, memory thrasher, context-switch storm)",
        description="Run co-located CPU load for a fixed time, then stop by itself (Ctrl-C stops it "
        "early; its processes also end if this one dies).",
    )
    interfere.add_argument("--spin", type=int, default=0, help="processes spinning on a core each")
    interfere.add_argument("--memory", type=int, default=0, help="memory-bandwidth thrashing processes")
    interfere.add_argument("--memory-mib", type=int, default=128, help="buffer size per memory process (x2)")
    interfere.add_argument(
        "--syscall", type=int, default=0, help="ping-pong process pairs (context switches)"
    )
    interfere.add_argument("--duration", type=float, default=30.0, help="seconds (default 30)")
    interfere.add_argument("--cpus", type=_cpu_list, default=None, help="pin the workers, e.g. 2-7")
    interfere.set_defaults(func=cmd_bench_interfere)


def _api_key(args: argparse.Namespace) -> str | None:
    import os

    return args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("BLINK_API_KEY")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from blink_appliance.bench.datasets import DatasetSpec, LengthRange
    from blink_appliance.bench.interference import InterferenceSpec
    from blink_appliance.bench.load_generator import LoadConfig
    from blink_appliance.bench.report import format_table, write_json
    from blink_appliance.bench.serve import ServeOptions, parse_rates, pin_client, run_serve
    from blink_appliance.bench.serving_metrics import SLO

    dataset = DatasetSpec.parse(args.dataset)
    if args.output_len is None:
        output_len = None if dataset.kind == "sharegpt" else LengthRange(128, 128)
    else:
        output_len = LengthRange.parse(args.output_len, "--output-len")
    load = LoadConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        api_key=_api_key(args),
        max_concurrency=args.max_concurrency,
        arrivals=args.arrivals,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        request_timeout_s=args.request_timeout,
    )
    if args.client_cpus is not None and args.interfere is not None and args.interfere_cpus is None:
        # Its processes would inherit this process's pinning and load the client's own cores.
        raise ValueError("--client-cpus with --interfere needs --interfere-cpus (cores away from the client)")
    if args.client_cpus is not None:
        pin_client(args.client_cpus)
    interference = None
    if args.interfere is not None:
        # Long enough for any run; each run stops it as soon as the run ends.
        interference = InterferenceSpec.parse(
            args.interfere, duration_s=24 * 3600.0, cpus=args.interfere_cpus
        )
    options = ServeOptions(
        load=load,
        rates=parse_rates(args.request_rate),
        dataset=dataset,
        num_prompts=args.num_prompts,
        input_len=LengthRange.parse(args.input_len, "--input-len"),
        output_len=output_len,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        max_model_len=args.max_model_len,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        warmup=args.warmup,
        server_pids=args.server_pids,
        gpu_index=None if args.no_gpu_energy else args.gpu_index,
        interference=interference,
        save_detailed=args.save_detailed,
        result_json=args.result_json,
    )
    result = run_serve(options, argv=sys.argv[1:])
    print(format_table(result))
    if args.result_json is not None:
        write_json(result, args.result_json)
        print(f"wrote {args.result_json}")
    failed = result.all_failed_runs
    if failed:
        rates = ", ".join("inf" if math.isinf(r.rate) else f"{r.rate:g}" for r in failed)
        print(f"error: every request failed at rate {rates}", file=sys.stderr)
        return 1
    return 0


def cmd_bench_interfere(args: argparse.Namespace) -> int:
    from blink_appliance.bench.interference import InterferenceSpec, run_interference

    spec = InterferenceSpec(
        duration_s=args.duration,
        spin=args.spin,
        memory=args.memory,
        syscall=args.syscall,
        memory_mib=args.memory_mib,
        cpus=args.cpus,
    )
    return run_interference(spec)
