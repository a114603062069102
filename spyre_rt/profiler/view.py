"""A trace in the terminal: timeline, per-op summary, idle-time breakdown, critical path.

:func:`parse` turns a trace dict (from :func:`spyre_rt.trace.load`) into arrays; the
``timeline``/``op_summary``/``idle_breakdown``/``critical_path`` functions compute numbers
from it; :func:`render` prints them with a rich ``Console``. Times are µs; a window is an
absolute ``(start, end)`` pair, and :func:`window` makes one from times relative to the
trace's first event (what ``--window`` takes and what Perfetto shows).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.console import Console, ConsoleOptions, RenderableType, RenderHook, RenderResult
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from ..trace import DEVICE_PID_BASE, link_launches

Window = tuple[float, float]

_CORE_TRACK = re.compile(r"^core (\d+) · (.+?)(?: \(\d+\))?$")
_SHADES = " ░▒▓█"
_SPARK = " ▁▂▃▄▅▆▇█"
# One character for one, so that tables measured before the substitution stay aligned.
_ASCII = str.maketrans("·µ—–…│→Δ░▒▓█▁▂▃▄▅▆▇", "-u--+|>D.:*#_.-=+*%")
_STYLE = {"host": "cyan", "launch": "bright_cyan", "jobs": "magenta", "pcie-h2d": "yellow",
          "pcie-d2h": "yellow", "ctrl": "white", "load": "green", "store": "bright_green", "pt": "red",
          "sfu": "blue", "ring": "bright_white", "counter": "bright_black"}


# ---- the parsed trace ----------------------------------------------------------------------


@dataclass
class Track:
    """The complete events of one (pid, tid), in µs."""

    pid: int
    tid: int
    name: str
    process: str
    sort: tuple
    start: np.ndarray
    end: np.ndarray


@dataclass
class Counter:
    pid: int
    name: str
    t: np.ndarray
    v: np.ndarray


@dataclass
class Jobs:
    """The jobs of one device (``cat: job`` events), in start order."""

    name: list[str]
    start: np.ndarray
    end: np.ndarray
    seq: np.ndarray
    launch: np.ndarray  # index into TraceData.launches, or -1


@dataclass
class Launches:
    """Host launch calls (``cat: launch`` events)."""

    op: list[str]
    start: np.ndarray
    end: np.ndarray
    first: np.ndarray
    count: np.ndarray
    card: np.ndarray  # -1 when the event does not say


@dataclass
class TraceData:
    t0: float
    t1: float
    tracks: list[Track]
    counters: list[Counter]
    processes: dict[int, str]
    jobs: dict[int, Jobs]  # by device pid
    launches: Launches
    events: int = 0

    @property
    def devices(self) -> list[int]:
        return sorted(self.jobs)


def _number(v: Any, default: float) -> float:
    return v if isinstance(v, int | float) and not isinstance(v, bool) else default


def _pair() -> tuple[list, list]:
    return [], []


@dataclass
class _Raw:
    """What one pass over the events collects, before it becomes arrays."""

    pname: dict[int, str] = field(default_factory=dict)
    tname: dict[tuple[int, int], str] = field(default_factory=dict)
    psort: dict[int, float] = field(default_factory=dict)
    tsort: dict[tuple[int, int], float] = field(default_factory=dict)
    spans: dict[tuple[int, int], tuple[list, list]] = field(default_factory=lambda: defaultdict(_pair))
    jobs: dict[int, list[tuple]] = field(default_factory=lambda: defaultdict(list))
    launches: list[tuple] = field(default_factory=list)
    counters: dict[tuple[int, str], tuple[list, list]] = field(default_factory=lambda: defaultdict(_pair))


def _collect(events: list[dict[str, Any]]) -> _Raw:
    raw = _Raw()
    for ev in events:
        ph = ev["ph"]
        args = ev.get("args")
        if not isinstance(args, dict):
            args = {}
        if ph == "X":
            pid, tid, ts, end = ev["pid"], ev["tid"], ev["ts"], ev["ts"] + ev["dur"]
            s, e = raw.spans[(pid, tid)]
            s.append(ts)
            e.append(end)
            cat = ev.get("cat")
            if cat == "job":
                raw.jobs[pid].append((ev["name"], ts, end, _number(args.get("seq"), -1)))
            elif cat == "launch":
                op = args.get("op") if isinstance(args.get("op"), str) else ev["name"].removeprefix("launch ")
                raw.launches.append((op, ts, end, _number(args.get("first_job"), -1),
                                     _number(args.get("jobs"), 0), _number(args.get("card"), -1)))
        elif ph == "C":
            for key, v in args.items():
                t, vals = raw.counters[(ev["pid"], ev["name"] if len(args) == 1 else f"{ev['name']} {key}")]
                t.append(ev["ts"])
                vals.append(v)
        elif ph == "M":
            key, name = (ev["pid"], ev.get("tid", 0)), ev["name"]
            if name == "process_name":
                raw.pname[ev["pid"]] = str(args.get("name", ev["pid"]))
            elif name == "thread_name":
                raw.tname[key] = str(args.get("name", key[1]))
            elif name == "process_sort_index":
                raw.psort[ev["pid"]] = _number(args.get("sort_index"), 0)
            elif name == "thread_sort_index":
                raw.tsort[key] = _number(args.get("sort_index"), 0)
    return raw


def parse(trace: dict[str, Any]) -> TraceData:
    """Arrays per track, jobs, launches and counters of a (validated) trace dict."""
    raw = _collect(trace["traceEvents"])
    tracks = [Track(pid, tid, raw.tname.get((pid, tid), f"tid {tid}"), raw.pname.get(pid, f"pid {pid}"),
                    (raw.psort.get(pid, pid), pid, raw.tsort.get((pid, tid), tid), tid),
                    np.asarray(s, np.float64), np.asarray(e, np.float64))
              for (pid, tid), (s, e) in raw.spans.items()]
    tracks.sort(key=lambda t: t.sort)
    col = [[x[i] for x in raw.launches] for i in range(6)]
    ls = Launches(col[0], np.asarray(col[1], np.float64), np.asarray(col[2], np.float64),
                  *(np.asarray(c, np.int64) for c in col[3:]))
    jobs = {}
    for pid, rows in raw.jobs.items():
        rows.sort(key=lambda r: r[1])
        start = np.asarray([r[1] for r in rows], np.float64)
        seq = np.asarray([r[3] for r in rows], np.int64)
        # launches name their card; with no card named they may be this device's
        idx = np.flatnonzero((ls.card == pid - DEVICE_PID_BASE) | (ls.card < 0))
        link = link_launches(ls.start[idx], ls.first[idx], ls.count[idx], seq, start)
        jobs[pid] = Jobs([r[0] for r in rows], start, np.asarray([r[2] for r in rows], np.float64), seq,
                         np.where(link >= 0, idx[np.maximum(link, 0)] if len(idx) else -1, -1))
    counters = []
    for (pid, name), (t, v) in raw.counters.items():
        t_, v_ = np.asarray(t, np.float64), np.asarray(v, np.float64)
        o = np.argsort(t_, kind="stable")
        counters.append(Counter(pid, name, t_[o], v_[o]))
    starts = [t.start.min() for t in tracks] + [c.t[0] for c in counters]
    ends = [t.end.max() for t in tracks] + [c.t[-1] for c in counters]
    return TraceData(min(starts, default=0.0), max(ends, default=0.0), tracks, counters, raw.pname, jobs, ls,
                     len(trace["traceEvents"]))


def window(data: TraceData, start: float | None = None, end: float | None = None) -> Window:
    """An absolute window from µs relative to the trace's first event (None: its edge)."""
    a = data.t0 + (start if start is not None else 0.0)
    b = data.t0 + end if end is not None else data.t1
    return a, max(a, b)


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


# ---- per-op summary ------------------------------------------------------------------------


@dataclass
class OpStat:
    name: str
    calls: int  # jobs (or launches, for a name that only launches, like a plan)
    host_us: float  # launch calls on the host for this op
    device_us: float  # job durations
    self_pct: float  # share of all device time in the window
    avg_us: float | None
    min_us: float | None
    max_us: float | None


def op_summary(data: TraceData, win: Window | None = None, device: int | None = None) -> list[OpStat]:
    """Per op (job name): calls, host and device µs, share, avg/min/max; biggest first.

    With a window, a job or launch counts when it starts inside it."""
    a, b = win or (-math.inf, math.inf)
    dev = _device(data, device)
    dur: dict[str, list[float]] = defaultdict(list)
    if dev is not None:
        jobs = data.jobs[dev]
        for name, s, e in zip(jobs.name, jobs.start.tolist(), jobs.end.tolist(), strict=True):
            if a <= s < b:
                dur[name].append(e - s)
    host: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    ls = data.launches
    mine = np.ones(len(ls.op), bool) if dev is None else (ls.card == dev - DEVICE_PID_BASE) | (ls.card < 0)
    for op, s, e, ok in zip(ls.op, ls.start.tolist(), ls.end.tolist(), mine.tolist(), strict=True):
        if ok and (a <= s < b):
            host[op] += e - s
            launches[op] += 1
    total = sum(sum(d) for d in dur.values())
    out = []
    for name in dur.keys() | host.keys():
        d = dur.get(name, [])
        dev_us = float(sum(d))
        out.append(OpStat(name, len(d) or launches.get(name, 0), host.get(name, 0.0), dev_us,
                          100.0 * dev_us / total if total > 0 else 0.0,
                          dev_us / len(d) if d else None, min(d) if d else None, max(d) if d else None))
    out.sort(key=lambda o: (-o.device_us, -o.host_us, o.name))
    return out


def _device(data: TraceData, device: int | None) -> int | None:
    if device is not None:
        return device
    return data.devices[0] if data.devices else None


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


def idle_breakdown(data: TraceData, win: Window | None = None, device: int | None = None,
                   stalls: int = 3) -> IdleBreakdown:
    """Where the device's time went over the window: busy, idle waiting on the host, idle
    otherwise.

    The jobs are walked in order. The gap before a job counts as waiting on the host when
    the job is the first of its launch and the launch call returned (its host end) after
    the previous job ended: the device had nothing to run. Later jobs of a multi-job launch
    (a plan) are queued behind their predecessor, so their gaps, like those of jobs launched
    before the device was free, are the device's own (job launch latency, data). After the
    last job the device waits on the host. A job without its launch in the trace counts as
    "other": nothing says when the host issued it."""
    a, b = win or window(data)
    dev = _device(data, device)
    busy = host = other = 0.0
    found: list[Stall] = []
    n = 0
    prev_end = -math.inf
    if dev is not None:
        jobs, ls = data.jobs[dev], data.launches
        for i in range(len(jobs.start)):
            s, e, li = float(jobs.start[i]), float(jobs.end[i]), int(jobs.launch[i])
            gap = max(0.0, min(s, b) - max(prev_end, a))
            first = li >= 0 and int(jobs.seq[i]) == int(ls.first[li])
            if first and ls.end[li] > prev_end:
                host += gap
                if gap > 0:
                    found.append(Stall(jobs.name[i], max(prev_end, a) - data.t0, gap))
            else:
                other += gap
            inside = max(0.0, min(e, b) - max(s, a))
            busy += inside
            if inside > 0 or a <= s < b:
                n += 1
            prev_end = max(prev_end, e)
    host += max(0.0, b - max(prev_end, a))
    found.sort(key=lambda st: -st.gap_us)
    return IdleBreakdown(b - a, busy, host, other, n, found[:stalls])


def critical_path(data: TraceData, win: Window | None = None, device: int | None = None) -> CriticalPath:
    """The span split into host-bound time (the device idle waiting for a launch) and
    device-bound time (jobs running, and the device's own gaps between queued jobs)."""
    idle = idle_breakdown(data, win, device)
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


def ops_table(ops: list[OpStat], top: int | None = None, title: str = "per-op summary") -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("op", "calls", "host µs", "device µs", "self %", "avg µs", "min µs", "max µs"):
        table.add_column(col, justify="left" if col == "op" else "right", no_wrap=col != "op")
    shown = ops if top is None else ops[:top]
    for o in shown:
        table.add_row(Text(o.name), str(o.calls), _us(o.host_us), _us(o.device_us), f"{o.self_pct:.1f}",
                      _us(o.avg_us), _us(o.min_us), _us(o.max_us))
    if len(shown) < len(ops):
        table.add_row(f"… {len(ops) - len(shown)} more", "", "", "", "", "", "", "", style="dim")
    if ops:
        table.add_section()
        table.add_row("total", str(sum(o.calls for o in ops)), _us(sum(o.host_us for o in ops)),
                      _us(sum(o.device_us for o in ops)), "100.0" if any(o.device_us for o in ops) else "0.0",
                      "", "", "", style="bold")
    return table


def idle_table(idle: IdleBreakdown, title: str = "device time") -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("")
    table.add_column("µs", justify="right")
    table.add_column("% of span", justify="right")
    for label, us in (("span", idle.span_us), ("busy", idle.busy_us),
                      ("idle, waiting on the host", idle.idle_host_us),
                      ("idle, waiting on data/other", idle.idle_other_us)):
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


def render(console: Console, data: TraceData, win: Window | None = None, top: int = 20,
           title: str = "") -> None:
    """Print the timeline, the per-op table, the idle-time breakdown and the critical path."""
    with ascii_safe(console):
        _render(console, data, win or window(data), top, title)


def _render(console: Console, data: TraceData, w: Window, top: int, title: str) -> None:
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
        console.print(ops_table(op_summary(data, w, dev), top, "per-op summary" + suffix))
        console.print()
        console.print(idle_table(idle_breakdown(data, w, dev), "device time" + suffix))
        render_critical_path(console, critical_path(data, w, dev))
