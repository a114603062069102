"""The published speedups placed on our model: the implied construction cost per kernel and the
what-if curve, against a hand-worked example."""

import io

import pytest
from rich.console import Console

from spyre_rt.profiler import published

REFERENCE = {"source": "published", "speedups": {"prebuilt": {"prefill": 1.7, "decode": 2.4}},
             "compute_share": {"prefill": 0.75, "decode": 0.75}}
KERNELS = {"prefill": 960, "decode": 920}


def phases(prefill_latency, prefill_device, decode_latency, decode_device, steps=4):
    return {"phases": {"prefill": {"latency_ms": prefill_latency, "device_ms": prefill_device, "jobs": 960},
                       "decode": {"latency_ms": decode_latency * steps, "device_ms": decode_device * steps,
                                  "jobs": 920 * steps, "steps": steps}}}


# construct: prefill 5,000 ms, decode 1,500 ms per token; prebuilt: 1,100 and 210 ms, on
# 1,000 and 200 ms of device time
RESULTS = {"construct": phases(5000.0, 1030.0, 1500.0, 205.0), "prebuilt": phases(1100.0, 1000.0, 210.0, 200.0)}


def test_the_implied_cost_per_kernel_by_hand():
    got = published.implied(RESULTS, REFERENCE, KERNELS)["prebuilt"]
    pre, dec = got["prefill"], got["decode"]
    # prefill: (1.7 - 1) x 1,000 ms = 700 ms of construction per step, over 960 kernels
    assert pre["implied_ms_per_step"] == pytest.approx(700.0)
    assert pre["implied_us_per_kernel"] == pytest.approx(700_000 / 960)  # 729 µs
    # ours: 5,000 - 1,100 = 3,900 ms per step, over 960 kernels
    assert pre["measured_ms_per_step"] == pytest.approx(3900.0)
    assert pre["measured_us_per_kernel"] == pytest.approx(3_900_000 / 960)  # 4,063 µs
    assert pre["measured_speedup"] == pytest.approx(5000 / 1100)
    # decode, per token: (2.4 - 1) x 200 ms = 280 ms over 920 kernels; ours 1,290 ms
    assert dec["device_ms"] == pytest.approx(200.0) and dec["kernels"] == 920
    assert dec["implied_us_per_kernel"] == pytest.approx(280_000 / 920)  # 304 µs
    assert dec["measured_us_per_kernel"] == pytest.approx(1_290_000 / 920)  # 1,402 µs


def test_ours_follows_the_runs_paired_speedup_when_given():
    """The run's speedups are medians of per-round ratios: ours is that speedup's excess over
    the mode's latency, so the two tables of the report agree."""
    got = published.implied(RESULTS, REFERENCE, KERNELS, speedups={"prebuilt": {"prefill": 4.0}})["prebuilt"]
    assert got["prefill"]["measured_speedup"] == 4.0
    assert got["prefill"]["measured_ms_per_step"] == pytest.approx(3 * 1100.0)
    assert got["decode"]["measured_ms_per_step"] == pytest.approx(1290.0)  # no paired figure: the latencies'


def test_nothing_is_implied_without_a_reference_or_a_baseline():
    assert published.implied(RESULTS, None, KERNELS) == {}
    assert published.implied({"prebuilt": RESULTS["prebuilt"]}, REFERENCE, KERNELS) == {}
    assert published.implied(RESULTS, REFERENCE, {"prefill": 0}) == {}


def test_the_whatif_curve_passes_through_the_published_point():
    implied = published.implied(RESULTS, REFERENCE, KERNELS)
    w = published.whatif(RESULTS, implied, KERNELS)
    pre = w["prefill"]
    assert pre["curve"][0] == [0.0, 1.0, 1.0]  # no construction, no gain
    x, y = pre["published"]["us_per_kernel"], pre["published"]["speedup"]
    assert published.speedup_at(x, pre["device_ms"], pre["kernels"]) == pytest.approx(y)
    # the curve reaches past both points
    assert pre["curve"][-1][0] == pytest.approx(1.25 * pre["ours"]["us_per_kernel"])
    # ours: measured cost per kernel and measured speedup
    assert pre["ours"] == {"us_per_kernel": pytest.approx(3_900_000 / 960), "speedup": pytest.approx(5000 / 1100)}
    # two lines: 1 + 960 x c / 1,000,000 µs of device time, and over our 1,100 ms prebuilt step
    assert pre["columns"] == ["us_per_kernel", "speedup_device_bound", "speedup_this_host"]
    for c, device_bound, this_host in pre["curve"]:
        assert device_bound == pytest.approx(1 + 960 * c / 1_000_000)
        assert this_host == pytest.approx(1 + 960 * c / 1_100_000)
    # ours lies on this host's line
    c = pre["ours"]["us_per_kernel"]
    assert published.speedup_at(c, pre["prebuilt_ms"], 960) == pytest.approx(pre["ours"]["speedup"])


def test_the_whatif_is_drawn_in_the_terminal_without_matplotlib(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    w = published.whatif(RESULTS, published.implied(RESULTS, REFERENCE, KERNELS), KERNELS)
    console = Console(file=io.StringIO(), width=80, record=True)
    published.render_whatif(console, w, str(tmp_path / "whatif.png"))
    out = console.export_text()
    assert "matplotlib is not installed" in out
    assert out.count("P published  O ours") == 2
    plot = out[out.index("prefill: speedup"):]
    assert "P" in plot.split("\n", 2)[2] and "O" in plot.split("\n", 2)[2]  # the points, below the legend
    assert max(len(line) for line in out.splitlines()) <= 80
    assert not (tmp_path / "whatif.png").exists()
