"""Reductions over long rows at small batches: the logits tail of serving (greedy argmax and
log-probs over a 49,155-word vocabulary at batch 1 to 32).

A stick of the output holds the results of many rows (16 int64 indices, 32 fp32 values),
and tiles of that many rows of 49,155 columns do not fit a 2 MiB scratchpad. The cores
write sticks back whole, so two cores may not store into one: the tiles of a stick's rows
form a group whose stores merge (construct/loops/tiling.py, ``spy_loop_merge``), each
sending its results over the ring to one core, which stores the stick once. These kernels
once ran on the CPU inside the compiled step (batch 8 to 32 in fp32, 15 to 32 in fp16)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from scratchpad_races import races

from spyre_rt import card as cards
from spyre_rt import device_profile, fallback
from spyre_rt.construct import loops
from spyre_rt.construct.context import BuildContext
from spyre_rt.construct.loops.analysis import analyse
from spyre_rt.construct.loops.tiling import choose_tiling
from spyre_rt.cost import CostModel
from spyre_rt.dtypes import ITEMSIZE
from spyre_rt.ir import Access, Buffer, LoopKernel, Op
from spyre_rt.layout import layout_for

TARGET = CostModel.of_figures(device_profile.load("spyre"))
VOCAB = 49155
BATCHES = (1, 2, 3, 8, 15, 16, 17, 32)


def row_reduction(sizes, kind="argmax", dtype="float32"):
    """y[rows] = kind over the last variable of x[rows, columns], both contiguous."""
    rows = sizes[:-1]
    x_strides, y_strides = _row_major(sizes), _row_major(rows)
    out = "int64" if kind.startswith("arg") else dtype
    body = (Op("x", "load", (), dtype, Access("x", 0, x_strides)),
            Op("r", "reduction", ("x",), out, None, {"kind": kind}),
            Op("y", "store", ("r",), out, Access("y", 0, y_strides + (0,))))
    buffers = (Buffer("x", dtype, tuple(sizes), x_strides), Buffer("y", out, tuple(rows), y_strides))
    return LoopKernel("k", tuple(sizes), 1, True, body, buffers)


def _row_major(sizes):
    return tuple(math.prod(sizes[j + 1:]) for j in range(len(sizes)))


def _layouts(k):
    return {b.name: layout_for(b.sizes, b.strides, math.prod(b.sizes), ITEMSIZE[b.dtype]) for b in k.buffers}


# ---- the tiling ------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [(8, VOCAB), (17, VOCAB), (32, VOCAB), (3, 8, VOCAB), (100, VOCAB)], ids=str)
def test_tiles_of_one_sticks_rows_merge_their_stores_and_no_stick_has_two_writers(sizes):
    t = choose_tiling(analyse(row_reduction(sizes)), TARGET)
    assert t.merges and t.merged == {"y"}
    rows = [(tile.fixed, s) for tile in t.tiles for s in range(tile.start, tile.start + tile.size)]
    assert sorted(rows) == sorted((f, s) for f in itertools.product(*map(range, sizes[:t.block]))
                                  for s in range(sizes[t.block]))
    # every tile is inside its group, a group's tiles hold all of its rows, and each stick
    # of y (16 int64 of a row of y) is stored by one tile or one group alone
    writers = {}
    for g, m in enumerate(t.merges):
        members = [tile for tile in t.tiles if tile.merge == g]
        assert sum(tile.size for tile in members) == m.size
        assert all(tile.fixed == m.fixed and m.start <= tile.start < m.start + m.size for tile in members)
    storing = [tile for tile in t.tiles if tile.merge < 0] + list(t.merges)
    for box in storing:
        for s in range(box.start, box.start + box.size):
            key = (box.fixed, s // 16)
            assert writers.setdefault(key, box) is box, f"stick {key} stored by two"
    # the rows spread over the cores: tiles of at most an even share of the rows, dealt to all
    assert max(tile.size for tile in t.tiles) * t.inner_rows <= -(-len(rows) // 32)
    assert len({tile.core for tile in t.tiles}) == min(32, len(t.tiles))


def test_a_cores_groups_have_regions_of_their_own():
    t = choose_tiling(analyse(row_reduction((1000, VOCAB))), TARGET)
    by_core = {}
    for m in t.merges:
        by_core.setdefault(m.core, []).append(m.region)
    assert all(sorted(r) == list(range(len(r))) for r in by_core.values())
    assert t.merge_regions == max(len(r) for r in by_core.values()) > 1


def test_tiles_of_whole_sticks_that_fit_do_not_merge():
    """Where tiles of a stick's rows fit the scratchpad, they are cut as before."""
    for sizes in [(3, VOCAB), (64, 4096), (9, 128, 128)]:
        assert not choose_tiling(analyse(row_reduction(sizes)), TARGET).merges


@pytest.mark.parametrize("sizes", [(8, VOCAB), (17, 4000), (3, 8, VOCAB)], ids=str)
def test_a_merged_kernel_has_no_scratchpad_races(sizes):
    """The rings write another core's scratchpad: each after the tile's last stage, the
    group's store after all its rings, and no tile reuses its staging slot before its ring
    has read it."""
    small = TARGET if sizes[-1] == VOCAB else dataclasses.replace(TARGET, scratchpad_bytes=64 << 10)
    k = row_reduction(sizes)
    ctx = BuildContext(small, _layouts(k))
    decided = loops.build(ctx, k)
    assert decided.tiling.merges
    assert races(ctx.encode()) == []


def test_stores_of_tiles_of_columns_merge_too(functional_card):
    """A transposed store, y[c, r] = 2 x[r, c]: each tile stores rows of 5,000 columns, and
    the block variable r moves along y's rows, so 32 of them share each stick. Tiles of 32
    rows do not fit; tiles of two rows send their whole tiles (a row of y's sticks each) to
    their group's region. The card's result equals torch's, with no scratchpad races."""
    from test_matmul_build import Operand, launch_built

    from spyre_rt.construct.matmul import View

    rows, cols = 40, 5000
    body = (Op("x", "load", (), "float32", Access("x", 0, (cols, 1))),
            Op("two", "constant", (), "float32", None, {"value": 2.0}),
            Op("v", "mul", ("x", "two")),
            Op("y", "store", ("v",), "float32", Access("y", 0, (1, rows))))
    buffers = (Buffer("x", "float32", (rows, cols), (cols, 1)), Buffer("y", "float32", (cols, rows), (rows, 1)))
    k = LoopKernel("k", (rows, cols), 1, False, body, buffers)
    x = torch.randn(rows * cols, generator=torch.Generator().manual_seed(3))
    ops = {"x": Operand(x, cols, View("x", 0, (rows, cols), (cols, 1))),
           "y": Operand(torch.zeros(rows * cols), rows, View("y", 0, (cols, rows), (rows, 1)))}
    ctx = BuildContext(CostModel.of_figures(functional_card.profile), {n: o.layout for n, o in ops.items()})
    decided = loops.build(ctx, k)
    assert decided.tiling.merges and decided.tiling.merged == {"y"}
    assert decided.layout.merge_stride >= 32 * cols * 4  # a group's 32 rows of 5,000 columns
    blob = ctx.encode()
    assert races(blob) == []
    got = launch_built(functional_card, ctx, blob, ops, ["y"])["y"]
    assert torch.equal(got, (x.view(rows, cols) * 2).t().reshape(-1))


# ---- on the card -------------------------------------------------------------------------------

OPS = {
    "argmax": lambda t: torch.argmax(t, -1),
    "argmin": lambda t: torch.argmin(t, -1),
    "amax": lambda t: torch.amax(t, -1),
    "sum": lambda t: t.sum(-1),
    "log_softmax": lambda t: torch.log_softmax(t, -1),
    "softmax": lambda t: torch.softmax(t, -1),
}
# tests/test_ops.py's bounds: fp32 few-ulp (sums of many terms: SUMS), fp16 two ulps
TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 2e-3)}
SUMS = {torch.float32: (1e-5, 2e-5), torch.float16: (2e-3, 2e-3)}


@pytest.fixture(scope="module")
def functional():
    with cards.configured(sim_mode="functional") as cs:
        yield cs


def on_card(fn, x):
    """fn compiled with CPU fallback off (a kernel construction refuses fails the compile),
    and the CPU ops the call ran inside its step."""
    torch._dynamo.reset()
    f = torch.compile(fn, backend="spyre_rt", dynamic=False, options={"cpu_fallback": False})
    before = dict(fallback.in_steps)
    got = f(x.to("spyre")).cpu()
    return got, {op: n - before.get(op, 0) for op, n in fallback.in_steps.items() if n != before.get(op, 0)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("op", list(OPS))
def test_reductions_over_the_vocabulary_run_on_the_card_at_every_batch(functional, op, dtype):
    fn = OPS[op]
    for batch in BATCHES:
        x = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)).to(dtype)
        got, on_cpu = on_card(fn, x)
        assert on_cpu == {}, (batch, on_cpu)
        want = fn(x)
        if op.startswith("arg"):
            assert torch.equal(got, want), batch
        else:
            rtol, atol = (SUMS if op == "sum" else TOL)[dtype]
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, b=batch: f"batch {b}: {m}")


@pytest.mark.parametrize("op", ["argmax", "argmin"])
def test_ties_give_the_first_index(functional, op):
    """Few distinct values: every row has its extreme many times, the CPU's answer is the
    first, in any tile and any group."""
    for batch in (8, 17):
        x = torch.randint(-3, 4, (batch, VOCAB), generator=torch.Generator().manual_seed(batch)).float()
        got, on_cpu = on_card(OPS[op], x)
        assert on_cpu == {} and torch.equal(got, OPS[op](x)), batch


def test_a_reduction_kept_in_a_middle_dimension_merges_per_fixed_row(functional):
    """(3, 8, V) -> (3, 8): each of the three rows of the output is a stick of its own."""
    x = torch.randn(3, 8, VOCAB, generator=torch.Generator().manual_seed(0))
    got, on_cpu = on_card(lambda t: (t * 2).argmax(-1), x)
    assert on_cpu == {} and torch.equal(got, (x * 2).argmax(-1))


def test_every_dispatch_mode_gives_the_same_bits(functional):
    """The rings and the groups' stores are part of the kernel's program in every mode
    (constructed at each launch, or built once into a plan)."""
    from spyre_rt import dispatch
    from spyre_rt.dispatch import dispatch_mode

    x = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1))
    fn = lambda t: (torch.log_softmax(t, -1), t.argmax(-1), t.amax(-1))  # noqa: E731
    outs = []
    for mode in dispatch.NAMES:
        with dispatch_mode(mode):
            torch._dynamo.reset()
            f = torch.compile(fn, backend="spyre_rt", dynamic=False, options={"cpu_fallback": False})
            outs.append([y.cpu() for y in f(x.to("spyre"))])
    assert all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o, strict=True))
    want = fn(x)
    assert torch.equal(outs[0][1], want[1]) and torch.equal(outs[0][2], want[2])
    torch.testing.assert_close(outs[0][0], want[0], rtol=1e-5, atol=1e-6)
