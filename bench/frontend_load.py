"""Who spends the CPU when many streams decode at once: front end, engine, client (issue 18, batch 64).

On the GPU (one command; scripts/device_wheels.sh puts py-spy in .whl/ for the profile, optional):
    python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/frontend_load.py --out $OUT/frontend_load.json
CPU smoke check of the script itself (reference engine, dummy:tiny):
    .venv/bin/python bench/frontend_load.py --device cpu --geometry 256/8/8/64 --batch 4 --output-len 16 --seconds 5 --out /tmp/fl.json

`blink-appliance up` serves one geometry (bench/http_sweep.py's profile). Waves of --batch
concurrent streaming requests (--output-len tokens, ignore_eos, greedy) run for --seconds; the CPU
time of the front-end process, the engine process and this client (/proc/<pid>/stat) is read
before and after, so each is a share of one core. With py-spy installed, the front end is sampled
meanwhile and its hottest leaf frames and its own functions (inclusive) are listed. TPOT is per
request, first token to last, as http_sweep measures it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.http_sweep import (  # noqa: E402
    MODEL_NAME,
    Geometry,
    appliance_server,
    gpu_name,
    model_defaults,
    ms,
    prompts,
    request_tpot_s,
)
from blink_appliance.bench.load_generator import LoadConfig, run_load  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def child_pid(module: str) -> int | None:
    """The pid of the process running `python -m <module>` (the daemon's children)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"-m" in argv and module.encode() in argv:
                return int(entry.name)
    return None


def cpu_s(pid: int) -> float:
    """utime + stime of `pid`, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def folded_summary(path: Path, own: str, top: int) -> dict:
    """py-spy's raw (folded) samples: the hottest leaf frames, and the front end's own functions by
    inclusive share (a frame counted once per sample)."""
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]  # by function
        total += n
        leaf[frames[-1]] += n
        for frame in set(frames):
            if own in frame:
                inclusive[frame] += n

    def share(c: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(f[:140], round(100 * k / max(total, 1), 1)) for f, k in c.most_common(top)]

    return {"samples": total, "leaf_pct": share(leaf), "own_inclusive_pct": share(inclusive)}


async def waves(url: str, args: argparse.Namespace, seconds: float) -> list:
    rng, records, until = random.Random(args.seed), [], time.monotonic() + seconds
    while time.monotonic() < until:
        config = LoadConfig(
            base_url=url, model=MODEL_NAME, temperature=0.0, ignore_eos=True, request_timeout_s=120
        )
        reqs = prompts(args.batch, args.input_len, args.output_len, args.vocab, rng)
        records += (await run_load(reqs, config)).records
    return records


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model", default=None, help="default dummy:llama-3.2-1b (cpu: dummy:tiny)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--geometry", default="8192/1024/256/2048")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    return model_defaults(ap.parse_args())


def main() -> int:
    args = arguments()
    geo = Geometry.parse(args.geometry)
    report: dict = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "gpu": gpu_name(args.device),
        "model": args.model, "geometry": geo.spec, "batch": args.batch, "command": " ".join(sys.argv),
    }  # fmt: skip
    server, _ = appliance_server(geo, args, args.out.parent / f"{args.out.stem}.log")
    server.start(300)
    try:
        asyncio.run(waves(server.url, args, 0.1))  # one warm-up wave
        pids = {
            "frontend": child_pid("blink_appliance.frontend"),
            "engine": child_pid("blink_appliance.engine.process"),
        }
        spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        folded = args.out.parent / f"{args.out.stem}-frontend.folded"
        sampler = None
        if spy and pids["frontend"]:
            sampler = subprocess.Popen(
                [spy, "record", "-p", str(pids["frontend"]), "-d", str(int(args.seconds)), "-r", "200",
                 "-f", "raw", "-o", str(folded), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
        before = {k: cpu_s(p) for k, p in pids.items() if p}
        mine, t0 = time.process_time(), time.monotonic()
        records = asyncio.run(waves(server.url, args, args.seconds))
        wall = time.monotonic() - t0
        after = {k: cpu_s(p) for k, p in pids.items() if p}
        report["cpu_share_of_one_core"] = {k: round((after[k] - before[k]) / wall, 3) for k in before}
        report["cpu_share_of_one_core"]["client"] = round((time.process_time() - mine) / wall, 3)
        done = [r for r in records if r.ok]
        tokens = sum(r.output_tokens for r in done)
        tpots = [t for r in done if (t := request_tpot_s(r)) is not None]
        report |= {
            "requests": len(records), "failed": len(records) - len(done), "wall_s": round(wall, 1),
            "failures": sorted({r.error or "unknown" for r in records if not r.ok})[:3],
            "tokens_per_s": round(tokens / wall), "tpot_p50_ms": ms(tpots, 50), "tpot_p99_ms": ms(tpots, 99),
        }  # fmt: skip
        if sampler is not None:
            _, err = sampler.communicate(timeout=args.seconds + 60)
            if folded.exists():
                report["frontend_profile"] = folded_summary(folded, "frontend/", 25) | {
                    "own_blink": folded_summary(folded, "blink_appliance/", 25)["own_inclusive_pct"]
                }
            else:
                report["frontend_profile"] = {"error": err[-500:]}
    finally:
        report["exit_code"] = server.stop(30.0)
        args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "frontend_profile"}, indent=1))
    for key in ("leaf_pct", "own_inclusive_pct", "own_blink"):
        for frame, pct in report.get("frontend_profile", {}).get(key, [])[:15]:
            print(f"{key:18} {pct:5.1f}%  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
