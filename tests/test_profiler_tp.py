"""``spyre-profile run --tp N``: a tiny Granite sharded over two cards, a process per card,
against one card (the runs of Granite 3.3 8B over 2, 4 and 8 cards are the README's)."""

from __future__ import annotations

import json

import pytest

from spyre_rt.profiler import cli
from spyre_rt.trace import merge as merge_mod


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    pytest.importorskip("accelerate")
    d = tmp_path_factory.mktemp("tp")
    out, trace = d / "out.json", d / "trace.json"
    code = cli.main(["run", "granite-tiny", "--tp", "2", "--layers", "2", "--seq", "8", "--decode-steps", "1",
                     "--repeats", "1", "--modes", "prebuilt,replay", "--timing", "--trace", str(trace),
                     "--json", str(out)])
    assert code == 0
    return json.loads(out.read_text()), trace


def test_a_tp_run_reports_each_mode_on_one_card_and_on_two(tp_run):
    out, _ = tp_run
    assert out["tp"] == [2]
    run = out["runs"][0]
    assert len(run["ranks"]) == 2 and [r["tp"] for r in run["ranks"]] == [2, 2]
    for mode in ("prebuilt", "replay"):
        one = out["one_card"]["results"][mode]
        two = run["results"][mode]
        for phase, key in (("prefill", "prefill_ms"), ("decode", "decode_ms_per_token")):
            assert two[key] == max(r["results"][mode][key] for r in run["ranks"])  # the slowest card
            assert run["speedups"][mode][phase] == pytest.approx(one[key] / two[key])
            assert 0 < run["ideal"][mode][phase] < 2  # one card's time halved, plus the collectives


def test_a_tp_run_spends_time_in_collectives_inside_its_plans(tp_run):
    out, _ = tp_run
    run = out["runs"][0]
    for phase in ("prefill", "decode"):
        assert run["collectives"][phase]["ms"] > 0 and 0 < run["collectives"][phase]["share"] < 1
    assert not out["one_card"]["collectives"]["prefill"]["ms"]  # one card: none


def test_the_ranks_traces_merge_into_one_with_a_track_per_card(tp_run, capsys):
    _, trace = tp_run
    data = merge_mod.read(trace)
    names = {(e["pid"], e["args"]["name"]) for e in data["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    assert {n for _, n in names} >= {"host", "spyre:0", "spyre:1"}
    assert data["spyre_rt"]["ranks"] == 2
    assert cli.main(["view", str(trace), "--span", "decode [replay]", "--top", "3"]) == 0
    shown = capsys.readouterr().out
    assert "spyre:0" in shown and "spyre:1" in shown and "host · rank 1" in shown


def test_tp_refuses_a_sweep(capsys):
    assert cli.main(["run", "granite-tiny", "--tp", "2", "--sweep"]) == 1
    assert "--sweep runs on one card" in capsys.readouterr().err


def test_a_failed_ranks_error_names_its_exception_before_torchs_advice():
    from spyre_rt.profiler.tp import _failure

    lines = ["[rank1]: Traceback (most recent call last):\n", "[rank1]:   File \"x.py\", line 1, in f\n",
             "[rank1]: torch._dynamo.exc.BackendCompilerFailed: backend='spyre_rt' raised:\n",
             "[rank1]: NotImplementedError: no rule for this\n",
             *[f"[rank1]: advice {i}\n" for i in range(20)]]
    text = _failure(lines)
    assert text.index("BackendCompilerFailed") < text.index("NotImplementedError: no rule") < text.index("advice 19")
    assert "advice 4\n" not in text  # only the last lines beside the exceptions
    assert _failure(["short\n", "log\n"]) == "short\nlog\n"
