"""``spyre-profile run --sweep``: speedup and device efficiency per size, measured side by
side, with efficiency plotted against batch size."""

import io
import json
import sys

import pytest
from rich.console import Console

from spyre_rt import card as cards
from spyre_rt.profiler import cli, sweep
from spyre_rt.profiler import run as runmod

TINY = ["granite-tiny", "--seq", "16", "--decode-steps", "2", "--layers", "1"]


@pytest.fixture(scope="module", autouse=True)
def _own_card_set():
    """The runs configure the process's cards (timing mode): give the current set back."""
    with cards.configured():
        yield


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    js = d / "out.json"
    code = cli.main(["run", *TINY, "--timing", "--repeats", "1", "--modes", "construct,prebuilt", "--sweep",
                     "--sweep-batch", "1,4", "--sweep-seq", "8", "--plot", str(d / "sweep.png"), "--json", str(js)])
    assert code == 0
    return json.loads(js.read_text())["sweep"]


def test_each_size_reports_the_efficiency_of_each_phase_against_its_own_roofline(swept):
    assert [(p["batch"], p["seq"]) for p in swept] == [(1, 8), (4, 8)]
    for p in swept:
        for phase in runmod.PHASES:
            e = p["efficiency"][phase]
            assert 0 < e["fraction"] <= 1.01, (p["batch"], phase, e)  # the roofline bounds the card
            assert e["fraction"] == pytest.approx(e["roofline_ms"] / e["device_ms"])
        assert p["speedups"]["prebuilt"]["decode"] > 0
    one, four = (p["efficiency"]["decode"] for p in swept)
    # four sequences read the weights once, as one does: the roofline grows, less than 4x
    assert one["roofline_ms"] < four["roofline_ms"] < 4 * one["roofline_ms"]


def test_efficiency_is_plotted_against_batch(swept, monkeypatch):
    speedup, efficiency = sweep.series(swept)
    assert set(efficiency) == {"prefill, sequence 8", "decode, sequence 8"}
    decode = dict(efficiency["decode, sequence 8"])
    assert sorted(decode) == [1, 4]
    assert decode[4] == pytest.approx(swept[1]["efficiency"]["decode"]["fraction"] * 100)
    assert set(speedup) == {f"{phase}, batch {b}" for phase in runmod.PHASES for b in (1, 4)}
    # without matplotlib, both plots are drawn in the terminal
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    text = io.StringIO()
    sweep.plot(swept, "never-written.png", Console(file=text, width=100))
    out = text.getvalue()
    assert "device efficiency, % of the roofline (rows), against batch size (columns)" in out
    assert "speedup of prebuilt over construct (rows), against sequence length (columns)" in out
    assert "decode, sequence 8" in out and "decode, batch 4" in out


@pytest.mark.parametrize("batches", ["1,x", "0", ""])
def test_sizes_it_cannot_read_are_refused_before_any_work(batches, monkeypatch, capsys):
    def no_run(*a, **k):
        raise AssertionError("measured before the sweep's sizes were read")

    monkeypatch.setattr(runmod, "measure", no_run)
    assert cli.main(["run", *TINY, "--timing", "--sweep", "--sweep-batch", batches]) == 1
    assert "sweep sizes must be" in capsys.readouterr().err
