"""How the dashboard writes numbers: one place for units, "n/a" and "—".

"n/a" means the source is missing (no GPU, no NVML, no engine counters); "—" means the source is
there but has nothing to report yet (no tokens in the window).
"""

from __future__ import annotations

NA = "n/a"
NONE_YET = "—"


def ms(value: float | None) -> str:
    if value is None:
        return NONE_YET
    if value >= 1000:
        return f"{value / 1000:.2f} s"
    if value >= 100:
        return f"{value:.0f} ms"
    return f"{value:.1f} ms"


def us(value: float | None) -> str:
    if value is None:
        return NONE_YET
    if value >= 1000:
        return f"{value / 1000:.1f} ms"
    return f"{value:.0f} µs"


def number(value: float | None, fmt: str = "{:.0f}", missing: str = NA) -> str:
    return missing if value is None else fmt.format(value)


def rate(value: float | None) -> str:
    if value is None:
        return NA
    if value >= 1000:
        return f"{value / 1000:.2f}k"
    return f"{value:.1f}"


def joules(value: float | None, missing: str = NA) -> str:
    if value is None:
        return missing
    if value < 1:
        return f"{value * 1000:.0f} mJ"
    return f"{value:.2f} J"


def duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"
