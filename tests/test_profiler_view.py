"""spyre-profile view / compare: numbers checked against a small trace computed by hand."""

import io
import json

import numpy as np
import pytest
from rich.console import Console

from spyre_rt import trace
from spyre_rt.card import EV_CMD, EV_HOST, EV_JOB, EV_LAUNCH, TRACE_EVENT
from spyre_rt.profiler import cli, compare, optable, view
from spyre_rt.program import OP_LOAD, OP_MATMUL

NAMES = {1: "mm", 2: "add", 3: "step"}.get
CARD = 0xFFFF


def synthetic(j0_us: float = 10.0) -> np.ndarray:
    """Five jobs, four launches (one a plan of two jobs) and a host span, in ns.

    host   step [0, 55]
    launch mm [0, 1]   add [2, 2.5]          mm [30, 31]   plan [41.5, 42]
    jobs      mm [3, 3+j0]  add [15, 20]     mm [33, 41]   add [44, 46]  mm [48, 52]
    gap before:  3 host     2 other (queued) 13 host       3 host        2 other (plan)
    tail 52 -> 55: host. With j0 = 10: busy 29, host 22, other 4, span 55 (µs).
    """
    rows = [
        (EV_HOST, CARD, 0, 0, 55_000, 0, 3, 0),
        (EV_LAUNCH, CARD, 0, 0, 1_000, 0, 1, 1),
        (EV_LAUNCH, CARD, 0, 2_000, 2_500, 1, 2, 1),
        (EV_LAUNCH, CARD, 0, 30_000, 31_000, 2, 1, 1),
        (EV_LAUNCH, CARD, 0, 41_500, 42_000, 3, 0, 2),
        (EV_JOB, CARD, 0, 3_000, 3_000 + j0_us * 1000, 0, 1, 8),
        (EV_JOB, CARD, 0, 15_000, 20_000, 1, 2, 2),
        (EV_JOB, CARD, 0, 33_000, 41_000, 2, 1, 0),
        (EV_JOB, CARD, 0, 44_000, 46_000, 3, 2, 0),
        (EV_JOB, CARD, 0, 48_000, 52_000, 4, 1, 0),
    ]
    rows += [(EV_CMD, core, 2, 3_000, 3_000 + j0_us * 1000, 0, OP_MATMUL, 1 << 20) for core in range(8)]
    rows += [(EV_CMD, core, 0, 15_000, 20_000, 1, OP_LOAD, 4096) for core in range(2)]
    return np.array(rows, TRACE_EVENT)


@pytest.fixture
def data():
    return view.parse(trace.export(synthetic(), NAMES))


@pytest.fixture
def files(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    trace.export(synthetic(), NAMES, a)
    trace.export(synthetic(j0_us=5.0), NAMES, b)
    return a, b


def result(prefill_ms, decode_ms, speedup):
    return {"model": "granite-3.3-8b", "batch": 1, "seq": 1024, "device_profile": "spyre",
            "results": {"construct": {"prefill_ms": 100.0, "decode_ms_per_token": 20.0, "host_ms": 60.0,
                                      "device_ms": 40.0, "device_wait_host_ms": 30.0},
                        "prebuilt": {"prefill_ms": prefill_ms, "decode_ms_per_token": decode_ms,
                                     "host_ms": 10.0, "device_ms": 40.0, "device_wait_host_ms": 2.0}},
            "speedups": {"prebuilt": {"prefill": speedup, "decode": 2.4}}}


def text_of(render, *args, width=120, **kwargs) -> str:
    console = Console(file=io.StringIO(), width=width, record=True)
    render(console, *args, **kwargs)
    return console.export_text()


# ---- the numbers -----------------------------------------------------------------------------


def test_parse_links_jobs_to_launches(data):
    (dev,) = data.devices
    assert dev == 2 and data.processes == {1: "host", 2: "spyre:0"}
    jobs = data.jobs[dev]
    assert jobs.name == ["mm", "add", "mm", "add", "mm"]
    assert jobs.launch.tolist() == [0, 1, 2, 3, 3]
    assert data.launches.op == ["mm", "add", "mm", "plan"]
    assert (data.t0, data.t1) == (0.0, 55.0)


def test_op_summary_matches_the_hand_computed_table(data):
    ops = {o.name: o for o in optable.op_table(data)}
    assert list(ops) == ["mm", "add", "plan"]  # biggest device time first
    mm, add, plan = ops["mm"], ops["add"], ops["plan"]
    assert (mm.calls, mm.device_us, mm.host_us) == (3, pytest.approx(22.0), pytest.approx(2.0))
    assert (mm.avg_us, mm.min_us, mm.max_us) == (pytest.approx(22 / 3), 4.0, 10.0)
    assert mm.step_pct == pytest.approx(100 * 22 / 29)
    assert (add.calls, add.device_us, add.host_us, add.step_pct) == (2, 7.0, 0.5, pytest.approx(100 * 7 / 29))
    # a plan launch has host time but no job of its own
    assert (plan.calls, plan.host_us, plan.device_us, plan.avg_us) == (1, 0.5, 0.0, None)


def test_idle_breakdown_separates_waiting_on_the_host(data):
    idle = view.idle_breakdown(data)
    assert idle.span_us == 55.0 and idle.jobs == 5
    assert idle.busy_us == pytest.approx(29.0)
    assert idle.idle_host_us == pytest.approx(3 + 13 + 3 + 3)
    assert idle.idle_other_us == pytest.approx(2 + 2)
    assert [(s.job, s.at_us, s.gap_us) for s in idle.stalls] == [("mm", 20.0, 13.0), ("mm", 0.0, 3.0),
                                                                   ("add", 41.0, 3.0)]


def test_critical_path_is_host_bound_gaps_against_device_work(data):
    cp = view.critical_path(data)
    assert cp.host_pct == pytest.approx(40.0)  # 22 of 55 µs
    assert cp.device_pct == pytest.approx(60.0)  # 29 busy + 4 of the device's own gaps


def test_a_window_clips_jobs_and_gaps(data):
    win = view.window(data, 20, 45)
    assert win == (20.0, 45.0)
    idle = view.idle_breakdown(data, win)
    assert (idle.span_us, idle.busy_us, idle.idle_host_us, idle.idle_other_us) == (25.0, 9.0, 16.0, 0.0)
    assert [o.name for o in optable.op_table(data, win)] == ["mm", "add", "plan"]
    assert {o.name: o.calls for o in optable.op_table(data, win)} == {"mm": 1, "add": 1, "plan": 1}


def test_timeline_merges_many_cores_into_one_row_per_engine(data):
    rows = {r.label: r for r in view.timeline(data, view.window(data, 3, 13), columns=10)}
    assert "pt (8 cores)" in rows and "load (2 cores)" in rows
    assert not any(label.startswith("core ") for label in rows)
    assert rows["pt (8 cores)"].level.tolist() == [1.0] * 10
    assert rows["jobs"].level.tolist() == pytest.approx([1.0] * 10)
    assert rows["load (2 cores)"].level.tolist() == [0.0] * 10
    assert rows["launch → spyre:0"].level.tolist() == [0.0] * 10
    assert rows["queue depth"].counter
    # half the columns of 15..25 µs are the add job's loads on both its cores
    rows = {r.label: r for r in view.timeline(data, view.window(data, 15, 25), columns=10)}
    assert rows["load (2 cores)"].level.tolist() == pytest.approx([1.0] * 5 + [0.0] * 5)


def test_timeline_keeps_one_row_per_core_when_few(data):
    labels = [r.label for r in view.timeline(data, columns=10, aggregate_above=8)]
    assert "core 00 · pt" in labels and "core 01 · load" in labels


# ---- rendering ---------------------------------------------------------------------------------


def test_render_prints_every_section(data):
    out = text_of(view.render, data, top=2)
    for text in ("pt (8 cores)", "per-op summary", "waiting on the host", "critical path",
                 "host-bound 40.0 %", "device-bound 60.0 %", "… 1 more", "host stall 13.0 µs before mm"):
        assert text in out
    mm_row = next(line for line in out.splitlines() if line.startswith("mm "))
    assert mm_row.split() == ["mm", "3", "2.0", "22.0", "75.9", "7.3", "4.0", "10.0"]
    assert "jobs carry no kernel info" in out


def test_render_degrades_to_ascii_on_a_legacy_terminal(data):
    console = Console(file=io.TextIOWrapper(io.BytesIO(), encoding="ascii"), width=100, record=True)
    view.render(console, data)
    out = console.export_text()
    assert "#" in out and "█" not in out and "░" not in out


def test_rich_markup_in_op_names_is_shown_as_is():
    tr = trace.export(synthetic(), {1: "mm[bold]", 2: "add", 3: "step"}.get)
    assert "mm[bold]" in text_of(view.render, view.parse(tr))


# ---- compare -----------------------------------------------------------------------------------


def test_compare_traces_gives_absolute_and_relative_deltas(files):
    (ka, a), (kb, b) = compare.load(files[0]), compare.load(files[1])
    assert ka == kb == "trace"
    cmp = compare.compare_traces(a, b, "a", "b")
    summary = {d.name: d for d in cmp.summary}
    busy = summary["busy µs"]
    assert (busy.a, busy.b, busy.delta) == (29.0, 24.0, -5.0)
    assert busy.pct == pytest.approx(-100 * 5 / 29)
    # add now waits 7 µs in the queue
    assert summary["idle, waiting on data/other µs"].b == pytest.approx(9.0)
    mm = next(o for o in cmp.ops if o.name == "mm")
    assert (mm.device.a, mm.device.b, mm.device.delta) == (22.0, 17.0, -5.0)
    assert mm.device.better is True
    out = text_of(compare.render, cmp)
    assert "-5.0" in out and "-22.7 %" in out


def test_compare_results_per_mode_and_speedups():
    cmp = compare.compare_results(result(59.0, 8.3, 1.7), result(50.0, 8.3, 1.9), "old", "new")
    pre = {d.name: d for d in cmp.modes["prebuilt"]}
    assert list(pre) == list(compare.RESULT_METRICS)
    assert (pre["prefill_ms"].delta, pre["prefill_ms"].pct) == (-9.0, pytest.approx(-100 * 9 / 59))
    assert pre["decode_ms_per_token"].delta == 0.0 and pre["decode_ms_per_token"].better is None
    sp = {d.name: d for d in cmp.speedups}
    assert sp["prebuilt.prefill"].delta == pytest.approx(0.2) and sp["prebuilt.prefill"].better is True
    assert cmp.notes == []
    out = text_of(compare.render, cmp)
    assert "mode prebuilt" in out and "-9.000" in out and "-15.3 %" in out and "+11.8 %" in out


def test_compare_results_notes_a_different_run():
    other = result(59.0, 8.3, 1.7) | {"seq": 2048}
    cmp = compare.compare_results(result(59.0, 8.3, 1.7), other)
    assert cmp.notes == ["seq differs: 1024 vs 2048"]


# ---- the command line --------------------------------------------------------------------------


def run_cli(capsys, *argv):
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out, err


def test_cli_view_and_compare_succeed(capsys, files, tmp_path):
    status, out, _ = run_cli(capsys, "view", str(files[0]), "--window", "0:30", "--top", "1")
    assert status == 0 and "per-op summary" in out and "window 0.0–30.0 µs" in out
    status, out, _ = run_cli(capsys, "compare", str(files[0]), str(files[1]))
    assert status == 0 and "per-op device µs" in out
    ra, rb = tmp_path / "ra.json", tmp_path / "rb.json"
    ra.write_text(json.dumps(result(59.0, 8.3, 1.7)))
    rb.write_text(json.dumps(result(50.0, 8.3, 1.9)))
    status, out, _ = run_cli(capsys, "compare", str(ra), str(rb), "--json")
    assert status == 0 and "speedups" in out


@pytest.mark.parametrize("argv", [
    [], ["bogus"], ["view"], ["view", "t.json", "--window", "5:1"], ["view", "t.json", "--window", "x:y"],
    ["view", "t.json", "--window", "5"], ["view", "t.json", "--top", "0"], ["compare", "a.json"],
])
def test_cli_usage_errors_exit_2(capsys, argv):
    status, _, err = run_cli(capsys, *argv)
    assert status == 2 and err.startswith("spyre-profile") and "error:" in err
    assert len(err.strip().splitlines()) == 1, err


def test_cli_bad_files_exit_1_with_one_line(capsys, files, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [{"ph": "X"}]}')
    res = tmp_path / "res.json"
    res.write_text(json.dumps(result(59.0, 8.3, 1.7)))
    broken = tmp_path / "broken.json"
    broken.write_text('{"results": {"prebuilt": {"prefill_ms": "fast"}}}')
    cases = [
        (["view", str(tmp_path / "missing.json")], "no such file"),
        (["view", str(tmp_path)], "is a directory"),
        (["view", str(bad)], "traceEvents[0]: 'X' event without a numeric 'pid'"),
        (["view", str(res)], "a result file, not a trace"),
        (["compare", str(files[0]), str(res)], "cannot compare a trace file"),
        (["compare", str(res), str(broken)], "must be a number"),
    ]
    for argv, message in cases:
        status, _, err = run_cli(capsys, *argv)
        assert status == 1, argv
        assert message in err and err.startswith("spyre-profile: error:"), err
        assert len(err.strip().splitlines()) == 1, err


def test_a_share_changes_in_points_not_percent(files):
    cmp = compare.compare_traces(compare.load(files[0])[1], compare.load(files[1])[1])
    share = next(d for d in cmp.summary if d.name == "host-bound %")
    assert not share.relative
    moved = compare.Delta("host-bound %", 40.0, 50.0, relative=False)
    assert (moved.delta, moved.pct, moved.better) == (10.0, None, False)
