"""Two traces, or two ``spyre-profile run`` result files, side by side with their deltas.

A result file is the JSON ``spyre-profile run --json`` writes, in any of its formats::

    {"format": 2, "model": ..., "batch": ..., "seq": ..., "device_profile": ..., "host": {...},
     "results": {MODE: {"prefill_ms": ..., "decode_ms_per_token": ..., "host_ms": ...,
                        "device_ms": ..., "device_wait_host_ms": ...,
                        "phases": {PHASE: {"latency_ms": ..., ...}}}},
     "speedups": {MODE: {PHASE: ...}}, "spread": {"speedups": {MODE: {PHASE: {"min", "max"}}}},
     "compute_share": {...}, "path_shares": {PHASE: {"transfer", "compute"}},
     "efficiency": {PHASE: {...}}, "implied": {MODE: {PHASE: {...}}}}

(format 1 had only the five figures per mode and the speedups). Nested figures are
compared by their dotted path (``phases.decode.latency_ms``); text figures (a bound) are
noted where they differ.

:func:`load` tells the two kinds apart by content; ``compare_traces``/``compare_results``
compute the tables and ``render`` prints them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..trace import data as tracedata
from ..trace.file import TraceFile
from . import optable, view

RESULT_METRICS = ("prefill_ms", "decode_ms_per_token", "host_ms", "device_ms", "device_wait_host_ms")
RUN_KEYS = ("model", "layers", "batch", "seq", "decode_steps", "repeats", "sim_mode", "device_profile")
# Sections of a result file compared figure by figure: title, and the figures shown (None: all).
SECTIONS = {
    "compute_share": ("share of the gain from the compute path", None),
    "path_shares": ("share of the gain from each path alone (prebuilt-transfer, prebuilt-compute)", None),
    "efficiency": ("device efficiency (per prefill, per decode token)",
                   ("device_ms", "roofline_ms", "fraction", "analytic.roofline_ms", "bound")),
    "implied": ("construction per kernel: implied by the published speedups, and ours",
                ("kernels", "device_ms", "implied_us_per_kernel", "measured_us_per_kernel", "measured_speedup")),
}


@dataclass
class Delta:
    """One figure in A and in B (None where a side lacks it)."""

    name: str
    a: float | None
    b: float | None
    higher_is_better: bool | None = False  # None: a change is neither good nor bad
    digits: int | None = None  # decimals to show (None: the table's default)
    relative: bool = True  # False for figures that are already shares (a % of a % misleads)
    spread_a: tuple[float, float] | None = None  # min and max over A's repeats
    spread_b: tuple[float, float] | None = None

    @property
    def delta(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a

    @property
    def pct(self) -> float | None:
        d = self.delta
        return None if d is None or not self.a or not self.relative else 100.0 * d / abs(self.a)

    @property
    def better(self) -> bool | None:
        d = self.delta
        if not d or self.higher_is_better is None:
            return None
        return (d > 0) == self.higher_is_better


@dataclass
class OpDelta:
    name: str
    calls_a: int
    calls_b: int
    device: Delta
    host: Delta


@dataclass
class TraceComparison:
    label_a: str
    label_b: str
    summary: list[Delta]
    ops: list[OpDelta]


@dataclass
class ResultsComparison:
    label_a: str
    label_b: str
    run: list[tuple[str, Any, Any]]  # (key, A, B) of what was run
    modes: dict[str, list[Delta]]
    speedups: list[Delta]
    notes: list[str] = field(default_factory=list)
    sections: dict[str, list[Delta]] = field(default_factory=dict)  # by SECTIONS title


# ---- loading -------------------------------------------------------------------------------


def load(path: str | os.PathLike[str], results: bool | None = None) -> tuple[str, Any]:
    """("trace", TraceData) or ("results", dict) for a file; `results` forces the kind.

    A trace is streamed, never parsed whole. Raises ValueError naming the problem when the
    file is neither."""
    path = os.fspath(path)
    with TraceFile(path) as f:
        if f.has_events and results:
            raise ValueError(f"{path}: a trace, not a result file")
        if f.has_events:
            return "trace", tracedata.read(f)
        doc = f.header
    if results or (results is None and "results" in doc):
        return "results", validate_results(doc, path)
    if "results" in doc:
        raise ValueError(f"{path}: a result file, not a trace")
    raise ValueError(f"{path}: no 'traceEvents' array")


def validate_results(obj: Any, where: str = "results") -> dict[str, Any]:
    """Check the shape of a ``spyre-profile run`` result dict (any format)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a result file is a JSON object, not a JSON {type(obj).__name__}")
    res = obj.get("results")
    if not isinstance(res, dict) or not res:
        raise ValueError(f"{where}: no 'results' object of modes "
                         "(is this a `spyre-profile run --json` file?)")
    for mode, figures in res.items():
        if not isinstance(figures, dict):
            raise ValueError(f"{where}: results[{mode!r}] must be an object of figures")
        _check_figures(figures, f"results[{mode!r}]", where)
    for key in ("speedups", "spread", "compute_share", "path_shares", "efficiency", "implied"):
        if not isinstance(obj.get(key, {}), dict):
            raise ValueError(f"{where}: {key!r} must be an object")
    return obj


def _check_figures(figures: dict[str, Any], path: str, where: str) -> None:
    """Figures are numbers (or null), or objects of figures."""
    for key, value in figures.items():
        if isinstance(value, dict):
            _check_figures(value, f"{path}[{key!r}]", where)
        elif value is not None and not _is_number(value):
            raise ValueError(f"{where}: {path}[{key!r}] must be a number, not {value!r}")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# ---- computing -----------------------------------------------------------------------------


def compare_traces(a: view.TraceData, b: view.TraceData, label_a: str = "A", label_b: str = "B",
                   by: str = optable.DEFAULT_GROUPING) -> TraceComparison:
    """Device time breakdown and per-op (grouped `by`) device/host µs of two whole traces."""
    ia, ib = view.idle_breakdown(a), view.idle_breakdown(b)
    ca, cb = view.critical_path(a), view.critical_path(b)
    summary = [
        Delta("span µs", ia.span_us, ib.span_us),
        Delta("busy µs", ia.busy_us, ib.busy_us),
        Delta("idle, waiting on the host µs", ia.idle_host_us, ib.idle_host_us),
        Delta("idle, waiting on data/other µs", ia.idle_other_us, ib.idle_other_us),
        Delta("host-bound %", ca.host_pct, cb.host_pct, relative=False),
        Delta("jobs", float(ia.jobs), float(ib.jobs), higher_is_better=None, digits=0),
    ]
    oa = {o.name: o for o in optable.op_table(a, by=by)}
    ob = {o.name: o for o in optable.op_table(b, by=by)}
    ops = []
    for name in oa.keys() | ob.keys():
        x, y = oa.get(name), ob.get(name)
        ops.append(OpDelta(name, x.calls if x else 0, y.calls if y else 0,
                           Delta("device µs", x.device_us if x else None, y.device_us if y else None),
                           Delta("host µs", x.host_us if x else None, y.host_us if y else None)))
    ops.sort(key=lambda o: (-max(o.device.a or 0.0, o.device.b or 0.0), o.name))
    return TraceComparison(label_a, label_b, summary, ops)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested figures as dotted keys: {"prebuilt": {"prefill": 1.7}} -> {"prebuilt.prefill": 1.7}.
    Numbers and strings are kept; anything else (lists) is left out."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif _is_number(d) or isinstance(d, str):
        out[prefix[:-1]] = d
    return out


_NEUTRAL = {"roofline_ms", "implied_ms_per_step", "implied_us_per_kernel", "published_speedup", "kernels",
            "kernels_with_info", "steps", "jobs"}
_LOWER_IS_BETTER = {"measured_us_per_kernel", "measured_ms_per_step", "native_calls"}


def _direction(key: str) -> bool | None:
    """Whether a higher value of a figure (by its dotted path) is better; None: neither."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf in ("fraction", "measured_speedup"):
        return True
    if leaf in _NEUTRAL or ".analytic." in f".{key}.":
        return None
    if leaf in _LOWER_IS_BETTER or leaf.endswith("_ms") or leaf.endswith("_ms_per_token"):
        return False
    return None


def _deltas(fa: dict[str, Any], fb: dict[str, Any], first: tuple[str, ...] = (),
            higher_is_better: bool | None | str = "auto", notes: list[str] | None = None,
            where: str = "", keep: tuple[str, ...] | None = None) -> list[Delta]:
    """A Delta per numeric figure of either side (`first` in that order, the rest as they
    come; only those whose path ends in one of `keep`, if given); text figures that differ
    become notes."""
    a, b = _flatten(fa), _flatten(fb)
    keys = [k for k in first if k in a or k in b] + [k for k in dict.fromkeys([*a, *b]) if k not in first]
    if keep is not None:
        keys = [k for k in keys if any(k == leaf or k.endswith("." + leaf) for leaf in keep)]
    out = []
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, str) or isinstance(vb, str):
            if notes is not None and va != vb:
                notes.append(f"{where}{k}: {va} vs {vb}")
            continue
        direction = _direction(k) if higher_is_better == "auto" else higher_is_better
        relative = not k.endswith("fraction") and not k.startswith("compute_share")
        out.append(Delta(k, _opt(va), _opt(vb), direction, relative=relative))
    return out


def compare_results(a: dict[str, Any], b: dict[str, Any], label_a: str = "A",
                    label_b: str = "B") -> ResultsComparison:
    """Per mode and figure (phases included), A vs B; speedups with their spreads (higher is
    better there); device efficiency, the compute path's share and the implied construction
    costs likewise."""
    run = [(k, a.get(k), b.get(k)) for k in RUN_KEYS if k in a or k in b]
    cpu_a, cpu_b = (x.get("host", {}).get("cpu") if isinstance(x.get("host"), dict) else None for x in (a, b))
    if cpu_a or cpu_b:
        run.append(("host", cpu_a, cpu_b))
    notes = [f"{k} differs: {va!r} vs {vb!r}" for k, va, vb in run if va != vb]
    modes: dict[str, list[Delta]] = {}
    ra, rb = a["results"], b["results"]
    for mode in list(ra) + [m for m in rb if m not in ra]:
        modes[mode] = _deltas(_unnest_phases(ra.get(mode, {})), _unnest_phases(rb.get(mode, {})), RESULT_METRICS)
    speedups = [d for d in _deltas(a.get("speedups", {}), b.get("speedups", {}), (), True)
                if not d.name.startswith("construct.")]  # the baseline is 1.00x by definition
    spread_a, spread_b = (_flatten(x.get("spread", {}).get("speedups", {})) for x in (a, b))
    for d in speedups:
        d.spread_a, d.spread_b = _range(spread_a, d.name), _range(spread_b, d.name)
    sections = {}
    for key, (title, keep) in SECTIONS.items():
        rows = _deltas(a.get(key) or {}, b.get(key) or {}, notes=notes, where=f"{key}.", keep=keep)
        if rows:
            sections[title] = rows
    return ResultsComparison(label_a, label_b, run, modes, speedups, notes, sections)


def _unnest_phases(figures: dict[str, Any]) -> dict[str, Any]:
    """A mode's figures with its phases beside them ("prefill.latency_ms", not "phases.prefill...")."""
    phases = figures.get("phases")
    rest = {k: v for k, v in figures.items() if k != "phases"}
    return {**rest, **phases} if isinstance(phases, dict) else rest


def _range(flat: dict[str, Any], key: str) -> tuple[float, float] | None:
    lo, hi = flat.get(f"{key}.min"), flat.get(f"{key}.max")
    return (lo, hi) if _is_number(lo) and _is_number(hi) else None


def _opt(v: Any) -> float | None:
    return float(v) if _is_number(v) else None


# ---- rendering -----------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "—"
    return f"{x:,.{min(digits, 1) if abs(x) >= 1000 else digits}f}"


def _delta_text(d: Delta, digits: int = 3) -> tuple[Text, Text]:
    style = {True: "green", False: "red", None: ""}[d.better]
    absolute = "—" if d.delta is None else f"{d.delta:+,.{digits}f}"
    pct = "—" if d.pct is None else f"{d.pct:+.1f} %"
    return Text(absolute, style=style), Text(pct, style=style)


def _delta_table(title: str, rows: list[Delta], label_a: str, label_b: str, digits: int = 3) -> Table:
    """A row per figure: A, B, their difference; with the spreads of A and B beside them
    when the figures have any (then the difference in % only, to fit 80 columns)."""
    spreads = any(d.spread_a or d.spread_b for d in rows)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  collapse_padding=True)
    table.add_column("", overflow="fold", min_width=min(32, max([len(d.name) for d in rows] + [1])))
    columns = (label_a, "spread", label_b, "spread", "Δ %") if spreads else (label_a, label_b, "Δ", "Δ %")
    for col in columns:
        table.add_column(Text(col), justify="right", no_wrap=True)
    for d in rows:
        n = digits if d.digits is None else d.digits
        a, b = _fmt(d.a, n), _fmt(d.b, n)
        absolute, pct = _delta_text(d, n)
        cells = [a, _span(d.spread_a, n), b, _span(d.spread_b, n), pct] if spreads else [a, b, absolute, pct]
        table.add_row(Text(d.name), *cells)
    return table


def _span(spread: tuple[float, float] | None, digits: int) -> str:
    return "" if spread is None else f"{_fmt(spread[0], digits)}–{_fmt(spread[1], digits)}"


def render_traces(console: Console, cmp: TraceComparison, top: int = 20) -> None:
    console.print(_delta_table("device time", cmp.summary, cmp.label_a, cmp.label_b, 1))
    table = Table(title="per-op device µs", title_justify="left")
    table.add_column("op")
    for col in (f"calls {cmp.label_a}", f"calls {cmp.label_b}", cmp.label_a, cmp.label_b, "Δ", "Δ %"):
        table.add_column(Text(col), justify="right")
    for o in cmp.ops[:top]:
        table.add_row(Text(o.name), str(o.calls_a), str(o.calls_b), _fmt(o.device.a, 1), _fmt(o.device.b, 1),
                      *_delta_text(o.device, 1))
    if len(cmp.ops) > top:
        table.add_row(f"… {len(cmp.ops) - top} more", "", "", "", "", "", "", style="dim")
    console.print()
    console.print(table)


def render_results(console: Console, cmp: ResultsComparison) -> None:
    if cmp.run:
        table = Table(title="run", title_justify="left")
        for col in ("", cmp.label_a, cmp.label_b):
            table.add_column(Text(col))
        for key, va, vb in cmp.run:
            table.add_row(key, Text(str(va)), Text(str(vb)), style="" if va == vb else "yellow")
        console.print(table)
    for note in cmp.notes:
        console.print(Text(f"note: {note}", style="yellow"))
    for mode, rows in cmp.modes.items():
        console.print()
        console.print(_delta_table(f"mode {mode}", rows, cmp.label_a, cmp.label_b))
    if cmp.speedups:
        console.print()
        console.print(_delta_table("speedups (spread: min–max over the repeats)", cmp.speedups, cmp.label_a,
                                   cmp.label_b, 2))
    for title, rows in cmp.sections.items():
        console.print()
        console.print(_delta_table(title, rows, cmp.label_a, cmp.label_b))


def render(console: Console, cmp: TraceComparison | ResultsComparison, top: int = 20) -> None:
    """Print a comparison made by :func:`compare_traces` or :func:`compare_results`."""
    with view.ascii_safe(console):
        console.print(Text(f"A = {cmp.label_a}    B = {cmp.label_b}", style="bold"))
        if isinstance(cmp, TraceComparison):
            render_traces(console, cmp, top)
        else:
            render_results(console, cmp)
