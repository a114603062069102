"""A card's trace as Chrome trace-event JSON, the format Perfetto UI and chrome://tracing open.

Layout of an exported file (one card per file; ``ts``/``dur`` in microseconds, whole ns):

- pid 1 "host": tid 1 "host" holds host spans (more lanes, tid 1 + k * LANE, when spans
  overlap without nesting); tid 100 + card "launch → spyre:N" holds one complete event
  per launch call, named ``launch <op>``.
- pid 2 + card "spyre:N": tid 1 "jobs" (one complete event per job, named by the job's
  name; its args carry what :mod:`spyre_rt.job_facts` knows of the kernel: ``op``,
  ``module``, ``flops``, ``dram_bytes_min``, ...; and, for a job that computes, ``fill_us``
  and ``drain_us``: how long it ran before its first compute command (systolic arrays or
  SFU) started and after its last one ended), tid 2 + engine for the card engines
  ("pcie-h2d", "pcie-d2h", "ctrl") and tid 16 + 16 * core + engine for the per-core
  engines ("core 07 · pt"), when commands were recorded.
- A flow (``s`` at the launch's start, ``f`` bound to the job's start) links each launch to
  every job it started.
- Counters on the device process: ``queue depth`` (jobs launched, not yet finished),
  ``DRAM bandwidth`` (GB/s over fixed windows) and ``scratchpad`` (bytes of LX in use,
  an approximation: see :func:`_scratchpad_counter`). Without commands in the trace the
  last two come from the jobs' kernel info (``dram_bytes``, ``scratchpad_peak``).
- ``metadata.spyre_rt.device``: the figures of the card's device profile, so that a
  reader can place each kernel against the card's roofline.

Host times are the host clock and device times are simulated, on one time axis (ns since
the card was opened), so both processes line up in the viewer. A path ending in ``.gz``
is written gzip-compressed (Perfetto UI opens it as it is).

This package is the trace format, its writer (here: a card's recording and its export)
and its readers: :mod:`.file` streams a file's events, :mod:`.data` turns them into
arrays the profiler reports on, and :mod:`.merge` places a card's tracks in a trace that
``torch.profiler`` exported.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import io
import json
import math
import os
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import job_facts
from ..card import (
    CARD_ENGINE_NAMES,
    CORE_CARD,
    ENGINE_NAMES,
    EV_CMD,
    EV_COMPUTE,
    EV_HOST,
    EV_JOB,
    EV_LAUNCH,
    Card,
)
from ..device_profile import DeviceProfile
from ..program import OP_NAMES

HOST_PID = 1
DEVICE_PID_BASE = 2
TID_HOST = 1
TID_LAUNCH_BASE = 100
TID_JOBS = 1
TID_CARD_ENGINE_BASE = 2
TID_CORE_BASE = 16
CORE_TID_STRIDE = 16
# Extra lanes of a track (events that would overlap improperly) get tid + lane * LANE.
LANE = 1_000_000

# What the `b` field of a command means, by opcode name (the arg key it is exported as).
_CMD_ARG = {
    "load": "bytes", "store": "bytes", "gather": "bytes", "scatter": "bytes", "ring": "bytes",
    "matmul": "macs", "sfu": "instructions", "h2d": "bytes", "d2h": "bytes",
}
_DRAM_OPS = ("load", "store", "gather", "scatter")
_LX_FILL_OPS = ("load", "gather")  # commands that write DRAM data into a scratchpad
_EVENTS_PER_CHUNK = 20_000


def device_pid(card_index: int) -> int:
    return DEVICE_PID_BASE + card_index


# ---- export ------------------------------------------------------------------------------


def export(
    events: np.ndarray,
    names: Callable[[int], str],
    path: str | os.PathLike[str] | None = None,
    *,
    metadata: dict[str, Any] | None = None,
    card_index: int = 0,
    dram_window_ns: int | None = None,
    device: DeviceProfile | None = None,
) -> dict[str, Any]:
    """The Chrome trace (JSON object form) of `events`, a TRACE_EVENT array of one card.

    `names` resolves the interned name ids of jobs, launches and host spans. When `path`
    is given the trace is also written there atomically (gzip-compressed when it ends in
    ``.gz``). `metadata` goes, with the exporter's own notes, under the file's
    ``metadata`` key; `device` (the card's profile) adds its figures to the notes.
    `dram_window_ns` is the width of the DRAM bandwidth windows (default: a round figure
    giving about 500 windows)."""
    ev = _check_events(events)
    with gc_paused():
        trace = _build(ev, names, metadata, card_index, dram_window_ns, device)
    if path is not None:
        write(trace, path)
    return trace


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Creating a million small dicts sets off the cyclic collector again and again (each
    pass walking every dict made so far) for nothing: none of them can be in a cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


Tracks = dict[tuple[int, int], tuple[str, int]]  # (pid, tid) -> (thread name, sort index)


class _Names:
    """Interned names resolved once each, and the kernel info of each job name."""

    def __init__(self, names: Callable[[int], str]):
        self._names = names
        self._text: dict[int, str] = {}
        self._info: dict[int, dict[str, Any]] = {}

    def __call__(self, nid: int) -> str:
        got = self._text.get(nid)
        if got is None:
            got = self._text[nid] = (self._names(nid) if nid else "") or ""
        return got

    def info(self, nid: int) -> dict[str, Any]:
        """The kernel-info keys of a job name, as job args ({} when none was registered)."""
        got = self._info.get(nid)
        if got is None:
            found = job_facts.lookup(self(nid)) or {}
            got = self._info[nid] = {k: found[k] for k in job_facts.KEYS if k in found}
        return got


def _build(ev: np.ndarray, names: Callable[[int], str], metadata: dict[str, Any] | None, card_index: int,
           dram_window_ns: int | None, device: DeviceProfile | None) -> dict[str, Any]:
    name_of = _Names(names)
    dev = device_pid(card_index)
    tracks: Tracks = {}
    kind = ev["kind"]
    jobs, launches, cmds = ev[kind == EV_JOB], ev[kind == EV_LAUNCH], ev[kind == EV_CMD]
    job_s, job_e = _ns(jobs)
    job_tid = _place(np.full(len(jobs), TID_JOBS, np.int64), job_s, job_e, serial=True)
    _name_tracks(tracks, dev, job_tid, lambda tid: ("jobs", 0))
    # Launches are host calls into this card, serialised by the card's lock.
    l_s, l_e = _ns(launches)
    l_tid = _place(np.full(len(launches), TID_LAUNCH_BASE + card_index, np.int64), l_s, l_e, serial=True)
    _name_tracks(tracks, HOST_PID, l_tid, lambda tid: (f"launch → spyre:{card_index}", 1))
    link = link_launches(l_s, launches["job"], launches["b"], jobs["job"], job_s)

    out = _job_events(jobs, job_s, job_e, job_tid, dev, name_of, ev[kind == EV_COMPUTE])
    out += _launch_events(launches, l_s, l_e, l_tid, card_index, name_of)
    out += _host_events(ev[kind == EV_HOST], name_of, tracks)
    out += _command_events(cmds, dev, tracks)
    out += _flow_events(link, l_s, l_tid, job_s, job_tid, dev, card_index)
    # A job joins the queue when its launch call begins (when it has none in the trace: as it starts).
    enqueued = np.where(link >= 0, l_s[np.maximum(link, 0)] if len(l_s) else 0, job_s)
    infos = [name_of.info(a) for a in jobs["a"].tolist()]
    counters, notes = _counters(cmds, jobs, job_s, job_e, enqueued, infos, dram_window_ns)
    for cname, key, t, v in counters:
        # Perfetto keeps counters per process; the tid is the jobs track's, so that every
        # (pid, tid) in the file is a named track.
        if len(t):
            tracks.setdefault((dev, TID_JOBS), ("jobs", 0))
        out += [{"name": cname, "ph": "C", "ts": ti / 1000, "pid": dev, "tid": TID_JOBS, "args": {key: vi}}
                for ti, vi in zip(t.tolist(), v.tolist(), strict=True)]

    notes = {
        "card": f"spyre:{card_index}",
        "clock": "ns since the card was opened; host events: host clock; device events: simulated",
        "commands": bool(len(cmds)),
        **notes,
    }
    if device is not None:
        notes["device"] = {"name": device.name, "digest": device.digest,
                           "figures": {k: f.value for k, f in device.figures.items()}}
    return {
        "traceEvents": _metadata_events(tracks) + out,
        "displayTimeUnit": "ns",
        "metadata": {**(metadata or {}), "spyre_rt": notes},
    }


def _job_events(jobs: np.ndarray, s: np.ndarray, e: np.ndarray, tid: np.ndarray, dev: int,
                name_of: _Names, compute: np.ndarray) -> list[dict[str, Any]]:
    out = [
        {"name": name_of(a) or "job", "cat": "job", "ph": "X", "ts": t, "dur": d, "pid": dev, "tid": k,
         "args": {"seq": q, "commands": c, **name_of.info(a)}}
        for a, t, d, k, q, c in zip(jobs["a"].tolist(), _us(s), _us(e - s), tid.tolist(),
                                    jobs["job"].tolist(), jobs["b"].tolist(), strict=True)
    ]
    # A job that computes: how long it runs before its first compute command starts (its
    # fill) and after its last one ends (its drain), in the same whole ns as the job.
    at = {q: i for i, q in enumerate(jobs["job"].tolist())}
    c_s, c_e = _ns(compute)
    for q, a, b in zip(compute["job"].tolist(), c_s.tolist(), c_e.tolist(), strict=True):
        i = at.get(q)
        if i is not None:
            fill, drain = min(max(a - int(s[i]), 0), int(e[i] - s[i])), max(int(e[i]) - b, 0)
            out[i]["args"].update(fill_us=fill / 1000, drain_us=min(drain, int(e[i] - s[i]) - fill) / 1000)
    return out


def _launch_events(launches: np.ndarray, s: np.ndarray, e: np.ndarray, tid: np.ndarray, card_index: int,
                   name_of: _Names) -> list[dict[str, Any]]:
    ops = [name_of(a) or ("plan" if b > 1 else "job")
           for a, b in zip(launches["a"].tolist(), launches["b"].tolist(), strict=True)]
    return [
        {"name": "launch " + op, "cat": "launch", "ph": "X", "ts": t, "dur": d, "pid": HOST_PID,
         "tid": k, "args": {"op": op, "card": card_index, "first_job": q, "jobs": c}}
        for op, t, d, k, q, c in zip(ops, _us(s), _us(e - s), tid.tolist(),
                                     launches["job"].tolist(), launches["b"].tolist(), strict=True)
    ]


def _flow_events(link: np.ndarray, l_s: np.ndarray, l_tid: np.ndarray, job_s: np.ndarray, job_tid: np.ndarray,
                 dev: int, card_index: int) -> list[dict[str, Any]]:
    """A flow from each launch to each job it started."""
    out = []
    for n, j in enumerate(np.flatnonzero(link >= 0).tolist()):
        li, fid = int(link[j]), (card_index << 32) + n + 1
        out.append({"name": "launch", "cat": "flow", "ph": "s", "id": fid, "ts": int(l_s[li]) / 1000,
                    "pid": HOST_PID, "tid": int(l_tid[li])})
        out.append({"name": "launch", "cat": "flow", "ph": "f", "bp": "e", "id": fid,
                    "ts": int(job_s[j]) / 1000, "pid": dev, "tid": int(job_tid[j])})
    return out


def _host_events(host: np.ndarray, name_of: Callable[[int], str], tracks: Tracks) -> list[dict[str, Any]]:
    """Host spans: recorded by callers, they may nest (a step around its ops) or overlap."""
    s, e = _ns(host)
    tid = _place(np.full(len(host), TID_HOST, np.int64), s, e, serial=False)
    _name_tracks(tracks, HOST_PID, tid, lambda t: ("host", 0))
    return [{"name": name_of(a) or "host", "cat": "host", "ph": "X", "ts": t, "dur": d, "pid": HOST_PID,
             "tid": k}
            for a, t, d, k in zip(host["a"].tolist(), _us(s), _us(e - s), tid.tolist(), strict=True)]


def _command_events(cmds: np.ndarray, dev: int, tracks: Tracks) -> list[dict[str, Any]]:
    """The bulk of a trace: columns are computed with numpy, then the dicts are built per
    opcode with the constant parts hoisted out of the loop."""
    s, e = _ns(cmds)
    core = cmds["core"].astype(np.int64)
    engine = cmds["engine"].astype(np.int64)
    base = np.where(core == CORE_CARD, TID_CARD_ENGINE_BASE + engine,
                    TID_CORE_BASE + CORE_TID_STRIDE * core + engine)
    tid = _place(base, s, e, serial=True)
    _name_tracks(tracks, dev, tid, _engine_track)
    out: list[dict[str, Any]] = []
    opcode = cmds["a"]
    for op in np.unique(opcode).tolist():
        m = opcode == op
        name = _op_name(op)
        key = _CMD_ARG.get(name, "b")
        out += [
            {"name": name, "cat": "cmd", "ph": "X", "ts": t, "dur": d, "pid": dev, "tid": k,
             "args": {"job": j, "opcode": op, key: v}}
            for t, d, k, j, v in zip(_us(s[m]), _us(e[m] - s[m]), tid[m].tolist(), cmds["job"][m].tolist(),
                                     cmds["b"][m].tolist(), strict=True)
        ]
    return out


def _op_name(op: int) -> str:
    return OP_NAMES.get(op, f"op {op}")


def _engine_track(tid: int) -> tuple[str, int]:
    if tid < TID_CORE_BASE:
        e = tid - TID_CARD_ENGINE_BASE
        return (CARD_ENGINE_NAMES[e] if e < len(CARD_ENGINE_NAMES) else f"card engine {e}"), 1 + e
    c, e = divmod(tid - TID_CORE_BASE, CORE_TID_STRIDE)
    return f"core {c:02d} · {ENGINE_NAMES[e] if e < len(ENGINE_NAMES) else f'engine {e}'}", tid


Series = tuple[str, str, np.ndarray, np.ndarray]  # (name, arg key, times ns, values)


def _counters(cmds: np.ndarray, jobs: np.ndarray, job_s: np.ndarray, job_e: np.ndarray, enqueued: np.ndarray,
              infos: list[dict[str, Any]], dram_window_ns: int | None) -> tuple[list[Series], dict[str, Any]]:
    """Each counter's series, and notes on how the approximate ones were made.

    DRAM bandwidth and scratchpad use come from the commands when the trace has them, else
    from each job's kernel info (a trace of jobs only has no commands to count)."""
    out: list[Series] = [("queue depth", "jobs", *_queue_depth(enqueued, job_e))]
    notes: dict[str, Any] = {}
    opcode = cmds["a"]
    ops = {op: _op_name(op) for op in np.unique(opcode).tolist()}
    dram = np.isin(opcode, [op for op, name in ops.items() if name in _DRAM_OPS])
    job_dram = _info_column(infos, "dram_bytes")
    if dram.any() or job_dram.any():
        if dram.any():
            s, e, nbytes = cmds["start_ns"][dram], cmds["end_ns"][dram], cmds["b"][dram].astype(np.float64)
            notes["dram_counter"] = "DRAM commands, each one's bytes spread over its duration"
        else:
            s, e, nbytes = job_s.astype(np.float64), job_e.astype(np.float64), job_dram
            notes["dram_counter"] = "kernel info: each job's dram_bytes spread over its duration"
        window, t, v = _dram_bandwidth(s, e, nbytes, dram_window_ns)
        out.append(("DRAM bandwidth", "GB/s", t, v))
        notes["dram_window_us"] = window / 1000
    fill = np.isin(opcode, [op for op, name in ops.items() if name in _LX_FILL_OPS])
    fill &= cmds["core"] != CORE_CARD
    job_lx = _info_column(infos, "scratchpad_peak") * np.maximum(_info_column(infos, "cores"), 1)
    if fill.any() and len(jobs):
        lx = _scratchpad_counter(cmds["job"][fill], cmds["core"][fill].astype(np.int64), cmds["b"][fill],
                                 jobs["job"], job_s, job_e)
        out.append(("scratchpad", "bytes", *lx))
        notes["scratchpad_counter"] = "approximate: per core, the largest single load/gather of the running job"
    elif job_lx.any():
        out.append(("scratchpad", "bytes", *_per_job_level(job_lx.astype(np.int64), job_s, job_e)))
        notes["scratchpad_counter"] = "kernel info: the running job's scratchpad_peak times its cores"
    return out, notes


def _info_column(infos: list[dict[str, Any]], key: str) -> np.ndarray:
    """One numeric kernel-info figure per job (0 where a job's kernel does not give it)."""
    return np.asarray([v if _is_number(v := info.get(key)) else 0 for info in infos], np.float64)


def _per_job_level(value: np.ndarray, job_start: np.ndarray, job_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A counter at each job's value while it runs and zero between jobs. Ends come before
    starts, so at equal times a job that starts as another ends wins."""
    return _steps(np.concatenate([job_end, job_start]), np.concatenate([np.zeros(len(value), np.int64), value]))


def _check_events(events: np.ndarray) -> np.ndarray:
    ev = np.asarray(events)
    needed = ("kind", "core", "engine", "start_ns", "end_ns", "job", "a", "b")
    if ev.dtype.names is None or any(f not in ev.dtype.names for f in needed):
        raise ValueError(f"trace events must be a TRACE_EVENT structured array with fields {needed}, "
                         f"not {ev.dtype}")
    return ev.reshape(-1)


def _ns(ev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end in whole ns: rounding both ends (not the duration) keeps abutting and
    nested events abutting and nested in the file."""
    s = np.rint(ev["start_ns"]).astype(np.int64)
    return s, np.maximum(np.rint(ev["end_ns"]).astype(np.int64), s)


def _us(ns: np.ndarray) -> list[float]:
    return (ns / 1000.0).tolist()


def _place(base_tid: np.ndarray, s: np.ndarray, e: np.ndarray, *, serial: bool) -> np.ndarray:
    """The tid of each event: its track's base tid, moved to an extra lane when it would
    overlap another event of the track without nesting (viewers mangle such slices).

    Serial tracks (an engine runs one command at a time) are checked with numpy and only a
    track that breaks the rule goes through the Python lane assignment."""
    tid = base_tid.astype(np.int64, copy=True)
    if not len(tid):
        return tid
    if serial:
        o = np.lexsort((s, tid))
        ts, ss, es = tid[o], s[o], e[o]
        bad = (ts[1:] == ts[:-1]) & (ss[1:] < es[:-1])
        tracks = np.unique(ts[1:][bad])
    else:
        tracks = np.unique(tid)
    for t in tracks.tolist():
        m = np.flatnonzero(base_tid == t)
        tid[m] = t + LANE * _nest_lanes(s[m], e[m])
    return tid


def _nest_lanes(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Greedy lanes in which every pair of events is disjoint or nested."""
    lane = np.zeros(len(s), np.int64)
    stacks: list[list[int]] = []  # per lane, the ends of the open (enclosing) events
    for i in np.lexsort((-e, s)).tolist():
        si, ei = int(s[i]), int(e[i])
        for k, stack in enumerate(stacks):
            while stack and stack[-1] <= si:
                stack.pop()
            if not stack or ei <= stack[-1]:
                stack.append(ei)
                lane[i] = k
                break
        else:
            stacks.append([ei])
            lane[i] = len(stacks) - 1
    return lane


def _name_tracks(tracks: Tracks, pid: int, tids: np.ndarray, name: Callable[[int], tuple[str, int]]) -> None:
    for tid in np.unique(tids).tolist():
        base, lane = tid % LANE, tid // LANE
        label, sort = name(base)
        tracks[(pid, tid)] = (label if lane == 0 else f"{label} ({lane + 1})", sort * 100 + lane)


def _metadata_events(tracks: Tracks) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for pid in sorted({pid for pid, _ in tracks}):
        pname = "host" if pid == HOST_PID else f"spyre:{pid - DEVICE_PID_BASE}"
        out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": pname}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                    "args": {"sort_index": 0 if pid == HOST_PID else pid}})
    for (pid, tid), (label, sort) in sorted(tracks.items()):
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                    "args": {"sort_index": sort}})
    return out


def link_launches(launch_start: np.ndarray, launch_first: np.ndarray, launch_count: np.ndarray,
                  job_seq: np.ndarray, job_start: np.ndarray) -> np.ndarray:
    """For each job, the index of the launch that started it (-1 when not in the trace).

    A launch names its jobs by sequence numbers [first, first + count). When two launches
    name one job (a launch that failed before its job ran still records itself), the job
    belongs to the latest launch that began before it started."""
    n_jobs = len(job_seq)
    out = np.full(n_jobs, -1, np.int64)
    count = np.asarray(launch_count, np.int64)
    if not n_jobs or not count.sum():
        return out
    li = np.repeat(np.arange(len(count)), count)  # one row per (launch, job it names)
    offset = np.arange(li.size) - np.repeat(np.cumsum(count) - count, count)
    seq = np.asarray(launch_first, np.int64)[li] + offset
    jseq = np.asarray(job_seq, np.int64)
    order = np.argsort(jseq, kind="stable")
    pos = np.minimum(np.searchsorted(jseq[order], seq), n_jobs - 1)
    ok = jseq[order][pos] == seq
    ji, li = order[pos[ok]], li[ok]
    ls = np.asarray(launch_start, np.float64)
    keep = ls[li] <= np.asarray(job_start, np.float64)[ji]
    ji, li = ji[keep], li[keep]
    o = np.lexsort((ls[li], ji))
    ji, li = ji[o], li[o]
    last = np.r_[ji[1:] != ji[:-1], True] if len(ji) else np.zeros(0, bool)
    out[ji[last]] = li[last]
    return out


# ---- counters ----------------------------------------------------------------------------


def _steps(t: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A step counter from points already in priority order: at equal times the last
    point wins, and points that do not change the value are dropped."""
    if not len(t):
        return t.astype(np.int64), v
    o = np.argsort(t, kind="stable")
    t, v = t[o], v[o]
    last = np.r_[t[1:] != t[:-1], True]
    t, v = t[last], v[last]
    change = np.r_[True, v[1:] != v[:-1]]
    return t[change], v[change]


def _queue_depth(enqueue_ns: np.ndarray, end_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Jobs launched and not yet finished, as a step function of time."""
    t = np.concatenate([enqueue_ns, end_ns]).astype(np.int64)
    d = np.concatenate([np.ones(len(enqueue_ns), np.int64), -np.ones(len(end_ns), np.int64)])
    o = np.lexsort((-d, t))  # at equal times the +1 come last, so the step keeps the new depth
    return _steps(t[o], np.cumsum(d[o]))


def _nice_window(span_ns: float) -> int:
    """A round window width (1, 2 or 5 x 10^k ns, at least 1 µs) giving about 500 windows."""
    target = max(span_ns / 500.0, 1000.0)
    k = 10 ** int(np.floor(np.log10(target)))
    for m in (1, 2, 5, 10):
        if m * k >= target:
            return int(m * k)
    return int(10 * k)


def _dram_bandwidth(s: np.ndarray, e: np.ndarray, nbytes: np.ndarray,
                    window_ns: int | None) -> tuple[int, np.ndarray, np.ndarray]:
    """GB/s of DRAM traffic per fixed window, spreading each command's bytes evenly over its
    duration (exact for the cost model's steady transfer rate after its latency, a slight
    smear over the latency itself)."""
    lo, hi = float(s.min()), float(e.max())
    w = int(window_ns) if window_ns else _nice_window(hi - lo)
    first = int(np.floor(lo / w)) * w
    edges = np.arange(first, max(hi, first + 1) + w, w, dtype=np.float64)
    dur = e - s
    timed = dur > 0
    # Cumulative bytes moved by time t is piecewise linear between the starts and ends of
    # commands, so interpolating it at the window edges is exact.
    rate = nbytes[timed] / dur[timed]
    bt = np.concatenate([s[timed], e[timed]])
    br = np.concatenate([rate, -rate])
    o = np.argsort(bt, kind="stable")
    bt, br = bt[o], np.cumsum(br[o])
    cum = np.concatenate([[0.0], np.cumsum(br[:-1] * np.diff(bt))]) if len(bt) else np.zeros(0)
    per_window = np.diff(np.interp(edges, bt, cum)) if len(bt) else np.zeros(len(edges) - 1)
    if (~timed).any():  # instantaneous commands count in the window they fall in
        idx = np.minimum(((s[~timed] - first) // w).astype(np.int64), len(per_window) - 1)
        per_window += np.bincount(idx, weights=nbytes[~timed], minlength=len(per_window))
    gbps = np.round(np.maximum(per_window, 0.0) / w, 3)  # bytes per ns is GB/s
    t = np.r_[edges[:-1], edges[-1]].astype(np.int64)
    return w, *_steps(t, np.r_[gbps, 0.0])


def _scratchpad_counter(job: np.ndarray, core: np.ndarray, nbytes: np.ndarray, job_seq: np.ndarray,
                        job_start: np.ndarray, job_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of LX in use while each job runs, approximated as the sum over cores of the
    largest single load (or gather) the job issues on that core.

    The trace does not record scratchpad addresses, so the true footprint is unknown: one
    load's bytes must fit in LX at once, which makes this a lower bound that ignores double
    buffering and compute outputs. It is constant over a job and zero between jobs."""
    key = job.astype(np.int64) * 65536 + core
    uk, inv = np.unique(key, return_inverse=True)
    biggest = np.zeros(len(uk))
    np.maximum.at(biggest, inv, nbytes.astype(np.float64))
    uj, jinv = np.unique(uk >> 16, return_inverse=True)
    per_job = np.bincount(jinv, weights=biggest)
    seq = np.asarray(job_seq, np.int64)
    pos = np.minimum(np.searchsorted(uj, seq), len(uj) - 1)
    val = np.where(uj[pos] == seq, per_job[pos], 0.0).astype(np.int64)
    return _per_job_level(val, job_start, job_end)


# ---- writing and reading -----------------------------------------------------------------


def write(trace: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a trace dict as JSON, atomically (temp file in the same directory + rename);
    gzip-compressed when the name ends in ``.gz``."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".tmp", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as raw, _text_writer(raw, compress=path.endswith(".gz")) as f:
            _dump(trace, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _text_writer(raw, compress: bool) -> Iterator[io.TextIOBase]:
    # Level 6 (gzip's default) is a good trade of size against time for JSON; mtime 0 keeps
    # the bytes of a trace the same from run to run. Closing the text layer closes the gzip
    # layer (which writes its trailer) but not `raw`: the caller closes that.
    inner = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) if compress else raw
    with io.TextIOWrapper(inner, encoding="utf-8") as text:
        yield text


def open_text(path: str | os.PathLike[str]) -> io.TextIOBase:
    """A trace file opened as UTF-8 text, decompressed when it is gzip (by its magic bytes,
    whatever its name)."""
    f = open(path, "rb")
    try:
        magic = f.read(2)
        f.seek(0)
        return io.TextIOWrapper(gzip.GzipFile(fileobj=f) if magic == b"\x1f\x8b" else f, encoding="utf-8")
    except BaseException:
        f.close()
        raise


def _dump(trace: dict[str, Any], f) -> None:
    # json.dump would use the pure-Python encoder; json.dumps per chunk uses the C one and
    # bounds the extra memory. The top-level keys keep ", " / ": " separators on purpose:
    # some Perfetto versions looked for the exact text '"displayTimeUnit":"ns"' and then
    # read every ts as ns instead of µs.
    events = trace.get("traceEvents", [])
    f.write('{"traceEvents": [\n')
    for i in range(0, len(events), _EVENTS_PER_CHUNK):
        if i:
            f.write(",\n")
        chunk = json.dumps(events[i: i + _EVENTS_PER_CHUNK], ensure_ascii=False, separators=(",", ":"),
                           allow_nan=False)
        f.write(chunk[1:-1])
    f.write("\n]")
    for key, value in trace.items():
        if key != "traceEvents":
            f.write(f",\n{json.dumps(key)}: {json.dumps(value, ensure_ascii=False, allow_nan=False)}")
    f.write("}\n")


_NUMBER = (int, float)


def _is_number(v: Any) -> bool:
    return isinstance(v, _NUMBER) and not isinstance(v, bool)


def _is_id(v: Any) -> bool:
    return isinstance(v, str) or (_is_number(v) and math.isfinite(v))


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a trace file; a ValueError names what is malformed and where."""
    return validate(read_json(path), os.fspath(path))


def read_json(path: str | os.PathLike[str]) -> Any:
    """A JSON file's content; ValueError (naming the file, line and column) when it is not
    JSON. OSError (missing, unreadable) passes through."""
    path = os.fspath(path)
    with open_text(path) as f:
        try:
            with gc_paused():
                return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") \
                from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not a UTF-8 text file ({e.reason})") from None
        except (gzip.BadGzipFile, EOFError) as e:
            raise ValueError(f"{path}: a broken gzip file ({e})") from None


def validate(obj: Any, where: str = "trace") -> dict[str, Any]:
    """Check a parsed trace (object or bare-array form); returns it in object form."""
    if isinstance(obj, list):
        obj = {"traceEvents": obj}
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a trace is a JSON object with 'traceEvents' (or an array of events), "
                         f"not a JSON {type(obj).__name__}")
    events = obj.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError(f"{where}: no 'traceEvents' array" if events is None
                         else f"{where}: 'traceEvents' must be an array, not {type(events).__name__}")
    for i, ev in enumerate(events):
        problem = event_problem(ev)
        if problem:
            raise ValueError(f"{where}: traceEvents[{i}]: {problem}")
    return obj


_NEEDS = {
    "X": ("name", "ts", "dur", "tid"), "B": ("ts", "tid"), "E": ("ts", "tid"), "i": ("name", "ts"),
    "I": ("name", "ts"), "C": ("name", "ts"), "M": ("name",), "s": ("ts", "id", "tid"),
    "t": ("ts", "id", "tid"), "f": ("ts", "id", "tid"),
}


_NUMBER_TYPES = (int, float)  # exact types: bool is not a number here
_ID_TYPES = (int, float, str)
_FLOW_PHASES = ("s", "t", "f")


def event_problem(ev: Any) -> str | None:
    """What makes `ev` not a usable trace event, or None when it is one."""
    # The events that fill a trace (slices and counters) are checked inline first: a
    # viewer checks hundreds of thousands of them. `x - x == 0` is false for inf and NaN.
    if type(ev) is dict:
        ph, pid, ts = ev.get("ph"), ev.get("pid"), ev.get("ts")
        if (type(ts) in _NUMBER_TYPES and ts - ts == 0 and type(pid) in _ID_TYPES and type(ev.get("name")) is str
                and (type(pid) is str or pid - pid == 0)):
            if ph == "X":
                dur, tid = ev.get("dur"), ev.get("tid")
                if (type(dur) in _NUMBER_TYPES and dur - dur == 0 and dur >= 0 and type(tid) in _ID_TYPES
                        and (type(tid) is str or tid - tid == 0)):
                    return None
            elif ph == "C":
                args = ev.get("args")
                if type(args) is dict and all(type(v) in _NUMBER_TYPES for v in args.values()):
                    return None
            elif ph in _FLOW_PHASES:
                tid = ev.get("tid")
                if ev.get("id") is not None and type(tid) in _ID_TYPES and (type(tid) is str or tid - tid == 0):
                    return None
    return _slow_event_problem(ev)


def _slow_event_problem(ev: Any) -> str | None:
    """:func:`event_problem` for every kind of event, naming the problem."""
    if not isinstance(ev, dict):
        return f"an event must be a JSON object, not {type(ev).__name__}"
    ph = ev.get("ph")
    if not isinstance(ph, str) or not ph:
        return "missing the 'ph' (phase) string"
    # Numbers in our traces; torch.profiler's also name some tracks with strings ("Spans").
    if not _is_id(ev.get("pid")):
        return f"'{ph}' event without a numeric 'pid'"
    for field in _NEEDS.get(ph, ("ts",)):
        v = ev.get(field)
        if v is None:
            return f"'{ph}' event without '{field}'"
        if field in ("ts", "dur") and not (_is_number(v) and math.isfinite(v)):
            return f"'{ph}' event: '{field}' must be a finite number, not {v!r}"
        if field == "tid" and not _is_id(v):
            return f"'{ph}' event: 'tid' must be a finite number or a string, not {v!r}"
        if field == "name" and not isinstance(v, str):
            return f"'{ph}' event: 'name' must be a string, not {v!r}"
    if ph == "X" and ev["dur"] < 0:
        return f"'X' event {ev['name']!r}: negative 'dur' {ev['dur']!r}"
    if ph in ("C", "M"):
        args = ev.get("args")
        if not isinstance(args, dict):
            return f"'{ph}' event {ev['name']!r} without an 'args' object"
        if ph == "C" and not all(_is_number(v) for v in args.values()):
            return f"counter {ev['name']!r}: every arg must be a number"
    return None


# ---- recording -----------------------------------------------------------------------------


class Recording:
    """The events a card recorded inside a :func:`recording` block."""

    def __init__(self, card: Card, first: int):
        self.card = card
        self.first = first
        self._events: np.ndarray | None = None

    @property
    def events(self) -> np.ndarray:
        """The recorded events (while the block runs: those recorded so far)."""
        return self.card.trace_events(self.first) if self._events is None else self._events

    def export(self, path: str | os.PathLike[str] | None = None, *,
               metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        """The recorded events as a Chrome trace (see :func:`export`), written to `path` if given."""
        return export(self.events, self.card.name_of, path, metadata=metadata, card_index=self.card.index,
                      device=self.card.profile)


# Open recordings per card (their `commands` flags): tracing stays on until the outermost ends.
_open: weakref.WeakKeyDictionary[Card, list[bool]] = weakref.WeakKeyDictionary()
_open_lock = threading.Lock()


@contextlib.contextmanager
def recording(card: Card, commands: bool = True) -> Iterator[Recording]:
    """Record a card's trace for the duration of a block::

        with trace.recording(card) as rec:
            step()
        rec.export("step.json", metadata={"model": "granite"})

    Recordings nest: commands are recorded while any open recording asks for them, and
    tracing is switched off when the outermost one ends (the card's trace buffer only grows
    while tracing is on). Events stay in the card's buffer; `trace_clear` during a recording
    loses them. (A *capture* is a graph's: :mod:`spyre_rt.graphs`.)
    """
    with _open_lock:
        stack = _open.setdefault(card, [])
        stack.append(commands)
        card.trace_enable(True, any(stack))
        cap = Recording(card, card.trace_count())
    try:
        yield cap
    finally:
        with _open_lock:
            cap._events = card.trace_events(cap.first)
            stack.remove(commands)
            card.trace_enable(bool(stack), any(stack))
