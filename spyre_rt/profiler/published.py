"""The published figures placed on our model: what construction cost per kernel they imply.

A dispatch mode that builds graphs on every step makes a step take the device time plus the
construction the prebuilt mode removes, so

    speedup = (device + kernels x c) / device,   i.e.   c = (speedup - 1) x device / kernels

where ``c`` is the construction cost per kernel (everything a construct-mode launch costs
beyond the device's own time). From the published speedup, our device time and our kernel
count, :func:`implied` gives the ``c`` the published system implies *on our model*, beside
the ``c`` we measure (construct latency minus prebuilt latency, per kernel). The what-if
curve (:func:`whatif`) is the speedup as a function of ``c``: the published point lies on
it by construction, ours near it (our prebuilt step is not quite device time alone). The
curve depends on the card and the model only, not on the host: it is the honest answer to
"why do our speedups differ from the published ones" on any machine.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

PHASES = ("prefill", "decode")
_CURVE_POINTS = 41


def implied_us_per_kernel(speedup: float, device_ms: float, kernels: int) -> float:
    """The construction cost per kernel (µs) at which a step of `kernels` kernels and
    `device_ms` of device time gets `speedup` from prebuilding."""
    return (speedup - 1.0) * device_ms * 1000.0 / kernels


def speedup_at(us_per_kernel: float, device_ms: float, kernels: int) -> float:
    """The speedup of prebuilding when construction costs `us_per_kernel` per kernel."""
    return 1.0 + kernels * us_per_kernel / (device_ms * 1000.0)


def phase_figures(results: dict[str, Any], mode: str, phase: str) -> dict[str, float] | None:
    """Latency, device time (ms) and jobs of one step of a phase in a mode (a decode step
    is one token), from ``spyre-profile run`` results; None when the mode was not run."""
    r = results.get(mode)
    if not r or "phases" not in r:
        return None
    f = r["phases"][phase]
    steps = f.get("steps", 1) if phase == "decode" else 1
    return {"latency_ms": f["latency_ms"] / steps, "device_ms": f["device_ms"] / steps,
            "jobs": f["jobs"] / steps}


def implied(results: dict[str, Any], reference: dict[str, Any] | None, kernels: dict[str, int],
            base: str = "construct", speedups: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per mode the reference has a speedup for, and per phase: the construction per kernel
    the published speedup implies on our model, beside ours as measured.

    `kernels` is the number of kernels of one step of each phase. Our device time is the
    prebuilt mode's (the device's own work, without construct-mode program uploads). With
    `speedups` (the run's, each a median of per-round ratios), ours is that speedup's
    excess over the mode's latency, so the two tables agree; else the ratio of latencies."""
    if not reference or base not in results:
        return {}
    out: dict[str, Any] = {}
    for mode, by_phase in reference.get("speedups", {}).items():
        for phase in PHASES:
            pub = by_phase.get(phase)
            ours, mine, device = (phase_figures(results, m, phase) for m in (base, mode, "prebuilt"))
            device = device or mine
            n = kernels.get(phase, 0)
            if pub is None or ours is None or mine is None or not n or not device["device_ms"]:
                continue
            measured = (speedups or {}).get(mode, {}).get(phase) or ours["latency_ms"] / mine["latency_ms"]
            measured_ms = (measured - 1.0) * mine["latency_ms"]
            out.setdefault(mode, {})[phase] = {
                "published_speedup": pub,
                "measured_speedup": measured,
                "device_ms": device["device_ms"],
                "kernels": n,
                "implied_ms_per_step": (pub - 1.0) * device["device_ms"],
                "implied_us_per_kernel": implied_us_per_kernel(pub, device["device_ms"], n),
                "measured_ms_per_step": measured_ms,
                "measured_us_per_kernel": measured_ms * 1000.0 / n,
            }
    return out


CURVE_COLUMNS = ("us_per_kernel", "speedup_device_bound", "speedup_this_host")


def whatif(results: dict[str, Any], implied_: dict[str, Any], kernels: dict[str, int],
           mode: str = "prebuilt") -> dict[str, Any]:
    """Per phase, the speedup of `mode` against construction cost per kernel, two ways:

    - device-bound: a prebuilt step takes the device time (the published point lies on it);
    - this host: a prebuilt step takes what ours took here (our point lies on it). Where
      our prebuilt step is device-bound the two coincide; where it is not (a small model,
      whose step is mostly Python around the launch) the gap is that host overhead."""
    out: dict[str, Any] = {}
    for phase in PHASES:
        device = phase_figures(results, "prebuilt", phase) or phase_figures(results, mode, phase)
        n = kernels.get(phase, 0)
        if device is None or not n or not device["device_ms"]:
            continue
        at = implied_.get(mode, {}).get(phase)
        ours = _our_point(results, mode, phase, n)
        top = max([ours["us_per_kernel"] if ours else 0.0, at["implied_us_per_kernel"] if at else 0.0]) * 1.25
        top = top if top > 0 else 1000.0
        step_ms = max(device["latency_ms"], device["device_ms"])
        costs = [top * i / (_CURVE_POINTS - 1) for i in range(_CURVE_POINTS)]
        out[phase] = {
            "device_ms": device["device_ms"], "prebuilt_ms": step_ms, "kernels": n,
            "model": "speedup = 1 + kernels x us_per_kernel / step_us, the step being the device time "
                     "(device-bound) or our prebuilt step's latency (this host)",
            "columns": list(CURVE_COLUMNS),
            "curve": [[c, speedup_at(c, device["device_ms"], n), speedup_at(c, step_ms, n)] for c in costs],
            "published": ({"us_per_kernel": at["implied_us_per_kernel"], "speedup": at["published_speedup"]}
                          if at else None),
            "ours": ours,
        }
    return out


def _our_point(results: dict[str, Any], mode: str, phase: str, kernels: int) -> dict[str, float] | None:
    base, mine = phase_figures(results, "construct", phase), phase_figures(results, mode, phase)
    if base is None or mine is None or mode == "construct":
        return None
    return {"us_per_kernel": (base["latency_ms"] - mine["latency_ms"]) * 1000.0 / kernels,
            "speedup": base["latency_ms"] / mine["latency_ms"]}


# ---- the report --------------------------------------------------------------------------------


def implied_table(implied_: dict[str, Any], mode: str = "prebuilt") -> Table:
    """The figures of one mode (by default prebuilt: construction off both paths)."""
    t = Table(title="construction per kernel: the published speedups placed on our model", title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for col in ("phase", "kernels", "device\nms", "published\nspeedup", "implied\nµs/kernel",
                "ours\nµs/kernel", "ours /\nimplied"):
        t.add_column(col, justify="left" if col.startswith("phase") else "right", no_wrap=True)
    for phase, f in implied_.get(mode, {}).items():
        implied_us, ours_us = f["implied_us_per_kernel"], f["measured_us_per_kernel"]
        t.add_row(phase, f"{f['kernels']:,}", f"{f['device_ms']:,.1f}", f"{f['published_speedup']:.2f}x",
                  f"{implied_us:,.0f}", f"{ours_us:,.0f}", f"{ours_us / implied_us:.1f}x" if implied_us > 0 else "—")
    return t


def render_whatif(console: Console, whatif_: dict[str, Any], path: str | None = None) -> None:
    """A PNG at `path` when matplotlib is installed, else (or without a path) terminal plots."""
    if not whatif_:
        return
    if path:
        try:
            _png(whatif_, path)
            console.print(f"what-if plot written to {path}")
            return
        except ImportError:
            console.print("[yellow]matplotlib is not installed: the what-if curve is drawn here instead[/]")
    for phase, w in whatif_.items():
        _terminal_plot(console, phase, w)


def _png(whatif_: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(whatif_), figsize=(5.5 * len(whatif_), 4.2), squeeze=False)
    for ax, (phase, w) in zip(axes[0], whatif_.items(), strict=True):
        xs, device_bound, this_host = zip(*w["curve"], strict=True)
        ax.plot(xs, device_bound, label=f"device-bound ({w['device_ms']:,.1f} ms)")
        ax.plot(xs, this_host, "--", label=f"this host's prebuilt step ({w['prebuilt_ms']:,.1f} ms)")
        for key, marker in (("published", "s"), ("ours", "o")):
            if w[key]:
                ax.plot([w[key]["us_per_kernel"]], [w[key]["speedup"]], marker, label=key)
        ax.set_title(f"{phase}: {w['kernels']} kernels per step")
        ax.set_xlabel("construction per kernel (µs)")
        ax.set_ylabel("speedup of prebuilt plans")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _terminal_plot(console: Console, phase: str, w: dict[str, Any], width: int = 56, height: int = 10) -> None:
    """The curves as dots (device-bound ·, this host's prebuilt step :) and the points as
    letters (P published, O ours); the y axis reaches just past the points."""
    xs, device_bound, this_host = (list(c) for c in zip(*w["curve"], strict=True))
    marks = [(w[key]["us_per_kernel"], w[key]["speedup"], ch) for key, ch in (("published", "P"), ("ours", "O"))
             if w[key]]
    x_hi = max(xs + [x for x, _, _ in marks]) or 1.0
    y_hi = max([y for _, y, _ in marks] or device_bound) * 1.25
    grid = [[" "] * width for _ in range(height)]

    def put(x: float, y: float, ch: str) -> None:
        if y > y_hi:
            return
        col = min(width - 1, int(round(x / x_hi * (width - 1))))
        row = height - 1 - int(round((y - 1.0) / max(y_hi - 1.0, 1e-9) * (height - 1)))
        grid[min(max(row, 0), height - 1)][col] = ch

    for col in range(width):  # the curves at every column, not only at their sample points
        x = x_hi * col / (width - 1)
        put(x, float(np.interp(x, xs, this_host)), ":")
        put(x, float(np.interp(x, xs, device_bound)), "·")
    for x, y, ch in marks:
        put(x, y, ch)
    console.print(f"{phase}: speedup of prebuilt plans against construction per kernel ({w['kernels']} kernels)",
                  markup=False, highlight=False)
    console.print(f"  · device-bound ({w['device_ms']:,.1f} ms)  : this host ({w['prebuilt_ms']:,.1f} ms)"
                  "  P published  O ours", markup=False, highlight=False)
    for i, line in enumerate(grid):
        y = y_hi - (y_hi - 1.0) * i / (height - 1)
        label = f"{y:6.2f}x|" if i % 3 == 0 or i == height - 1 else "       |"
        console.print(label + "".join(line), markup=False, highlight=False, emoji=False)
    console.print("       +" + "-" * width, markup=False, highlight=False)
    console.print(f"        0{'µs per kernel'.center(width - 12)}{x_hi:,.0f}", markup=False, highlight=False)
