"""The passes that make a LoopKernel of a recorded kernel (spyre_rt.compiler.describe), one
at a time, on hand-made inputs: canonical loop variables, affine coefficients, the points
where `//`, `%` and storage rows split a loop, masked loads restricted to their box,
forwarding of kernel-local buffers, and the adapters of operations the card lacks."""

import math
import operator

import pytest
import sympy
from spyre_rt.compiler import describe as d

from spyre_rt.construct.loops import CARD_OPS
from spyre_rt.ir import Access, Buffer, Op

# ---- canonical variables ------------------------------------------------------------------


def test_canonical_sizes_cut_a_flat_range_at_every_boundary_outermost_first():
    assert d.canonical_sizes(24, {4, 12}) == [2, 3, 4]


def test_canonical_sizes_ignore_boundaries_at_or_beyond_the_ends():
    assert d.canonical_sizes(24, {0, 1, 4, 24, 48}) == [6, 4]


def test_canonical_sizes_of_a_range_without_boundaries_is_one_variable():
    assert d.canonical_sizes(24, set()) == [24]
    assert d.canonical_sizes(1, set()) == []


def test_canonical_sizes_refuse_loop_nests_that_do_not_nest():
    with pytest.raises(d.NotSupported, match="do not nest"):
        d.canonical_sizes(24, {4, 6})


# ---- split points ----------------------------------------------------------------------------

X, Y = d.loop_symbols("n0_", 2)


def test_a_floor_division_of_a_loop_variable_splits_the_loop_at_its_divisor():
    assert d._split_points(d.FloorDiv(X, 4), {X: 1}) == {4}


def test_a_modular_index_splits_the_loop_at_its_divisor_and_its_wrap():
    assert d._split_points(d.ModularIndexing(X, 2, 3), {X: 1}) == {2, 6}


def test_split_points_are_flat_positions_scaled_by_the_variables_stride():
    assert d._split_points(d.FloorDiv(X, 4) + d.ModularIndexing(Y, 2, 3), {X: 1, Y: 8}) == {4, 16, 48}


def test_a_division_of_an_expression_does_not_split_a_loop():
    assert d._split_points(d.FloorDiv(X + Y, 4), {X: 1, Y: 8}) == set()


ROWS_OF_32 = {"a": Buffer("a", "float32", (4, 32), (32, 1))}


def test_a_loop_walking_a_buffer_contiguously_splits_at_its_storage_rows():
    assert d._row_points(X, [X], [128], {X: 1}, "a", ROWS_OF_32) == {32}


def test_a_loop_that_strides_over_a_buffer_does_not_split_at_its_rows():
    assert d._row_points(2 * X, [X], [128], {X: 1}, "a", ROWS_OF_32) == set()


def test_a_loop_within_one_row_or_not_whole_rows_does_not_split():
    assert d._row_points(X, [X], [32], {X: 1}, "a", ROWS_OF_32) == set()
    assert d._row_points(X, [X], [48], {X: 1}, "a", ROWS_OF_32) == set()


def test_an_unknown_or_one_column_buffer_has_no_row_points():
    assert d._row_points(X, [X], [128], {X: 1}, "b", ROWS_OF_32) == set()
    column = {"a": Buffer("a", "float32", (128, 1), (1, 1))}
    assert d._row_points(X, [X], [128], {X: 1}, "a", column) == set()


# ---- affine coefficients ---------------------------------------------------------------------

C0, C1 = (lambda canon: canon[0]), (lambda canon: canon[1])


def test_affine_coefficients_of_a_row_major_index():
    assert d.affine_coefficients(64 * X + Y + 5, [X, Y], {X: C0, Y: C1}, [3, 64]) == (5, [64, 1], [])


def test_floor_division_and_modulo_become_affine_over_split_variables():
    # x of 128 iterations is split at 64 into (c0, c1): x = 64*c0 + c1
    split = {X: lambda canon: 64 * canon[0] + canon[1]}
    expr = 10 * d.FloorDiv(X, 64) + d.ModularIndexing(X, 1, 64)
    assert d.affine_coefficients(expr, [X], split, [2, 64]) == (0, [10, 1], [])


def test_a_variable_of_size_one_gets_no_coefficient():
    assert d.affine_coefficients(7 * X + Y, [X, Y], {X: C0, Y: C1}, [1, 8]) == (0, [0, 1], [])


def test_an_indirect_index_gets_a_coefficient_of_its_own():
    tmp = sympy.Symbol("tmp3", integer=True)
    assert d.affine_coefficients(96 * tmp + Y, [X, Y], {X: C0, Y: C1}, [4, 96], [tmp]) == (0, [0, 1], [96])


def test_an_index_that_is_not_affine_is_refused():
    with pytest.raises(d.NotSupported, match="not affine"):
        d.affine_coefficients(X * X, [X], {X: C0}, [16])
    with pytest.raises(d.NotSupported, match="not affine"):
        d.affine_coefficients(d.FloorDiv(X, 3), [X], {X: C0}, [16])


def test_describe_splits_a_loop_at_a_division_so_that_every_index_is_affine():
    # a (4, 32) view into (4, 64) storage, read through one flat loop of 128
    x = d.loop_symbols("n0_", 1)[0]
    ops = ({"op": "load", "id": "l", "buf": "a", "index": 64 * d.FloorDiv(x, 32) + d.ModularIndexing(x, 1, 32)},
           {"op": "store", "id": "s", "args": ["l"], "buf": "out", "index": x})
    buffers = {"a": Buffer("a", "float32", (4, 32), (64, 1)), "out": Buffer("out", "float32", (4, 32), (32, 1))}
    k = d.describe(d.RecordedKernel("k", (d.RecordedNode((128,), (), ops),), 128, 1, (), buffers))
    assert k.sizes == (4, 32)
    assert [o.access.coeffs for o in k.ops] == [(64, 1), (32, 1)]


# ---- forwarding of kernel-local buffers ------------------------------------------------------

def _two_nodes_through(local_index):
    x, y = d.loop_symbols("n0_", 1)[0], d.loop_symbols("n1_", 1)[0]
    first = ({"op": "load", "id": "l0", "buf": "a", "index": x},
             {"op": "exp", "id": "e0", "args": ["l0"]},
             {"op": "store", "id": "s0", "args": ["e0"], "buf": "tmp", "index": x})
    second = ({"op": "load", "id": "l1", "buf": "tmp", "index": local_index(y)},
              {"op": "neg", "id": "n1", "args": ["l1"]},
              {"op": "store", "id": "s1", "args": ["n1"], "buf": "out", "index": y})
    buffers = {b: Buffer(b, "float32", (64,), (1,)) for b in ("a", "out")}
    nodes = (d.RecordedNode((64,), (), first), d.RecordedNode((64,), (), second))
    return d.RecordedKernel("k", nodes, 64, 1, ("tmp",), buffers)


def test_a_kernel_local_buffer_is_forwarded_and_never_stored():
    k = d.describe(_two_nodes_through(lambda y: y))
    assert [b.name for b in k.buffers] == ["a", "out"]
    assert [(o.id, o.op, o.args) for o in k.ops] == [
        ("l0", "load", ()), ("e0", "exp", ("l0",)), ("n1", "neg", ("e0",)), ("s1", "store", ("n1",))]


def test_a_kernel_local_buffer_read_at_another_index_is_refused():
    with pytest.raises(d.NotSupported, match="another index"):
        d.describe(_two_nodes_through(lambda y: 63 - y))


# ---- masked loads ----------------------------------------------------------------------------

def _masked_load(mask_op, limit, storage_cols=5):
    """A load over (2, 8) reading a (2, `storage_cols`) buffer, masked by `index1 <mask_op> limit`."""
    ops = [Op("i", "index", (), "int64", Access("", 0, (0, 1))),
           Op("c", "constant", (), "int64", None, {"value": limit}),
           Op("m", mask_op, ("i", "c")),
           Op("l", "load", (), "float32", Access("x", 0, (storage_cols, 1)))]
    buffers = {"x": Buffer("x", "float32", (2, storage_cols), (storage_cols, 1))}
    return ops, buffers


def test_a_masked_load_that_would_read_past_its_buffer_gets_the_box_of_its_mask():
    ops, buffers = _masked_load("lt", 5)
    d._restrict_masked_load(ops, "l", ["m"], [2, 8], buffers)
    assert ops[-1].access.domain == ((1, 0, 5),)


def test_a_masked_gathered_load_whose_columns_leave_the_row_gets_the_box_of_its_mask():
    """A rotary embedding's `sin`: columns 32 + c of the cos-sin row an index picks, over the
    64 columns of a cat and masked to c < 32. The whole box is inside the (32, 64) table, but
    columns 64..95 would be the next row's: the load is restricted to its mask's box."""
    ops = [Op("p", "load", (), "int64", Access("pos", 0, (1, 0))),
           Op("r", "indirect", ("p",), "int64", None, {"size": 32, "wrap_neg": True}),
           Op("i", "index", (), "int64", Access("", 0, (0, 1))),
           Op("c", "constant", (), "int64", None, {"value": 32}),
           Op("m", "lt", ("i", "c")),
           Op("l", "load", (), "float32", Access("cs", 32, (0, 1), (("r", 64),)))]
    buffers = {"cs": Buffer("cs", "float32", (32, 64), (64, 1)), "pos": Buffer("pos", "int64", (5,), (1,))}
    d._restrict_masked_load(ops, "l", ["m"], [5, 64], buffers, ncols=1)
    assert ops[-1].access.domain == ((1, 0, 32),)
    inside = Op("l", "load", (), "float32", Access("cs", 0, (0, 1), (("r", 64),)))
    ops[-1] = inside  # columns 0..63 of the row: nothing to restrict
    d._restrict_masked_load(ops, "l", ["m"], [5, 64], buffers, ncols=1)
    assert ops[-1].access.domain == ()


def test_masks_over_disjoint_loop_indices_are_boxes_of_their_own():
    """A cat of a rotated key along the tokens (rows < 4096) with the rotation's half along
    the columns (< 64): 8,192 x 128 points together, past what is enumerated at once, but
    each mask alone is a range of one index, and a mask sharing an index joins its group."""
    ops = [Op("r", "index", (), "int64", Access("", 0, (1, 0, 0))),
           Op("n", "constant", (), "int64", None, {"value": 4096}),
           Op("m0", "lt", ("r", "n")),
           Op("c", "index", (), "int64", Access("", 0, (0, 0, 1))),
           Op("h", "constant", (), "int64", None, {"value": 64}),
           Op("m1", "lt", ("c", "h")),
           Op("k", "constant", (), "int64", None, {"value": 4}),
           Op("m2", "ge", ("c", "k")),
           Op("l", "load", (), "float32", Access("x", 64, (128, 0, 1)))]
    buffers = {"x": Buffer("x", "float32", (4096, 128), (128, 1))}
    d._restrict_masked_load(ops, "l", ["m0", "m1", "m2"], [8192, 8, 128], buffers)
    assert ops[-1].access.domain == ((0, 0, 4096), (2, 4, 64))
    ops[2] = Op("m0", "lt", ("r", "k"))
    ops[7] = Op("m2", "ge", ("r", "n"))  # rows < 4 and >= 4096: never true
    d._restrict_masked_load(ops, "l", ["m0", "m1", "m2"], [8192, 8, 128], buffers)
    assert ops[-1].op == "constant"


def test_a_masked_load_inside_its_buffer_keeps_its_whole_box():
    ops, buffers = _masked_load("lt", 5, storage_cols=8)
    d._restrict_masked_load(ops, "l", ["m"], [2, 8], buffers)
    assert ops[-1].access.domain == ()


def test_a_masked_load_whose_mask_is_never_true_becomes_a_zero():
    ops, buffers = _masked_load("lt", 0)
    d._restrict_masked_load(ops, "l", ["m"], [2, 8], buffers)
    assert (ops[-1].op, ops[-1].attrs) == ("constant", {"value": 0})


def test_a_mask_that_is_not_a_box_of_loop_indices_is_refused():
    ops, buffers = _masked_load("ne", 3)
    with pytest.raises(d.NotSupported, match="not a box"):
        d._restrict_masked_load(ops, "l", ["m"], [2, 8], buffers)


def test_a_mask_that_depends_on_data_is_refused():
    ops, buffers = _masked_load("lt", 5)
    ops.insert(0, Op("v", "load", (), "float32", Access("x", 0, (5, 0))))
    ops[3] = Op("m", "lt", ("v", "c"))
    with pytest.raises(d.NotSupported, match="data-dependent"):
        d._restrict_masked_load(ops, "l", ["m"], [2, 8], buffers)


# ---- adapters --------------------------------------------------------------------------------

_EVAL = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
         "neg": operator.neg, "abs": abs, "exp": math.exp, "log": math.log, "sqrt": math.sqrt,
         "rsqrt": lambda x: 1 / math.sqrt(x), "sin": math.sin, "cos": math.cos, "atan": math.atan, "erf": math.erf,
         "lt": operator.lt, "ge": operator.ge, "eq": operator.eq, "where": lambda c, a, b: a if c else b}


def _run(ops, **inputs):
    env = dict(inputs)
    for op in ops:
        env[op["id"]] = op["value"] if op["op"] == "constant" else _EVAL[op["op"]](*[env[a] for a in op["args"]])
    return env


CASES = [("log2", (8.0,), math.log2), ("log10", (1000.0,), math.log10), ("erfc", (0.3,), math.erfc),
         ("tan", (0.4,), math.tan), ("sinh", (0.7,), math.sinh), ("cosh", (0.7,), math.cosh),
         ("asinh", (1.5,), math.asinh), ("acosh", (1.5,), math.acosh), ("atanh", (0.3,), math.atanh),
         ("asin", (0.4,), math.asin), ("acos", (0.4,), math.acos), ("hypot", (3.0, 4.0), math.hypot),
         ("copysign", (2.0, -1.0), math.copysign), ("copysign", (-2.0, 1.0), math.copysign),
         ("isinf", (float("inf"),), math.isinf), ("isinf", (1.0,), math.isinf),
         ("fma", (2.0, 3.0, 4.0), lambda x, y, z: x * y + z)] + [
        ("atan2", (y, x), math.atan2) for y, x in ((1.0, 2.0), (1.0, -2.0), (-1.0, -2.0), (-1.0, 2.0))]


@pytest.mark.parametrize("name,args,want", CASES, ids=[f"{c[0]}{c[1]}" for c in CASES])
def test_each_adapter_computes_its_function_with_the_cards_operations(name, args, want):
    names = [f"x{i}" for i in range(len(args))]
    ops = d.adapt([{"op": name, "id": "r", "args": names}])
    assert {op["op"] for op in ops} <= CARD_OPS
    assert _run(ops, **dict(zip(names, args, strict=True)))["r"] == pytest.approx(want(*args), rel=1e-12)


def test_every_adapter_has_a_case():
    assert {c[0] for c in CASES} == set(d.ADAPTERS)


def test_an_adapted_op_keeps_its_id_and_masks_and_other_ops_pass_unchanged():
    other = {"op": "exp", "id": "e", "args": ["x"]}
    ops = d.adapt([{"op": "log2", "id": "r", "args": ["e"], "masks": ["m"]}, other])
    assert ops[-1] is other
    made = ops[:-1]
    assert made[-1]["id"] == "r" and all(op["masks"] == ["m"] for op in made)
    assert all(op["dtype"] == "float32" for op in made if op["op"] == "constant")


def test_the_affinity_check_on_columns_agrees_with_the_check_point_by_point():
    # the columns path (numpy ints) and the point-by-point path (Python ints) must agree:
    # floor division and modulo of negative values included
    pts = d._affine_points((8, 6, 5), 1)
    cases = [(lambda a, b, c, t: 30 * a + 5 * b + c + 3 * t - 7, -7, [30, 5, 1, 3], True),
             (lambda a, b, c, t: ((a - 9) // 4) % 3 + b, 0, [0, 1, 0, 0], False),
             (lambda a, b, c, t: (30 * a + c) // 30 - (b - 3) % 6, 3, [1, -1, 0, 0], False),
             (lambda a, b, c, t: a * b, 0, [0, 0, 0, 0], False)]
    for f, base, coeffs, affine in cases:
        point_by_point = all(int(f(*pt)) == base + sum(c * x for c, x in zip(coeffs, pt, strict=True))
                             for pt in pts.rows)
        assert point_by_point == affine
        assert d._affine_at(f, base, coeffs, pts, "") == affine
        assert d._affine_at(f, base, coeffs, pts, "Min(") == affine  # the point-by-point path


def test_an_index_whose_check_divides_by_zero_fails_as_on_ints():
    # at the check's points the divisor is zero: the columns path must not hide it
    with pytest.raises(ZeroDivisionError):
        d._affine_at(lambda a: 4 // (a - a), 0, [0], d._affine_points((16,), 0), "")


def test_the_affinity_check_points_come_from_the_sizes_alone_and_reach_each_far_corner():
    pts = d._affine_points((3, 64), 1)
    assert pts.rows == d._affine_points.__wrapped__((3, 64), 1).rows
    assert len(pts.rows) == d._AFFINE_TRIALS and pts.rows[0][0] == 2 and pts.rows[1][1] == 63
    assert all(0 <= x < n for pt in pts.rows for x, n in zip(pt, (3, 64, 7), strict=True))
    assert pts.cols.T.tolist() == [list(pt) for pt in pts.rows] and pts.top == max(map(max, pts.rows))


def test_an_affine_analysis_is_remembered_per_expression_and_sizes():
    # the same expression over other sizes: a variable of size one has no coefficient
    assert d.affine_coefficients(7 * X + Y, [X, Y], {X: C0, Y: C1}, [1, 8]) == (0, [0, 1], [])
    assert d.affine_coefficients(7 * X + Y, [X, Y], {X: C0, Y: C1}, [2, 8]) == (0, [7, 1], [])
    # and an index found not affine stays refused, with its own expression named
    for _ in range(2):
        with pytest.raises(d.NotSupported, match=r"index n0_v0\*\*2 is not affine"):
            d.affine_coefficients(X * X, [X], {X: C0}, [16])


def test_split_and_row_points_are_remembered_per_loop_nest():
    assert d._split_points(d.FloorDiv(X, 4), {X: 1}) == {4}
    assert d._split_points(d.FloorDiv(X, 4), {X: 8}) == {32}
    assert d._row_points(X, [X], [128], {X: 1}, "a", ROWS_OF_32) == {32}
    assert d._row_points(X, [X], [128], {X: 2}, "a", ROWS_OF_32) == {64}
    assert d._row_points(X, [X], [128], {X: 1}, "a", {"a": Buffer("a", "float32", (2, 64), (64, 1))}) == {64}


def test_sizes_and_indices_are_worked_out_per_size_symbols():
    for n in (2, 3, 2):
        assert d.value(d.Sym("64*s0 + 1"), {"s0": n}) == 64 * n + 1
        op = d._concrete_op({"op": "load", "id": "l", "buf": "a", "index": "s0*n0_v0 + n0_v1"}, {"s0": n})
        assert op["index"] == n * X + Y
    with pytest.raises(d.NotSupported, match="depends on"):
        d.value(d.Sym("s1"), {"s0": 3})
