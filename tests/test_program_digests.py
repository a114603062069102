"""Construction builds the same programs, byte for byte, as when the digests were made.

``tests/program_digests.json`` (made by ``tests/make_program_digests.py``) holds, for a
set of kernels of every kind (loops, matmuls with their epilogues, attention, snapshot
copies) from tiny model families and the layers of Granite 3.3 8B (prefill and decode),
and for transfer graphs of a few view geometries, the plain data a build starts from and
the sha256 of the program it encoded. Each is built again here, as a launch builds it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os

import pytest

from spyre_rt import construct, device_profile
from spyre_rt import ir as kdesc
from spyre_rt.construct import copy
from spyre_rt.construct.context import BuildContext
from spyre_rt.cost import CostModel
from spyre_rt.layout import StickLayout
from spyre_rt.transfer import ViewGeometry, transfer_program

DIGESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "program_digests.json")


@pytest.fixture(scope="module")
def records() -> dict:
    with open(DIGESTS) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def target() -> CostModel:
    return CostModel.of_figures(device_profile.load("spyre"))


def build(target: CostModel, r: dict):
    """The encoded program of one record, built twice: the second time with the tiling the
    first chose (a launch after the first)."""
    layouts = {b: StickLayout(*lay) for b, lay in r["layouts"].items()}
    if r["kind"] == "copy":
        ctx = BuildContext(target, layouts)
        copy.build(ctx, [copy.Copy(*c) for c in r["copies"]])
        return ctx.encode(), ctx.encode()
    kernel = kdesc.from_json(r["kernel"])
    first = BuildContext(target, layouts, offsets=dict(r.get("offsets", {})))
    tiling = construct.build(first, kernel)
    again = BuildContext(target, layouts, offsets=dict(r.get("offsets", {})))
    construct.build(again, kernel, tiling)
    return first.encode(), again.encode()


def sha(blob) -> str:
    return hashlib.sha256(bytes(blob)).hexdigest()


def test_the_digests_cover_every_kind_and_granite_8b(records):
    kinds = collections.Counter(r["kind"] for r in records["kernels"])
    assert set(kinds) == {"loop", "matmul", "attention", "copy"}, kinds
    assert any(r["kind"] == "matmul" and '"epilogue":null' not in r["kernel"] for r in records["kernels"])
    assert {r["source"] for r in records["kernels"]} >= {"granite", "granite-3.3-8b"}
    assert records["transfers"]


def test_every_kernel_builds_the_program_of_its_digest(records, target):
    wrong = []
    for i, r in enumerate(records["kernels"]):
        first, again = build(target, r)
        if sha(first) != r["sha256"] or sha(again) != r["sha256"]:
            wrong.append(f"#{i} {r['source']} {r['kind']}")
    assert not wrong, f"{len(wrong)} of {len(records['kernels'])} programs changed: {', '.join(wrong[:10])}"


def test_every_transfer_graph_builds_the_program_of_its_digest(records):
    for r in records["transfers"]:
        view = ViewGeometry(StickLayout(*r["layout"]), r["offset"], tuple(r["sizes"]), tuple(r["strides"]))
        assert sha(transfer_program(r["direction"], view)) == r["sha256"], r


def test_a_changed_program_changes_its_digest(records, target):
    """The comparison can fail: one byte of a program moved is another digest."""
    r = next(r for r in records["kernels"] if r["kind"] == "matmul")
    blob = build(target, r)[0].copy()
    blob[-1] ^= 1
    assert sha(blob) != r["sha256"]
