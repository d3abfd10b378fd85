"""Tables from bench/ncu_step.sh's CSVs: the forward's kernels of one layer and the LM head
(duration alone, DRAM throughput, registers, occupancy, cycles per issued instruction), and each
profiled loop kernel's executed warp instructions and stall samples by source line.

    python3 bench/ncu_summary.py DIR [--layer 1] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import csv
from pathlib import Path

KERNEL_COLUMNS = (
    ("Duration", "us"),
    ("DRAM Throughput", "DRAM %"),
    ("Registers Per Thread", "regs"),
    ("Dynamic Shared Memory Per Block", "smem KB"),
    ("Achieved Occupancy", "occupancy %"),
    ("Warp Cycles Per Issued Instruction", "cycles/issue"),
)


def forward_table(path: Path, layer: int) -> list[str]:
    """The kernels of `layer` (1-based: from its input norm to the next layer's) and the last kernel."""
    kernels: dict[int, dict] = collections.OrderedDict()
    for r in csv.DictReader(path.open()):
        k = kernels.setdefault(int(r["ID"]), {"name": r["Kernel Name"], "grid": r["Grid Size"]})
        if r["Metric Name"]:
            k[r["Metric Name"]] = r["Metric Value"]
    ids = list(kernels)
    norms = [i for i in ids if "rmsnorm" in kernels[i]["name"]]
    # A layer runs from its input norm to the next one's, and its post-attention norm sits inside.
    start = norms[2 * (layer - 1)]
    end = norms[2 * layer] if 2 * layer < len(norms) else ids[-1]
    picked = [i for i in ids if start <= i < end] + [ids[-1]]
    out = [
        "| kernel | grid | " + " | ".join(h for _, h in KERNEL_COLUMNS) + " |",
        "|---" * (len(KERNEL_COLUMNS) + 2) + "|",
    ]
    for i in picked:
        k = kernels[i]
        out.append(
            f"| {k['name'][:32]} | {k['grid']} | "
            + " | ".join(k.get(m, "") for m, _ in KERNEL_COLUMNS)
            + " |"
        )
    return out


def _number(cell: str | None) -> float:
    """A counter cell; ncu leaves some source rows with unquoted commas, whose cells are text."""
    try:
        return float(cell or 0)
    except ValueError:
        return 0.0


def source_lines(path: Path, top: int) -> list[str]:
    """Executed warp instructions and stall samples per (file, line), most executed first."""
    executed: collections.Counter = collections.Counter()
    stalls: collections.Counter = collections.Counter()
    text: dict[tuple[str, int], str] = {}
    current, header = "", None
    for row in csv.reader(path.open()):
        if not row or row[0] == "Function Name":
            continue
        if row[0] == "File Path":
            current = Path(row[1]).name
            continue
        if row[0] == "Line No":
            header = row
            continue
        if header is None or not row[0].isdigit():
            continue
        d = dict(zip(header, row, strict=False))
        key = (current, int(row[0]))
        text[key] = row[1].strip()
        executed[key] += _number(d.get("Instructions Executed"))
        stalls[key] += _number(d.get("Warp Stall Sampling (All Samples)"))
    total = sum(executed.values()) or 1.0
    out = [f"warp instructions executed: {total:.0f}; stall samples: {sum(stalls.values()):.0f}", ""]
    out += ["| warp instructions | share | stall samples | line | source |", "|---|---|---|---|---|"]
    for key, n in executed.most_common(top):
        src = text[key][:70].replace("|", "\\|")
        out.append(f"| {n:.0f} | {100 * n / total:.1f}% | {stalls[key]:.0f} | {key[0]}:{key[1]} | `{src}` |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    if (args.dir / "forward-details.csv").exists():
        print("\n".join(forward_table(args.dir / "forward-details.csv", args.layer)), "\n")
    for source in sorted(args.dir.glob("*-source.csv")):
        print(f"{source.name.removesuffix('-source.csv')}:", *source_lines(source, args.top), "", sep="\n")


if __name__ == "__main__":
    main()
