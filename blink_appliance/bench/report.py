"""The printed table and the JSON document of a `bench serve` result.

JSON: {"version", "argv", "config": {...}, "warmup_failures", "runs": [{"request_rate", "metrics",
"cost", "interference", "requests": [...]}]}. Rates are numbers, or the string "inf" (JSON has no
infinity). Latencies are milliseconds; per-request ITLs only with --save-detailed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from blink_appliance.bench.load_generator import RequestRecord
from blink_appliance.bench.serve import RateRun, ServeResult

RESULT_VERSION = 1
CLIENT_BUSY_PERCENT = 80.0  # above this, the client is a suspect in the latencies


def _rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def request_dict(r: RequestRecord, detailed: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": r.index,
        "ok": r.ok,
        "error": r.error,
        "http_status": r.http_status,
        "finish_reason": r.finish_reason,
        "input_len_expected": r.input_len_expected,
        "output_len_requested": r.output_len_requested,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "usage_reported": r.usage_reported,
        "output_tokens": r.output_tokens,
        "text_chunks": len(r.chunk_times_s),
        "scheduled_s": r.scheduled_s,
        "start_s": r.start_s,
        "ttft_ms": _ms(r.ttft_s),
        "tpot_ms": _ms(r.tpot_s),
        "e2e_ms": _ms(r.e2e_s),
    }
    if detailed:
        out["itl_ms"] = [gap * 1000.0 for gap in r.itls_s]
    return out


def run_dict(run: RateRun, detailed: bool) -> dict[str, Any]:
    return {
        "request_rate": _rate(run.rate),
        "started_unix": run.load.started_unix,
        "metrics": run.metrics.to_dict(),
        "cost": run.cost.to_dict(),
        "interference": None
        if run.interference is None
        else [{**dataclasses.asdict(w), "rate": w.rate} for w in run.interference],
        "requests": [request_dict(r, detailed) for r in run.load.records],
    }


def result_document(result: ServeResult) -> dict[str, Any]:
    o = result.options
    return {
        "version": RESULT_VERSION,
        "argv": result.argv,
        "config": {
            "base_url": o.load.base_url,
            "model": o.load.model,
            "endpoint": o.load.endpoint,
            "dataset": str(o.dataset),
            "num_prompts": o.num_prompts,
            "input_len": str(o.input_len),
            "output_len": str(o.output_len) if o.output_len is not None else "from the data",
            "tokenizer": o.tokenizer,
            "arrivals": o.load.arrivals,
            "request_rates": [_rate(r) for r in o.rates],
            "max_concurrency": o.load.max_concurrency,
            "ignore_eos": o.load.ignore_eos,
            "temperature": o.load.temperature,
            "seed": o.load.seed,
            "slo": dataclasses.asdict(o.slo),
            "warmup": o.warmup,
            "interference": None if o.interference is None else dataclasses.asdict(o.interference),
        },
        "warmup_failures": result.warmup_failures,
        "runs": [run_dict(run, o.save_detailed) for run in result.runs],
    }


def write_json(result: ServeResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_document(result), indent=1, allow_nan=False) + "\n")


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def format_table(result: ServeResult) -> str:
    """One row per request rate; latencies in ms."""
    headers = [
        "rate",
        "ok/fail",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "ITL p99",
        "E2E p99",
        "goodput",
        "J/tok",
        "CPU s/1k tok",
    ]
    rows = []
    for run in result.runs:
        m, c = run.metrics, run.cost
        rows.append(
            [
                "inf" if math.isinf(run.rate) else f"{run.rate:g}",
                f"{m.completed}/{m.failed}",
                f"{m.request_throughput:.2f}",
                f"{m.output_throughput:.1f}",
                _num(m.ttft_ms.p50),
                _num(m.ttft_ms.p99),
                _num(m.tpot_ms.p50),
                _num(m.tpot_ms.p99),
                _num(m.itl_ms.p99),
                _num(m.e2e_ms.p99),
                _num(m.goodput, "{:.2f}"),
                _num(c.joules_per_output_token, "{:.3f}"),
                _num(c.server_cpu_s_per_1k_tokens, "{:.2f}"),
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    notes = []
    first = result.runs[0] if result.runs else None
    if first is not None:
        if first.cost.gpu_unavailable:
            notes.append(f"J/tok n/a: {first.cost.gpu_unavailable}")
        if first.cost.server_cpu_unavailable:
            notes.append(f"CPU s/1k tok n/a: {first.cost.server_cpu_unavailable}")
        elif first.cost.server_found_by:
            notes.append(
                f"server processes: {first.cost.server_found_by} ({len(first.cost.server_pids)} pids)"
            )
    for run in result.runs:
        m = run.metrics
        if run.cost.client_cpu_percent > CLIENT_BUSY_PERCENT:
            notes.append(
                f"rate {_rate(run.rate)}: this load generator used {run.cost.client_cpu_percent:.0f}% of a "
                "core; its latencies include its own delays (fewer requests in flight, or a faster core)"
            )
        if m.failure_reasons:
            reason, count = next(iter(m.failure_reasons.items()))
            notes.append(f"rate {_rate(run.rate)}: {m.failed} failed; most often ({count}x): {reason}")
        if m.completed and not m.output_tokens_from_usage:
            notes.append(f"rate {_rate(run.rate)}: the server sent no usage; output tokens are text chunks")
        if m.output_len_mismatches:
            notes.append(
                f"rate {_rate(run.rate)}: {m.output_len_mismatches} request(s) got output tokens != max_tokens"
            )
    if not result.options.slo.given:
        notes.append("goodput n/a: no SLO given (--slo-ttft-ms / --slo-tpot-ms)")
    return "\n".join(lines + [f"  {n}" for n in notes])
