"""The report of bench/compare: the issue's targets (met / missed, by how much), tables, a PNG plot.

Everything here reads the raw JSON document compare.py writes, so a report can be rendered again
from a results file: `python -m bench.compare_report RESULT.json`.

Targets (issue 7), as judged here:
- loop mode: P99 TPOT colocated / isolated <= 1.1 at every rate measured;
- host mode degrades visibly: its ratio reaches HOST_VISIBLE_RATIO at some rate (our reading of
  "visibly"; the table shows every ratio);
- loop mode output throughput >= host mode's in isolation at every rate, within
  THROUGHPUT_TOLERANCE (below saturation both deliver the offered load, so equal up to noise).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOOP_RATIO_LIMIT = 1.1
HOST_VISIBLE_RATIO = 1.25
THROUGHPUT_TOLERANCE = 0.02
LOADS = ("isolated", "colocated")


def _rate_key(rate: float | str) -> float:
    return math.inf if rate == "inf" else float(rate)


def rate_label(rate: float | str) -> str:
    r = _rate_key(rate)
    return "inf" if math.isinf(r) else f"{r:g}/s"


def _get(d: dict[str, Any] | None, *path: str) -> Any:
    for key in path:
        if d is None:
            return None
        d = d.get(key)
    return d


def system_named(doc: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((s for s in doc["systems"] if s["name"] == name), None)


def result_of(system: dict[str, Any], rate: float | str, load: str) -> dict[str, Any] | None:
    for run in system["runs"]:
        if _rate_key(run["rate"]) == _rate_key(rate) and run["load"] == load:
            return run["result"]
    return None


def p99_tpot(result: dict[str, Any] | None) -> float | None:
    return _get(result, "metrics", "tpot_ms", "p99")


def output_throughput(result: dict[str, Any] | None) -> float | None:
    if result is None or not _get(result, "metrics", "completed"):
        return None
    return result["metrics"]["output_throughput"]


def tpot_ratio(system: dict[str, Any], rate: float | str) -> float | None:
    iso = p99_tpot(result_of(system, rate, "isolated"))
    colo = p99_tpot(result_of(system, rate, "colocated"))
    if iso is None or colo is None or iso <= 0:
        return None
    return colo / iso


def tpot_ratios(system: dict[str, Any]) -> dict[float, float]:
    out = {}
    for rate in system["rates"]:
        ratio = tpot_ratio(system, rate)
        if ratio is not None:
            out[_rate_key(rate)] = ratio
    return out


def _failed(system: dict[str, Any]) -> int:
    return sum(_get(r["result"], "metrics", "failed") or 0 for r in system["runs"] if r["result"])


def _ratios_text(ratios: dict[float, float]) -> str:
    return ", ".join(f"{rate_label(r)}: {v:.2f}" for r, v in sorted(ratios.items()))


@dataclass(frozen=True)
class Target:
    text: str
    status: str  # "met" | "missed" | "not measured"
    detail: str


def _with_failures(detail: str, *systems: dict[str, Any]) -> str:
    notes = [f"{s['name']} had {n} failed request(s)" for s in systems if (n := _failed(s))]
    return detail + (f" (note: {'; '.join(notes)})" if notes else "")


def loop_flat_target(doc: dict[str, Any]) -> Target:
    text = f"loop mode: P99 TPOT colocated / isolated <= {LOOP_RATIO_LIMIT} at every rate"
    loop = system_named(doc, "loop")
    ratios = tpot_ratios(loop) if loop else {}
    if not ratios:
        why = (
            "loop mode was not run"
            if loop is None
            else "no rate has both an isolated and a colocated P99 TPOT"
        )
        return Target(text, "not measured", why)
    worst_rate, worst = max(ratios.items(), key=lambda kv: kv[1])
    if worst <= LOOP_RATIO_LIMIT:
        detail = f"worst {worst:.2f} at {rate_label(worst_rate)} ({_ratios_text(ratios)})"
        return Target(text, "met", _with_failures(detail, loop))
    detail = (
        f"worst {worst:.2f} at {rate_label(worst_rate)}: {worst - LOOP_RATIO_LIMIT:.2f} over the limit "
        f"({_ratios_text(ratios)})"
    )
    return Target(text, "missed", _with_failures(detail, loop))


def host_degrades_target(doc: dict[str, Any]) -> Target:
    text = f"host mode degrades visibly: P99 TPOT colocated / isolated >= {HOST_VISIBLE_RATIO} at some rate"
    host = system_named(doc, "host")
    ratios = tpot_ratios(host) if host else {}
    if not ratios:
        why = (
            "host mode was not run"
            if host is None
            else "no rate has both an isolated and a colocated P99 TPOT"
        )
        return Target(text, "not measured", why)
    best_rate, best = max(ratios.items(), key=lambda kv: kv[1])
    loop = system_named(doc, "loop")
    loop_ratios = tpot_ratios(loop) if loop else {}
    versus = f"; loop mode: {_ratios_text(loop_ratios)}" if loop_ratios else ""
    if best >= HOST_VISIBLE_RATIO:
        detail = f"up to {best:.2f} at {rate_label(best_rate)} ({_ratios_text(ratios)}{versus})"
        return Target(text, "met", _with_failures(detail, host))
    detail = (
        f"at most {best:.2f} at {rate_label(best_rate)}: {HOST_VISIBLE_RATIO - best:.2f} short "
        f"({_ratios_text(ratios)}{versus})"
    )
    return Target(text, "missed", _with_failures(detail, host))


def loop_throughput_target(doc: dict[str, Any]) -> Target:
    text = (
        f"loop mode output throughput >= host mode's in isolation at every rate "
        f"(within {THROUGHPUT_TOLERANCE:.0%})"
    )
    loop, host = system_named(doc, "loop"), system_named(doc, "host")
    if loop is None or host is None:
        return Target(text, "not measured", "needs both loop and host mode")
    ratios = {}
    for rate in loop["rates"]:
        a = output_throughput(result_of(loop, rate, "isolated"))
        b = output_throughput(result_of(host, rate, "isolated"))
        if a is not None and b:
            ratios[_rate_key(rate)] = a / b
    if not ratios:
        return Target(text, "not measured", "no rate has an isolated throughput for both modes")
    low_rate, low = min(ratios.items(), key=lambda kv: kv[1])
    listing = f"loop / host output tok/s: {_ratios_text(ratios)}"
    if low >= 1.0 - THROUGHPUT_TOLERANCE:
        return Target(text, "met", _with_failures(listing, loop, host))
    detail = (
        f"lowest {low:.2f} at {rate_label(low_rate)}: loop mode {1 - low:.0%} below host mode ({listing})"
    )
    return Target(text, "missed", _with_failures(detail, loop, host))


def evaluate_targets(doc: dict[str, Any]) -> list[Target]:
    return [loop_flat_target(doc), host_degrades_target(doc), loop_throughput_target(doc)]


# -- Markdown ----------------------------------------------------------------------------------


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _run_row(system: dict[str, Any], run: dict[str, Any]) -> list[str]:
    head = [rate_label(run["rate"]), run["load"]]
    res = run["result"]
    if res is None:
        return head + [f"skipped: {run['skipped'] or 'not run'}"] + [""] * 10
    m, c = res["metrics"], res["cost"]
    ratio = tpot_ratio(system, run["rate"]) if run["load"] == "colocated" else None
    return head + [
        f"{m['completed']}/{m['failed']}",
        _num(m["output_throughput"]),
        _num(m["ttft_ms"]["p50"]),
        _num(m["ttft_ms"]["p99"]),
        _num(m["tpot_ms"]["p50"], "{:.2f}"),
        _num(m["tpot_ms"]["p99"], "{:.2f}"),
        _num(ratio, "**{:.2f}**") if run["load"] == "colocated" else "",
        _num(c["joules_per_output_token"], "{:.3f}"),
        _num(c["server_cpu_s_per_1k_tokens"], "{:.2f}"),
        _num(c["machine_cpu_percent"], "{:.0f}"),
    ]


def _system_notes(system: dict[str, Any], device: str) -> list[str]:
    notes = []
    if system["error"]:
        notes.append(f"error: {system['error']}")
    if system["warmup_failures"]:
        notes.append(
            f"{len(system['warmup_failures'])} warm-up request(s) failed: {system['warmup_failures'][0]}"
        )
    for run in system["runs"]:
        res, where = run["result"], f"{rate_label(run['rate'])} {run['load']}"
        if res is None:
            continue
        m, c = res["metrics"], res["cost"]
        if m["failure_reasons"]:
            reason, count = next(iter(m["failure_reasons"].items()))
            notes.append(f"{where}: {m['failed']} failed; most often ({count}x): {reason}")
        if m["output_len_mismatches"]:
            notes.append(f"{where}: {m['output_len_mismatches']} request(s) got output tokens != max_tokens")
        if c["client_cpu_percent"] > 80.0:
            notes.append(
                f"{where}: the load generator used {c['client_cpu_percent']:.0f}% of its core; latencies "
                "include its own delays"
            )
    first = next((r["result"] for r in system["runs"] if r["result"]), None)
    if first is not None:
        cost = first["cost"]
        if cost["gpu_unavailable"]:
            why = "device cpu, no GPU" if device == "cpu" else cost["gpu_unavailable"]
            notes.append(f"J/tok n/a: {why}")
        if cost["server_cpu_unavailable"]:
            notes.append(f"CPU s/1k tok n/a: {cost['server_cpu_unavailable']}")
        else:
            notes.append(f"server processes: {cost['server_found_by']} ({len(cost['server_pids'])} pids)")
    return notes


def _setup_lines(doc: dict[str, Any]) -> list[str]:
    cfg, machine, layout = doc["config"], doc["machine"], doc["layout"]
    gpu = machine["gpu"]
    packages = ", ".join(f"{k} {v}" for k, v in machine["packages"].items() if v)
    gpu_text = (
        f"{gpu['name']} (driver {gpu.get('driver') or '?'})" if gpu.get("name") else gpu.get("unavailable")
    )
    interference = doc["interference"]
    workers = [f"spinners: {interference['spin']}"] if interference["spin"] else []
    if interference["memory"]:
        mib = interference["memory_mib"]
        workers.append(f"memory thrashers: {interference['memory']} ({mib} MiB x2 each)")
    if interference["syscall"]:
        workers.append(f"syscall ping-pong pairs: {interference['syscall']}")
    cores = layout["note"]
    if layout["client"] is not None:
        cores += (
            f": client {layout['client']}, front end {layout['frontend']}, engine {layout['engine']}, "
            f"interference {layout['interference'][0]}-{layout['interference'][-1]}"
        )

    def arrivals(shape: dict[str, Any], rates: list[float | str]) -> str:
        parts = []
        if any(r != "inf" for r in rates):
            parts.append(f"{shape['duration_s']:g} s of Poisson arrivals (seed {cfg['seed']})")
        if "inf" in rates:
            parts.append(f"rate inf: {shape['inf_prompts']} requests released at once")
        return "; ".join(parts)

    hf = next((s for s in doc["systems"] if s["name"] == "hf"), None)
    hf_load = ""
    if hf is not None:
        hf_load = (
            f" The HF baseline, slower to drain, gets {arrivals(cfg['hf_runs'], hf['rates'])} per run and "
            f"{cfg['hf_runs']['request_timeout_s']:g} s per request at most."
        )
    return [
        f"- **Machine**: {gpu_text}; {machine.get('cpu_model') or 'CPU'} x {machine['cpus']} cores; "
        f"Python {machine['python']}; {packages}",
        f"- **Command**: `python3 bench/compare.py {' '.join(doc['argv'])}` ({doc['elapsed_s']:.0f} s in all)",
        f"- **Model**: `{cfg['model']}` (random weights, the same seed for every system), {cfg['dtype']} on "
        f"{cfg['device']}",
        f"- **Load** (`bench serve`): random token-id prompts of {cfg['input_len']} tokens, "
        f"{cfg['output_len']} output tokens each (ignore_eos), greedy; per run "
        f"{arrivals(cfg['appliance_runs'], cfg['rates'])}; at most {cfg['max_concurrency']} requests in flight "
        f"at the client. A rate's isolated and colocated runs send the same requests on the same schedule.{hf_load}",
        f"- **Colocated**: `bench interfere` during the run: {', '.join(workers)}.",
        f"- **Cores**: {cores}.",
        f"- **Appliance**: max_seqs {cfg['max_seqs']}, max_num_batched_tokens {cfg['step_tokens']}, "
        f"max_model_len {cfg['max_model_len']} (the generated profile of each mode is in the JSON).",
        "- **J/tok**: the GPU board's NVML energy over the run (idle power included) / output tokens. "
        "**CPU s/1k tok**: user + system seconds of the server's processes (the appliance's daemon, front end "
        "and engine; the HF baseline's one process) per 1,000 output tokens. **machine CPU %**: all cores.",
        "- TTFT, TPOT in ms; TPOT per request = (E2E - TTFT) / (output tokens - 1), then P50 / P99 over requests.",
    ]


def render_markdown(doc: dict[str, Any], png_name: str | None, png_missing: str | None) -> str:
    cfg, machine = doc["config"], doc["machine"]
    where = machine["gpu"].get("name") or "CPU"
    names = ", ".join(s["name"] for s in doc["systems"])
    lines = [
        f"# bench/compare: {names} on `{cfg['model']}` {cfg['dtype']}, {where} ({doc['date']})",
        "",
        "## Targets (issue 7)",
        "",
    ]
    rows = [[t.text, f"**{t.status}**", t.detail] for t in evaluate_targets(doc)]
    lines += _table(["target", "result", "measured"], rows)
    lines += ["", "## Setup", "", *_setup_lines(doc), "", "## P99 TPOT colocated / isolated", ""]
    all_rates = sorted({_rate_key(r) for s in doc["systems"] for r in s["rates"]})
    ratio_rows = []
    for system in doc["systems"]:
        ratios = tpot_ratios(system)
        ratio_rows.append([system["name"]] + [_num(ratios.get(r), "{:.2f}") for r in all_rates])
    lines += _table(["system"] + [rate_label(r) for r in all_rates], ratio_rows)
    headers = ["rate", "load", "ok/fail", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    headers += ["P99 TPOT colo/iso", "J/tok", "CPU s/1k tok", "machine CPU %"]
    for system in doc["systems"]:
        if system["startup_s"] is None:
            started = "did not serve"
        else:
            walls = [r["wall_s"] for r in system["runs"] if r.get("wall_s") is not None]
            started = f"ready {system['startup_s']:.1f} s after start"
            if system.get("warmup_s") is not None:
                started += f", warm-up {system['warmup_s']:.1f} s"
            started += f", {len(walls)} runs in {sum(walls):.0f} s"
        lines += [
            "",
            f"## {system['name']}: {system['label']}",
            "",
            f"{started}; log `{system['log_file']}`.",
            "",
        ]
        lines += _table(headers, [_run_row(system, run) for run in system["runs"]])
        notes = _system_notes(system, cfg["device"])
        if notes:
            lines += [""] + [f"- {n}" for n in notes]
    lines += ["", "## Plot", ""]
    if png_name:
        lines.append(f"![P99 TPOT and output throughput vs request rate, isolated and colocated]({png_name})")
    else:
        lines.append(f"No plot: {png_missing}")
    lines += ["", f"Raw results (every request's timings): `{doc.get('stem', 'the JSON')}.json`.", ""]
    return "\n".join(lines)


# -- the plot ----------------------------------------------------------------------------------


def write_plot(doc: dict[str, Any], path: Path) -> str | None:
    """P99 TPOT and output tok/s vs rate, one colour per system, isolated solid, colocated dashed.

    Returns why no plot was written, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e})"
    rates = sorted({_rate_key(r) for s in doc["systems"] for r in s["rates"]})
    position = {r: i for i, r in enumerate(rates)}
    drawn = 0
    fig, (ax_tpot, ax_thr) = plt.subplots(1, 2, figsize=(11, 4.3))
    for i, system in enumerate(doc["systems"]):
        for load, style in (("isolated", "-o"), ("colocated", "--x")):
            points = []
            for rate in system["rates"]:
                res = result_of(system, rate, load)
                points.append((position[_rate_key(rate)], p99_tpot(res), output_throughput(res)))
            tpot = [(x, y) for x, y, _ in points if y is not None]
            thr = [(x, y) for x, _, y in points if y is not None]
            label = f"{system['name']} {load}"
            if tpot:
                ax_tpot.plot(*zip(*tpot, strict=True), style, color=f"C{i}", label=label)
                drawn += 1
            if thr:
                ax_thr.plot(*zip(*thr, strict=True), style, color=f"C{i}", label=label)
    if not drawn:
        plt.close(fig)
        return "no run produced a P99 TPOT"
    for ax, ylabel in ((ax_tpot, "P99 TPOT (ms)"), (ax_thr, "output tokens / s")):
        ax.set_xticks(range(len(rates)), [rate_label(r) for r in rates])
        ax.set_xlabel("request rate")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_tpot.set_yscale("log")
    ax_tpot.legend(fontsize=8)
    where = doc["machine"]["gpu"].get("name") or "CPU"
    fig.suptitle(f"{doc['config']['model']} {doc['config']['dtype']} on {where}, {doc['date']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(doc: dict[str, Any], out_dir: Path, stem: str) -> dict[str, Path]:
    """<stem>.png (when matplotlib is there and some run has numbers) and <stem>.md."""
    doc = {**doc, "stem": stem}
    files: dict[str, Path] = {}
    png = out_dir / f"{stem}.png"
    missing = write_plot(doc, png)
    if missing is None:
        files["png"] = png
    md = out_dir / f"{stem}.md"
    md.write_text(render_markdown(doc, png.name if missing is None else None, missing))
    files["md"] = md
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_report")
    p.add_argument("result_json", type=Path, help="a bench/compare JSON result")
    p.add_argument("--out-dir", type=Path, default=None, help="default: beside the JSON")
    args = p.parse_args(argv)
    doc = json.loads(args.result_json.read_text())
    if doc.get("kind") != "blink-bench-compare":
        print(f"error: {args.result_json} is not a bench/compare result", file=sys.stderr)
        return 2
    files = write_outputs(doc, args.out_dir or args.result_json.parent, args.result_json.stem)
    for path in files.values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
