"""The loop's write order under load (issue 20, defect 12): payload_waits over a million tokens.

On the GPU (one command; `dummy:llama-3.2-1b` bf16, random weights with the real shapes):
    python3 -m pip install -q --no-deps .whl/*.whl && python3 -m pip install -q --no-deps --no-build-isolation -e . && PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/payload_order.py --out $OUT/payload_order.json
CPU smoke check of the script itself (reference engine, dummy:tiny):
    .venv/bin/python bench/payload_order.py --device cpu --geometry 256/8/8/64 --concurrency 4 --tokens 400 --max-tokens 20 --out /tmp/po.json

`blink-appliance up` serves one geometry (bench/http_sweep.py's profile). For each --concurrency,
that many clients send /v1/completions requests back to back (token-id prompts, --max-tokens each,
ignore_eos; every --stream-every-th one streams, the rest do not, so the client keeps up) until
--tokens tokens have come back. The front end counts every token whose count it saw before its
payload (`blink_ring_payload_waits_total` in /metrics, docs/protocol.md "Publication order"); the
counter is read before and after each run. Any wait, or any failed request, exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.http_sweep import MODEL_NAME, Geometry, appliance_server, gpu_name, model_defaults  # noqa: E402
from bench.server_process import ServerStartError  # noqa: E402

COUNTERS = ("blink_ring_payload_waits_total", "blink_generation_tokens_total")


def counters(url: str) -> dict[str, float]:
    """The two Prometheus counters, summed over their labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> int:
    """Tokens received; raises on any failure, including a stream that ends without [DONE]."""
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        if not body["stream"]:
            return int((await r.json())["usage"]["completion_tokens"])
        tokens, done = 0, False
        async for raw in r.content:
            line = raw.strip()
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error']}")
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
        if not done:
            raise RuntimeError("stream ended without [DONE]")
        return tokens


async def run(url: str, concurrency: int, args: argparse.Namespace) -> dict:
    """`concurrency` clients, each sending requests back to back until the token target is met."""
    rng = random.Random(args.seed + concurrency)
    received, requests, failures = 0, 0, []

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal received, requests
        while received < args.tokens and len(failures) < 10:
            requests += 1
            body = {
                "model": MODEL_NAME, "prompt": [rng.randrange(3, args.vocab) for _ in range(args.input_len)],
                "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.0,
                "stream": requests % args.stream_every == 0, "stream_options": None,
            }  # fmt: skip
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            else:
                del body["stream_options"]
            try:
                got = await one_request(session, url, body)  # not `received += await`: that reads it first
                received += got
            except Exception as e:  # noqa: BLE001 - every failure is reported, none is fatal here
                failures.append(f"{type(e).__name__}: {e}"[:300])

    before, t0 = counters(url), time.monotonic()
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    wall, after = time.monotonic() - t0, counters(url)
    waits = after[COUNTERS[0]] - before[COUNTERS[0]]
    generated = after[COUNTERS[1]] - before[COUNTERS[1]]
    return {
        "concurrency": concurrency, "requests": requests, "failed": len(failures), "failures": failures[:5],
        "tokens_received": received, "tokens_generated": int(generated), "payload_waits": int(waits),
        "wall_s": round(wall, 1), "tokens_per_s": round(received / wall),
    }  # fmt: skip


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu: the reference engine, dummy:tiny")
    ap.add_argument("--model", default=None, help="default dummy:llama-3.2-1b (cpu: dummy:tiny)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (cpu: float32)")
    ap.add_argument("--geometry", default="8192/1024/256/2048", help="mml/slots/seqs/budget")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--tokens", type=int, default=1_000_000, help="tokens per concurrency")
    ap.add_argument("--max-tokens", type=int, default=1000, help="tokens per request")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--stream-every", type=int, default=4, help="every N-th request streams")
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    return model_defaults(ap.parse_args())


def main() -> int:
    args = arguments()
    geo = Geometry.parse(args.geometry)
    report: dict = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": gpu_name(args.device), "model": args.model, "dtype": args.dtype, "geometry": geo.spec,
        "command": " ".join(sys.argv), "runs": [],
    }  # fmt: skip
    server, _ = appliance_server(geo, args, args.out.parent / f"{args.out.stem}.log")
    try:
        server.start(args.startup_timeout)
        report["startup_s"] = round(server.ready_after_s or 0.0, 1)
        for c in args.concurrency:
            result = asyncio.run(run(server.url, min(c, geo.max_seqs), args))
            report["runs"].append(result)
            print(f"[payload_order] {json.dumps(result)}", file=sys.stderr, flush=True)
            args.out.write_text(json.dumps(report, indent=1))
    except ServerStartError as e:
        report["error"] = str(e)
    finally:
        report["exit_code"] = server.stop(30.0)
        args.out.write_text(json.dumps(report, indent=1))
    print("| concurrency | requests | tokens | payload waits | failed | tok/s |\n|---|---|---|---|---|---|")
    for r in report["runs"]:
        print(
            f"| {r['concurrency']} | {r['requests']} | {r['tokens_received']} | {r['payload_waits']} "
            f"| {r['failed']} | {r['tokens_per_s']} |"
        )
    bad = "error" in report or any(r["payload_waits"] or r["failed"] for r in report["runs"])
    return 1 if bad or len(report["runs"]) < len(args.concurrency) else 0


if __name__ == "__main__":
    sys.exit(main())
