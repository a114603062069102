"""The card's tracks merged into a trace ``torch.profiler`` exported: one timeline in Perfetto.

A torch.profiler trace holds the host as it really ran (aten ops, and the card's launches
as ``spyre:N launch ...`` ranges, see :mod:`spyre_rt.torch_ranges`) on the wall clock. A
card trace (``trace.recording(card).export(...)``) holds the card's jobs, commands and
counters on the card's clock: simulated device time after the host clock's launches.

The clocks are aligned at the launches, which both traces record: the launches are
matched in order by card and job name, and each of the card's jobs is placed after the
torch range of the launch that started it, as far after it as the card put it after the
launch, and never before the end of the card's previous job (the card runs one job at a
time). Commands move with their job and counters with the job running when they change;
durations are kept. Launches the torch trace has no range for (copies) are placed by the
nearest launch before them that it has. The card trace's own host process is left out:
the torch trace has the real one. A flow joins each launch range to each job it started.
"""

from __future__ import annotations

import bisect
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import trace as trace_format
from ..torch_ranges import RANGE_NAME
from .file import TraceFile

_LOOKAHEAD = 256  # card launches skipped at most to match one range (copies have none)


@dataclass
class Launch:
    """A launch as one of the two traces recorded it."""

    name: str  # the job (or plan) name
    ts: float  # µs
    event: dict[str, Any]


@dataclass
class MergeReport:
    cards: list[int] = field(default_factory=list)
    ranges: int = 0  # spyre launch ranges in the torch trace
    matched: int = 0  # of them, matched to a card launch
    jobs: int = 0  # card jobs placed on the timeline


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A trace file (plain or gzip, any writer's) as a dict, its events checked."""
    with TraceFile(path) as f:
        if not f.has_events:
            raise ValueError(f"{f.path}: no 'traceEvents' array")
        with trace_format.gc_paused():
            events = list(f.validated_events())
        return {**f.document(), "traceEvents": events}


def merge(torch_trace: dict[str, Any], card_traces: list[dict[str, Any]]) -> tuple[dict[str, Any], MergeReport]:
    """`torch_trace` with the device tracks of each card trace added, clocks aligned."""
    events = list(torch_trace["traceEvents"])
    report = MergeReport()
    ranges = _torch_ranges(events)
    report.ranges = sum(len(r) for r in ranges.values())
    next_pid = 1 + max([e["pid"] for e in events if isinstance(e.get("pid"), int)] + [0])
    flow_ids = 1 + max([e["id"] for e in events if isinstance(e.get("id"), int)] + [0])
    for card_trace in card_traces:
        card = _card_index(card_trace)
        placed, matched, flow_ids = _place_card(card_trace, ranges.get(card, []), next_pid, flow_ids)
        events += placed
        report.cards.append(card)
        report.matched += matched
        report.jobs += sum(e.get("cat") == "job" for e in placed)
        next_pid += 1
    merged = {k: v for k, v in torch_trace.items() if k != "traceEvents"}
    merged["traceEvents"] = events
    merged["spyre_rt"] = {"merged": {"cards": report.cards, "launch_ranges": report.ranges,
                                     "matched": report.matched, "jobs": report.jobs}}
    return merged, report


# ---- the anchors -------------------------------------------------------------------------------


def _torch_ranges(events: list[dict[str, Any]]) -> dict[int, list[Launch]]:
    """The spyre launch ranges of a torch trace, per card, in time order."""
    out: dict[int, list[Launch]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            m = RANGE_NAME.match(e["name"])
            if m:
                out[int(m.group(1))].append(Launch(m.group(2), e["ts"], e))
    for launches in out.values():
        launches.sort(key=lambda x: x.ts)
    return out


def _card_index(card_trace: dict[str, Any]) -> int:
    notes = card_trace.get("metadata", {}).get("spyre_rt", {})
    card = notes.get("card", "") if isinstance(notes, dict) else ""
    if isinstance(card, str) and card.startswith("spyre:") and card[6:].isdigit():
        return int(card[6:])
    return 0


def match(ranges: list[Launch], launches: list[Launch]) -> list[tuple[Launch, Launch]]:
    """(torch range, card launch) pairs: in order, by name; card launches without a range
    (copies) are skipped, and so is a range with no launch of its name near enough."""
    pairs, j = [], 0
    for r in ranges:
        for k in range(j, min(j + _LOOKAHEAD, len(launches))):
            if launches[k].name == r.name:
                pairs.append((r, launches[k]))
                j = k + 1
                break
    return pairs


# ---- placing the card's events -----------------------------------------------------------------


def _place_card(card_trace: dict[str, Any], ranges: list[Launch], pid: int,
                flow_id: int) -> tuple[list[dict[str, Any]], int, int]:
    """The card's device events moved onto the torch clock (pid `pid`), with flows; the
    number of launches matched and the next free flow id."""
    events = card_trace["traceEvents"]
    launches = sorted((Launch(_launch_name(e), e["ts"], e) for e in events if e.get("cat") == "launch"),
                      key=lambda x: x.ts)
    pairs = match(ranges, launches)
    jobs = sorted((e for e in events if e.get("cat") == "job"), key=lambda e: e["ts"])
    shifts, starter = _job_shifts(jobs, launches, _launch_wall_times(launches, pairs))
    out = _moved_device_events(events, jobs, shifts, pid)
    by_range = {id(launch.event): r for r, launch in pairs}
    for job, shift, li in zip(jobs, shifts, starter, strict=True):
        r = by_range.get(id(launches[li].event)) if li >= 0 else None
        if r is not None:
            out.append({"name": "launch", "cat": "flow", "ph": "s", "id": flow_id, "ts": r.ts,
                        "pid": r.event["pid"], "tid": r.event["tid"]})
            out.append({"name": "launch", "cat": "flow", "ph": "f", "bp": "e", "id": flow_id,
                        "ts": job["ts"] + shift, "pid": pid, "tid": job["tid"]})
            flow_id += 1
    return out, len(pairs), flow_id


def _moved_device_events(events: list[dict[str, Any]], jobs: list[dict[str, Any]], shifts: list[float],
                         pid: int) -> list[dict[str, Any]]:
    """The events of the card's device process under `pid`: jobs moved by their shift,
    commands by their job's, the rest (counters) by the shift of the job running then.
    The card trace's own host process and flows are left out."""
    device_pids = {e["pid"] for e in jobs}
    by_seq = {e["args"].get("seq"): s for e, s in zip(jobs, shifts, strict=True)}
    starts = np.asarray([e["ts"] for e in jobs], np.float64)
    out: list[dict[str, Any]] = []
    for e in events:
        if e.get("pid") not in device_pids or e.get("cat") == "flow":
            continue
        if e["ph"] == "M":
            # after the torch trace's processes, whose sort indices are their pids
            args = {"sort_index": pid} if e["name"] == "process_sort_index" else e.get("args", {})
            out.append({**e, "pid": pid, "args": args})
            continue
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        key = args.get("seq") if e.get("cat") == "job" else args.get("job") if e.get("cat") == "cmd" else None
        shift = by_seq.get(key) if key is not None else None
        if shift is None:
            shift = _shift_at(starts, shifts, e["ts"])
        out.append({**e, "pid": pid, "ts": e["ts"] + shift})
    return out


def _launch_name(e: dict[str, Any]) -> str:
    op = e.get("args", {}).get("op")
    return op if isinstance(op, str) else e["name"].removeprefix("launch ")


def _launch_wall_times(launches: list[Launch], pairs: list[tuple[Launch, Launch]]) -> list[float]:
    """Each card launch's start on the torch clock: its range's where it has one, else its
    own moved as the nearest matched launch before it (after it, for the first ones) moved."""
    matched = {id(launch.event): r.ts for r, launch in pairs}
    anchors = [(launch.ts, r.ts - launch.ts) for r, launch in pairs]
    keys = [t for t, _ in anchors]
    out = []
    for launch in launches:
        got = matched.get(id(launch.event))
        if got is None:
            k = bisect.bisect_right(keys, launch.ts) - 1
            offset = anchors[max(k, 0)][1] if anchors else 0.0
            got = launch.ts + offset
        out.append(got)
    return out


def _job_shifts(jobs: list[dict[str, Any]], launches: list[Launch], wall: list[float]) -> tuple[list[float], list[int]]:
    """How far each job moves, and the index of the launch that started it (-1: none). A
    job keeps its distance from its launch and never starts before the previous job ends."""
    starter = _starters(jobs, launches)
    shifts: list[float] = []
    prev_end = -np.inf
    default = wall[0] - launches[0].ts if launches else 0.0
    for job, li in zip(jobs, starter, strict=True):
        if li >= 0:
            start = wall[li] + (job["ts"] - launches[li].ts)
        else:
            start = job["ts"] + (shifts[-1] if shifts else default)
        start = max(start, prev_end)
        shifts.append(start - job["ts"])
        prev_end = start + job["dur"]
    return shifts, starter


def _starters(jobs: list[dict[str, Any]], launches: list[Launch]) -> list[int]:
    """For each job, the launch that started it (by the sequence numbers the launch names)."""
    seq = np.asarray([_int_arg(j, "seq") for j in jobs], np.int64)
    start = np.asarray([j["ts"] for j in jobs], np.float64)
    first = np.asarray([_int_arg(launch.event, "first_job") for launch in launches], np.int64)
    count = np.asarray([_int_arg(launch.event, "jobs", 0) for launch in launches], np.int64)
    lts = np.asarray([launch.ts for launch in launches], np.float64)
    return trace_format.link_launches(lts, first, count, seq, start).tolist()


def _int_arg(e: dict[str, Any], key: str, default: int = -1) -> int:
    v = e.get("args", {}).get(key)
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else default


def _shift_at(starts: np.ndarray, shifts: list[float], ts: float) -> float:
    """The shift of the job running at `ts` (the last to start by then; the first before any)."""
    if not shifts:
        return 0.0
    k = int(np.searchsorted(starts, ts, "right")) - 1
    return shifts[max(k, 0)]


def merge_ranks(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """The card traces of the ranks of one run (``spyre-profile run --tp N``; rank r's card
    is spyre:r) as one trace, a device process per card. Each rank's host tracks keep their
    process and move to tracks of their own (``host · rank r``); the ranks' cards are on
    one time axis already (their collectives start together). The metadata is rank 0's."""
    events: list[dict[str, Any]] = []
    named: set[tuple] = set()
    for rank, t in enumerate(traces):
        for ev in t["traceEvents"]:
            if ev.get("pid") == trace_format.HOST_PID and rank and isinstance(ev.get("tid"), int) \
                    and ev["tid"] % trace_format.LANE < trace_format.TID_LAUNCH_BASE and ev["tid"]:
                ev = {**ev, "tid": ev["tid"] + rank}  # a host-span track of this rank
                if ev.get("ph") == "M" and ev.get("name") == "thread_name":
                    ev["args"] = {**ev.get("args", {}), "name": f"{ev['args'].get('name', 'host')} · rank {rank}"}
            if ev.get("ph") == "M":  # the host process is named by every rank: once
                key = (ev.get("name"), ev.get("pid"), ev.get("tid"))
                if key in named:
                    continue
                named.add(key)
            events.append(ev)
    merged = {k: v for k, v in traces[0].items() if k != "traceEvents"}
    merged["traceEvents"] = events
    merged["spyre_rt"] = {**merged.get("spyre_rt", {}), "ranks": len(traces)}
    return merged
