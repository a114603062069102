"""The decisions of loop-kernel construction, one room at a time: the analysis of a body,
the choice of tiles, and the scratchpad layout (spyre_rt.construct.loops)."""

import dataclasses
import itertools
from collections import Counter

import pytest

from spyre_rt import device_profile
from spyre_rt.construct import loops
from spyre_rt.construct.context import BuildContext, ScratchpadOverflow
from spyre_rt.construct.loops.analysis import Unsupported, analyse
from spyre_rt.construct.loops.scratchpad import lay_out, scratch_needs
from spyre_rt.construct.loops.tiling import choose_tiling
from spyre_rt.construct.sfu import COL, ROW, SCALAR, TILE
from spyre_rt.cost import CostModel
from spyre_rt.ir import Access, Buffer, LoopKernel, Op
from spyre_rt.layout import StickLayout

TARGET = CostModel.of_figures(device_profile.load("spyre"))


def _row_major(sizes):
    strides, acc = [], 1
    for n in reversed(sizes):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def pointwise(sizes, ops=("exp",), dtype="float16", ncols=1):
    """y = ops(x) over `sizes`, both contiguous; the trailing `ncols` variables are columns."""
    strides = _row_major(sizes)
    body = [Op("x", "load", (), dtype, Access("x", 0, strides))]
    for i, name in enumerate(ops):
        body.append(Op(f"v{i}", name, (body[-1].id,)))
    body.append(Op("y", "store", (body[-1].id,), dtype, Access("y", 0, strides)))
    buffers = tuple(Buffer(b, dtype, tuple(sizes), strides) for b in ("x", "y"))
    return LoopKernel("k", tuple(sizes), ncols, False, tuple(body), buffers)


def covered_rows(tiling):
    """Every row (values of the row variables) of every tile, in tile order."""
    rows = []
    sizes, nrow = tiling.analysis.kernel.sizes, tiling.analysis.n_row_vars
    for t in tiling.tiles:
        ranges = [range(x, x + 1) for x in t.fixed]
        if tiling.block >= 0:
            ranges.append(range(t.start, t.start + t.size))
        ranges += [range(n) for n in sizes[tiling.block + 1:nrow]]
        rows += list(itertools.product(*ranges))
    return rows


# ---- analysis --------------------------------------------------------------------------------

def test_a_value_is_a_tile_row_column_or_scalar_by_the_variables_it_varies_along():
    body = (Op("x", "load", (), "float32", Access("x", 0, (8, 1))),
            Op("r", "index", (), "int64", Access("", 0, (1, 0))),
            Op("c", "index", (), "int64", Access("", 0, (0, 1))),
            Op("one", "constant", (), "float32", None, {"value": 1.0}),
            Op("s", "reduction", ("x",), "float32", None, {"kind": "sum"}),
            Op("y", "store", ("s",), "float32", Access("y", 0, (1, 0))))
    buffers = (Buffer("x", "float32", (4, 8), (8, 1)), Buffer("y", "float32", (4,), (1,)))
    a = analyse(LoopKernel("k", (4, 8), 1, True, body, buffers))
    assert {vid: v.kind for vid, v in a.values.items()} == {
        "x": TILE, "r": ROW, "c": COL, "one": SCALAR, "s": ROW, "y": ROW}
    assert (a.n_row_vars, a.columns, a.levels) == (1, 8, 1)


def test_a_gathered_load_is_computed_one_stage_after_its_index():
    body = (Op("i", "load", (), "int64", Access("i", 0, (1, 0))),
            Op("ii", "indirect", ("i",), "int64", None, {"size": 50}),
            Op("e", "load", (), "float32", Access("e", 0, (0, 1), (("ii", 96),))),
            Op("y", "store", ("e",), "float32", Access("y", 0, (96, 1))))
    buffers = (Buffer("i", "int64", (9,), (1,)), Buffer("e", "float32", (50, 96), (96, 1)),
               Buffer("y", "float32", (9, 96), (96, 1)))
    a = analyse(LoopKernel("k", (9, 96), 1, False, body, buffers))
    assert (a.values["ii"].level, a.values["e"].level, a.levels) == (0, 1, 2)


def test_an_indirect_index_that_varies_along_the_columns_is_unsupported():
    body = (Op("i", "load", (), "int64", Access("i", 0, (0, 1))),
            Op("e", "load", (), "float32", Access("e", 0, (0, 0), (("i", 96),))),
            Op("y", "store", ("e",), "float32", Access("y", 0, (96, 1))))
    buffers = (Buffer("i", "int64", (96,), (1,)), Buffer("e", "float32", (50, 96), (96, 1)),
               Buffer("y", "float32", (9, 96), (96, 1)))
    with pytest.raises(Unsupported, match="varies along the columns"):
        loops.check_kernel(LoopKernel("k", (9, 96), 1, False, body, buffers))


def test_a_buffer_of_a_dtype_the_card_does_not_compute_in_is_unsupported():
    with pytest.raises(Unsupported, match="float64"):
        loops.check_kernel(pointwise((4, 8), dtype="float64"))


def test_an_operation_construction_does_not_know_is_unsupported():
    with pytest.raises(Unsupported, match="operation frobnicate"):
        loops.check_kernel(pointwise((4, 8), ops=("frobnicate",)))


# ---- tiling ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [(37, 96), (5, 7, 130), (1000, 3), (3, 1, 200), (65,)], ids=str)
def test_tiles_cover_every_row_once_for_shapes_off_the_64_grid(sizes):
    k = pointwise(sizes, ncols=1 if len(sizes) > 1 else 0)
    tiling = choose_tiling(analyse(k), TARGET)
    rows = covered_rows(tiling)
    nrow = tiling.analysis.n_row_vars
    assert sorted(rows) == list(itertools.product(*[range(n) for n in sizes[:nrow]]))
    assert all(t.rows(tiling.inner_rows) <= tiling.rows_per_tile for t in tiling.tiles)


def test_a_row_too_wide_for_the_scratchpad_is_an_error():
    small = dataclasses.replace(TARGET, scratchpad_bytes=16 << 10)
    with pytest.raises(ScratchpadOverflow, match="one row of 8192 columns of kernel k"):
        choose_tiling(analyse(pointwise((4, 8192))), small)


def test_blocks_start_on_stick_boundaries():
    tiling = choose_tiling(analyse(pointwise((10000, 64))), TARGET)
    assert tiling.block_size > 64 and tiling.block_size % 64 == 0  # 64 fp16 elements: the narrowest stick
    assert all(t.start % 64 == 0 for t in tiling.tiles)


def _row_sums(batch, n, dtype="float32"):
    """y[b, i] = sum_j (x[b, i] - x[b, j]): rows (b, i), the reduction over j; the output's
    rows are x's, so the block variable i moves along the output's sticks."""
    x_strides = (n, 1)
    body = [Op("a", "load", (), dtype, Access("x", 0, (n, 1, 0))),
            Op("b", "load", (), dtype, Access("x", 0, (n, 0, 1))),
            Op("d", "sub", ("a", "b")),
            Op("s", "reduction", ("d",), dtype, None, {"kind": "sum"}),
            Op("y", "store", ("s",), dtype, Access("y", 0, (n, 1, 0)))]
    buffers = (Buffer("x", dtype, (batch, n), x_strides), Buffer("y", dtype, (batch, n), x_strides))
    return LoopKernel("k", (batch, n, n), 1, True, tuple(body), buffers)


@pytest.mark.parametrize("batch,n,dtype", [(9, 128, "float32"), (17, 64, "float32"), (9, 120, "float32"),
                                           (9, 128, "float16"), (3, 100, "float16")])
def test_no_two_tiles_store_into_one_stick(batch, n, dtype):
    """A tile's stores fill sticks of their own: the cores write sticks back whole, so two
    tiles storing into one stick lose one's values (rows of 36 once split 128-element
    rows mid-stick, and the kernel returned wrong sums)."""
    t = choose_tiling(analyse(_row_sums(batch, n, dtype)), TARGET)
    per_stick = TARGET.stick_bytes // {"float32": 4, "float16": 2}[dtype]
    assert sorted(covered_rows(t)) == list(itertools.product(range(batch), range(n)))
    owners = {}
    for tile in t.tiles:
        first = t.origin(t.analysis.stores[0].op.access, tile)
        for e in {(e // n, (e % n) // per_stick) for e in range(first, first + tile.size)}:
            assert owners.setdefault(e, tile) is tile, f"stick {e} stored by two tiles"


def test_tiles_go_round_robin_over_the_32_cores_in_per_core_order():
    tiling = choose_tiling(analyse(pointwise((10000, 64))), TARGET)
    tiles = tiling.tiles
    assert len(tiles) == 40
    assert Counter(t.core for t in tiles) == {c: 2 if c < 8 else 1 for c in range(32)}
    assert [(t.core, t.seq) for t in tiles] == sorted((i % 32, i // 32) for i in range(40))
    in_order = sorted(tiles, key=lambda t: t.seq * 32 + t.core)  # the order they were dealt in
    assert [t.start for t in in_order] == list(range(0, 10000, tiling.block_size))


def test_tiles_hold_at_most_an_even_share_of_the_rows_per_core():
    tiling = choose_tiling(analyse(pointwise((64, 64))), TARGET)
    assert tiling.rows_per_tile == 2 and len(tiling.tiles) == 32


def test_tiles_hold_as_many_rows_as_the_scratchpad_layout_fits():
    small = dataclasses.replace(TARGET, scratchpad_bytes=64 << 10)
    a = analyse(pointwise((4096, 100), ops=("exp", "neg")))
    tiling = choose_tiling(a, small)
    assert tiling.block_size < 64  # not rounded down to a stick: fewer rows than one
    needs = tiling.scratch_needs
    assert lay_out(a, tiling.rows_per_tile, needs, 128).peak <= small.scratchpad_bytes
    assert lay_out(a, tiling.rows_per_tile + 1, needs, 128).peak > small.scratchpad_bytes


def test_inner_row_variables_fit_whole_inside_a_tile():
    tiling = choose_tiling(analyse(pointwise((300, 5, 7, 64))), TARGET)
    assert (tiling.block, tiling.inner_rows) == (0, 35)
    assert tiling.rows_per_tile == tiling.block_size * 35


def test_a_kernel_without_row_variables_is_one_tile():
    tiling = choose_tiling(analyse(pointwise((200,), ncols=1)), TARGET)
    assert (tiling.block, tiling.rows_per_tile, len(tiling.tiles)) == (-1, 1, 1)


# ---- scratchpad layout -------------------------------------------------------------------

def test_every_region_starts_on_a_stick_boundary_and_slots_do_not_overlap():
    a = analyse(pointwise((37, 96), ops=("exp", "neg")))
    layout = lay_out(a, 5, scratch_needs(a), 128)
    slots = [(off, a.values[vid]) for vid, s in layout.slots.items() for off in s.off]
    regions = sorted(off for off, _ in slots) + sorted(o.off for o in layout.temporaries.values())
    assert all(off % 128 == 0 for off in regions)
    assert len(set(off for off, _ in slots)) == 4  # two per load and store
    assert layout.slots["x"].pitch == 128  # a tile row padded to whole 64-element sticks
    assert layout.peak % 128 == 0 and layout.peak > max(regions)


def test_temporaries_of_values_no_longer_live_are_reused():
    a = analyse(pointwise((37, 96), ops=("exp", "neg", "abs", "sqrt"), dtype="float32"))
    t = lay_out(a, 5, scratch_needs(a), 128).temporaries
    assert t["v2"].off == t["v0"].off and t["v3"].off == t["v1"].off and t["v0"].off != t["v1"].off


def test_the_layout_grows_with_the_rows():
    a = analyse(pointwise((37, 96), ops=("exp", "neg")))
    peaks = [lay_out(a, rows, scratch_needs(a), 128).peak for rows in (1, 2, 8, 9, 37)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


def test_scratch_areas_exist_only_where_a_stage_needs_working_space():
    assert scratch_needs(analyse(pointwise((4, 8)))) == frozenset()
    body = (Op("r", "index", (), "float32", Access("", 0, (1, 0))),
            Op("y", "store", ("r",), "float32", Access("y", 0, (1, 0))))
    indexed = LoopKernel("k", (4, 8), 1, False, body, (Buffer("y", "float32", (4,), (1,)),))
    a = analyse(indexed)
    assert scratch_needs(a) == {("i64", 0)}  # the affine term
    layout = lay_out(a, 4, scratch_needs(a), 128)
    assert min(layout.scratch.values()) >= max(o.off for o in layout.temporaries.values())


# ---- build ----------------------------------------------------------------------------------

def test_a_build_returns_a_frozen_decision_record_that_a_later_build_takes_back():
    k = pointwise((37, 96))
    layouts = {"x": StickLayout(37, 96, 2), "y": StickLayout(37, 96, 2)}
    first, again = BuildContext(TARGET, layouts), BuildContext(TARGET, layouts)
    decided = loops.build(first, k)
    assert loops.build(again, k, decided) is decided
    assert first.encode().tobytes() == again.encode().tobytes()
    assert first.scratchpad_peak == again.scratchpad_peak == decided.layout.peak > 0
    assert first.buffers() == again.buffers() == ["x", "y"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        decided.tiling = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        decided.tiling.rows_per_tile = 1
