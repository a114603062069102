"""A trace in the terminal: timeline, per-op table, idle-time breakdown, critical path.

:func:`load` streams a trace file into arrays (:func:`parse` does the same for a trace
dict; both from :mod:`spyre_rt.trace.data`); the ``timeline``/``idle_breakdown``/``critical_path``
functions compute numbers from them, :mod:`.optable` the per-op table; :func:`render` prints them with a rich
``Console``. Times are µs; a window is an absolute ``(start, end)`` pair, and
:func:`window` makes one from times relative to the trace's first event (what
``--window`` takes and what Perfetto shows); ``TraceData.span`` gives a host span's.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console, ConsoleOptions, RenderableType, RenderHook, RenderResult
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from ..cost import CostModel
from ..trace.data import Counter, Jobs, TraceData, Track, Window, device, job_waits, load, parse, window
from . import optable
from .roofline import compute_bound

__all__ = ["TraceData", "Window", "load", "parse", "window", "timeline", "idle_breakdown", "critical_path",
           "render", "ascii_safe"]

_CORE_TRACK = re.compile(r"^core (\d+) · (.+?)(?: \(\d+\))?$")
_SHADES = " ░▒▓█"
_SPARK = " ▁▂▃▄▅▆▇█"
# One character for one, so that tables measured before the substitution stay aligned.
_ASCII = str.maketrans("·µ—–…│→Δ░▒▓█▁▂▃▄▅▆▇", "-u--+|>D.:*#_.-=+*%")
_STYLE = {"host": "cyan", "launch": "bright_cyan", "jobs": "magenta", "pcie-h2d": "yellow",
          "pcie-d2h": "yellow", "ctrl": "white", "load": "green", "store": "bright_green", "pt": "red",
          "sfu": "blue", "ring": "bright_white", "counter": "bright_black"}


# ---- timeline ------------------------------------------------------------------------------


@dataclass
class TimelineRow:
    label: str
    group: str  # the style key
    level: np.ndarray  # per column, 0..1
    counter: bool = False
    note: str = ""


def _busy_per_bin(start: np.ndarray, end: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Busy time of the events inside each [edges[k], edges[k+1]) (overlaps count twice).

    The busy time before t, sum(clip(t - s, 0, e - s)), is evaluated at every edge from
    sorted starts and ends with prefix sums: O((n + bins) log n), not n x bins."""
    a, b = edges[0], edges[-1]
    s = np.sort(np.clip(start, a, b) - a)
    e = np.sort(np.clip(end, a, b) - a)
    x = edges - a
    cs = np.r_[0.0, np.cumsum(s)]
    ce = np.r_[0.0, np.cumsum(e)]
    ks = np.searchsorted(s, x, "right")
    ke = np.searchsorted(e, x, "right")
    before = (x * ks - cs[ks]) - (x * ke - ce[ke])
    return np.diff(before)


def _counter_levels(c: Counter, edges: np.ndarray) -> np.ndarray:
    """The largest value a step counter takes in each bin."""
    nb = len(edges) - 1
    carried_idx = np.searchsorted(c.t, edges[:-1], "right") - 1
    out = np.where(carried_idx >= 0, c.v[np.maximum(carried_idx, 0)], 0.0) if len(c.t) else np.zeros(nb)
    bins = np.searchsorted(edges, c.t, "right") - 1
    inside = (bins >= 0) & (bins < nb)
    np.maximum.at(out, bins[inside], c.v[inside])
    return out


def timeline(data: TraceData, win: Window | None = None, columns: int = 80,
             aggregate_above: int = 4) -> list[TimelineRow]:
    """One row per track over the window; per-core tracks are merged per engine kind
    ("pt (32 cores)", level = share of those cores busy) when more than `aggregate_above`
    cores appear on a device."""
    a, b = win or window(data)
    edges = np.linspace(a, b if b > a else a + 1e-3, max(1, columns) + 1)
    width = edges[1] - edges[0]
    rows: list[TimelineRow] = []
    by_pid: dict[int, list[Track]] = defaultdict(list)
    for t in data.tracks:
        by_pid[t.pid].append(t)
    for pid, tracks in by_pid.items():
        per_core = {t.tid: m for t in tracks if (m := _CORE_TRACK.match(t.name))}
        merge = len({int(m.group(1)) for m in per_core.values()}) > aggregate_above
        kinds: dict[str, list[Track]] = defaultdict(list)
        for t in tracks:
            m = per_core.get(t.tid)
            if merge and m:
                kinds[m.group(2)].append(t)
                continue
            busy = _busy_per_bin(t.start, t.end, edges) / width
            rows.append(TimelineRow(_track_label(t, data), _group(t, m), np.clip(busy, 0.0, 1.0)))
        for kind, ts in kinds.items():
            n = len({int(per_core[t.tid].group(1)) for t in ts})
            starts, ends = np.concatenate([t.start for t in ts]), np.concatenate([t.end for t in ts])
            busy = _busy_per_bin(starts, ends, edges) / (width * n)
            label = f"{kind} ({n} core{'s' if n > 1 else ''})"
            rows.append(TimelineRow(label, kind, np.clip(busy, 0.0, 1.0)))
        for c in data.counters:
            if c.pid == pid:
                level = _counter_levels(c, edges)
                peak = float(level.max())
                rows.append(TimelineRow(c.name, "counter", level / peak if peak > 0 else level, True,
                                        f"peak {_num(peak)}"))
    return rows


def _group(t: Track, core_match: re.Match | None) -> str:
    """The style key of a track."""
    if core_match:
        return core_match.group(2)
    if t.name.startswith("launch"):
        return "launch"
    return "host" if t.process == "host" else t.name


def _track_label(t: Track, data: TraceData) -> str:
    many = len({x.process for x in data.tracks}) > 2 and t.process != "host"
    return f"{t.process} {t.name}" if many else t.name


_LABEL_W = 28  # widest track label drawn
_NOTE_W = 16  # room for "peak 8,388,608" after a row


def _glyph(x: float, palette: str) -> str:
    """palette[0] for nothing, then evenly spaced levels; any activity at all shows."""
    return palette[0] if x <= 0 else palette[min(len(palette) - 1, 1 + int(x * (len(palette) - 1)))]


def render_timeline(console: Console, rows: list[TimelineRow], win: Window, data: TraceData) -> None:
    label_w = min(_LABEL_W, max([len(r.label) for r in rows] + [8]))
    note_w = max([len(r.note) for r in rows] + [0])
    cols = len(rows[0].level) if rows else 0
    left, right = f"{win[0] - data.t0:,.1f} µs", f"{win[1] - data.t0:,.1f} µs"
    axis = Text(" " * (label_w + 1))
    axis.append(left + right.rjust(max(1, cols - len(left))), style="dim")
    console.print(axis, no_wrap=True, overflow="crop")
    for r in rows:
        palette = _SPARK if r.counter else _SHADES
        line = Text(r.label[:label_w].ljust(label_w) + "│")
        line.append("".join(_glyph(x, palette) for x in r.level.tolist()), style=_STYLE.get(r.group, "white"))
        line.append("│ " + r.note.ljust(note_w), style="dim")
        console.print(line, no_wrap=True, overflow="crop")


# ---- idle time and critical path -----------------------------------------------------------


@dataclass
class Stall:
    """A gap in which the device waited for the host to launch `job`."""

    job: str
    at_us: float  # when the gap began, relative to the trace's first event
    gap_us: float


@dataclass
class IdleBreakdown:
    span_us: float
    busy_us: float
    idle_host_us: float  # the next job's launch had not reached the device yet
    idle_other_us: float  # launched and queued, not yet started (job launch latency, data)
    jobs: int
    stalls: list[Stall] = field(default_factory=list)  # the longest host stalls, longest first
    edges_us: float = 0.0  # of busy_us: the jobs' fill and drain, no compute command running

    def pct(self, us: float) -> float:
        return 100.0 * us / self.span_us if self.span_us > 0 else 0.0


@dataclass
class CriticalPath:
    span_us: float
    host_bound_us: float
    device_bound_us: float
    stalls: list[Stall]

    @property
    def host_pct(self) -> float:
        return 100.0 * self.host_bound_us / self.span_us if self.span_us > 0 else 0.0

    @property
    def device_pct(self) -> float:
        return 100.0 * self.device_bound_us / self.span_us if self.span_us > 0 else 0.0


def idle_breakdown(data: TraceData, win: Window | None = None, device_pid=None, stalls: int = 3) -> IdleBreakdown:
    """Where the device's time went over the window: busy, idle waiting on the host (see
    :func:`~.tracedata.job_waits`), idle otherwise. After the last job the device waits on
    the host."""
    a, b = win or window(data)
    dev = device(data, device_pid)
    if dev is None:
        return IdleBreakdown(b - a, 0.0, b - a, 0.0, 0)
    jobs = data.jobs[dev]
    waits = job_waits(data, dev, (a, b))
    inside = np.maximum(0.0, np.minimum(jobs.end, b) - np.maximum(jobs.start, a))
    counted = (inside > 0) | ((a <= jobs.start) & (jobs.start < b))
    host = float(waits.gap_us[waits.on_host].sum()) + max(0.0, b - max(waits.last_end_us, a))
    stalled = np.flatnonzero(waits.on_host & (waits.gap_us > 0))
    longest = stalled[np.argsort(-waits.gap_us[stalled], kind="stable")[:stalls]]
    found = [Stall(jobs.name[i], float(waits.after_us[i]) - data.t0, float(waits.gap_us[i])) for i in longest.tolist()]
    return IdleBreakdown(b - a, float(inside.sum()), host, float(waits.gap_us[~waits.on_host].sum()),
                         int(counted.sum()), found, _compute_bound_edges(data, jobs, inside))


def _compute_bound_edges(data: TraceData, jobs: Jobs, inside: np.ndarray) -> float:
    """The fill and drain (µs, within the window) of the compute-bound jobs: time their
    arrays wait while the first operands load and the last results store. A DRAM-bound
    job's are left out: DRAM works through them."""
    roofline = CostModel.of_trace_metadata(data.metadata)
    if roofline is None or len(jobs.edges) != len(inside):
        return 0.0
    bound = {name: compute_bound(info, roofline) for name, info in jobs.info.items()}
    mine = np.fromiter((bound.get(n, False) for n in jobs.name), bool, len(jobs.name))
    return float(np.minimum(jobs.edges, inside)[mine].sum())


def critical_path(data: TraceData, win: Window | None = None, device_pid=None) -> CriticalPath:
    """The span split into host-bound time (the device idle waiting for a launch) and
    device-bound time (jobs running, and the device's own gaps between queued jobs)."""
    idle = idle_breakdown(data, win, device_pid)
    return CriticalPath(idle.span_us, idle.idle_host_us, idle.busy_us + idle.idle_other_us, idle.stalls)


# ---- rendering -----------------------------------------------------------------------------


class _Transliterated:
    """A renderable drawn with ASCII stand-ins for the characters the output cannot encode."""

    def __init__(self, inner: RenderableType, encoding: str):
        self.inner = inner
        self.encoding = encoding

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        enc = self.encoding
        for seg in console.render(self.inner, options):
            if seg.control:
                yield seg
            else:
                yield Segment(seg.text.translate(_ASCII).encode(enc, "replace").decode(enc), seg.style)


class _AsciiHook(RenderHook):
    def __init__(self, encoding: str):
        self.encoding = encoding

    def process_renderables(self, renderables: list) -> list:
        return [_Transliterated(r, self.encoding) for r in renderables]


def _utf(console: Console) -> bool:
    return (console.encoding or "utf-8").lower().replace("-", "").startswith("utf")


@contextlib.contextmanager
def ascii_safe(console: Console) -> Iterator[None]:
    """Inside the block, output to a console that is not UTF-8 (a legacy terminal, a pipe with
    PYTHONIOENCODING=ascii) degrades to ASCII instead of failing with UnicodeEncodeError.
    Rich already swaps table borders for ASCII ones; this covers the rest (µs, ·, blocks)."""
    if _utf(console):
        yield
        return
    console.push_render_hook(_AsciiHook(console.encoding))
    try:
        yield
    finally:
        console.pop_render_hook()


def _num(x: float) -> str:
    if x == int(x) and abs(x) < 1e15:
        return f"{int(x):,}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:,.3g}" if abs(x) < 1 else f"{x:,.1f}"


def _us(x: float | None) -> str:
    return "—" if x is None else f"{x:,.1f}"


def idle_table(idle: IdleBreakdown, title: str = "device time") -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("")
    table.add_column("µs", justify="right")
    table.add_column("% of span", justify="right")
    rows = [("span", idle.span_us), ("busy", idle.busy_us)]
    if idle.edges_us > 0:  # the trace says when each job computes
        rows += [("  compute-bound kernels' fill and drain", idle.edges_us)]
    rows += [("idle, waiting on the host", idle.idle_host_us), ("idle, waiting on data/other", idle.idle_other_us)]
    for label, us in rows:
        table.add_row(label, _us(us), f"{idle.pct(us):.1f}")
    return table


def render_critical_path(console: Console, cp: CriticalPath) -> None:
    ascii_only = not _utf(console)
    width = max(10, min(60, console.width - 2))
    h = round(width * cp.host_pct / 100) if cp.span_us > 0 else 0
    console.print(Text(f"critical path: host-bound {cp.host_pct:.1f} % · device-bound {cp.device_pct:.1f} %",
                       style="bold"))
    bar = Text(("#" if ascii_only else "█") * h, style="cyan")
    bar.append(("=" if ascii_only else "█") * (width - h), style="magenta")
    console.print(bar, no_wrap=True, overflow="crop")
    for st in cp.stalls:
        console.print(Text(f"  host stall {st.gap_us:,.1f} µs before {st.job} (at {st.at_us:,.1f} µs)",
                           style="dim"), no_wrap=True, overflow="crop")


def _missing_info_note(data: TraceData, dev) -> str:
    if not any(data.jobs[dev].info.values()):
        return "jobs carry no kernel info (op, module, FLOPs, bytes): rows are kernels, no roofline columns"
    if CostModel.of_trace_metadata(data.metadata) is None:
        return "the trace has no device figures (metadata.spyre_rt.device): no roofline columns"
    return ""


def render(console: Console, data: TraceData, win: Window | None = None, top: int = 20, title: str = "",
           by: str = optable.DEFAULT_GROUPING) -> None:
    """Print the timeline, the per-op table (grouped `by`), the idle-time breakdown and the
    critical path."""
    with ascii_safe(console):
        _render(console, data, win or window(data), top, title, by)


def _render(console: Console, data: TraceData, w: Window, top: int, title: str, by: str) -> None:
    head = Text(title + "  " if title else "", style="bold")
    head.append(f"{data.events:,} events · trace {data.t1 - data.t0:,.1f} µs · "
                f"window {w[0] - data.t0:,.1f}–{w[1] - data.t0:,.1f} µs", style="dim")
    console.print(head)
    rows = timeline(data, w, max(10, console.width - _LABEL_W - _NOTE_W - 3))
    if rows:
        render_timeline(console, rows, w, data)
    else:
        console.print("(no events)")
    if not data.devices:
        console.print("no jobs in this trace: nothing to summarise", style="dim")
        return
    for dev in data.devices:
        pname = data.processes.get(dev, f"pid {dev}")
        suffix = f" · {pname}" if len(data.devices) > 1 else ""
        console.print()
        ops = optable.op_table(data, w, dev, by)
        roofline = CostModel.of_trace_metadata(data.metadata)
        caption = optable.roofline_caption(roofline) if roofline and any(r.compute_pct is not None for r in ops) else None
        console.print(optable.ops_table(ops, console.width, top, "per-op summary" + suffix, by, caption))
        note = _missing_info_note(data, dev)
        if note:
            console.print(Text(note, style="dim"))
        console.print()
        console.print(idle_table(idle_breakdown(data, w, dev), "device time" + suffix))
        render_critical_path(console, critical_path(data, w, dev))
