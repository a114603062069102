"""``spyre-profile run``, ``info`` and ``cache`` on the tiny Granite (one layer, short prompt)."""

import io
import json

import pytest
import torch
from rich.console import Console

from spyre_rt import card as cards
from spyre_rt import device_profile, trace
from spyre_rt.cost import CostModel
from spyre_rt.profiler import analytic, cli, efficiency, published
from spyre_rt.profiler import run as runmod
from spyre_rt.profiler import view as viewmod

TINY = ["granite-tiny", "--seq", "16", "--decode-steps", "2", "--layers", "1"]
PHASES = ("prefill", "decode")


@pytest.fixture(scope="module", autouse=True)
def _own_card_set():
    """`spyre-profile run` configures the process's cards (timing mode for these runs): give
    the card set that was current back afterwards, so later tests keep functional cards."""
    with cards.configured():
        yield


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    js, tr = d / "out.json", d / "out.trace.json.gz"
    code = cli.main(["run", *TINY, "--timing", "--repeats", "2", "--json", str(js), "--trace", str(tr)])
    return code, json.loads(js.read_text()), tr


@pytest.fixture(scope="module")
def other_run(tmp_path_factory):
    """A second, different run: two modes, one repeat, every command in the trace."""
    d = tmp_path_factory.mktemp("other")
    js, tr = d / "other.json", d / "other.trace.json"
    code = cli.main(["run", *TINY, "--timing", "--repeats", "1", "--modes", "construct,prebuilt",
                     "--trace-detail", "commands", "--json", str(js), "--trace", str(tr)])
    assert code == 0
    return js, tr


def _quiet_measure(sim_mode: str) -> dict:
    opts = runmod.Options(model="granite-tiny", seq=16, decode_steps=2, layers=1, sim_mode=sim_mode)
    return runmod.measure(opts, Console(file=io.StringIO()))


def test_run_succeeds_and_the_json_carries_every_figure_of_the_table(cli_run):
    code, out, _ = cli_run
    assert code == 0
    for key in ("model", "batch", "seq", "decode_steps", "layers", "dtype", "sim_mode", "device_profile",
                "results", "speedups", "compute_share", "path_shares", "timings"):
        assert key in out
    assert out["repeats"] == 2
    assert set(out["results"]) == set(runmod.MODES)
    for mode, r in out["results"].items():
        for key in ("prefill_ms", "decode_ms_per_token", "host_ms", "device_ms", "device_wait_host_ms"):
            assert r[key] >= 0, (mode, key)
        for phase in PHASES:
            f = r["phases"][phase]
            for key in ("latency_ms", "host_ms", "device_ms", "device_wait_host_ms", "native_calls", "jobs"):
                assert key in f, (mode, phase, key)
            # latency is host work plus waiting for the card, never less than either
            assert f["latency_ms"] >= f["host_ms"] - 1e-6
    for mode in ("prebuilt-transfer", "prebuilt-compute", "prebuilt"):
        for phase in PHASES:
            assert out["speedups"][mode][phase] > 0
    # the prebuilt step is one native launch, whatever its kernel count
    assert out["results"]["prebuilt"]["phases"]["prefill"]["native_calls"] < \
        out["results"]["construct"]["phases"]["prefill"]["native_calls"]


def test_figures_are_medians_of_the_runs_figure_by_figure():
    runs = [{"prefill_ms": v, "phases": {"decode": {"jobs": j, "note": "x"}}}
            for v, j in ((5.0, 3), (1.0, 9), (3.0, 4))]
    assert runmod.median_of(runs) == {"prefill_ms": 3.0, "phases": {"decode": {"jobs": 4, "note": "x"}}}
    assert runmod.median_of(runs[:2])["prefill_ms"] == 3.0  # an even count: the mean of the middle two


def test_every_mode_runs_the_same_device_commands(cli_run):
    _, out, _ = cli_run
    for phase in PHASES:
        jobs = {mode: out["results"][mode]["phases"][phase]["jobs"] for mode in runmod.MODES}
        # both construct modes upload each kernel's program before running it (a job each);
        # a plan's programs are resident, so it runs the kernels alone
        assert jobs["construct"] == jobs["prebuilt-transfer"] > jobs["prebuilt"]
        # prebuilt-compute runs the same plans: its transfers are built per launch, not more jobs
        assert jobs["prebuilt-compute"] == jobs["prebuilt"]
    # a replay runs the prebuilt plans; its prefill uploads the prompt alone (the positions
    # stay on the card), the compiled call uploads both
    decode = {mode: out["results"][mode]["phases"]["decode"]["jobs"] for mode in runmod.MODES}
    assert decode["replay"] == decode["prebuilt"]
    prefill = {mode: out["results"][mode]["phases"]["prefill"]["jobs"] for mode in runmod.MODES}
    assert prefill["replay"] == prefill["prebuilt"] - 1


def test_the_decode_loop_keeps_the_token_on_the_card(cli_run):
    """Prebuilt and replay decode steps are one native call each (the phase's closing
    synchronize is the one more): no upload of the token, no download of the logits."""
    _, out, _ = cli_run
    for mode in ("prebuilt", "prebuilt-compute", "replay"):
        f = out["results"][mode]["phases"]["decode"]
        assert f["native_calls"] == f["steps"] + 1, mode


def test_prebuilt_compute_builds_the_prefills_uploads_and_launches_plans(cli_run):
    """prebuilt-compute is prebuilt's plan launches with a transfer graph built for each
    upload of the prefill (the prompt and its positions): more native calls than prebuilt,
    far fewer than prebuilt-transfer, which builds every kernel."""
    _, out, _ = cli_run
    calls = {m: out["results"][m]["phases"]["prefill"]["native_calls"] for m in runmod.MODES}
    assert calls["prebuilt"] < calls["prebuilt-compute"] < calls["prebuilt-transfer"]


def test_the_report_has_a_row_per_mode_and_the_share_of_each_path_alone(cli_run):
    _, out, _ = cli_run
    for phase in PHASES:
        assert set(out["path_shares"][phase]) == {"transfer", "compute"}
    text = io.StringIO()
    reference = runmod.load_reference("granite-3.3-8b", 1, 1024)  # published for two of the modes
    runmod.render(Console(file=text, width=160), {**out, "reference": reference})
    lines = text.getvalue().splitlines()
    assert any(line.startswith("prebuilt-compute ") and line.rstrip().endswith("x") for line in lines)
    gains = {line.split("│")[1].strip(): line for line in lines if line.count("│") >= 5}
    for phase in PHASES:
        for path in ("transfer", "compute"):
            assert f"{phase}: share of the gain, {path} path alone" in gains
        # the published speedups are of prebuilt-transfer and prebuilt: prebuilt-compute has none
        assert gains[f"{phase} speedup, prebuilt-compute"].split("│")[4].strip() == "—"
        assert gains[f"{phase} speedup, prebuilt"].split("│")[4].strip().endswith("x")


def test_the_share_of_each_path_alone_is_its_mode_against_construct_and_prebuilt():
    def r(prefill, decode):
        return {"prefill_ms": prefill, "decode_ms_per_token": decode}

    results = {"construct": r(100.0, 50.0), "prebuilt-transfer": r(80.0, 45.0),
               "prebuilt-compute": r(30.0, 10.0), "prebuilt": r(10.0, 5.0)}
    shares = runmod.path_shares_of(results)
    assert shares["prefill"] == pytest.approx({"transfer": 20 / 90, "compute": 70 / 90})
    assert shares["decode"] == pytest.approx({"transfer": 5 / 45, "compute": 40 / 45})
    assert runmod.compute_share_of(results)["prefill"] == pytest.approx(70 / 90)
    del results["prebuilt-compute"]
    assert runmod.path_shares_of(results) == {"prefill": {"transfer": 20 / 90}, "decode": {"transfer": 5 / 45}}


def test_replay_picks_the_tokens_the_compiled_calls_pick():
    """A functional run in each mode (replay between and after compiled calls) leaves the
    same last token and position on the card."""
    session = runmod.Session(runmod.Options(model="granite-tiny", seq=8, decode_steps=3, layers=2,
                                            sim_mode="functional"))
    tokens = {}
    for mode in ("construct", "prebuilt", "replay", "prebuilt", "replay"):
        session.run(mode)
        with session.active():
            tokens.setdefault(mode, []).append((session.tok.cpu(), session.tok_pos.cpu()))
    assert tokens["replay"][0][1].item() == 8 + 3  # the position the next step would write
    for mode, got in tokens.items():
        for tok, pos in got:
            assert torch.equal(tok, tokens["construct"][0][0]) and torch.equal(pos, tokens["construct"][0][1]), mode


def test_the_session_compiles_its_decoder_layers_once_and_picks_the_same_tokens():
    """By default the layers, one graph, are a compile region: Inductor compiles one region
    per graph (the prefill's and the decode step's), called once per layer; with
    ``regional=False`` (``--no-regional``) every layer is traced. The tokens are the same."""
    from torch._dynamo.utils import counters

    got = {}
    for regional in (True, False):
        counters["spyre_rt"].clear()
        session = runmod.Session(runmod.Options(model="granite-tiny", seq=8, decode_steps=2, layers=3,
                                                sim_mode="functional", regional=regional))
        session.run("prebuilt")
        with session.active():
            got[regional] = (session.tok.cpu(), session.tok_pos.cpu(), dict(counters["spyre_rt"]))
    count = got[True][2]
    assert (count.get("regions_compiled"), count.get("region_calls")) == (2, 6), count
    assert "regions_compiled" not in got[False][2], got[False][2]
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
    assert cli.build_parser().parse_args(["run", "granite-tiny", "--no-regional"]).regional is False


def test_the_trace_of_a_run_loads_and_views(cli_run, capsys):
    _, _, tr = cli_run
    loaded = trace.load(str(tr))
    spans = {e["name"] for e in loaded["traceEvents"] if e.get("ph") == "X"}
    for mode in runmod.MODES:
        assert {f"prefill [{mode}]", f"decode [{mode}]"} <= spans
    data = viewmod.parse(loaded)
    assert data.jobs and len(data.launches.op) > 0, "device jobs linked to host launches"
    assert cli.main(["view", str(tr)]) == 0
    printed = capsys.readouterr().out
    for section in ("per-op summary", "critical path"):
        assert section in printed


def test_timing_and_functional_mode_agree_on_device_time():
    timing, functional = _quiet_measure("timing"), _quiet_measure("functional")
    assert timing["sim_mode"] == "timing" and functional["sim_mode"] == "functional"
    for mode in runmod.MODES:
        for phase in PHASES:
            t = timing["results"][mode]["phases"][phase]
            f = functional["results"][mode]["phases"][phase]
            assert t["jobs"] == f["jobs"], (mode, phase)
            assert t["device_ms"] == pytest.approx(f["device_ms"], rel=1e-9), (mode, phase)


@pytest.mark.parametrize("argv", [
    ["run", "no-such-model"],
    ["run", "granite-tiny", "--batch", "0"],
    ["run", "granite-tiny", "--modes", "fastest"],
    ["run", "granite-tiny", "--functional", "--timing"],
    ["run", "granite-tiny", "--repeats", "0"],
])
def test_run_refuses_bad_input_with_a_clear_error(argv, capsys):
    code = cli.main(argv)
    assert code in (1, 2)
    err = capsys.readouterr().err
    assert "error" in err and len(err.strip().splitlines()) <= 3


def test_info_prints_the_profile_and_a_self_test(capsys):
    assert cli.main(["info", "--timing"]) == 0
    out = capsys.readouterr().out
    assert "scratchpad" in out.lower() and "pcie" in out.lower()


def test_cache_commands_list_inspect_stats_and_clear(cli_run, capsys, tmp_path):
    from spyre_rt import config

    d = config.settings().cache_dir
    assert cli.main(["cache", "list", "--dir", d]) == 0
    listed = capsys.readouterr().out
    assert cli.main(["cache", "stats", "--dir", d]) == 0
    assert "plans" in capsys.readouterr().out
    keys = [line.split("│")[1].strip() for line in listed.splitlines() if line.count("│") >= 3]
    assert keys, listed
    assert cli.main(["cache", "inspect", keys[0], "--dir", d]) == 0
    assert "names" in capsys.readouterr().out
    assert cli.main(["cache", "inspect", "zzzz-no-such-key", "--dir", d]) == 1
    assert cli.main(["cache", "inspect", "--dir", d]) == 1
    empty = tmp_path / "cache"
    assert cli.main(["cache", "clear", "--dir", str(empty)]) == 0
    assert "removed 0" in capsys.readouterr().out


def test_a_session_gives_back_the_card_set_it_found():
    """A profiler session (the benchmarks' decoders are sessions) works on timing-mode
    cards of its own: whatever ran it keeps the cards it had (a benchmark once left the
    process on cards that move no data, and later figures were measured on them)."""
    before = cards.card_set()
    session = runmod.Session(runmod.Options(model="granite-tiny", seq=8, decode_steps=1, layers=1,
                                            sim_mode="timing"))
    assert cards.card_set() is before
    session.run("prebuilt", decode_steps=1)
    assert cards.card_set() is before
    assert session.card.sim_mode == "timing" and session.card is not cards.get(0)


def test_the_published_compute_share_follows_from_the_published_speedups():
    """By the run's own formula: (1/1.099 - 1/1.7) / (1 - 1/1.7) = 78.1 % in prefill,
    (1/1.136 - 1/2.4) / (1 - 1/2.4) = 79.5 % in decode (not the 75 % of the prose)."""
    ref = runmod.load_reference("granite-3.3-8b", 1, 1024)
    assert ref["compute_share"]["prefill"] == pytest.approx(0.7812, abs=1e-4)
    assert ref["compute_share"]["decode"] == pytest.approx(0.7948, abs=1e-4)


# ---- what the run explains ---------------------------------------------------------------------


def per_step(out, mode, phase, key):
    f = out["results"][mode]["phases"][phase]
    return f[key] / (f["steps"] if phase == "decode" else 1)


def test_the_json_names_its_format_and_host_and_the_spread_of_every_figure(cli_run):
    _, out, _ = cli_run
    assert out["format"] == runmod.FORMAT == 3
    assert out["host"]["cpu"] and out["host"]["cores"] >= 1
    for mode in runmod.MODES:
        for phase, key in (("prefill", "prefill_ms"), ("decode", "decode_ms_per_token")):
            lat = out["spread"]["latency_ms"][mode][phase]
            assert lat["n"] == 2 and lat["min"] <= out["results"][mode][key] <= lat["max"]
            sp = out["spread"]["speedups"][mode][phase]
            assert sp["min"] <= sp["max"]
    assert out["spread"]["speedups"]["construct"]["prefill"] == {"min": 1.0, "max": 1.0, "n": 2}


def test_efficiency_is_device_time_against_the_roofline_per_phase(cli_run):
    _, out, _ = cli_run
    roofline = CostModel.of_figures(device_profile.load("spyre"))
    config = runmod.load_model("granite-tiny").config | {"num_hidden_layers": 1}
    for phase in PHASES:
        e = out["efficiency"][phase]
        assert e["device_ms"] == pytest.approx(per_step(out, "prebuilt", phase, "device_ms"))
        # every kernel carries what it computes: the phase's roofline is the sum of theirs,
        # which the analytic model of the whole step cannot exceed by much (kernels over a
        # static cache attend to all of it; fused kernels move less)
        assert e["source"] == "kernels" and e["kernels_with_info"] == e["kernels"] > 0
        cost = analytic.granite_step(config, 1, 16, phase, "float32")
        assert e["roofline_ms"] >= 0.5 * cost.roofline_ms(roofline)
        assert e["fraction"] == pytest.approx(e["roofline_ms"] / e["device_ms"])
        assert e["bound"] in ("compute", "DRAM") and 0 < e["fraction"] < 1


def test_the_fill_and_drain_of_a_prefill_is_its_compute_bound_kernels_in_the_trace(cli_run):
    """The report's fill and drain of a prefill: the jobs' fill_us and drain_us in the trace
    of a prefill, over the kernels whose roofline is compute."""
    _, out, tr = cli_run
    roofline = CostModel.of_figures(device_profile.load("spyre"))
    data = viewmod.load(tr)
    a, b = data.span("prefill [prebuilt]")
    jobs = data.jobs[viewmod.device(data)]
    edges = [(jobs.name[i], jobs.edges[i] * 1000) for i in range(len(jobs.name)) if a <= jobs.start[i] < b]
    assert any(ns > 0 for _, ns in edges)
    e = out["efficiency"]["prefill"]
    assert e["edges_ms"] == pytest.approx(efficiency.compute_bound_edges_ms(edges, roofline, jobs.info.get),
                                          rel=1e-6, abs=1e-9)
    for phase in PHASES:
        assert 0 <= out["efficiency"][phase]["edges_ms"] < out["efficiency"][phase]["device_ms"]


def test_kernels_are_the_prebuilt_steps_jobs_without_copies(cli_run):
    _, out, _ = cli_run
    for phase in PHASES:
        jobs = per_step(out, "prebuilt", phase, "jobs")
        assert 0 < out["kernels"][phase] <= jobs


def test_implied_costs_on_real_output_follow_the_worked_formula(cli_run):
    _, out, _ = cli_run
    assert out["implied"] == {}  # no published figures for this model and size
    reference = {"speedups": {"prebuilt": {"prefill": 1.7, "decode": 2.4}}}
    got = published.implied(out["results"], reference, out["kernels"])["prebuilt"]
    for phase, pub in (("prefill", 1.7), ("decode", 2.4)):
        n, device = out["kernels"][phase], per_step(out, "prebuilt", phase, "device_ms")
        assert got[phase]["implied_us_per_kernel"] == pytest.approx((pub - 1) * device * 1000 / n)
        ours = per_step(out, "construct", phase, "latency_ms") - per_step(out, "prebuilt", phase, "latency_ms")
        assert got[phase]["measured_us_per_kernel"] == pytest.approx(ours * 1000 / n)
    for phase in PHASES:
        w = out["whatif"][phase]
        assert w["published"] is None and w["ours"]["speedup"] > 1 and len(w["curve"]) > 10


def test_the_default_trace_holds_jobs_and_counters_not_commands(cli_run, other_run):
    _, _, jobs_trace = cli_run
    _, commands_trace = other_run
    assert jobs_trace.read_bytes()[:2] == b"\x1f\x8b"  # .gz asked for gzip
    tr = trace.load(jobs_trace)
    cats = {e.get("cat") for e in tr["traceEvents"]}
    assert "job" in cats and "cmd" not in cats
    assert {e["name"] for e in tr["traceEvents"] if e["ph"] == "C"} >= {"queue depth"}
    spans = [e["name"] for e in tr["traceEvents"] if e.get("cat") == "host" and "[" in e["name"]]
    assert sorted(spans) == sorted(f"{p} [{m}]" for m in runmod.MODES for p in PHASES)  # the warm-up is not in it
    assert tr["metadata"]["spyre_rt"]["device"]["figures"]["dram_bandwidth_gbps"] == 150
    full = trace.load(commands_trace)
    assert any(e.get("cat") == "cmd" for e in full["traceEvents"])
    # bytes per job: a jobs trace stays small whatever the kernels do
    jobs = sum(e.get("cat") == "job" for e in tr["traceEvents"])
    assert len(json.dumps(tr)) / jobs < 1500


def test_view_shows_one_span_of_a_run(cli_run, capsys):
    _, _, tr = cli_run
    assert cli.main(["view", str(tr), "--span", "decode [prebuilt]"]) == 0
    out = capsys.readouterr().out
    assert "per-op summary" in out
    assert cli.main(["view", str(tr), "--span", "no such span"]) == 1
    assert "no host span named" in capsys.readouterr().err


def test_compare_works_on_two_real_run_outputs(cli_run, other_run, capsys):
    from spyre_rt.profiler import compare

    _, out, _ = cli_run
    a_path = cli_run[2].with_name("out.json")
    b_path, _ = other_run
    assert cli.main(["compare", str(a_path), str(b_path)]) == 0
    printed = capsys.readouterr().out
    for text in ("mode prebuilt", "prefill.latency_ms", "speedups", "spread", "device efficiency",
                 "repeats differs"):
        assert text in printed, text
    cmp = compare.compare_results(out, json.loads(b_path.read_text()))
    eff = {d.name: d for d in cmp.sections["device efficiency (per prefill, per decode token)"]}
    assert eff["prefill.fraction"].higher_is_better is True
    assert eff["prefill.device_ms"].a == pytest.approx(out["efficiency"]["prefill"]["device_ms"])
    speedup = next(d for d in cmp.speedups if d.name == "prebuilt.decode")
    spread = out["spread"]["speedups"]["prebuilt"]["decode"]
    assert speedup.spread_a == (spread["min"], spread["max"])
    assert set(cmp.modes) == set(runmod.MODES)


def test_cache_inspect_shows_the_kernel_info_a_plan_file_carries(tmp_path, capsys):
    import numpy as np

    from spyre_rt import plan_cache

    cache = plan_cache.PlanCache(tmp_path, 1 << 30)
    info = {"k3": {"kind": "matmul", "op": "aten.mm", "module": "model.layers.3.mlp.up_proj", "flops": 2 * 64**3,
                   "dram_bytes_min": 24_576, "dram_bytes": 32_768, "cores": 32, "scratchpad_peak": 65_536}}
    cache.store("ab" * 32, {"kernels": 1, "names": [["k3"]], "kernel_info": info}, [np.zeros(8, np.uint8)])
    assert cli.main(["cache", "inspect", "abab", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "kernels: what each computes" in out
    row = next(line for line in out.splitlines() if line.startswith("k3 "))
    assert row.split() == ["k3", "matmul", "mm", "·", "layers.3.mlp.up_proj", "0.5", "24", "32", "32", "64"]
    assert '"k3": {' not in out  # not repeated as raw JSON in the header table


def test_a_run_without_construct_says_its_speedups_are_undefined(capsys):
    assert cli.main(["run", *TINY, "--timing", "--repeats", "1", "--modes", "prebuilt"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "construct, which was not run" in out


def test_the_run_names_its_clock_and_reports_wall_time_beside_host_time(cli_run):
    """Host figures are CPU time of the dispatching thread; each has a wall twin, which puts
    the host's time off the CPU back and so is not below it on one thread (but for the
    clocks' reading, about a microsecond a call on a virtual machine)."""
    _, out, _ = cli_run
    assert out["clock"]["host"] == "thread-cpu" and out["clock"]["wall"] == "monotonic"
    for mode, r in out["results"].items():
        calls = sum(r["phases"][p]["native_calls"] for p in ("prefill", "decode"))
        slack = calls * 2e-3  # ms: 2 µs a call
        assert r["host_wall_ms"] >= r["host_ms"] - slack
        assert r["prefill_wall_ms"] >= r["prefill_ms"] - slack
        for phase in ("prefill", "decode"):
            f = r["phases"][phase]
            assert f["latency_wall_ms"] - f["host_wall_ms"] == pytest.approx(f["latency_ms"] - f["host_ms"])
        assert set(out["wall"]["speedups"][mode]) == {"prefill", "decode"}
    console = Console(file=io.StringIO(), width=80)
    runmod.render(console, out)
    text = console.file.getvalue()
    assert "CLOCK_THREAD_CPUTIME_ID" in text and "in wall time" in text
    assert "pt_utilization" in out["roofline_assumptions"]
    assert "the roofline rests on figures that are assumptions" in " ".join(text.split())


def test_speedups_are_medians_of_each_rounds_ratio_not_ratios_of_medians():
    """A round runs every mode once; a speedup pairs construct with the mode of the same
    round, so a round in which the whole host ran slow cancels out of its own ratio."""
    def r(prefill, decode):
        return {"prefill_ms": prefill, "decode_ms_per_token": decode}

    samples = {"construct": [r(100.0, 10.0), r(200.0, 20.0), r(400.0, 40.0)],
               "prebuilt": [r(40.0, 5.0), r(200.0, 10.0), r(100.0, 20.0)]}
    speedups = runmod.speedups_of(samples)
    assert speedups["prebuilt"]["prefill"] == pytest.approx(2.5)  # rounds 2.5, 1, 4; medians would give 2
    assert speedups["prebuilt"]["decode"] == pytest.approx(2.0)
    assert speedups["construct"] == {"prefill": 1.0, "decode": 1.0}
    relative = runmod.relative_latencies(speedups)
    assert relative["prebuilt"]["prefill_ms"] == pytest.approx(0.4)
    assert runmod.speedups_of({"prebuilt": samples["prebuilt"]}) == {}  # no construct, no speedups
