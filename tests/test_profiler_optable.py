"""The per-op table: grouping by kernel, op, module and layer; roofline shares and bounds worked
by hand; drawn at 80 columns with names that keep their meaningful tail."""

import io

import numpy as np
import pytest
from rich.console import Console

from spyre_rt import device_profile, job_facts, trace
from spyre_rt.card import EV_JOB, EV_LAUNCH, TRACE_EVENT
from spyre_rt.profiler import cli, optable, view

CARD = 0xFFFF
NAMES = {1: "k1", 2: "k2", 3: "k3", 4: "k4", 5: "h2d", 6: "tiny"}.get
MM_1024 = {"flops": 2 * 1024**3, "dram_bytes_min": 3 * 1024 * 1024 * 2}  # roofline: 29.43 µs compute, 41.94 µs DRAM
INFO = {
    "k1": {"kind": "matmul", "op": "aten.mm", "module": "model.layers.0.mlp.up_proj", **MM_1024},
    "k2": {"kind": "matmul", "op": "aten.mm", "module": "model.layers.1.mlp.up_proj", **MM_1024},
    "k3": {"kind": "loop", "op": ["aten.mul", "aten.add"], "module": "model.layers.0.post_attention_layernorm",
           "flops": 10**6, "dram_bytes_min": 10**6},
    "k4": {"kind": "matmul", "op": "aten.mm", "module": "lm_head", **MM_1024},
    "tiny": {"kind": "loop", "op": "aten.add", "module": "model.norm", "flops": 1000, "dram_bytes_min": 24_576},
}


def synthetic() -> np.ndarray:
    """µs:  launches k1 [0, 1], k2 [1.5, 2], k3 [2.5, 3] queue up; k4's launch [400, 401]
    comes long after the device went idle at 212; h2d and tiny have no launch.

    jobs:   k1 [2, 102]  k2 [102, 202]  k3 [202, 212]  k4 [402, 452]  h2d [460, 461]  tiny [470, 472]
    """
    rows = [
        (EV_LAUNCH, CARD, 0, 0, 1_000, 0, 1, 1),
        (EV_LAUNCH, CARD, 0, 1_500, 2_000, 1, 2, 1),
        (EV_LAUNCH, CARD, 0, 2_500, 3_000, 2, 3, 1),
        (EV_LAUNCH, CARD, 0, 400_000, 401_000, 3, 4, 1),
        (EV_JOB, CARD, 0, 2_000, 102_000, 0, 1, 1),
        (EV_JOB, CARD, 0, 102_000, 202_000, 1, 2, 1),
        (EV_JOB, CARD, 0, 202_000, 212_000, 2, 3, 1),
        (EV_JOB, CARD, 0, 402_000, 452_000, 3, 4, 1),
        (EV_JOB, CARD, 0, 460_000, 461_000, 4, 5, 1),
        (EV_JOB, CARD, 0, 470_000, 472_000, 5, 6, 1),
    ]
    return np.array(rows, TRACE_EVENT)


@pytest.fixture
def data():
    job_facts.clear()
    for name, info in INFO.items():
        job_facts.register(name, info)
    try:
        return view.parse(trace.export(synthetic(), NAMES, device=device_profile.load("spyre")))
    finally:
        job_facts.clear()


def rows_by_name(data, by):
    return {r.name: r for r in optable.op_table(data, by=by)}


def test_by_op_folds_the_layers_together(data):
    rows = rows_by_name(data, "op")
    assert list(rows) == ["mm · layers.*.mlp.up_proj", "mm · lm_head", "mul+add · layers.*.post_attention_layernorm",
                          "add · norm", "h2d"]
    up = rows["mm · layers.*.mlp.up_proj"]
    assert (up.calls, up.device_us, up.host_us) == (2, pytest.approx(200.0), pytest.approx(1.5))
    assert up.step_pct == pytest.approx(100 * 200 / 263)


def test_the_other_groupings(data):
    assert set(rows_by_name(data, "module")) == {"layers.*.mlp.up_proj", "lm_head", "layers.*.post_attention_layernorm",
                                                 "norm", "h2d"}
    layers = rows_by_name(data, "layer")
    assert set(layers) == {"layers.0", "layers.1", "lm_head", "norm", "h2d"}
    assert layers["layers.0"].calls == 2 and layers["layers.0"].device_us == pytest.approx(110.0)
    assert set(rows_by_name(data, "kernel")) == {"k1", "k2", "k3", "k4", "h2d", "tiny"}
    with pytest.raises(ValueError, match="group by one of"):
        optable.op_table(data, by="colour")


def test_roofline_shares_and_bounds_by_hand(data):
    rows = rows_by_name(data, "op")
    up = rows["mm · layers.*.mlp.up_proj"]
    # each call: 29.43 µs of compute and 41.94 µs of DRAM roofline in 100 µs
    assert up.compute_pct == pytest.approx(100 * 2 * 1024**3 / (2 * 36_480.6144) / 1000 / 100)
    assert up.dram_pct == pytest.approx(100 * 6_291_456 / 150 / 1000 / 100)
    assert up.bound == "DRAM"
    # lm_head's launch came 190 µs after the device went idle: longer than it ran (50 µs)
    assert rows["mm · lm_head"].host_wait_us == pytest.approx(190.0)
    assert rows["mm · lm_head"].bound == "host"
    assert rows["add · norm"].bound == "latency"  # 0.16 µs of DRAM roofline, 2 µs to launch a job
    h2d = rows["h2d"]  # no kernel info: no roofline
    assert (h2d.compute_pct, h2d.dram_pct, h2d.bound) == (None, None, None)


def test_totals_weigh_the_roofline_shares_by_device_time(data):
    rows = optable.op_table(data)
    total = optable.totals(rows)
    known = [r for r in rows if r.compute_pct is not None]
    assert total.device_us == pytest.approx(263.0) and total.calls == 6
    assert total.dram_pct == pytest.approx(sum(r.dram_pct * r.device_us for r in known)
                                           / sum(r.device_us for r in known))


def render_at(data, width, **kwargs):
    console = Console(file=io.StringIO(), width=width, record=True)
    view.render(console, data, **kwargs)
    return console.export_text()


def test_at_80_columns_names_keep_their_tail_and_numbers_give_way(data):
    out = render_at(data, 80)
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    table = lines[lines.index(next(x for x in lines if x.startswith("per-op summary"))):]
    for tail in ("mlp.up_proj", "lm_head", "_layernorm", "norm"):
        assert any(tail in line for line in table), tail
    assert "roofline" in out and "bound" in out and "DRAM" in out
    assert "min" not in table[2] and "max" not in table[2]  # the least telling columns went first
    up = next(line for line in table if "mlp.up_proj" in line)
    assert up.split()[-1] == "DRAM"
    # at 160 columns everything fits
    wide = render_at(data, 160)
    assert "max" in wide and "mm · layers.*.post_attention_layernorm" not in wide  # a mul+add kernel
    assert "mul+add · layers.*.post_attention_layernorm" in wide


def test_a_long_name_loses_its_middle_not_its_tail():
    name = "mul+add+rsqrt+mean+pow · layers.*.self_attn.rotary_emb"
    cut = optable.ellipsize(name, 24)
    assert len(cut) == 24 and "…" in cut and cut.endswith("rotary_emb") and cut.startswith("mul+add")
    assert optable.ellipsize("short", 24) == "short"


def test_narrow_tables_keep_a_readable_name(data):
    out = render_at(data, 60)
    assert max(len(line) for line in out.splitlines()) <= 60
    up = next(line for line in out.splitlines() if "up_proj" in line)
    assert up.split("  ")[0].strip().endswith("up_proj")


def test_cli_view_groups_as_asked(capsys, tmp_path):
    job_facts.clear()
    for name, info in INFO.items():
        job_facts.register(name, info)
    path = tmp_path / "t.json.gz"
    trace.export(synthetic(), NAMES, path, device=device_profile.load("spyre"))
    job_facts.clear()
    assert cli.main(["view", str(path), "--group-by", "layer"]) == 0
    out = capsys.readouterr().out
    assert "layers.0" in out and "layers.1" in out and "mlp.up_proj" not in out
    assert cli.main(["view", str(path), "--group-by", "nonsense"]) == 2
