"""``spyre-profile run --sweep``: speedup against batch size and sequence length.

The published result is one point (batch 1, sequence 1024); this shows how the gain of
prebuilt graph plans moves with size: more work per kernel hides more host work.
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
                       "compute_share": out["compute_share"], "results": out["results"]})
    render(console, points)
    plot(points, plot_path, console)
    return points


def render(console, points: list[dict]) -> None:
    t = Table(title="speedup of the dispatch modes against construct, by size", title_justify="left")
    # every dispatch mode but construct (the base) that some point measured
    modes = [m for m in runmod.DISPATCH[1:] if any(m in p["speedups"] for p in points)]
    columns = [(phase, mode) for phase in runmod.PHASES for mode in modes]
    for col in ("batch", "seq", *(f"{phase} ({mode})" for phase, mode in columns)):
        t.add_column(col, justify="right")

    def cell(speedups, mode, phase):
        v = speedups.get(mode, {}).get(phase)
        return f"{v:.2f}x" if v is not None and math.isfinite(v) else "—"

    for p in points:
        sp = p["speedups"]
        t.add_row(str(p["batch"]), str(p["seq"]), *(cell(sp, mode, phase) for phase, mode in columns))
    console.print(t)


def plot(points: list[dict], path: str, console) -> None:
    """A PNG with matplotlib where it is installed, else a plot in the terminal."""
    series = {}
    for p in points:
        for phase in ("prefill", "decode"):
            v = p["speedups"].get("prebuilt", {}).get(phase)
            if v is not None:
                series.setdefault(f"{phase}, batch {p['batch']}", []).append((p["seq"], v))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _terminal_plot(series, console)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in sorted(series.items()):
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("speedup of prebuilt over construct")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    console.print(f"sweep plot written to {path}")


def _terminal_plot(series: dict, console, width: int = 60, height: int = 14) -> None:
    pts = [(x, y) for s in series.values() for x, y in s]
    if not pts:
        return
    xs = sorted({x for x, _ in pts})
    ymax = max(y for _, y in pts) * 1.05
    ymin = min(0.0, min(y for _, y in pts))
    marks = "ox+*#@%&"
    grid = [[" "] * width for _ in range(height)]
    legend = []
    for k, (name, s) in enumerate(sorted(series.items())):
        legend.append(f"{marks[k % len(marks)]} {name}")
        for x, y in s:
            col = int((xs.index(x) / max(1, len(xs) - 1)) * (width - 1))
            row = height - 1 - int((y - ymin) / (ymax - ymin or 1) * (height - 1))
            grid[row][col] = marks[k % len(marks)]
    console.print("speedup of prebuilt over construct (rows: speedup, columns: sequence length)")
    for i, line in enumerate(grid):
        label = f"{ymax - (ymax - ymin) * i / (height - 1):6.2f} |" if i % 3 == 0 else "       |"
        console.print(label + "".join(line), markup=False, highlight=False)
    console.print("       +" + "-" * width, markup=False)
    console.print("        " + "   ".join(str(x) for x in xs), markup=False)
    for line in legend:
        console.print("        " + line, markup=False, highlight=False)
