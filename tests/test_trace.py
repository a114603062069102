"""Trace export: a real card's trace as Chrome trace-event JSON, checked the way a viewer reads it."""

import json
import os
from collections import Counter, defaultdict

import numpy as np
import pytest
from programs import loads

from spyre_rt import jobs, trace
from spyre_rt.card import EV_CMD, EV_COMPUTE, EV_HOST, EV_JOB, EV_LAUNCH, TRACE_EVENT
from spyre_rt.errors import SpyreInvalidCommandError
from spyre_rt.program import (
    CMD_MM,
    CMD_RING,
    OP_LOAD,
    OP_MATMUL,
    OP_RING,
    ProgramBuilder,
    empty_cmds,
)
from spyre_rt.transfer import D2H, TransferGraph

KiB = 1 << 10


def matmul(m, n, k):
    b = ProgramBuilder()
    c = empty_cmds(1, OP_MATMUL, 0, CMD_MM)
    c["b_off"], c["c_off"] = m * k * 2, m * k * 2 + k * n * 2
    c["m"], c["n"], c["k"] = m, n, k
    c["lda"], c["ldb"], c["ldc"] = k, n, n
    b.add(c)
    return b.encode()


def ring(nbytes):
    b = ProgramBuilder()
    c = empty_cmds(1, OP_RING, 3, CMD_RING)
    c["dst_core"], c["bytes"] = 4, nbytes
    b.add(c)
    return b.encode()


@pytest.fixture
def captured(functional_card):
    """A small step on a functional card: uploads (H2D), loads on 8 cores, two launches of
    a resident matmul, a ring transfer, a read-back (D2H), inside nested host spans."""
    card = functional_card
    card.trace_enable(True)
    buf = card.malloc(8 * 64 * KiB)
    jobs.run_once(card, loads(range(8), 4 * KiB), [buf], name="warm-up")  # before the capture
    with trace.recording(card) as cap:
        t0 = card.host_clock_ns()
        jobs.run_once(card, loads(range(8), 64 * KiB), [buf], name="load8")
        mm = jobs.ResidentProgram(card, matmul(64, 64, 64), name="mm")
        t1 = card.host_clock_ns()
        mm.launch([])
        mm.launch([])
        card.trace_host_span("mm x2", t1, card.host_clock_ns())
        jobs.run_once(card, ring(16 * KiB), [], name="ring")
        host = np.zeros(4096, np.uint8)
        TransferGraph(card, D2H, jobs.program_view(4096)).run(host.ctypes.data, buf)
        card.synchronize()
        mm.free()
        card.trace_host_span("step", t0, card.host_clock_ns())
    return card, cap


@pytest.fixture
def exported(captured, tmp_path):
    card, cap = captured
    path = tmp_path / "step.json"
    return cap.export(path, metadata={"model": "test"}), path


def x_events(tr):
    return [e for e in tr["traceEvents"] if e["ph"] == "X"]


def test_capture_holds_only_the_events_of_its_block(captured):
    card, cap = captured
    ev = cap.events
    names = {card.name_of(int(a)) for a in ev["a"][ev["kind"] == EV_JOB]}
    assert "warm-up" not in names
    assert {"load8", "mm", "ring", "h2d", "d2h"} <= names
    # the matmul jobs compute: each has its compute span beside it
    assert set(np.unique(ev["kind"]).tolist()) == {EV_JOB, EV_CMD, EV_HOST, EV_LAUNCH, EV_COMPUTE}
    assert (ev["kind"] == EV_COMPUTE).sum() == 2


def test_capture_turns_tracing_off_when_the_outermost_block_ends(functional_card):
    card = functional_card
    with trace.recording(card) as outer:
        with trace.recording(card, commands=False) as inner:
            jobs.run_once(card, matmul(8, 64, 8), [], name="inner")
        jobs.run_once(card, matmul(8, 64, 8), [], name="outer")  # still traced: outer is open
    before = len(card.trace_events())
    jobs.run_once(card, matmul(8, 64, 8), [], name="after")
    assert len(card.trace_events()) == before
    job_names = lambda ev: {card.name_of(int(a)) for a in ev["a"][ev["kind"] == EV_JOB]}  # noqa: E731
    assert "inner" in job_names(inner.events) and "outer" not in job_names(inner.events)
    assert {"inner", "outer"} <= job_names(outer.events)
    # the outer capture asked for commands, so the inner one recorded them too
    assert (inner.events["kind"] == EV_CMD).any()


def test_every_event_has_the_required_fields(exported):
    tr, _ = exported
    assert tr["displayTimeUnit"] == "ns"
    assert tr["metadata"]["model"] == "test"
    for e in tr["traceEvents"]:
        assert isinstance(e["name"], str) and e["name"]
        assert e["ph"] in {"X", "M", "C", "s", "f"}
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] != "M":
            assert isinstance(e["ts"], float | int) and e["ts"] >= 0
        if e["ph"] == "X":
            assert isinstance(e["dur"], float | int) and e["dur"] >= 0
        if e["ph"] in {"C", "M"}:
            assert isinstance(e["args"], dict)


def test_the_file_is_the_returned_dict_and_nothing_else_is_left(exported):
    tr, path = exported
    assert trace.load(path) == json.loads(json.dumps(tr))
    assert os.listdir(path.parent) == [path.name]  # the temp file was renamed, not left behind
    # '"displayTimeUnit":"ns"' without spaces made some Perfetto versions read ts as ns
    assert '"displayTimeUnit":"ns"' not in path.read_text()


def test_tracks_are_processes_and_threads_named_by_metadata(exported):
    tr, _ = exported
    meta = [e for e in tr["traceEvents"] if e["ph"] == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    sorted_threads = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_sort_index"}
    assert processes == {1: "host", 2: "spyre:0"}
    used = {(e["pid"], e["tid"]) for e in tr["traceEvents"] if e["ph"] != "M"}
    assert used <= threads.keys()
    assert used <= sorted_threads
    names = set(threads.values())
    assert {"host", "launch → spyre:0", "jobs", "pcie-h2d", "pcie-d2h", "core 00 · pt",
            "core 03 · ring"} <= names
    assert {f"core {c:02d} · load" for c in range(8)} <= names
    # each kind of event is on its own kind of track
    for e in x_events(tr):
        track = threads[(e["pid"], e["tid"])]
        if e["cat"] == "cmd":
            assert track.startswith("core ") or track.startswith("pcie-") or track == "ctrl"
            assert track.split(" · ")[-1] in {e["name"], "pt"} or track.startswith("pcie-")
        else:
            assert track == {"job": "jobs", "launch": "launch → spyre:0", "host": "host"}[e["cat"]]


def test_jobs_are_named_by_their_kernel_and_commands_carry_their_figures(exported):
    tr, _ = exported
    x = x_events(tr)
    jobs_ = Counter(e["name"] for e in x if e["cat"] == "job")
    assert jobs_["mm"] == 2 and jobs_["load8"] == 1 and jobs_["ring"] == 1 and jobs_["d2h"] == 1
    assert jobs_["h2d"] == 3  # the program uploads of load8, mm and ring
    launches = Counter(e["name"] for e in x if e["cat"] == "launch")
    assert launches["launch mm"] == 2 and launches["launch h2d"] == 3
    cmds = [e for e in x if e["cat"] == "cmd"]
    loads_ = [e for e in cmds if e["name"] == "load"]
    assert len(loads_) == 8 and all(e["args"]["bytes"] == 64 * KiB for e in loads_)
    assert all(e["args"]["opcode"] == OP_LOAD for e in loads_)
    mms = [e for e in cmds if e["name"] == "matmul"]
    assert [e["args"]["macs"] for e in mms] == [64 * 64 * 64] * 2
    assert [e["args"]["bytes"] for e in cmds if e["name"] == "ring"] == [16 * KiB]
    # every command lies inside its job
    job_span = {e["args"]["seq"]: (e["ts"], e["ts"] + e["dur"]) for e in x if e["cat"] == "job"}
    for e in cmds:
        lo, hi = job_span[e["args"]["job"]]
        assert lo - 1e-6 <= e["ts"] and e["ts"] + e["dur"] <= hi + 1e-6


def test_complete_events_nest_properly_on_each_track(exported):
    tr, _ = exported
    by_track = defaultdict(list)
    for e in x_events(tr):
        # ts and dur are whole ns written in µs: compare them as integers, as Perfetto does
        s = round(e["ts"] * 1000)
        by_track[(e["pid"], e["tid"])].append((s, s + round(e["dur"] * 1000)))
    for track, spans in by_track.items():
        open_ends = []
        for s, e in sorted(spans, key=lambda p: (p[0], -p[1])):
            while open_ends and open_ends[-1] <= s:
                open_ends.pop()
            assert not open_ends or e <= open_ends[-1], f"{track}: [{s}, {e}) overlaps its neighbour"
            open_ends.append(e)


def test_every_flow_links_a_launch_to_a_job_it_started(exported):
    tr, _ = exported
    x = x_events(tr)
    flows = defaultdict(dict)
    for e in tr["traceEvents"]:
        if e["ph"] in "sf":
            assert e["ph"] not in flows[e["id"]], f"flow id {e['id']} used twice"
            flows[e["id"]][e["ph"]] = e
    jobs_ = [e for e in x if e["cat"] == "job"]
    assert len(flows) == len(jobs_)  # every job of the capture was launched inside it

    def enclosing(ev, cat):
        return [x_ for x_ in x if x_["cat"] == cat and (x_["pid"], x_["tid"]) == (ev["pid"], ev["tid"])
                and x_["ts"] <= ev["ts"] <= x_["ts"] + x_["dur"]]

    started = set()
    for fid, pair in flows.items():
        assert pair.keys() == {"s", "f"}, f"flow {fid} is missing an end"
        s, f = pair["s"], pair["f"]
        assert f["bp"] == "e" and s["name"] == f["name"] and s["cat"] == f["cat"]
        (launch,) = enclosing(s, "launch")
        assert launch["ts"] == s["ts"]
        (job,) = enclosing(f, "job")
        assert job["ts"] == f["ts"]
        first, count = launch["args"]["first_job"], launch["args"]["jobs"]
        assert first <= job["args"]["seq"] < first + count
        assert s["ts"] <= f["ts"]  # a job cannot start before its launch
        started.add(job["args"]["seq"])
    assert started == {j["args"]["seq"] for j in jobs_}


def test_counters_follow_the_jobs(exported, spyre_profile):
    tr, _ = exported
    series = defaultdict(list)
    for e in tr["traceEvents"]:
        if e["ph"] == "C":
            assert e["pid"] == 2
            ((key, value),) = e["args"].items()
            series[(e["name"], key)].append((e["ts"], value))
    assert set(series) == {("queue depth", "jobs"), ("DRAM bandwidth", "GB/s"), ("scratchpad", "bytes")}
    depth = [v for _, v in series[("queue depth", "jobs")]]
    assert min(depth) >= 0 and max(depth) >= 1 and depth[-1] == 0
    # the bandwidth windows account for every byte the loads moved
    points = series[("DRAM bandwidth", "GB/s")]
    window_us = tr["metadata"]["spyre_rt"]["dram_window_us"]
    moved = sum(v * (t1 - t0) * 1000 for (t0, v), (t1, _) in zip(points, points[1:], strict=False))
    assert points[-1][1] == 0
    assert all(min(t % window_us, window_us - t % window_us) < 1e-6 for t, _ in points)  # window edges
    assert moved == pytest.approx(8 * 64 * KiB, rel=1e-3)
    # scratchpad: during load8, the largest load of each of its 8 cores
    x = x_events(tr)
    (load8,) = [e for e in x if e["name"] == "load8"]
    lx = dict(series[("scratchpad", "bytes")])
    assert lx[load8["ts"]] == 8 * 64 * KiB
    assert lx[round(load8["ts"] + load8["dur"], 3)] == 0
    assert max(lx.values()) == 8 * 64 * KiB


def test_a_failed_launch_gets_no_flow(functional_card):
    """A launch whose binding is refused runs no job and records no launch; the flow goes
    to the launch that really ran the job."""
    card = functional_card
    small = card.malloc(4096)
    blob = loads([0], 8192)
    with trace.recording(card) as cap:
        prog = jobs.ResidentProgram(card, blob, name="bad")
        with pytest.raises(SpyreInvalidCommandError):
            prog.launch([small])
        prog.launch([card.malloc(8192)])
        prog.free()
    tr = cap.export()
    x = {(e["pid"], e["tid"], e["ts"]): e for e in x_events(tr)}
    launches_with_flows = [x[(e["pid"], e["tid"], e["ts"])] for e in tr["traceEvents"] if e["ph"] == "s"]
    bad = [e for e in launches_with_flows if e["name"] == "launch bad"]
    assert sum(e["name"] == "launch bad" for e in x.values()) == 1
    assert len(bad) == 1
    jobs_bad = [e for e in x.values() if e["cat"] == "job" and e["name"] == "bad"]
    assert len(jobs_bad) == 1 and bad[0]["ts"] < jobs_bad[0]["ts"]


def test_overlapping_host_spans_get_lanes_nested_ones_do_not():
    ev = np.zeros(4, TRACE_EVENT)
    ev["kind"] = EV_HOST
    ev["core"] = 0xFFFF
    ev["a"] = [1, 2, 3, 4]
    ev["start_ns"] = [0, 1000, 5000, 8000]
    ev["end_ns"] = [10000, 3000, 12000, 9000]  # 2 inside 1; 3 crosses 1's end; 4 inside 1 and 3
    tr = trace.export(ev, {1: "step", 2: "a", 3: "b", 4: "c"}.get)
    tid = {e["name"]: e["tid"] for e in x_events(tr)}
    names = {e["tid"]: e["args"]["name"] for e in tr["traceEvents"] if e["name"] == "thread_name"}
    assert tid["step"] == tid["a"] == tid["c"] == trace.TID_HOST
    assert tid["b"] == trace.TID_HOST + trace.LANE
    assert names[tid["b"]] == "host (2)"


def test_link_launches_picks_the_latest_launch_naming_a_job():
    launch_start = np.array([0.0, 10.0, 20.0, 30.0])
    first = np.array([0, 1, 1, 2])  # launch 1 failed: its job 1 was run by launch 2
    count = np.array([1, 1, 1, 3])  # launch 3 is a plan of jobs 2, 3, 4
    job_seq = np.array([4, 0, 1, 2, 3])
    job_start = np.array([60.0, 5.0, 25.0, 35.0, 45.0])
    assert trace.link_launches(launch_start, first, count, job_seq, job_start).tolist() == [3, 0, 2, 3, 3]
    none = trace.link_launches(launch_start[:0], first[:0], count[:0], job_seq, job_start)
    assert none.tolist() == [-1] * 5


def test_export_refuses_arrays_that_are_not_trace_events():
    with pytest.raises(ValueError, match="TRACE_EVENT"):
        trace.export(np.zeros(3), str)


MALFORMED = {
    "not json": ("{\"traceEvents\": [", "not valid JSON"),
    "a number": ("42", "not a JSON int"),
    "no events": ('{"displayTimeUnit": "ns"}', "no 'traceEvents'"),
    "events not a list": ('{"traceEvents": {}}', "'traceEvents' must be an array"),
    "event not an object": ('{"traceEvents": [1]}', r"traceEvents\[0\]: an event must be a JSON object"),
    "no phase": ('[{"name": "a", "pid": 1, "tid": 1, "ts": 0}]', r"traceEvents\[0\]: missing the 'ph'"),
    "no pid": ('[{"name": "a", "ph": "X", "tid": 1, "ts": 0, "dur": 1}]', "without a numeric 'pid'"),
    "X without dur": ('[{"name": "a", "ph": "M", "pid": 1, "args": {}}, {"name": "a", "ph": "X", "pid": 1, '
                      '"tid": 1, "ts": 0}]', r"traceEvents\[1\]: 'X' event without 'dur'"),
    "ts a string": ('[{"name": "a", "ph": "X", "pid": 1, "tid": 1, "ts": "0", "dur": 1}]',
                    "'ts' must be a finite number"),
    "ts not finite": ('[{"name": "a", "ph": "X", "pid": 1, "tid": 1, "ts": NaN, "dur": 1}]',
                      "'ts' must be a finite number"),
    "negative dur": ('[{"name": "a", "ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": -1}]', "negative 'dur'"),
    "counter of text": ('[{"name": "q", "ph": "C", "pid": 1, "ts": 0, "args": {"n": "x"}}]',
                        "every arg must be a number"),
    "flow without id": ('[{"name": "l", "ph": "s", "pid": 1, "tid": 1, "ts": 0}]', "without 'id'"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_load_rejects_malformed_files_naming_the_problem(tmp_path, case):
    text, message = MALFORMED[case]
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        trace.load(path)
    assert str(path) in str(e.value)


def test_load_accepts_the_bare_array_form(tmp_path):
    path = tmp_path / "array.json"
    path.write_text('[{"name": "a", "ph": "X", "pid": 1, "tid": 1, "ts": 0.5, "dur": 1}]')
    assert trace.load(path)["traceEvents"][0]["dur"] == 1


def events(*rows):
    """TRACE_EVENT rows (kind, core, engine, start_ns, end_ns, job, a, b)."""
    ev = np.zeros(len(rows), TRACE_EVENT)
    for i, r in enumerate(rows):
        ev[i] = r
    return ev


def counter(tr, name):
    return [(e["ts"], next(iter(e["args"].values()))) for e in tr["traceEvents"]
            if e["ph"] == "C" and e["name"] == name]


def test_dram_bandwidth_spreads_bytes_over_each_command():
    tr = trace.export(events(
        (EV_CMD, 0, 0, 0, 2000, 0, OP_LOAD, 2000),     # 1 B/ns over windows 0 and 1
        (EV_CMD, 1, 0, 500, 1500, 0, OP_LOAD, 3000),   # 3 B/ns, half in each
        (EV_CMD, 2, 0, 2500, 2500, 0, OP_LOAD, 4000),  # instantaneous: all in window 2
        (EV_CMD, 0, 2, 0, 3000, 0, OP_MATMUL, 10**9),  # not DRAM traffic
    ), str, dram_window_ns=1000)
    assert counter(tr, "DRAM bandwidth") == [(0.0, 2.5), (2.0, 4.0), (3.0, 0.0)]
    assert tr["metadata"]["spyre_rt"]["dram_window_us"] == 1.0


def test_queue_depth_counts_jobs_from_their_launch_to_their_end():
    card = 0xFFFF
    tr = trace.export(events(
        (EV_LAUNCH, card, 0, 0, 1000, 0, 1, 1),
        (EV_LAUNCH, card, 0, 2000, 2500, 1, 1, 1),     # queued behind job 0
        (EV_LAUNCH, card, 0, 30000, 31000, 2, 0, 2),   # a plan of jobs 2 and 3
        (EV_JOB, card, 0, 3000, 13000, 0, 1, 0),
        (EV_JOB, card, 0, 15000, 20000, 1, 1, 0),
        (EV_JOB, card, 0, 33000, 41000, 2, 1, 0),
        (EV_JOB, card, 0, 43000, 46000, 3, 1, 0),
    ), {1: "op"}.get)
    assert counter(tr, "queue depth") == [(0.0, 1), (2.0, 2), (13.0, 1), (20.0, 0), (30.0, 2), (41.0, 1),
                                          (46.0, 0)]
    launches = [e["name"] for e in x_events(tr) if e["cat"] == "launch"]
    assert launches == ["launch op", "launch op", "launch plan"]


# ---- kernel info, device figures, gzip ---------------------------------------------------------


@pytest.fixture
def registered_kernels():
    from spyre_rt import job_facts

    job_facts.clear()
    job_facts.register("mm", {"kind": "matmul", "op": "aten.mm", "module": "model.layers.0.mlp.up_proj",
                                "flops": 2 * 64**3, "dram_bytes_min": 3 * 64 * 64 * 2, "dram_bytes": 4000,
                                "cores": 2, "scratchpad_peak": 1000, "unlisted": "kept out of the trace"})
    yield
    job_facts.clear()


def test_job_events_carry_their_kernel_info(registered_kernels):
    tr = trace.export(events((EV_JOB, 0xFFFF, 0, 0, 1000, 0, 1, 3), (EV_JOB, 0xFFFF, 0, 2000, 3000, 1, 2, 1)),
                      {1: "mm", 2: "h2d"}.get)
    mm, h2d = x_events(tr)
    assert mm["args"] == {"seq": 0, "commands": 3, "kind": "matmul", "op": "aten.mm",
                          "module": "model.layers.0.mlp.up_proj", "flops": 2 * 64**3,
                          "dram_bytes_min": 3 * 64 * 64 * 2, "dram_bytes": 4000, "cores": 2, "scratchpad_peak": 1000}
    assert h2d["args"] == {"seq": 1, "commands": 1}  # nothing registered: the args it always had


def test_without_commands_the_counters_come_from_kernel_info(registered_kernels):
    tr = trace.export(events((EV_JOB, 0xFFFF, 0, 0, 1000, 0, 1, 3), (EV_JOB, 0xFFFF, 0, 2000, 3000, 1, 2, 1)),
                      {1: "mm", 2: "h2d"}.get, dram_window_ns=500)
    # mm's 4000 bytes over its 1000 ns: 4 GB/s in the two windows it covers
    assert counter(tr, "DRAM bandwidth") == [(0.0, 4.0), (1.0, 0.0)]
    assert counter(tr, "scratchpad") == [(0.0, 2 * 1000), (1.0, 0)]  # scratchpad_peak on each of 2 cores
    notes = tr["metadata"]["spyre_rt"]
    assert notes["commands"] is False
    assert "kernel info" in notes["dram_counter"] and "kernel info" in notes["scratchpad_counter"]


def test_a_capture_records_the_figures_of_its_card(exported, spyre_profile):
    tr, _ = exported
    device = tr["metadata"]["spyre_rt"]["device"]
    assert device["name"] == spyre_profile.name and device["digest"] == spyre_profile.digest
    assert device["figures"]["pt_macs_per_ns"] == spyre_profile["pt_macs_per_ns"]
    assert device["figures"]["dram_bandwidth_gbps"] == spyre_profile["dram_bandwidth_gbps"]


def test_a_gz_name_writes_gzip_that_reads_back_the_same(exported, tmp_path):
    import gzip

    tr, plain = exported
    packed = tmp_path / "step.json.gz"
    trace.write(tr, packed)
    assert packed.read_bytes()[:2] == b"\x1f\x8b"
    assert gzip.decompress(packed.read_bytes()).decode() == plain.read_text()
    assert trace.load(packed) == trace.load(plain)
    assert packed.stat().st_size < plain.stat().st_size / 3
