"""Two traces, or two ``spyre-profile run`` result files, side by side with their deltas.

A result file is the JSON ``spyre-profile run --json`` writes::

    {"model": ..., "batch": ..., "seq": ..., "device_profile": ...,
     "results": {MODE: {"prefill_ms": ..., "decode_ms_per_token": ..., "host_ms": ...,
                        "device_ms": ..., "device_wait_host_ms": ...}},
     "speedups": {...}}

:func:`load` tells the two kinds apart by content; ``compare_traces``/``compare_results``
compute the tables and ``render`` prints them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import optable, tracedata, view
from .tracefile import TraceFile

RESULT_METRICS = ("prefill_ms", "decode_ms_per_token", "host_ms", "device_ms", "device_wait_host_ms")
RUN_KEYS = ("model", "batch", "seq", "device_profile")


@dataclass
class Delta:
    """One figure in A and in B (None where a side lacks it)."""

    name: str
    a: float | None
    b: float | None
    higher_is_better: bool | None = False  # None: a change is neither good nor bad
    digits: int | None = None  # decimals to show (None: the table's default)
    relative: bool = True  # False for figures that are already shares (a % of a % misleads)

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
    """Check the shape of a ``spyre-profile run`` result dict."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a result file is a JSON object, not a JSON {type(obj).__name__}")
    res = obj.get("results")
    if not isinstance(res, dict) or not res:
        raise ValueError(f"{where}: no 'results' object of modes "
                         "(is this a `spyre-profile run --json` file?)")
    for mode, figures in res.items():
        if not isinstance(figures, dict):
            raise ValueError(f"{where}: results[{mode!r}] must be an object of figures")
        for key, value in figures.items():
            if value is not None and not _is_number(value):
                raise ValueError(f"{where}: results[{mode!r}][{key!r}] must be a number, not {value!r}")
    speedups = obj.get("speedups", {})
    if not isinstance(speedups, dict):
        raise ValueError(f"{where}: 'speedups' must be an object")
    return obj


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


def _flatten(d: Any, prefix: str = "") -> dict[str, float]:
    """Nested numbers as dotted keys: {"prebuilt": {"prefill": 1.7}} -> {"prebuilt.prefill": 1.7}."""
    out: dict[str, float] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif _is_number(d):
        out[prefix[:-1]] = float(d)
    return out


def compare_results(a: dict[str, Any], b: dict[str, Any], label_a: str = "A",
                    label_b: str = "B") -> ResultsComparison:
    """Per mode and figure, A vs B; speedups likewise (higher is better there)."""
    run = [(k, a.get(k), b.get(k)) for k in RUN_KEYS if k in a or k in b]
    notes = [f"{k} differs: {va!r} vs {vb!r}" for k, va, vb in run if va != vb]
    modes: dict[str, list[Delta]] = {}
    ra, rb = a["results"], b["results"]
    for mode in list(ra) + [m for m in rb if m not in ra]:
        fa, fb = ra.get(mode, {}), rb.get(mode, {})
        keys = [k for k in RESULT_METRICS if k in fa or k in fb]
        keys += [k for k in list(fa) + list(fb) if k not in keys and k not in RESULT_METRICS]
        modes[mode] = [Delta(k, _opt(fa.get(k)), _opt(fb.get(k))) for k in dict.fromkeys(keys)]
    sa, sb = _flatten(a.get("speedups", {})), _flatten(b.get("speedups", {}))
    speedups = [Delta(k, sa.get(k), sb.get(k), higher_is_better=True) for k in dict.fromkeys([*sa, *sb])]
    return ResultsComparison(label_a, label_b, run, modes, speedups, notes)


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
    table = Table(title=title, title_justify="left")
    table.add_column("")
    for col in (label_a, label_b, "Δ", "Δ %"):
        table.add_column(Text(col), justify="right")
    for d in rows:
        n = digits if d.digits is None else d.digits
        table.add_row(Text(d.name), _fmt(d.a, n), _fmt(d.b, n), *_delta_text(d, n))
    return table


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
        console.print(_delta_table("speedups", cmp.speedups, cmp.label_a, cmp.label_b))


def render(console: Console, cmp: TraceComparison | ResultsComparison, top: int = 20) -> None:
    """Print a comparison made by :func:`compare_traces` or :func:`compare_results`."""
    with view.ascii_safe(console):
        console.print(Text(f"A = {cmp.label_a}    B = {cmp.label_b}", style="bold"))
        if isinstance(cmp, TraceComparison):
            render_traces(console, cmp, top)
        else:
            render_results(console, cmp)
