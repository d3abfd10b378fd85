"""The dashboard's widgets. Each holds its data in reactive attributes and redraws when they change;
layout and colours live in dashboard.tcss."""

from __future__ import annotations

from blink_appliance.tui import formatting as fmt
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Sparkline, Static

from blink_appliance.telemetry.snapshot import (
    ClassLatency,
    EngineCounters,
    GpuStats,
    HostStats,
    ModelTelemetry,
    SmShare,
)

LEVELS = "▁▂▃▄▅▆▇█"


def load_style(percent: float) -> str:
    """Colour for a 0-100 load: green when idle, red when saturated."""
    if percent < 25:
        return "green"
    if percent < 50:
        return "yellow3"
    if percent < 75:
        return "dark_orange"
    return "red"


def _share_line(label: str, cpu_percent: float | None, share_percent: float | None) -> Text:
    """`label N cores (S%)`: a group's CPU and its share of the host's."""
    return _line(
        _label(label), (_cores(cpu_percent), "bold"), _label(" cores ("),
        fmt.number(share_percent, "{:.1f}%"), _label(")"),
    )  # fmt: skip


def _line(*parts: tuple[str, str] | str) -> Text:
    """A line of (text, style) pairs; plain strings are values, labels come in dim."""
    return Text.assemble(*parts, no_wrap=True, overflow="ellipsis")


def _lines(lines: list[Text]) -> Text:
    text = Text("\n").join(lines)
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


def _label(text: str) -> tuple[str, str]:
    return (text, "dim")


class StatusBar(Static):
    """Connection state, the model tabs, uptime and pause."""

    connection: reactive[str] = reactive("connecting")  # connecting | live | disconnected
    detail: reactive[str] = reactive("")
    models: reactive[tuple[str, ...]] = reactive(())
    selected: reactive[int] = reactive(0)
    paused: reactive[bool] = reactive(False)
    uptime_s: reactive[float | None] = reactive(None)

    def render(self) -> Text:
        marks = {
            "live": ("● live", "bold green"),
            "connecting": ("◌ connecting", "bold yellow"),
            "disconnected": ("○ disconnected", "bold red"),
        }
        mark, style = marks.get(self.connection, (self.connection, "bold"))
        parts: list[tuple[str, str] | str] = [(mark, style)]
        if self.detail:
            parts.append((f" {self.detail}", "red" if self.connection == "disconnected" else "dim"))
        if self.paused:
            parts.append(("  ⏸ paused", "bold yellow"))
        parts.append(_label("  models "))
        if not self.models:
            parts.append(fmt.NONE_YET)
        for i, name in enumerate(self.models):
            parts.append((f" {name} ", "reverse bold" if i == self.selected else ""))
        if self.uptime_s is not None:
            parts += [_label("  up "), fmt.duration(self.uptime_s)]
        return _line(*parts)


def sm_text(share: SmShare | None, engine: EngineCounters | None) -> str:
    """A model's SMs: the engine's own count when it reports one, else the profile's share
    ("rest": what the partitions leave; "all": the whole GPU); n/a on a CPU engine."""
    sms = engine.sm_partition if engine else None
    if share is None or share.kind == "partition":
        return fmt.number(sms if sms is not None else share.sm_count if share else None)
    word = "rest" if share.kind == "rest" else "all"
    return word if sms is None else f"{word} ({sms})"


class ModelsTable(Static):
    """With several models, one row each: SM share, TPOT, tokens/s and KV use side by side; the
    model the panel below shows is marked. Hidden with one model (its panel says it all)."""

    models: reactive[tuple[ModelTelemetry, ...]] = reactive(())
    selected: reactive[int] = reactive(0)

    def watch_models(self, models: tuple[ModelTelemetry, ...]) -> None:
        self.display = len(models) > 1

    def render(self) -> Text:
        columns = [
            [m.name for m in self.models],
            [sm_text(m.sm_share, m.engine) for m in self.models],
            [fmt.ms(m.latency.tpot_p50_ms) for m in self.models],
            [fmt.rate(m.latency.tokens_per_s) for m in self.models],
            [fmt.number(kv_percent(m.engine), "{:.0f}%") for m in self.models],
        ]
        # Each column as wide as its widest value, so the models' numbers line up.
        name, sms, tpot, rate, kv = ([v.ljust(max(map(len, c))) for v in c] for c in columns)
        rows = []
        for i in range(len(self.models)):
            mark = ("▸ ", "bold") if i == self.selected else ("  ", "")
            rows.append(
                _line(
                    mark,
                    (name[i], mark[1]),
                    _label("  SMs "),
                    sms[i],
                    _label("  TPOT p50 "),
                    tpot[i],
                    _label("  tokens/s "),
                    rate[i],
                    _label("  KV "),
                    kv[i],
                )  # fmt: skip
            )
        return _lines(rows)


def kv_percent(engine: EngineCounters | None) -> float | None:
    return engine.kv_usage * 100 if engine is not None and engine.kv_usage is not None else None


class UsageBar(Widget):
    """A labelled horizontal bar: used / total."""

    used: reactive[int | None] = reactive(None)
    total: reactive[int | None] = reactive(None)

    def __init__(self, label: str, unit: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.label = label
        self.unit = unit

    def render(self) -> Text:
        head = f"{self.label} "
        if self.used is None or not self.total:
            return _line(_label(head), fmt.NA)
        frac = min(1.0, max(0.0, self.used / self.total))
        tail = f" {self.used}/{self.total}{self.unit} {frac * 100:.0f}%"
        width = max(4, self.size.width - len(head) - len(tail))
        filled = round(frac * width)
        return _line(
            _label(head), ("█" * filled, load_style(frac * 100)), ("░" * (width - filled), "dim"), tail
        )


class ModelPanel(Vertical):
    """One model: latencies with sparklines, throughput, batch/queue, KV, its GPU share."""

    model: reactive[ModelTelemetry | None] = reactive(None)
    gpu: reactive[GpuStats | None] = reactive(None)
    energy_per_token_j: reactive[float | None] = reactive(None)

    def compose(self) -> ComposeResult:
        yield Static(id="itl")
        yield Sparkline([], id="itl-spark")
        yield Static(id="tpot")
        yield Static(id="ttft")
        yield Static(id="classes")  # shown only once a second priority class has been seen
        yield Static(id="rate")
        yield Sparkline([], id="rate-spark")
        yield Static(id="batch")
        yield UsageBar("KV", " blocks", id="kv")
        yield Static(id="gpu-share")

    def on_mount(self) -> None:
        self._draw()

    def watch_model(self) -> None:
        self._show()

    def watch_gpu(self) -> None:
        self._show()

    def watch_energy_per_token_j(self) -> None:
        self._show()

    def _show(self) -> None:
        # Watchers can fire before mount (children not composed yet); on_mount draws then.
        if self.is_mounted:
            self._draw()

    def _draw(self) -> None:
        m = self.model
        if m is None:
            self.border_title, self.border_subtitle = "model", ""
            self.query_one("#itl", Static).update(_line("no models reported yet"))
            for static in self.query(Static).exclude("#itl"):
                static.update("")
            for spark in self.query(Sparkline):
                spark.data = []
            kv = self.query_one("#kv", UsageBar)
            kv.used = kv.total = None
            return
        engine = m.engine
        device = engine.device if engine and engine.device else fmt.NA
        self.border_title = f"model {m.name} · {device}"
        self.border_subtitle = f"{engine.steps} steps" if engine and engine.steps is not None else ""
        lat = m.latency
        self.query_one("#itl", Static).update(
            _line(_label("ITL  p50 "), fmt.ms(lat.itl_p50_ms), _label("  p99 "), fmt.ms(lat.itl_p99_ms))
        )
        # Buckets before the first token hold no latency (0.0): leave them out rather than draw 0 ms.
        itl = lat.itl_history_ms
        first = next((i for i, v in enumerate(itl) if v > 0), len(itl))
        self.query_one("#itl-spark", Sparkline).data = itl[first:]
        self.query_one("#tpot", Static).update(
            _line(_label("TPOT p50 "), fmt.ms(lat.tpot_p50_ms), _label("  p99 "), fmt.ms(lat.tpot_p99_ms))
        )
        self.query_one("#ttft", Static).update(
            _line(_label("TTFT p50 "), fmt.ms(lat.ttft_p50_ms), _label("  p99 "), fmt.ms(lat.ttft_p99_ms))
        )
        classes = self.query_one("#classes", Static)
        classes.display = len(m.classes) > 1
        classes.update(classes_text(m.classes, lat.window_s) if classes.display else "")
        self.query_one("#rate", Static).update(
            _line(
                _label("tokens/s "),
                (fmt.rate(lat.tokens_per_s), "bold"),
                _label(f"  ({lat.window_s:.0f} s)  total "),
                str(lat.total_tokens),
            )
        )
        self.query_one("#rate-spark", Sparkline).data = lat.tokens_per_s_history
        if engine is None:
            reason = m.engine_error or "engine counters not reported"
            batch = _line(_label("batch "), fmt.NA, _label("  queue "), fmt.NA, (f"  {reason}", "red"))
        else:
            batch = _line(
                _label("batch "),
                (fmt.number(engine.running), "bold"),
                _label("  queue "),
                (fmt.number(engine.waiting), "bold"),
                _label("  step "),
                fmt.ms(engine.last_step_ns / 1e6 if engine.last_step_ns else None),
            )
            if (rate := engine.prefix_hit_rate) is not None:  # an engine that caches prefixes
                cached = fmt.number(engine.kv_blocks_cached)
                batch.append_text(_line(_label("  prefix hits "), fmt.number(100 * rate, "{:.0f}%"),
                                        _label(" cached blocks "), cached))  # fmt: skip
        self.query_one("#batch", Static).update(batch)
        kv = self.query_one("#kv", UsageBar)
        kv.used = engine.kv_blocks_used if engine else None
        kv.total = engine.kv_blocks_total if engine else None
        gpu = self.gpu
        share: list[tuple[str, str] | str] = [_label("SMs "), sm_text(m.sm_share, engine), _label("  GPU ")]
        if gpu is None or not gpu.available:
            share.append(fmt.NA)
        else:
            share += [
                fmt.number(gpu.gpu_util_percent, "{:.0f}%"),
                "  ",
                fmt.number(gpu.power_w, "{:.0f} W"),
                "  ",
                fmt.joules(self.energy_per_token_j, fmt.NONE_YET),
                _label("/token"),
            ]
        self.query_one("#gpu-share", Static).update(_line(*share))


def _class_ms(value: float | None) -> str:
    """A latency in ms without its unit (the table's header says ms)."""
    if value is None:
        return fmt.NONE_YET
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def classes_text(classes: list[ClassLatency], window_s: float) -> Text:
    """The model's priority classes side by side, one row each (lowest number, first to run, on
    top): TTFT and TPOT P50/P99 in ms and tokens/s over the window."""
    header = ["prio", "TTFT p50", "p99", "TPOT p50", "p99", "tok/s"]
    rows = [
        [c.label, _class_ms(c.ttft_p50_ms), _class_ms(c.ttft_p99_ms), _class_ms(c.tpot_p50_ms),
         _class_ms(c.tpot_p99_ms), fmt.rate(c.tokens_per_s)]
        for c in classes
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def cells(row: list[str]) -> str:
        return " ".join(
            [row[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]
        )

    lines = [_line(_label(f"priority classes (ms, {window_s:.0f} s)")), _line(_label(cells(header)))]
    lines += [_line(cells(row)) for row in rows]
    return _lines(lines)


class GpuPanel(Static):
    """Device-wide NVML readings; every line says n/a without NVML."""

    gpu: reactive[GpuStats | None] = reactive(None)
    energy_per_token_j: reactive[float | None] = reactive(None)

    def render(self) -> Text:
        g = self.gpu or GpuStats(available=False, reason="no data yet")
        self.border_title = f"GPU · {g.name}" if g.name else "GPU"
        na = fmt.NA
        power = fmt.number(g.power_w, "{:.0f}")
        if g.power_limit_w is not None:
            power += f" / {g.power_limit_w:.0f}"
        memory = fmt.number(g.memory_used_mib and g.memory_used_mib / 1024, "{:.1f}")
        if g.memory_total_mib is not None:
            memory += f" / {g.memory_total_mib / 1024:.1f} GiB"
        lines = [
            _line(
                _label("util "),
                fmt.number(g.gpu_util_percent, "{:.0f}%"),
                _label("  mem "),
                fmt.number(g.mem_util_percent, "{:.0f}%"),
            ),
            _line(_label("power "), power, " W" if g.power_w is not None else ""),
            _line(
                _label("energy/token "),
                fmt.joules(self.energy_per_token_j, na if not g.available else fmt.NONE_YET),
            ),
            _line(_label("SM clock "), fmt.number(g.sm_clock_mhz, "{:.0f} MHz")),
            _line(_label("memory "), memory),
        ]
        if not g.available and g.reason:
            lines.append(Text(g.reason, style="dim italic", overflow="ellipsis", no_wrap=True))
        return _lines(lines)


class CoreHeatStrip(Widget):
    """One cell per host core, its height and colour the core's load."""

    loads: reactive[tuple[float, ...]] = reactive(())

    def render(self) -> Text:
        if not self.loads:
            return Text(fmt.NA)
        width = max(1, self.size.width)
        cell = max(1, min(3, width // len(self.loads)))
        per_line = max(1, width // cell)
        text = Text(no_wrap=True)
        for i, load in enumerate(self.loads):
            if i and i % per_line == 0:
                text.append("\n")
            level = LEVELS[min(len(LEVELS) - 1, int(load / 100 * len(LEVELS)))]
            text.append(level * cell, style=load_style(load))
        return text

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001
        if not self.loads:
            return 1
        cell = max(1, min(3, width // len(self.loads)))
        per_line = max(1, width // cell)
        return -(-len(self.loads) // per_line)


INTERFERENCE_STYLES = {"quiet": "bold green", "busy": "bold yellow", "contended": "bold red"}


def interference_level(verdict: str | None) -> tuple[str, str]:
    """(word, style) for the host's interference verdict (telemetry/interference.py decides it)."""
    if verdict is None:
        return fmt.NA, "dim"
    return verdict, INTERFERENCE_STYLES.get(verdict, "bold")


def _cores(percent: float | None) -> str:
    """A CPU rate (100 = one core) in cores."""
    return fmt.number(percent / 100 if percent is not None else None, "{:.2f}")


class HostPanel(Vertical):
    """Host CPU heat strip, the appliance's processes, what others take, and the interference verdict."""

    host: reactive[HostStats | None] = reactive(None)

    def compose(self) -> ComposeResult:
        yield CoreHeatStrip(id="cores")
        yield Static(id="host-info")

    def on_mount(self) -> None:
        self.border_title = "host CPU"
        self._draw()

    def watch_host(self) -> None:
        self._show()

    def _show(self) -> None:
        if self.is_mounted:
            self._draw()

    def _draw(self) -> None:
        h = self.host
        strip = self.query_one("#cores", CoreHeatStrip)
        info = self.query_one("#host-info", Static)
        if h is None:
            strip.loads = ()
            info.update(_line(fmt.NA))
            return
        strip.loads = tuple(h.cpu_percent_per_core)
        cores = len(h.cpu_percent_per_core)
        word, style = interference_level(h.interference)
        lines = [
            _line(_label("total "), f"{h.cpu_percent_total:.0f}%", _label(f" of {cores} cores")),
            _share_line("appliance ", h.appliance_cpu_percent, h.appliance_share_percent),
        ]
        # Each process apart, so a missing one (an engine the sum leaves out) shows.
        for p in h.processes:
            lines.append(
                _line(
                    _label(f"  {p.role:<8} "),
                    _cores(p.cpu_percent),
                    _label(" cores  "),
                    fmt.number(p.cpu_seconds, "{:.0f} s"),
                )
            )
        lines += [
            _share_line("others ", h.others_cpu_percent, h.others_share_percent),
            _line(_label("run-queue wait "), fmt.number(h.runqueue_ms_per_s, "{:.0f} ms/s")),
            _line(_label("sched p50 "), fmt.us(h.sched_p50_us), _label(" p99 "), fmt.us(h.sched_p99_us)),
            _line(_label("interference "), (f"● {word}", style)),
        ]
        info.update(_lines(lines))
