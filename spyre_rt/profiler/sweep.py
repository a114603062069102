"""``spyre-profile run --sweep``: speedup and device efficiency against batch size and
sequence length.

The published result is one point (batch 1, sequence 1024); this shows how the gain of
prebuilt graph plans moves with size (more work per kernel hides more host work), and how
close the card runs to the roofline of each batch: a decode step reads the weights once
for the whole batch, so its roofline grows slower than the batch, and the kernels' tilings
must keep up.
"""

from __future__ import annotations

import dataclasses
import math

from rich.table import Table

from . import run as runmod


def parse_sizes(batches: str, seqs: str) -> list[tuple[int, int]]:
    try:
        b = [int(x) for x in batches.split(",") if x.strip()]
        s = [int(x) for x in seqs.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"sweep sizes must be comma lists of whole numbers: {batches!r}, {seqs!r}") from None
    if not b or not s or min(b + s) < 1:
        raise ValueError("sweep sizes must be positive")
    return [(x, y) for x in b for y in s]


def sweep(opts: runmod.Options, sizes: list[tuple[int, int]], console, plot_path: str) -> list[dict]:
    points = []
    for batch, seq in sizes:
        o = dataclasses.replace(opts, batch=batch, seq=seq, decode_steps=min(opts.decode_steps, 4),
                                trace=None, py_spy=None)
        console.print(f"[bold]sweep[/]: batch {batch}, sequence {seq}")
        out = runmod.measure(o, console)
        points.append({"batch": batch, "seq": seq, "speedups": out["speedups"],
                       "compute_share": out["compute_share"], "efficiency": out["efficiency"],
                       "results": out["results"]})
    render(console, points)
    plot(points, plot_path, console)
    return points


def render(console, points: list[dict]) -> None:
    # every dispatch mode but construct (the base) that some point measured
    modes = [m for m in runmod.DISPATCH[1:] if any(m in p["speedups"] for p in points)]
    if modes:
        console.print(speedup_table(points, modes))
    console.print(efficiency_table(points))


def speedup_table(points: list[dict], modes: list[str]) -> Table:
    t = Table(title="speedup of the dispatch modes against construct, by size", title_justify="left")
    columns = [(phase, mode) for phase in runmod.PHASES for mode in modes]
    for col in ("batch", "seq", *(f"{phase} ({mode})" for phase, mode in columns)):
        t.add_column(col, justify="right")

    def cell(speedups, mode, phase):
        v = speedups.get(mode, {}).get(phase)
        return f"{v:.2f}x" if v is not None and math.isfinite(v) else "—"

    for p in points:
        sp = p["speedups"]
        t.add_row(str(p["batch"]), str(p["seq"]), *(cell(sp, mode, phase) for phase, mode in columns))
    return t


def efficiency_table(points: list[dict]) -> Table:
    """Per size: each phase's device time against the roofline of that batch and sequence."""
    t = Table(title="device efficiency by size: device time and the roofline of that batch and sequence, "
                    "in ms per prefill and per decode token", title_justify="left")
    for col in ("batch", "seq", *(f"{phase} {what}" for phase in runmod.PHASES for what in ("ms", "roofline", "%"))):
        t.add_column(col, justify="right")
    for p in points:
        cells = []
        for phase in runmod.PHASES:
            e = p["efficiency"].get(phase)
            if e is None:
                cells += ["—"] * 3
                continue
            fraction = e["fraction"]
            cells += [runmod.ms_text(e["device_ms"]), runmod.ms_text(e["roofline_ms"]),
                      f"{fraction * 100:.0f} %" if fraction is not None else "—"]
        t.add_row(str(p["batch"]), str(p["seq"]), *cells)
    return t


def series(points: list[dict]) -> tuple[dict, dict]:
    """The plot's curves: prebuilt's speedup against sequence length, one per phase and
    batch; and device efficiency (percent) against batch, one per phase and sequence length."""
    speedup, efficiency = {}, {}
    for p in points:
        for phase in runmod.PHASES:
            v = p["speedups"].get("prebuilt", {}).get(phase)
            if v is not None and math.isfinite(v):
                speedup.setdefault(f"{phase}, batch {p['batch']}", []).append((p["seq"], v))
            e = p["efficiency"].get(phase)
            if e is not None and e["fraction"] is not None:
                efficiency.setdefault(f"{phase}, sequence {p['seq']}", []).append((p["batch"], e["fraction"] * 100))
    return speedup, efficiency


def plot(points: list[dict], path: str, console) -> None:
    """A PNG with matplotlib where it is installed, else plots in the terminal: speedup
    against sequence length, and device efficiency against batch size."""
    speedup, efficiency = series(points)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _terminal_plot(speedup, console, "speedup of prebuilt over construct", "sequence length")
        _terminal_plot(efficiency, console, "device efficiency, % of the roofline", "batch size")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, curves, xlabel, ylabel in ((left, speedup, "sequence length", "speedup of prebuilt over construct"),
                                       (right, efficiency, "batch size", "device efficiency (% of the roofline)")):
        for name, pts in sorted(curves.items()):
            xs, ys = zip(*sorted(pts), strict=True)
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        if curves:
            ax.legend()
    right.set_ylim(0, 105)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    console.print(f"sweep plot written to {path}")


def _terminal_plot(curves: dict, console, title: str, xlabel: str, width: int = 60, height: int = 14) -> None:
    pts = [(x, y) for s in curves.values() for x, y in s]
    if not pts:
        return
    xs = sorted({x for x, _ in pts})
    ymax = max(y for _, y in pts) * 1.05
    ymin = min(0.0, min(y for _, y in pts))
    marks = "ox+*#@%&"
    grid = [[" "] * width for _ in range(height)]
    legend = []
    for k, (name, s) in enumerate(sorted(curves.items())):
        legend.append(f"{marks[k % len(marks)]} {name}")
        for x, y in s:
            col = int((xs.index(x) / max(1, len(xs) - 1)) * (width - 1))
            row = height - 1 - int((y - ymin) / (ymax - ymin or 1) * (height - 1))
            grid[row][col] = marks[k % len(marks)]
    console.print(f"{title} (rows), against {xlabel} (columns)")
    for i, line in enumerate(grid):
        label = f"{ymax - (ymax - ymin) * i / (height - 1):6.2f} |" if i % 3 == 0 else "       |"
        console.print(label + "".join(line), markup=False, highlight=False)
    console.print("       +" + "-" * width, markup=False)
    labels = [" "] * (width + 8)  # each x under its column, as far as the one before allows
    at = 0
    for i, x in enumerate(xs):
        text = str(x)
        col = max(at, min(width - len(text), int(i / max(1, len(xs) - 1) * (width - 1))))
        labels[8 + col: 8 + col + len(text)] = text
        at = col + len(text) + 1
    console.print("".join(labels).rstrip(), markup=False)
    for line in legend:
        console.print("        " + line, markup=False, highlight=False)
