"""Loads a tile serves from its own scratchpad (spyre_rt/construct/loops/reuse.py), on the
kernel that needs them most: the rotary embedding of a prefill.

Granite 3.3 8B's prefill rotates q as ``q * cos + rotate_half(q) * sin`` in one loop
kernel over (positions, heads, 128 columns). Loaded as the body reads it, q came from DRAM
twice (whole, and again as the two halves ``rotate_half`` cats) and cos and sin once per
head: 40 MiB for a kernel whose every buffer is 16.5 MiB, 287 us of simulated time against
a DRAM roofline of 115 us. Fetching each byte once and copying on the SFU what the tile
already holds brings its DRAM bytes to that minimum and its time near the roofline, with
the same bits out."""

from __future__ import annotations

import json

import pytest
import torch
from scratchpad_races import races
from test_matmul_build import Operand, launch_built
from test_program_digests import DIGESTS

from spyre_rt import device_profile, jobs
from spyre_rt import ir as kdesc
from spyre_rt.card import Card
from spyre_rt.construct import loops
from spyre_rt.construct.context import BuildContext
from spyre_rt.construct.facts import dram_bytes, min_bytes
from spyre_rt.construct.loops import record
from spyre_rt.construct.loops.analysis import analyse
from spyre_rt.construct.loops.reuse import Reuse, plan_reuse
from spyre_rt.construct.loops.tiling import choose_tiling
from spyre_rt.construct.matmul import View
from spyre_rt.cost import CostModel
from spyre_rt.ir import Access, Buffer, LoopKernel, Op
from spyre_rt.layout import StickLayout

TARGET = CostModel.of_figures(device_profile.load("spyre"))


def rotary(seq: int, heads: int, dim: int = 128, dtype: str = "float16") -> LoopKernel:
    """out[0, h, s] = q[s, h] * cos[0, s] + rotate_half(q[s, h]) * sin[0, s] as Inductor
    records Granite's: q a (seq, heads x dim) projection, cos and sin (1, seq, dim), out
    (1, heads, seq, dim) stored position-major; rotate_half as a cat of two masked loads."""
    half = dim // 2
    row = heads * dim
    q = (row, dim, 1)
    trig = (dim, 0, 1)  # one row per position, read by every head
    body = (
        Op("q", "load", (), dtype, Access("q", 0, q)),
        Op("cos", "load", (), dtype, Access("cos", 0, trig)),
        Op("qcos", "mul", ("q", "cos")),
        Op("col", "index", (), "int64", Access("", 0, (0, 0, 1))),
        Op("half", "constant", (), "int64", None, {"value": half}),
        Op("first", "lt", ("col", "half")),
        Op("x2", "load", (), dtype, Access("q", half, q, (), ((2, 0, half),))),
        Op("neg", "neg", ("x2",)),
        Op("zero", "constant", (), "", None, {"value": 0.0}),
        Op("lhs", "where", ("first", "neg", "zero")),
        Op("second", "ge", ("col", "half")),
        Op("x1", "load", (), dtype, Access("q", -half, q, (), ((2, half, dim),))),
        Op("rhs", "where", ("second", "x1", "zero")),
        Op("rot", "where", ("first", "lhs", "rhs")),
        Op("sin", "load", (), dtype, Access("sin", 0, trig)),
        Op("rsin", "mul", ("rot", "sin")),
        Op("sum", "add", ("qcos", "rsin")),
        Op("out", "store", ("sum",), dtype, Access("out", 0, q)),
    )
    buffers = (Buffer("q", dtype, (seq, row), (row, 1)),
               Buffer("cos", dtype, (1, seq, dim), (seq * dim, dim, 1)),
               Buffer("sin", dtype, (1, seq, dim), (seq * dim, dim, 1)),
               Buffer("out", dtype, (1, heads, seq, dim), (heads * seq * dim, dim, row, 1)))
    return LoopKernel("rotary", (seq, heads, dim), 1, False, body, buffers)


def layouts(seq: int, heads: int, dim: int = 128, itemsize: int = 2) -> dict[str, StickLayout]:
    """As the prefill has them: q in linear memory (a matmul's output), cos, sin and out in sticks."""
    return {"q": StickLayout(1, seq * heads * dim, itemsize), "cos": StickLayout(seq, dim, itemsize),
            "sin": StickLayout(seq, dim, itemsize), "out": StickLayout(seq * heads, dim, itemsize)}


def built(k: LoopKernel, lay: dict[str, StickLayout], target: CostModel = TARGET) -> BuildContext:
    ctx = BuildContext(target, lay)
    loops.build(ctx, k)
    return ctx


# ---- what is served from the scratchpad ------------------------------------------------------

def test_cos_and_sin_are_broadcast_over_the_heads_and_the_halves_are_views_of_q():
    k = rotary(1024, 32)
    reuse = plan_reuse(choose_tiling(analyse(k), TARGET), TARGET)
    assert {b.load: (b.variables, b.copies) for b in reuse.broadcasts.values()} == {
        "cos": ((1,), 32), "sin": ((1,), 32)}
    assert {v.load: (v.source, v.first, v.count, v.shift) for v in reuse.views.values()} == {
        "x2": ("q", 0, 64, 64), "x1": ("q", 64, 64, -64)}


def test_a_load_broadcast_over_an_outer_row_variable_is_fetched_as_before():
    """Only the innermost row variables of a tile can be copied by strided moves; a load
    that varies along them (here the heads) is fetched whole."""
    k = rotary(64, 8)
    ops = [op if op.id not in ("cos", "sin") else
           Op(op.id, "load", (), op.dtype, Access(op.access.buf, 0, (0, 128, 1))) for op in k.ops]
    bufs = [b if b.name not in ("cos", "sin") else Buffer(b.name, b.dtype, (8, 128), (128, 1)) for b in k.buffers]
    k = LoopKernel(k.name, k.sizes, k.ncols, k.reduce, tuple(ops), tuple(bufs))
    assert not plan_reuse(choose_tiling(analyse(k), TARGET), TARGET).broadcasts


def test_a_masked_load_whose_shift_leaves_the_tile_is_fetched_as_before():
    """x[..., 64:] shifted by 96 columns would read past the row: no view."""
    k = rotary(64, 8)
    ops = [op if op.id != "x2" else Op("x2", "load", (), op.dtype, Access("q", 96, op.access.coeffs, (),
                                                                          ((2, 0, 64),))) for op in k.ops]
    k = LoopKernel(k.name, k.sizes, k.ncols, k.reduce, tuple(ops), k.buffers)
    assert set(plan_reuse(choose_tiling(analyse(k), TARGET), TARGET).views) == {"x1"}


# ---- DRAM bytes and time ------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [32, 8], ids=["q", "k"])
def test_the_rotary_embedding_moves_each_byte_once(heads):
    k = rotary(1024, heads)
    ctx = built(k, layouts(1024, heads))
    assert dram_bytes(ctx.commands(), ctx.descriptors()) == min_bytes(k)


@pytest.mark.parametrize("heads", [32, 8], ids=["q", "k"])
def test_the_rotary_embedding_runs_near_its_dram_roofline(heads):
    """Simulated device time alone on a timing card (deterministic) against the least time
    its DRAM bytes take at the card's bandwidth: 99 % for q, 90 % for k (one tile per core,
    so nothing overlaps its loads). Fetched as the body reads it, 40 % and 43 %."""
    k = rotary(1024, heads)
    ctx = built(k, layouts(1024, heads))
    card = Card(device_profile.load("spyre"), "timing", 0)
    ns = jobs.time_alone(card, ctx.encode(), [ctx.layouts[n].nbytes for n in ctx.buffers()])[0]
    assert TARGET.dram_ns(min_bytes(k)) >= 0.85 * ns, (ns, TARGET.dram_ns(min_bytes(k)))


# ---- the same bits ---------------------------------------------------------------------------

def _operands(k: LoopKernel, lay: dict[str, StickLayout], seed: int) -> dict:
    """Random storages for the kernel's buffers: normal floats, small integers (indices
    inside any table here)."""
    gen = torch.Generator().manual_seed(seed)
    ops = {}
    for b in k.buffers:
        n = lay[b.name].rows * lay[b.name].row_len
        dtype = getattr(torch, b.dtype)
        values = (torch.randint(0, 4, (n,), generator=gen) if not dtype.is_floating_point
                  else torch.randn(n, generator=gen)).to(dtype)
        ops[b.name] = Operand(values, lay[b.name].row_len, View(b.name, b.offset, b.sizes, b.strides))
    return ops


def served_and_fetched(card: Card, k: LoopKernel, lay: dict[str, StickLayout], offsets=None, seed: int = 0):
    """The stored buffers after the kernel with its loads served from the scratchpad, and
    after it with every load fetched (its plan emptied), from the same inputs; each program
    checked for scratchpad races."""
    target = CostModel.of_figures(card.profile)
    stored = sorted({op.access.buf for op in k.ops if op.op == "store"})
    outs = []
    for plan in (record.plan_reuse, lambda tiling, target: Reuse({}, {})):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(record, "plan_reuse", plan)
            ctx = BuildContext(target, lay, offsets=dict(offsets or {}))
            loops.build(ctx, k)
        blob = ctx.encode()
        assert races(blob) == []
        ops = _operands(k, lay, seed)
        outs.append((launch_built(card, ctx, blob, ops, stored), ops))
    return outs


@pytest.mark.parametrize("seq,heads,dim,dtype", [(40, 4, 128, "float16"), (9, 8, 128, "float16"),
                                                 (33, 3, 64, "float32")], ids=str)
def test_served_loads_give_the_bits_fetched_ones_give(functional_card, seq, heads, dim, dtype):
    """Bit for bit the same as fetching every load, and torch's rotation to fp16 rounding."""
    k = rotary(seq, heads, dim, dtype)
    (served, ops), (fetched, _) = served_and_fetched(functional_card, k, layouts(seq, heads, dim,
                                                                                   2 if dtype == "float16" else 4))
    assert plan_reuse(choose_tiling(analyse(k), TARGET), TARGET).views
    assert torch.equal(served["out"], fetched["out"])
    q = ops["q"].values.float().view(seq, heads, dim)
    cos, sin = (ops[n].values.float().view(seq, 1, dim) for n in ("cos", "sin"))
    rotated = torch.cat((-q[..., dim // 2:], q[..., : dim // 2]), -1)
    want = (q * cos + rotated * sin).reshape(-1)
    tol = 2e-3 if dtype == "float16" else 1e-6
    assert torch.allclose(served["out"].float(), want, rtol=tol, atol=tol)


def test_every_served_kernel_of_the_digest_corpus_gives_the_fetched_bits(functional_card):
    """The recorded kernels of model families and Granite 3.3 8B whose loads are served
    (their rotary embeddings, computing cos and sin from positions broadcast over the heads,
    or fused with the KV-cache write): the same bits either way."""
    with open(DIGESTS) as f:
        corpus = json.load(f)["kernels"]
    seen = 0
    for r in corpus:
        if r["kind"] != "loop":
            continue
        k = kdesc.from_json(r["kernel"])
        lay = {b: StickLayout(*x) for b, x in r["layouts"].items()}
        ctx = BuildContext(TARGET, lay, offsets=dict(r.get("offsets", {})))
        reuse = plan_reuse(loops.build(ctx, k).tiling, TARGET)
        if not (reuse.views or reuse.broadcasts):
            continue
        seen += 1
        (served, _), (fetched, _) = served_and_fetched(functional_card, k, lay, r.get("offsets"))
        assert all(torch.equal(served[b], fetched[b]) for b in served), k.name
    assert seen >= 8
