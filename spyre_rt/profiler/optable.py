"""The per-op table: device time grouped by kernel, op, module or layer, against the roofline.

Like ``torch.profiler``'s ``key_averages()``, rows aggregate the jobs of one key: calls,
host µs (launch calls), device µs, its share of all device time, avg/min/max, and — where
the jobs carry kernel info (:mod:`spyre_rt.job_facts`) and the trace carries the card's
figures — the share of the device time the roofline accounts for (compute: FLOPs at the MAC
rate; DRAM: minimum bytes at the bandwidth) and what bounds the row. Where the trace says
when each job computes (a job's ``fill_us`` and ``drain_us``), a column sums the time the
row's jobs ran with no compute command running: at their start, while the first operands
load, and at their end, while the last results store (their fill and drain).


- ``host``: the device sat idle waiting for the host before these jobs longer than they ran;
- ``latency``: their work is less than the card's fixed cost per job;
- ``compute`` / ``DRAM``: the larger of the two roofline times.

Groupings (``--group-by``): ``kernel`` (the job's name), ``op`` (the default: aten ops and
module path, layers folded together: ``mm · layers.*.mlp.up_proj``), ``module`` (the path
alone), ``layer`` (``layers.3``; kernels outside the layers by their module). Jobs without
kernel info keep their own name in every grouping.

:func:`ops_table` draws the rows at a given width: the name column keeps room for a
readable name and numeric columns give way (the least telling first); a name that is still
too long loses its middle, never its tail.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich import box
from rich.table import Table
from rich.text import Text

from ..cost import CostModel
from ..job_facts import module_path, op_names
from ..trace.data import TraceData, Window, device, job_waits, window
from .roofline import HOST, kernel_figures

GROUPINGS = ("kernel", "op", "module", "layer")
DEFAULT_GROUPING = "op"
NAME_HEADERS = {"kernel": "kernel", "op": "op · module", "module": "module", "layer": "layer"}

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")  # a ModuleList index in a module path
_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")  # the path up to the first index


# ---- grouping ----------------------------------------------------------------------------------


def group_name(job_name: str, info: dict[str, Any] | None, by: str) -> str:
    """The row a job falls in, grouped `by` one of :data:`GROUPINGS`."""
    if by not in GROUPINGS:
        raise ValueError(f"group by one of {', '.join(GROUPINGS)}, not {by!r}")
    if by == "kernel" or not info:
        return job_name
    module = module_path(info)
    across_layers = _INDEX.sub(".*", module) if module else None
    if by == "module":
        return across_layers or job_name
    if by == "layer":
        if not module:
            return job_name
        m = _LAYER.match(module)
        return m.group(1) if m else module
    ops = op_names(info)
    return " · ".join(x for x in (ops, across_layers) if x) or job_name


# ---- the rows ----------------------------------------------------------------------------------


@dataclass
class OpRow:
    name: str
    calls: int  # jobs (or launches, for a name that only launches, like a plan)
    host_us: float  # launch calls on the host
    device_us: float  # job durations
    step_pct: float  # share of all device time in the window
    avg_us: float | None = None
    min_us: float | None = None
    max_us: float | None = None
    compute_pct: float | None = None  # compute roofline time over the device time of the jobs with info
    dram_pct: float | None = None  # DRAM roofline time over the same
    bound: str | None = None
    host_wait_us: float = 0.0  # device idle, waiting for the host, just before these jobs
    edges_us: float = 0.0  # of device_us: the jobs' fill and drain (no compute command running)


@dataclass
class _Acc:
    durations: list[float] = field(default_factory=list)
    host_us: float = 0.0
    launches: int = 0
    wait_us: float = 0.0
    compute_ns: float = 0.0
    dram_ns: float = 0.0
    known_us: float = 0.0  # device time of the jobs with kernel figures
    known_calls: int = 0
    edges_us: float = 0.0


def op_table(data: TraceData, win: Window | None = None, device_pid: Any = None,
             by: str = DEFAULT_GROUPING) -> list[OpRow]:
    """One row per group of jobs (and launches) of a device that start inside the window
    (default: the whole trace); biggest device time first."""
    a, b = win or window(data)
    dev = device(data, device_pid)
    roofline = CostModel.of_trace_metadata(data.metadata)
    groups: dict[str, _Acc] = defaultdict(_Acc)
    info_of = data.jobs[dev].info if dev is not None else {}
    group_of = functools.cache(lambda name: group_name(name, info_of.get(name), by))
    if dev is not None:
        _add_jobs(groups, data, dev, (a, b), group_of, roofline)
    _add_launches(groups, data, dev, (a, b), group_of)
    total = sum(sum(g.durations) for g in groups.values())
    rows = [_row(name, g, total, roofline) for name, g in groups.items()]
    rows.sort(key=lambda r: (-r.device_us, -r.host_us, r.name))
    return rows


def _add_jobs(groups: dict[str, _Acc], data: TraceData, dev: Any, win: Window, group_of: Callable[[str], str],
              roofline: CostModel | None) -> None:
    a, b = win
    jobs = data.jobs[dev]
    waits = job_waits(data, dev, win)
    host_wait = np.where(waits.on_host, waits.gap_us, 0.0)
    inside = np.flatnonzero((jobs.start >= a) & (jobs.start < b))
    edges = jobs.edges if len(jobs.edges) == len(jobs.start) else np.zeros(len(jobs.start))
    figures = {name: kernel_figures(info) for name, info in jobs.info.items()}
    for i in inside.tolist():
        name = jobs.name[i]
        g = groups[group_of(name)]
        d = float(jobs.end[i] - jobs.start[i])
        g.durations.append(d)
        g.wait_us += float(host_wait[i])
        g.edges_us += float(edges[i])
        fig = figures.get(name)
        if fig is not None and roofline is not None:
            flops, nbytes, dtype = fig
            g.compute_ns += roofline.compute_ns(flops, dtype)
            g.dram_ns += roofline.dram_ns(nbytes)
            g.known_us += d
            g.known_calls += 1


def _add_launches(groups: dict[str, _Acc], data: TraceData, dev: Any, win: Window,
                  group_of: Callable[[str], str]) -> None:
    a, b = win
    ls = data.launches
    mine = np.ones(len(ls.op), bool) if dev is None else (ls.card == data.card_of(dev)) | (ls.card < 0)
    for op, s, e, ok in zip(ls.op, ls.start.tolist(), ls.end.tolist(), mine.tolist(), strict=True):
        if ok and a <= s < b:
            g = groups[group_of(op)]
            g.host_us += e - s
            g.launches += 1


def _row(name: str, g: _Acc, total_us: float, roofline: CostModel | None) -> OpRow:
    d = g.durations
    device_us = float(sum(d))
    row = OpRow(name, len(d) or g.launches, g.host_us, device_us, 100.0 * device_us / total_us if total_us > 0 else 0.0,
                device_us / len(d) if d else None, min(d) if d else None, max(d) if d else None,
                host_wait_us=g.wait_us, edges_us=g.edges_us)
    if g.known_calls and g.known_us > 0 and roofline is not None:
        row.compute_pct = 100.0 * g.compute_ns / 1000 / g.known_us
        row.dram_pct = 100.0 * g.dram_ns / 1000 / g.known_us
        row.bound = roofline.bound_of(g.compute_ns, g.dram_ns, g.known_calls)
    if d and g.wait_us >= device_us:
        row.bound = HOST
    return row


def totals(rows: list[OpRow]) -> OpRow:
    """The table's total row (roofline shares over the rows that have them)."""
    known = [r for r in rows if r.compute_pct is not None and r.device_us > 0]
    known_us = sum(r.device_us for r in known)
    device_us = sum(r.device_us for r in rows)
    out = OpRow("total", sum(r.calls for r in rows), sum(r.host_us for r in rows), device_us,
                100.0 if device_us > 0 else 0.0, host_wait_us=sum(r.host_wait_us for r in rows),
                edges_us=sum(r.edges_us for r in rows))
    if known_us > 0:
        out.compute_pct = sum(r.compute_pct * r.device_us for r in known) / known_us
        out.dram_pct = sum(r.dram_pct * r.device_us for r in known) / known_us
    return out


# ---- drawing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Column:
    header: str  # lines split by "\n"
    cell: Callable[[OpRow], str]
    keep: int  # the higher, the longer the column stays when space runs out


def _us(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.1f}"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.1f}"


COLUMNS = (
    _Column("calls", lambda r: f"{r.calls:,}", 6),
    _Column("host\nµs", lambda r: _us(r.host_us), 3),
    _Column("device\nµs", lambda r: _us(r.device_us), 10),
    _Column("% of\nstep", lambda r: f"{r.step_pct:.1f}", 9),
    _Column("avg\nµs", lambda r: _us(r.avg_us) if r.avg_us is not None else "", 2),
    _Column("min\nµs", lambda r: _us(r.min_us) if r.min_us is not None else "", 1),
    _Column("max\nµs", lambda r: _us(r.max_us) if r.max_us is not None else "", 1),
    _Column("fill +\ndrain µs", lambda r: _us(r.edges_us) if r.edges_us > 0 else "", 5),
    _Column("compute\n% roof", lambda r: _pct(r.compute_pct), 7),
    _Column("DRAM\n% roof", lambda r: _pct(r.dram_pct), 7),
    _Column("bound", lambda r: r.bound or "", 8),
)
NAME_MIN = 24  # the name column keeps this much (or its widest name) before numbers give way
_GAP = 3  # between columns: a space of padding either side of the divider


def ellipsize(text: str, width: int) -> str:
    """`text` in `width` characters: the middle gives way to "…", keeping a third of the
    width for the head and the rest for the tail (a module path's meaningful end)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[-width:] if width > 0 else ""
    head = (width - 1) // 3
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def fit_columns(names: list[str], cells: list[list[str]], width: int,
                columns: Sequence[_Column] = COLUMNS) -> tuple[list[int], int]:
    """Which of the `columns` fit beside the name column in `width` characters, and the
    name column's width. Empty columns go first; then columns are dropped by their ``keep``
    rank (lowest first, the rightmost of equals first) until the name column has at least
    :data:`NAME_MIN` (or its widest name, if less)."""
    widths = [max(len(line) for text in [col.header, *(c[i] for c in cells)] for line in text.split("\n"))
              for i, col in enumerate(columns)]
    natural = max(len(n) for n in names)
    want = min(natural, NAME_MIN)
    shown = [i for i in range(len(columns)) if any(c[i] for c in cells)]
    drop_order = sorted(shown, key=lambda i: (columns[i].keep, -i))
    while True:
        room = width - sum(widths[i] + _GAP for i in shown)
        if room >= want or len(shown) <= 1:
            return shown, max(min(room, natural), min(want, 8))
        shown.remove(drop_order.pop(0))


def roofline_caption(roofline: CostModel) -> str:
    return (f"% roof: the share of the device time the card's roofline accounts for — compute: FLOPs at "
            f"{roofline.card_macs_per_ns:,.0f} MAC/ns; DRAM: minimum bytes at {roofline.dram_bytes_per_ns:,.0f} GB/s")


def ops_table(rows: list[OpRow], width: int, top: int | None = None, title: str = "per-op summary",
              by: str = DEFAULT_GROUPING, caption: str | None = None) -> Table:
    """The rows (the first `top`) with a total row, drawn to fit `width` columns."""
    shown = rows if top is None else rows[:top]
    every = [*shown, totals(rows)]
    cells = [[col.cell(r) for col in COLUMNS] for r in every]
    more = f"… {len(rows) - len(shown)} more"
    header = NAME_HEADERS.get(by, "name")
    columns, name_w = fit_columns([r.name for r in every] + [more, header], cells, width)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  padding=(0, 1), collapse_padding=False, caption=caption, caption_justify="left",
                  caption_style="dim")
    table.add_column(ellipsize(header, name_w), width=name_w, no_wrap=True, overflow="crop")
    for i in columns:
        table.add_column(COLUMNS[i].header, justify="right", no_wrap=True)
    for r, c in zip(shown, cells, strict=False):
        table.add_row(Text(ellipsize(r.name, name_w)), *(c[i] for i in columns))
    if len(shown) < len(rows):
        table.add_row(Text(ellipsize(more, name_w), style="dim"), *("" for _ in columns))
    if rows:
        table.add_section()
        table.add_row(Text("total", style="bold"), *(Text(cells[-1][i], style="bold") for i in columns))
    return table
