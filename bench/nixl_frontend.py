"""The front end over NIXL against the shared-memory one (issue 23): TTFT and TPOT through HTTP, and
the engine host's CPU per 1k tokens with the ring agent (UCX's progress thread) counted.

On the GPU (one command; `dummy:llama-3.2-1b` bf16, random weights with the real shapes):
    python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/nixl_frontend.py --out $OUT/nixl_frontend.json
CPU smoke check of the script itself (reference engine, dummy:tiny; timings meaningless):
    .venv/bin/python bench/nixl_frontend.py --device cpu --geometry 256/8/8/64 --output-len 8 --out /tmp/nixl.json

Modes: "shm" is `blink-appliance up` with its own front end; "nixl-tcp" is `up` with
frontend.transport "nixl" (engines + ring agent) and `blink-appliance frontend` in a network
namespace behind a veth pair (as root; else on loopback), UCX forced to TCP, as on a host whose NIC has
no RDMA. Each case is waves of `batch` concurrent streaming requests (bench/http_sweep.py's client and
TPOT). CPU: user+system seconds of the engine host's processes (the daemon and its children: engines,
and the ring agent with its progress thread) over the case, per 1000 generated tokens; the front
end's own CPU is reported apart (on a DPU it is not the host's).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.http_sweep import (  # noqa: E402
    CASES,
    MODEL_NAME,
    Case,
    Geometry,
    gpu_name,
    model_defaults,
    one_geometry_parser,
    profile_text,
    run_case,
    say,
)
from bench.server_process import ServerProcess, ServerStartError  # noqa: E402
from blink_appliance.bench.interference import Interference, InterferenceSpec  # noqa: E402

BENCH_CASES = [Case("b1-greedy", 1, 0.0), Case("b16-greedy", 16, 0.0), CASES["b64-greedy"]]


def namespace() -> tuple[str | None, str, str]:
    """(netns, engine ip, front-end ip): a veth pair as root, else loopback."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return None, "127.0.0.1", "127.0.0.1"
    ns, a, b = "blinkbench", "bbh0", "bbf0"
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    subprocess.run(["ip", "link", "del", a], capture_output=True, check=False)
    steps = [
        f"ip netns add {ns}", f"ip link add {a} type veth peer name {b}", f"ip link set {b} netns {ns}",
        f"ip addr add 10.214.0.1/24 dev {a}", f"ip link set {a} up",
        f"ip netns exec {ns} ip addr add 10.214.0.2/24 dev {b}", f"ip netns exec {ns} ip link set {b} up",
        f"ip netns exec {ns} ip link set lo up",
    ]  # fmt: skip
    for step in steps:
        if subprocess.run(step.split(), capture_output=True, check=False).returncode:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            return None, "127.0.0.1", "127.0.0.1"
    return ns, "10.214.0.1", "10.214.0.2"


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def engine_host_pids(up: ServerProcess, exclude: int | None = None) -> list[int]:
    root = psutil.Process(up.proc.pid)  # type: ignore[union-attr]
    pids = [root.pid] + [c.pid for c in root.children(recursive=True)]
    return [p for p in pids if p != exclude]


def run_mode(mode: str, geo: Geometry, args: argparse.Namespace, net: tuple[str | None, str, str]) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"blink-{mode}-"))
    text = profile_text(geo, args, f"blink-nixl-bench-{os.getpid()}-{mode}")
    ns, engine_ip, frontend_ip = net
    if mode != "shm":
        (secret := work / "secret").write_text(secrets.token_hex(32))
        text = text.replace('host = "127.0.0.1"', f'host = "{frontend_ip}"\ntransport = "nixl"')
        text += (
            f'\n[dpu]\nlisten = "{engine_ip}"\nport = 7455\nsecret_file = "{secret}"\n'
            'ucx_transports = ["tcp", "cuda_copy"]\n'
        )
        if args.frontend_cpus:  # the DPU's cores, which the host's load cannot reach
            text = text.replace("\n[frontend]\n", f"\n[frontend]\ncpus = {list(args.frontend_cpus)}\n")
    (profile := work / "profile.toml").write_text(text)
    log = args.out.parent / f"{args.out.stem}-{mode}.log"
    cli = [sys.executable, "-m", "blink_appliance.cli"]
    up = ServerProcess(f"{mode} up", [*cli, "up", str(profile)], log, http=mode == "shm")
    fe: ServerProcess | None = None
    out: dict[str, Any] = {"mode": mode, "netns": ns, "cases": [], "error": None}
    try:
        up.start(args.startup_timeout)
        url, fe_pid = up.url, None
        if mode != "shm":
            argv = [*cli, "frontend", str(profile)]
            argv = ["ip", "netns", "exec", ns, *argv] if ns else argv
            fe = ServerProcess(f"{mode} frontend", argv, log.with_suffix(".frontend.log"))
            fe.start(120)
            url, fe_pid = fe.url, fe.proc.pid  # type: ignore[union-attr]
        else:
            fe_pid = next(
                c.pid for c in psutil.Process(up.proc.pid).children() if "frontend" in " ".join(c.cmdline())
            )  # type: ignore[union-attr]
        out["startup_s"] = round(up.ready_after_s or 0.0, 2)
        asyncio.run(run_case(url, Case("warm-up", 1, 0.0), 1, 1, args, time.monotonic() + 60))
        out["greedy_text"] = greedy_text(url, args)
        for case, load in planned_cases(mode, args):
            batch = min(case.batch, geo.max_seqs, args.batch_cap)
            host_pids = engine_host_pids(up, exclude=fe_pid)
            interference = Interference(load) if load is not None else None
            if interference is not None:
                interference.start()
            host0, fe0, t0 = cpu_seconds(host_pids), cpu_seconds([fe_pid]), time.monotonic()
            waves = max(1, args.requests // batch)
            try:
                result = asyncio.run(run_case(url, case, batch, waves, args, time.monotonic() + 120))
            finally:
                if interference is not None:
                    interference.stop()
            wall = time.monotonic() - t0
            tokens = result["completed"] * args.output_len
            host, front = cpu_seconds(host_pids) - host0, cpu_seconds([fe_pid]) - fe0
            result.update(
                wall_s=round(wall, 2), tokens=tokens,
                engine_host_cpu_s=round(host, 3), frontend_cpu_s=round(front, 3),
                engine_host_cpu_s_per_1k_tokens=round(1000 * host / max(tokens, 1), 4),
                frontend_cpu_s_per_1k_tokens=round(1000 * front / max(tokens, 1), 4),
            )  # fmt: skip
            if load is not None:
                result.update(case=f"{case.name}+load", load=load.describe_workers())
            out["cases"].append(result)
            say(f"[{mode}] {json.dumps(result)}")
    except ServerStartError as e:
        out["error"] = str(e)[-3000:]
        say(f"[{mode}] {out['error']}")
    finally:
        if fe is not None:
            fe.stop(30)
        out["exit_code"] = up.stop(30)
    return out


def planned_cases(mode: str, args: argparse.Namespace) -> list[tuple[Case, InterferenceSpec | None]]:
    """Every case alone, then batch 1 and 64 again beside the co-located load (--interference). The
    load may use every core but the bench client's and, with the front end off the host, the front
    end's (stand-ins for the DPU's own cores): on the shm front end's host it shares them."""
    plan: list[tuple[Case, InterferenceSpec | None]] = [(case, None) for case in BENCH_CASES]
    if args.interference:
        spared = set(args.client_cpus) | (set(args.frontend_cpus) if mode != "shm" else set())
        cpus = tuple(c for c in range(os.cpu_count() or 1) if c not in spared)
        spec = InterferenceSpec.parse(args.interference, duration_s=300.0, cpus=cpus)
        plan += [(case, spec) for case in BENCH_CASES if case.batch in (1, 64)]
    return plan


def greedy_text(url: str, args: argparse.Namespace) -> str:
    """One fixed greedy request's text: the same engine must answer it alike through either front end."""
    prompt = [3 + (i * 37) % (args.vocab - 3) for i in range(args.input_len)]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def table(report: dict) -> str:
    head = "| mode | case | TTFT P50 ms | TPOT P50 ms | TPOT P99 ms | engine-host CPU s / 1k tok | front-end CPU s / 1k tok |"
    rows = [head, "|" + "---|" * 7]
    for m in report["modes"]:
        for c in m["cases"]:
            rows.append(
                f"| {m['mode']} | {c['case']} | {c['ttft_p50_ms']} | {c['tpot_p50_ms']} | {c['tpot_p99_ms']} "
                f"| {c['engine_host_cpu_s_per_1k_tokens']} | {c['frontend_cpu_s_per_1k_tokens']} |"
            )
    return "\n".join(rows)


def _cpus(text: str) -> tuple[int, ...]:
    return tuple(int(c) for c in text.split(",") if c.strip())


def main() -> None:
    ap = one_geometry_parser(__doc__)
    ap.add_argument("--modes", nargs="+", default=["shm", "nixl-tcp"], choices=["shm", "nixl-tcp"])
    ap.add_argument("--requests", type=int, default=32, help="requests per case (waves of the batch)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--interference", default="", help="co-located load, e.g. spin=32 (default: none)")
    ap.add_argument("--client-cpus", type=_cpus, default=(), help="pin this bench's client here, e.g. 13")
    ap.add_argument("--frontend-cpus", type=_cpus, default=(), help="the NIXL front end's cores, e.g. 14,15")
    ap.add_argument(
        "--deterministic", action="store_true",
        help="[engine] deterministic = true: the default loop sums split-K partials with fp32 atomics, so "
        "two engine processes may break a near-tie of random weights' logits differently",
    )  # fmt: skip
    args = model_defaults(ap.parse_args())
    args.batch_cap = 8 if args.device == "cpu" else 1 << 30
    if args.client_cpus:
        os.sched_setaffinity(0, set(args.client_cpus))
    args.engine_lines = ["deterministic = true"] if args.deterministic else []
    geo = Geometry.parse(args.geometry)
    net = namespace() if "nixl-tcp" in args.modes else (None, "127.0.0.1", "127.0.0.1")
    report: dict[str, Any] = {
        "gpu": gpu_name(args.device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "geometry": geo.spec, "model": args.model, "dtype": args.dtype,
        "input_len": args.input_len, "output_len": args.output_len, "deterministic": args.deterministic,
        "interference": args.interference, "client_cpus": args.client_cpus, "frontend_cpus": args.frontend_cpus,
        "modes": [],
    }  # fmt: skip
    try:
        for mode in args.modes:
            report["modes"].append(run_mode(mode, geo, args, net))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    finally:
        if net[0]:
            subprocess.run(["ip", "netns", "del", net[0]], capture_output=True, check=False)
    texts = {m["mode"]: m.get("greedy_text") for m in report["modes"]}
    report["greedy_equal"] = len(set(texts.values())) == 1 and None not in texts.values()
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['gpu']}; {args.model} {args.dtype}; geometry {geo.spec}; netns {net[0]}")
    print(f"greedy text equal across modes: {report['greedy_equal']}")
    print(table(report))


if __name__ == "__main__":
    main()
