"""One timeline with torch.profiler: launches as record_function ranges, and the card's tracks
merged into a trace torch.profiler exported."""

import json
from collections import defaultdict

import pytest
import torch

from spyre_rt import card as cards
from spyre_rt import job_facts, torch_ranges, trace
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.profiler import cli, view
from spyre_rt.trace import merge


def mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2 + 1


@pytest.fixture(scope="module")
def compiled():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(64, 128, generator=g).to("spyre"), torch.randn(128, 96, generator=g).to("spyre"),
            torch.randn(96, 64, generator=g).to("spyre")]
    fast = torch.compile(mlp, backend="spyre_rt", dynamic=False)
    for mode in ("construct", "prebuilt"):  # compiled, plans built: the profiled calls are steady state
        with dispatch_mode(mode):
            fast(*args)
    return fast, args


@pytest.fixture(scope="module")
def profiled(compiled, tmp_path_factory):
    """A construct-mode call and a prebuilt call inside torch.profiler and a card capture,
    both exported as their tools export them."""
    fast, args = compiled
    d = tmp_path_factory.mktemp("torch-profiler")
    card = cards.get(0)
    with trace.recording(card, commands=True) as cap, torch.profiler.profile() as prof:
        for mode in ("construct", "prebuilt"):
            with dispatch_mode(mode):
                fast(*args).cpu()
    torch_path, card_path = d / "torch.json", d / "card.json"
    prof.export_chrome_trace(str(torch_path))
    cap.export(card_path)
    return torch_path, card_path, d


def launch_ranges(tr):
    return [e for e in tr["traceEvents"] if e.get("ph") == "X" and torch_ranges.RANGE_NAME.match(e["name"])]


def test_launches_are_ranges_in_the_torch_trace(profiled):
    torch_path, _, _ = profiled
    names = [e["name"] for e in launch_ranges(json.loads(torch_path.read_text()))]
    kernels = [n for n in names if n != "spyre:0 launch step"]
    assert kernels and all(n.startswith("spyre:0 launch k") for n in kernels)  # one per kernel in construct mode
    assert any(" | mm" in n for n in kernels)  # named by what they compute, and kept by the export
    assert names.count("spyre:0 launch step") == 1  # the prebuilt call: one plan launch


def test_no_range_is_made_outside_a_profiler(compiled, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("record_function created with no profiler running")

    monkeypatch.setattr(torch_ranges._autograd_profiler, "record_function", refuse)
    fast, args = compiled
    assert not torch_ranges.active()
    for mode in ("construct", "prebuilt"):
        with dispatch_mode(mode):
            fast(*args)


def test_a_range_names_the_kernels_op_and_module():
    job_facts.clear()
    try:
        job_facts.register("k7", {"op": ["aten.mm", "aten.relu"], "module": "model.layers.3.mlp.up_proj"})
        assert torch_ranges.range_name(0, "k7") == "spyre:0 launch k7 | mm+relu | layers.3.mlp.up_proj"
        assert torch_ranges.range_name(1, "step") == "spyre:1 launch step"
        assert torch_ranges.RANGE_NAME.match("spyre:0 launch k7 | mm+relu | layers.3.mlp.up_proj").groups() == \
            ("0", "k7")
    finally:
        job_facts.clear()


def test_merge_places_each_job_after_the_launch_range_that_started_it(profiled):
    torch_path, card_path, d = profiled
    out = d / "merged.json.gz"
    assert cli.main(["merge", str(torch_path), str(card_path), "-o", str(out)]) == 0
    merged = trace.load(out)  # a valid trace
    torch_trace = json.loads(torch_path.read_text())
    card_trace = json.loads(card_path.read_text())
    assert len(merged["traceEvents"]) > len(torch_trace["traceEvents"])
    torch_pids = {e["pid"] for e in torch_trace["traceEvents"]}
    jobs = [e for e in merged["traceEvents"] if e.get("cat") == "job"]
    (pid,) = {e["pid"] for e in jobs}
    assert pid not in torch_pids
    assert not any(e.get("cat") in ("launch", "host") for e in merged["traceEvents"])  # the card's host is left out
    # durations are the card's; the card runs one job at a time
    original = {e["args"]["seq"]: e["dur"] for e in card_trace["traceEvents"] if e.get("cat") == "job"}
    assert {e["args"]["seq"]: e["dur"] for e in jobs} == original
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in jobs)
    assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:], strict=False))
    # every kernel job has a flow from its launch range, and starts after it
    ranges = {(e["pid"], e["tid"], e["ts"]): e for e in launch_ranges(merged)}
    flows = defaultdict(dict)
    for e in merged["traceEvents"]:
        if e.get("cat") == "flow":
            flows[e["id"]][e["ph"]] = e
    started = {}
    for pair in flows.values():
        s, f = pair["s"], pair["f"]
        r = ranges[(s["pid"], s["tid"], s["ts"])]
        job = next(j for j in jobs if j["ts"] == f["ts"])
        assert r["ts"] <= job["ts"]
        assert r["name"].split(" ")[2] in (job["name"], "step")  # "spyre:0 launch k3" started k3; a plan, its kernels
        started[job["args"]["seq"]] = r["name"]
    kernel_jobs = {e["args"]["seq"] for e in jobs if e["name"].startswith("k")}
    assert kernel_jobs <= started.keys()
    assert merged["spyre_rt"]["merged"]["matched"] == len(launch_ranges(torch_trace))
    # commands moved with their jobs
    job_span = {e["args"]["seq"]: (e["ts"], e["ts"] + e["dur"]) for e in jobs}
    for c in (e for e in merged["traceEvents"] if e.get("cat") == "cmd"):
        lo, hi = job_span[c["args"]["job"]]
        assert lo - 1e-3 <= c["ts"] and c["ts"] + c["dur"] <= hi + 1e-3


def test_the_merged_trace_reads_in_the_viewer(profiled, capsys):
    torch_path, card_path, d = profiled
    out = d / "merged-view.json"
    assert cli.main(["merge", str(torch_path), str(card_path), "-o", str(out)]) == 0
    data = view.load(out)
    assert len(data.devices) == 1 and data.card_of(data.devices[0]) == 0
    assert cli.main(["view", str(out)]) == 0
    assert "per-op summary" in capsys.readouterr().out


def test_match_skips_copies_and_ranges_it_cannot_place():
    def launches(*names):
        return [merge.Launch(n, float(i), {}) for i, n in enumerate(names)]

    ranges = launches("k1", "k2", "step")
    card = launches("h2d", "k1", "h2d", "k2", "d2h", "step")
    assert [(r.name, c.ts) for r, c in merge.match(ranges, card)] == [("k1", 1.0), ("k2", 3.0), ("step", 5.0)]
    assert merge.match(launches("k9", "k1"), launches("k1")) == [(launches("k9", "k1")[1], launches("k1")[0])]


def test_merge_refuses_files_that_are_not_traces(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"results": {}}')
    assert cli.main(["merge", str(bad), str(bad), "-o", str(tmp_path / "out.json")]) == 1
    assert "no 'traceEvents'" in capsys.readouterr().err
    assert cli.main(["merge", str(tmp_path / "missing.json"), str(bad), "-o", str(tmp_path / "o.json")]) == 1
