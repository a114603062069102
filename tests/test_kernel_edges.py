"""A job's fill and drain: how long it runs before its first compute command (systolic
arrays or SFU) starts and after its last one ends, recorded by the card beside the job and
reported by the trace, `spyre-profile view` and `spyre-profile run`."""

import contextlib
from collections import defaultdict

import numpy as np
import pytest
import torch

from spyre_rt import card as cards
from spyre_rt import trace
from spyre_rt.card import EV_COMPUTE, EV_JOB, TRACE_EVENT
from spyre_rt.cost import CostModel
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.profiler import efficiency, optable, view

COMPUTE_CMDS = ("matmul", "sfu")


def mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2 + 1


def _recorded(sim_mode: str | None, calls: int = 1) -> dict:
    """The exported trace, every command in it, of `calls` prebuilt calls of a compiled MLP
    (its plans built by a call before the recording)."""
    with cards.configured(None, sim_mode) if sim_mode else contextlib.nullcontext():
        g = torch.Generator().manual_seed(0)
        args = [torch.randn(256, 512, generator=g).to("spyre"), torch.randn(512, 384, generator=g).to("spyre"),
                torch.randn(384, 256, generator=g).to("spyre")]
        fast = torch.compile(mlp, backend="spyre_rt", dynamic=False)
        with dispatch_mode("prebuilt"):
            fast(*args)
            card = cards.get(0)
            with trace.recording(card, commands=True) as rec:
                for _ in range(calls):
                    fast(*args)
                card.synchronize()
            return rec.export(None)


def _spans(tr: dict) -> tuple[list[dict], dict[int, tuple[float, float]]]:
    """The job events, and per job the span of its compute commands (µs)."""
    x = [e for e in tr["traceEvents"] if e.get("ph") == "X"]
    compute = defaultdict(list)
    for e in x:
        if e["cat"] == "cmd" and e["name"] in COMPUTE_CMDS:
            compute[e["args"]["job"]].append((e["ts"], e["ts"] + e["dur"]))
    return ([e for e in x if e["cat"] == "job"],
            {j: (min(s for s, _ in c), max(t for _, t in c)) for j, c in compute.items()})


@pytest.mark.parametrize("sim_mode", [None, "timing"])
def test_fill_and_drain_are_the_job_outside_its_compute_commands(sim_mode):
    jobs, compute = _spans(_recorded(sim_mode))
    kernels = [j for j in jobs if j["args"]["seq"] in compute]
    assert len(kernels) >= 2
    for j in jobs:
        span = compute.get(j["args"]["seq"])
        if span is None:  # no compute command: the job says nothing of fill and drain
            assert "fill_us" not in j["args"] and "drain_us" not in j["args"]
            continue
        fill, drain = j["args"]["fill_us"], j["args"]["drain_us"]
        assert fill == pytest.approx(span[0] - j["ts"], abs=2e-3)
        assert drain == pytest.approx(j["ts"] + j["dur"] - span[1], abs=2e-3)
        assert 0 <= fill and 0 <= drain and fill + drain <= j["dur"] + 1e-9
    # a matmul loads its first operands before its arrays start, and stores its last results after
    mm = [j for j in kernels if "mm" in j["args"].get("op", [])]
    assert mm and all(j["args"]["fill_us"] > 0 and j["args"]["drain_us"] > 0 for j in mm)


def test_a_job_timed_once_reports_the_fill_and_drain_of_its_first_run():
    """In timing mode a program's later runs reuse the timeline of its first: and its compute span."""
    jobs, _ = _spans(_recorded("timing", calls=2))
    by_name = defaultdict(list)
    for j in jobs:
        if "fill_us" in j["args"]:
            by_name[j["name"]].append((j["dur"], j["args"]["fill_us"], j["args"]["drain_us"]))
    assert by_name and all(len(v) == 2 and v[0] == pytest.approx(v[1]) for v in by_name.values())


def _events(*rows):
    ev = np.zeros(len(rows), TRACE_EVENT)
    for i, r in enumerate(rows):
        ev[i] = r
    return ev


def test_the_view_sums_fill_and_drain_per_row_and_of_compute_bound_kernels():
    """Two jobs of one kernel, its compute spans inside them; an unknown job without any."""
    card = 0xFFFF
    ev = _events((EV_JOB, card, 0, 0, 10_000, 0, 1, 1), (EV_COMPUTE, card, 0, 2_000, 9_000, 0, 0, 0),
                 (EV_JOB, card, 0, 20_000, 30_000, 1, 1, 1), (EV_COMPUTE, card, 0, 21_000, 30_000, 1, 0, 0),
                 (EV_JOB, card, 0, 40_000, 45_000, 2, 2, 1))
    tr = trace.export(ev, {1: "kmm", 2: "copy"}.get)
    args = {e["args"]["seq"]: e["args"] for e in tr["traceEvents"] if e.get("cat") == "job"}
    assert (args[0]["fill_us"], args[0]["drain_us"], args[1]["fill_us"], args[1]["drain_us"]) == (2, 1, 1, 0)
    assert "fill_us" not in args[2]
    data = view.parse(tr)
    rows = {r.name: r for r in optable.op_table(data, by="kernel")}
    assert rows["kmm"].edges_us == pytest.approx(4.0) and rows["copy"].edges_us == 0
    assert optable.totals(list(rows.values())).edges_us == pytest.approx(4.0)
    # without kernel figures nothing says the kernel is compute-bound: the device-time table leaves it out
    assert view.idle_breakdown(data).edges_us == 0


def test_only_compute_bound_kernels_count_toward_the_phase_fill_and_drain():
    roofline = CostModel.of_figures(cards.get(0).profile)
    facts = {"big": {"flops": 1e12, "dram_bytes_min": 1e6, "dtype": "float16"},  # compute-bound
             "stream": {"flops": 1e3, "dram_bytes_min": 1e9, "dtype": "float16"}}  # DRAM-bound
    edges = [("big", 2e6), ("stream", 5e6), ("big", 1e6), ("unknown", 7e6)]
    assert efficiency.compute_bound_edges_ms(edges, roofline, facts.get) == pytest.approx(3.0)
