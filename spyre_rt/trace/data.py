"""What a trace says, as arrays: tracks, jobs, launches, counters, host spans.

:func:`load` streams a trace file (plain or gzip) into a :class:`TraceData`; :func:`parse`
does the same for a trace dict. Times are µs. :func:`job_waits` tells, job by job, how
long the device sat idle before it and whether it was waiting for the host: the basis of
the idle-time breakdown and of the per-op table's "host" bound.
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import job_facts
from .. import trace as trace_format
from ..trace import DEVICE_PID_BASE, link_launches
from .file import TraceFile

Window = tuple[float, float]

_DEVICE_PROCESS = re.compile(r"^spyre:(\d+)$")


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
    info: dict[str, dict[str, Any]] = field(default_factory=dict)  # by job name: its kernel info
    # the job's fill and drain (µs): what it ran before its first compute command started and
    # after its last one ended (0 for a job that computes nothing, or a trace that does not say)
    edges: np.ndarray = field(default_factory=lambda: np.zeros(0))


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
    jobs: dict[Any, Jobs]  # by device pid
    launches: Launches
    events: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)  # the file's "metadata"
    spans: dict[str, Window] = field(default_factory=dict)  # host spans by name (the first of each)

    @property
    def devices(self) -> list[Any]:
        return sorted(self.jobs, key=_sortable)

    def card_of(self, pid: Any) -> int:
        """The card index of a device process: from its name ("spyre:N"), else from its pid."""
        m = _DEVICE_PROCESS.match(self.processes.get(pid, ""))
        if m:
            return int(m.group(1))
        return pid - DEVICE_PID_BASE if isinstance(pid, int) else -1

    def span(self, name: str) -> Window | None:
        """The first host span named `name` ("decode [prebuilt]"), as a window."""
        return self.spans.get(name)


def _sortable(v: Any) -> tuple:
    """Sort numbers before strings (torch.profiler names some tracks with strings)."""
    return (0, v, "") if isinstance(v, int | float) else (1, 0, str(v))


def _number(v: Any, default: float) -> float:
    return v if isinstance(v, int | float) and not isinstance(v, bool) else default


def _pair() -> tuple[list, list]:
    return [], []


@dataclass
class _Raw:
    """What one pass over the events collects, before it becomes arrays."""

    pname: dict[Any, str] = field(default_factory=dict)
    tname: dict[tuple[Any, Any], str] = field(default_factory=dict)
    psort: dict[Any, float] = field(default_factory=dict)
    tsort: dict[tuple[Any, Any], float] = field(default_factory=dict)
    spans: dict[tuple[Any, Any], tuple[list, list]] = field(default_factory=lambda: defaultdict(_pair))
    jobs: dict[Any, list[tuple]] = field(default_factory=lambda: defaultdict(list))
    job_info: dict[Any, dict[str, dict[str, Any]]] = field(default_factory=lambda: defaultdict(dict))
    launches: list[tuple] = field(default_factory=list)
    counters: dict[tuple[Any, str], tuple[list, list]] = field(default_factory=lambda: defaultdict(_pair))
    host_spans: dict[str, Window] = field(default_factory=dict)
    events: int = 0


def collect(events: Iterable[dict[str, Any]]) -> _Raw:
    raw = _Raw()
    n = 0
    for n, ev in enumerate(events, 1):  # noqa: B007 - n is the count
        ph = ev["ph"]
        args = ev.get("args")
        if not isinstance(args, dict):
            args = {}
        if ph == "X":
            _collect_complete(raw, ev, args)
        elif ph == "C":
            for key, v in args.items():
                t, vals = raw.counters[(ev["pid"], ev["name"] if len(args) == 1 else f"{ev['name']} {key}")]
                t.append(ev["ts"])
                vals.append(v)
        elif ph == "M":
            _collect_metadata(raw, ev, args)
    raw.events = n
    return raw


def _collect_complete(raw: _Raw, ev: dict[str, Any], args: dict[str, Any]) -> None:
    pid, tid, ts, end = ev["pid"], ev["tid"], ev["ts"], ev["ts"] + ev["dur"]
    s, e = raw.spans[(pid, tid)]
    s.append(ts)
    e.append(end)
    cat = ev.get("cat")
    if cat == "job":
        name = ev["name"]
        edges = sum(max(_number(args.get(k), 0.0), 0.0) for k in ("fill_us", "drain_us"))
        raw.jobs[pid].append((name, ts, end, _number(args.get("seq"), -1), min(edges, end - ts)))
        infos = raw.job_info[pid]
        if name not in infos:  # one kernel, one info: read it from its first job
            infos[name] = {k: args[k] for k in job_facts.KEYS if k in args}
    elif cat == "launch":
        op = args.get("op") if isinstance(args.get("op"), str) else ev["name"].removeprefix("launch ")
        raw.launches.append((op, ts, end, _number(args.get("first_job"), -1), _number(args.get("jobs"), 0),
                             _number(args.get("card"), -1)))
    elif cat == "host":
        raw.host_spans.setdefault(ev["name"], (ts, end))


def _collect_metadata(raw: _Raw, ev: dict[str, Any], args: dict[str, Any]) -> None:
    key, name = (ev["pid"], ev.get("tid", 0)), ev["name"]
    if name == "process_name":
        raw.pname[ev["pid"]] = str(args.get("name", ev["pid"]))
    elif name == "thread_name":
        raw.tname[key] = str(args.get("name", key[1]))
    elif name == "process_sort_index":
        raw.psort[ev["pid"]] = _number(args.get("sort_index"), 0)
    elif name == "thread_sort_index":
        raw.tsort[key] = _number(args.get("sort_index"), 0)


def load(path: str | os.PathLike[str]) -> TraceData:
    """A trace file (plain or gzip), streamed: events are validated and folded into arrays
    as they are read, never held all at once. ValueError names what is malformed."""
    with TraceFile(path) as f:
        if not f.has_events:
            raise ValueError(f"{f.path}: a result file, not a trace" if "results" in f.header
                             else f"{f.path}: no 'traceEvents' array")
        return read(f)


def read(f: TraceFile) -> TraceData:
    """The TraceData of an open trace file with events (read to its end)."""
    with trace_format.gc_paused():  # the events are dicts made and dropped by the million
        raw = collect(f.validated_events())
    metadata = f.document().get("metadata")
    return arrays(raw, metadata if isinstance(metadata, dict) else {})


def parse(trace: dict[str, Any]) -> TraceData:
    """Arrays per track, jobs, launches and counters of a (validated) trace dict."""
    metadata = trace.get("metadata")
    return arrays(collect(trace["traceEvents"]), metadata if isinstance(metadata, dict) else {})


def arrays(raw: _Raw, metadata: dict[str, Any]) -> TraceData:
    tracks = [Track(pid, tid, raw.tname.get((pid, tid), f"tid {tid}"), raw.pname.get(pid, f"pid {pid}"),
                    (_number(raw.psort.get(pid), _number(pid, 0)), _sortable(pid),
                     _number(raw.tsort.get((pid, tid)), _number(tid, 0)), _sortable(tid)),
                    np.asarray(s, np.float64), np.asarray(e, np.float64))
              for (pid, tid), (s, e) in raw.spans.items()]
    tracks.sort(key=lambda t: t.sort)
    col = [[x[i] for x in raw.launches] for i in range(6)]
    ls = Launches(col[0], np.asarray(col[1], np.float64), np.asarray(col[2], np.float64),
                  *(np.asarray(c, np.int64) for c in col[3:]))
    counters = []
    for (pid, name), (t, v) in raw.counters.items():
        t_, v_ = np.asarray(t, np.float64), np.asarray(v, np.float64)
        o = np.argsort(t_, kind="stable")
        counters.append(Counter(pid, name, t_[o], v_[o]))
    starts = [t.start.min() for t in tracks] + [c.t[0] for c in counters]
    ends = [t.end.max() for t in tracks] + [c.t[-1] for c in counters]
    data = TraceData(min(starts, default=0.0), max(ends, default=0.0), tracks, counters, raw.pname, {}, ls,
                     raw.events, metadata, raw.host_spans)
    for pid, rows in raw.jobs.items():
        data.jobs[pid] = _jobs(rows, ls, data.card_of(pid), raw.job_info[pid])
    return data


def _jobs(rows: list[tuple], ls: Launches, card: int, info: dict[str, dict[str, Any]]) -> Jobs:
    """A device's jobs in start order, each linked to the launch that started it."""
    rows.sort(key=lambda r: r[1])
    start = np.asarray([r[1] for r in rows], np.float64)
    seq = np.asarray([r[3] for r in rows], np.int64)
    # launches name their card; with no card named they may be this device's
    idx = np.flatnonzero((ls.card == card) | (ls.card < 0))
    link = link_launches(ls.start[idx], ls.first[idx], ls.count[idx], seq, start)
    return Jobs([r[0] for r in rows], start, np.asarray([r[2] for r in rows], np.float64), seq,
                np.where(link >= 0, idx[np.maximum(link, 0)] if len(idx) else -1, -1), info,
                np.asarray([r[4] for r in rows], np.float64))


def window(data: TraceData, start: float | None = None, end: float | None = None) -> Window:
    """An absolute window from µs relative to the trace's first event (None: its edge)."""
    a = data.t0 + (start if start is not None else 0.0)
    b = data.t0 + end if end is not None else data.t1
    return a, max(a, b)


def device(data: TraceData, pid: Any = None) -> Any:
    """`pid`, or the first device of the trace (None when it has no jobs)."""
    if pid is not None:
        return pid
    return data.devices[0] if data.devices else None


@dataclass
class JobWaits:
    """Per job of a device (in start order): the idle time before it inside a window, and
    whether the device was waiting for the host then."""

    gap_us: np.ndarray
    on_host: np.ndarray  # bool
    after_us: np.ndarray  # when the device became idle: the end of its work before the job
    last_end_us: float  # the end of the device's last job (-inf without jobs)


def job_waits(data: TraceData, pid: Any, win: Window | None = None) -> JobWaits:
    """The gap before each job counts as waiting on the host when the job is the first of
    its launch and that launch call returned (its host end) after the device's previous
    work ended: the device had nothing to run. Later jobs of a multi-job launch (a plan)
    are queued behind their predecessor, so their gaps, like those of jobs launched before
    the device was free, are the device's own (job launch latency, data). A job without
    its launch in the trace counts as not waiting on the host: nothing says when the host
    issued it."""
    a, b = win or (-math.inf, math.inf)
    jobs, ls = data.jobs[pid], data.launches
    prev_end = np.maximum.accumulate(np.r_[-math.inf, jobs.end[:-1]]) if len(jobs.end) else jobs.end
    li = np.maximum(jobs.launch, 0)
    linked = jobs.launch >= 0
    first = linked & (jobs.seq == (ls.first[li] if len(ls.first) else -1))
    on_host = first & ((ls.end[li] if len(ls.end) else -math.inf) > prev_end)
    after = np.maximum(prev_end, a)
    gap = np.maximum(0.0, np.minimum(jobs.start, b) - after)
    return JobWaits(gap, on_host, after, float(jobs.end.max()) if len(jobs.end) else -math.inf)
