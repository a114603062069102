"""Epilogue fusion: a pointwise kernel that reads a matmul's product, where nothing else
does, runs as the matmul's epilogue (compiler/fusion.py, construct/matmul/epilogue.py).

Compiled functions give the same bits fused as unfused in every dispatch mode (fp16 and
fp32, shapes off the 64 grid, a batched matmul, a decode-shaped M = 1), and the fused
kernel is in the step; a product that something else also reads (a graph output, another
matmul) stays stored. The builder's epilogue equals torch exactly on small integers under
random tilings (split-K, batches, broadcast rows), with no scratchpad races; and the pass
refuses to move a kernel past a write of what it reads, or to fuse a shifted view."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scratchpad_races import races
from spyre_rt.compiler.fusion import fuse_epilogues
from test_matmul_build import DTYPES, launch_built, operand, tilings
from test_matmul_tiling import swiglu_up

from spyre_rt import dispatch, dtypes, executor
from spyre_rt.construct.context import BuildContext
from spyre_rt.construct.matmul import MatmulSpec, Tiling, View, build
from spyre_rt.cost import CostModel
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.errors import SpyreError
from spyre_rt.ir import Access, Buffer, Epilogue, LoopKernel, MatmulKernel, Op, StepDesc

MODES = dispatch.NAMES  # every dispatch mode, from the table


def swiglu_residual(x, wg, wu, r):
    return F.silu(x @ wg.t()) * (x @ wu.t()) + r


def scaled_bmm(a, b, r):
    return torch.bmm(a, b) * 0.25 + r


def product_also_returned(x, w, r):
    y = x @ w
    return y, y + r


def product_also_multiplied(x, w, w2, r):
    y = x @ w
    return y @ w2, y * 2 + r


def _compile_and_run(fn, args, fuse: bool, option: str = "fuse_epilogues", **more):
    """{mode: outputs on the CPU}, and the step's description (`option` set to `fuse`, and
    the other options `more` names)."""
    torch._dynamo.reset()
    before = set(executor.live_steps())
    compiled = torch.compile(fn, backend="spyre_rt", dynamic=False, options={option: fuse, **more})
    out = {}
    for mode in MODES:
        with dispatch_mode(mode):
            res = compiled(*(a.to("spyre") for a in args))
        out[mode] = [t.cpu() for t in (res if isinstance(res, tuple) else (res,))]
    (step,) = set(executor.live_steps()) - before
    return out, step.desc


def _fused(desc: StepDesc) -> list[MatmulKernel]:
    return [k for k in desc.kernels.values() if isinstance(k, MatmulKernel) and k.epilogue is not None]


def _loops(desc: StepDesc) -> list[LoopKernel]:
    return [k for k in desc.kernels.values() if isinstance(k, LoopKernel)]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype != torch.float32
                                                                      else a.view(torch.int32),
                                                                      b.view(torch.uint8) if b.dtype != torch.float32
                                                                      else b.view(torch.int32))


CASES = {
    "swiglu_residual": (swiglu_residual, lambda dt, g: (torch.randn(100, 72, dtype=dt, generator=g),
                                                        torch.randn(130, 72, dtype=dt, generator=g),
                                                        torch.randn(130, 72, dtype=dt, generator=g),
                                                        torch.randn(100, 130, dtype=dt, generator=g))),
    "decode_row": (swiglu_residual, lambda dt, g: (torch.randn(1, 72, dtype=dt, generator=g),
                                                   torch.randn(130, 72, dtype=dt, generator=g),
                                                   torch.randn(130, 72, dtype=dt, generator=g),
                                                   torch.randn(1, 130, dtype=dt, generator=g))),
    "scaled_bmm": (scaled_bmm, lambda dt, g: (torch.randn(3, 33, 40, dtype=dt, generator=g),
                                              torch.randn(3, 40, 70, dtype=dt, generator=g),
                                              torch.randn(3, 33, 70, dtype=dt, generator=g))),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_pointwise_consumer_runs_as_the_matmuls_epilogue(case, dtype):
    fn, make = CASES[case]
    args = make(dtype, torch.Generator().manual_seed(7))
    fused, desc = _compile_and_run(fn, args, fuse=True)
    # apart, without the epilogue, the gate and up GEMMs would be one grouped matmul
    plain, plain_desc = _compile_and_run(fn, args, fuse=False, group_matmuls=False)
    assert len(_fused(desc)) == 1 and not _loops(desc), "the pointwise kernel was not folded into a matmul"
    assert _loops(plain_desc) and not _fused(plain_desc)
    assert len(desc.kernels) == len(plain_desc.kernels) - 1
    for mode in MODES:
        for a, b in zip(fused[mode], plain["prebuilt"], strict=True):
            assert _same_bits(a, b), f"{case} {mode}: fused and unfused results differ"
    want = fn(*(a.double() for a in args))
    got = fused["prebuilt"][0].double()
    tol = 0.05 if dtype == torch.float16 else 1e-4
    assert (got - want).abs().max().item() <= tol * (1 + want.abs().max().item())


def residual(h, x, w):
    return h + x @ w.t()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("m, k", [(40, 512), (200, 384), (40, 256), (300, 1024)])
def test_a_residual_epilogue_keeps_the_bits_of_the_matmul_apart(m, k, dtype):
    """The fused matmul is cut with the K chunks and slices of the matmul alone (its
    epilogue's temporaries hold a strip of rows, so that they fit beside that tiling): the
    dot products are added in the same order. Once, its epilogue's room made another
    split-K of these shapes the cheapest, and the bits moved."""
    g = torch.Generator().manual_seed(m + k)
    args = (torch.randn(m, 256, dtype=dtype, generator=g), torch.randn(m, k, dtype=dtype, generator=g),
            torch.randn(256, k, dtype=dtype, generator=g) * 0.06)
    options = {"fuse_prologues": False, "group_matmuls": False, "fuse_residuals": False}
    fused, desc = _compile_and_run(residual, args, fuse=True, **options)
    plain, _ = _compile_and_run(residual, args, fuse=False, **options)
    assert len(_fused(desc)) == 1
    assert _same_bits(fused["prebuilt"][0], plain["prebuilt"][0])


def test_an_epilogue_that_does_not_fit_beside_the_matmuls_own_tiling_stays_a_kernel():
    """On a card whose scratchpad holds the matmul's own tiling but not the epilogue's tiles
    beside any tiling of its K chunks, fusing would take other K chunks and other bits: the
    pass leaves the add a kernel of its own (checked when the step compiles)."""
    from small_profiles import profile_text_with

    from spyre_rt import device_profile
    from spyre_rt.construct.matmul import Problem, choose, spec_of

    step = _step([_matmul(), _add("add", "p", "s", "o")], ["mm", "add"])

    def card(nbytes):
        return CostModel.of_figures(device_profile.parse(profile_text_with(scratchpad_mib=nbytes / 2 ** 20)))

    tight, roomy = card(2688), card(3072)
    assert choose(tight, Problem.of(spec_of(step.kernels["mm"])))  # the matmul alone fits
    assert fuse_epilogues(step, tight) == step
    fused = fuse_epilogues(step, roomy)
    assert fused.sequence == (("run", "mm"),) and fused.kernels["mm"].epilogue is not None


@pytest.mark.parametrize("fn", [product_also_returned, product_also_multiplied])
def test_a_product_something_else_reads_is_not_fused_away(fn):
    g = torch.Generator().manual_seed(3)
    x, w, r = torch.randn(40, 72, generator=g), torch.randn(72, 66, generator=g), torch.randn(40, 66, generator=g)
    args = (x, w, r) if fn is product_also_returned else (x, w, torch.randn(66, 20, generator=g), r)
    out, desc = _compile_and_run(fn, args, fuse=True)
    assert not _fused(desc) and _loops(desc)
    want = fn(*args)
    for mode in MODES:
        for a, b in zip(out[mode], want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---- the pass on hand-made steps ------------------------------------------------------------

M, N, K = 20, 30, 8


def _buf(name, dtype="float32", shape=(M, N)):
    return Buffer(name, dtype, shape, (shape[1], 1) if len(shape) == 2 else (1,))


def _matmul(name="mm", out="p"):
    return MatmulKernel(name, ("a", 0, (1, M, K), (0, K, 1)), ("b", 0, (1, K, N), (0, N, 1)),
                        (out, 0, (1, M, N), (0, N, 1)), "float32", "float32",
                        buffers=(_buf("a", shape=(M, K)), _buf("b", shape=(K, N)), _buf(out)))


def _add(name, x, y, out, y_const=0):
    """out = x + y over (M, N) (y read from `y_const` on)."""
    acc = lambda buf, c=0: Access(buf, c, (N, 1))  # noqa: E731
    return LoopKernel(name, (M, N), 1, False, (
        Op("0", "load", (), "float32", acc(x)), Op("1", "load", (), "float32", acc(y, y_const)),
        Op("2", "add", ("0", "1")), Op("3", "store", ("2",), "float32", acc(out))),
        (_buf(x), _buf(y), _buf(out)))


def _step(kernels, order, outputs=("o",)):
    bufs = {n: _buf(n) for n in ("p", "r", "o", "q")}
    return StepDesc(inputs=((_buf("a", shape=(M, K)), False), (_buf("b", shape=(K, N)), False), (_buf("s"), False)),
                    outputs=tuple((o, 0, (M, N), (N, 1)) for o in outputs), buffers=bufs, aliases={}, constants={},
                    kernels={k.name: k for k in kernels}, sequence=tuple(("run", n) for n in order))


def test_the_pass_folds_a_residual_add_and_keeps_plain_data():
    step = _step([_matmul(), _add("add", "p", "s", "o")], ["mm", "add"])
    fused = fuse_epilogues(step)
    assert fused.sequence == (("run", "mm"),) and "p" not in fused.buffers
    ep = fused.kernels["mm"].epilogue
    assert [o.op for o in ep.ops] == ["product", "load", "add", "store"]
    assert ep.inputs == (("s", 0, (1, M, N), (0, N, 1)),) and ep.outputs == (("o", 0, (1, M, N), (0, N, 1)),)
    from spyre_rt.ir import from_json, to_json
    assert from_json(to_json(fused)) == fused


def test_the_pass_does_not_move_a_kernel_past_a_write_of_what_it_reads():
    # r is written between the matmul and the add that reads it: the add cannot run earlier
    step = _step([_matmul(), _add("w", "s", "s", "r"), _add("add", "p", "r", "o")], ["mm", "w", "add"])
    assert fuse_epilogues(step) == step
    # the same kernels with r written before the matmul fuse
    step = _step([_matmul(), _add("w", "s", "s", "r"), _add("add", "p", "r", "o")], ["w", "mm", "add"])
    assert fuse_epilogues(step).sequence == (("run", "w"), ("run", "mm"))


def test_the_pass_refuses_a_shifted_view_of_the_product_and_a_product_read_elsewhere():
    shifted = LoopKernel("add", (M, N - 1), 1, False, (
        Op("0", "load", (), "float32", Access("p", 1, (N, 1))), Op("1", "load", (), "float32", Access("s", 0, (N, 1))),
        Op("2", "add", ("0", "1")), Op("3", "store", ("2",), "float32", Access("o", 0, (N, 1)))),
        (_buf("p"), _buf("s"), _buf("o")))
    step = _step([_matmul(), shifted], ["mm", "add"])
    assert fuse_epilogues(step) == step
    step = _step([_matmul(), _add("add", "p", "s", "o"), _add("again", "p", "s", "q")], ["mm", "add", "again"],
                 outputs=("o", "q"))
    assert fuse_epilogues(step) == step


# ---- the builder's epilogue against torch -------------------------------------------------

def _epilogue(out_dtype: str, dtype: str) -> Epilogue:
    """o1 = (product + r) * row, o2 = float32(product) - r."""
    return Epilogue((
        Op("p", "product", dtype=out_dtype), Op("f", "to_dtype", ("p",), "float32"),
        Op("r", "load", (), dtype, attrs={"input": 0}), Op("w", "load", (), dtype, attrs={"input": 1}),
        Op("s", "add", ("f", "r")), Op("t", "mul", ("s", "w")), Op("u", "sub", ("f", "r")),
        Op("o1", "store", ("t",), dtype, attrs={"output": 0}),
        Op("o2", "store", ("u",), "float32", attrs={"output": 1})),
        (), (dtype, dtype), (), (dtype, "float32"))


def test_the_swiglu_epilogue_needs_two_temporaries():
    """SiLU(gate) * up as Inductor writes it (gate converted to fp32 twice): the repeated
    conversion is computed once, the sigmoid's chain overwrites its own temporary, and the
    product of the two, read only by the store, is written into the staging tile. Two fp32
    tile temporaries, not three: the room a larger matmul tile needs."""
    from spyre_rt.construct.matmul import epilogue

    ep = swiglu_up(64, 64, 64)[1].epilogue
    plan = epilogue.plan(ep)
    assert [op.id for op in plan.ops if op.op == "to_dtype"] == ["a", "s"]
    assert plan.ops[2].args == ("a",)                       # neg reads the one conversion
    assert plan.ntemps == 2 and plan.temp["c"] == plan.temp["d"] == plan.temp["e"]
    assert plan.stored == {"y": 0} and "y" not in plan.temp
    assert plan.instrs == 8                                 # the conversion once, no move for the store
    body = epilogue.program(ep, plan, 0, 0, epilogue.Operand(epilogue.TILE, "float32", 0, 64), [1000, 2000], 64,
                            [(3000, 64)], [(4000, 64)])
    assert len(body) == plan.instrs and body[-1][6][4] == 4000   # the product lands in the staging tile
    # an fp16 value stored as fp32 keeps its own temporary and the store's move: written
    # straight into an fp32 staging tile, it would not be rounded to fp16 first
    narrowed = Epilogue((Op("x", "load", (), "float32", attrs={"input": 0}), Op("y", "to_dtype", ("x",), "float16"),
                         Op("o", "store", ("y",), "float32", attrs={"output": 0})), (), ("float32",), (), ("float32",))
    assert epilogue.plan(narrowed).stored == {} and epilogue.plan(narrowed).instrs == 2


@st.composite
def epilogue_cases(draw):
    batch = draw(st.sampled_from([1, 1, 2]))
    m = draw(st.sampled_from([1, 7, 65, 130]))
    n = draw(st.sampled_from([1, 5, 100, 130]))
    k = draw(st.sampled_from([0, 3, 100, 300]))
    return batch, m, n, k, draw(st.sampled_from(DTYPES)), draw(tilings(batch, m, n, k)), draw(st.integers(0, 999))


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(epilogue_cases())
def test_the_builders_epilogue_equals_torch_exactly(functional_card, case):
    batch, m, n, k, dtype, tiling, seed = case
    card, g = functional_card, torch.Generator().manual_seed(seed)
    a = operand("a", dtype, batch, m, k, gen=g)
    b = operand("b", dtype, batch, k, n, gen=g, transposed=True)
    p = operand("p", dtype, batch, m, n, gen=g)
    r = operand("r", dtype, batch, m, n, gen=g, col0=3)
    w = operand("w", dtype, 1, 1, n, gen=g)
    o1 = operand("o1", dtype, batch, m, n, gen=g, pad=5)
    o2 = operand("o2", torch.float32, batch, m, n, gen=g)
    w_view = View("w", w.view.offset, (batch, m, n), (0, 0, 1))
    name = dtypes.of(dtype).name
    ep = dataclasses.replace(_epilogue(name, name), inputs=(r.view, w_view), outputs=(o1.view, o2.view))
    ops = {"a": a, "b": b, "p": p, "r": r, "w": w, "o1": o1, "o2": o2}
    code = dtypes.of(dtype).code
    spec = MatmulSpec(a.view, b.view, p.view, code, code, epilogue=ep)
    ctx = BuildContext(CostModel.of_figures(card.profile), {x: o.layout for x, o in ops.items()})
    tiling = build(ctx, spec, tiling).tiling
    blob = ctx.encode()
    assert races(blob) == [], f"scratchpad races under {tiling}"
    got = launch_built(card, ctx, blob, ops, ["p", "o1", "o2"])
    prod = (a.tensor().double() @ b.tensor().double()).to(dtype).double()
    want1 = o1.values.clone()
    want2 = o2.values.clone()
    torch.as_strided(want1, o1.view.sizes, o1.view.strides, o1.view.offset).copy_(
        ((prod + r.tensor().double()) * torch.as_strided(w.values, (batch, m, n), (0, 0, 1), w.view.offset).double())
        .to(dtype))
    torch.as_strided(want2, o2.view.sizes, o2.view.strides, o2.view.offset).copy_(prod - r.tensor().double())
    assert torch.equal(got["o1"], want1), f"{tiling}: first output off"
    assert torch.equal(got["o2"], want2), f"{tiling}: second output off"
    assert torch.equal(got["p"], p.values), "the product was stored"


def _strip_case(functional_card, rows: int = 130):
    g = torch.Generator().manual_seed(3)
    a = operand("a", torch.float16, 1, rows, 64, gen=g)
    b = operand("b", torch.float16, 1, 64, 96, gen=g, transposed=True)
    p = operand("p", torch.float16, 1, rows, 96, gen=g)
    r = operand("r", torch.float16, 1, rows, 96, gen=g)
    w = operand("w", torch.float16, 1, 1, 96, gen=g)
    o1 = operand("o1", torch.float16, 1, rows, 96, gen=g)
    o2 = operand("o2", torch.float32, 1, rows, 96, gen=g)
    ep = dataclasses.replace(_epilogue("float16", "float16"), inputs=(r.view, View("w", 0, (1, rows, 96), (0, 0, 1))),
                             outputs=(o1.view, o2.view))
    ops = {"a": a, "b": b, "p": p, "r": r, "w": w, "o1": o1, "o2": o2}
    spec = MatmulSpec(a.view, b.view, p.view, dtypes.CODE["float16"], dtypes.CODE["float16"], epilogue=ep)
    return ops, spec, BuildContext(CostModel.of_figures(functional_card.profile), {x: o.layout for x, o in ops.items()})


def test_an_epilogues_temporaries_hold_one_strip_of_its_tile(functional_card):
    """A tile of 130 rows runs its epilogue 32 rows at a time: its temporaries take 32 rows
    of the scratchpad, not 130 (the room that lets the matmul keep its own tiling), and the
    program is there once per strip, the temporaries in the same place in each."""
    from spyre_rt.construct.matmul.record import Scratchpad, decide
    from spyre_rt.construct.matmul.spec import EPI_STRIP, Problem

    ops, spec, ctx = _strip_case(functional_card)
    rec = decide(ctx, spec, Tiling(1, 1, 1, 1, 1, 1, 64, 2))  # one tile of all 130 rows
    p = Problem.of(spec)
    assert p.epi_strip == EPI_STRIP and rec.cdata.epi_strip == EPI_STRIP
    lx = Scratchpad(ctx.target, spec, p, rec.tiling, 130, 96, 64)
    regions = [*lx.temps, lx.peak]
    assert lx.temps and all(hi - lo == EPI_STRIP * lx.c_pitch * 4 for lo, hi in itertools.pairwise(regions))
    rec.build(ctx)
    blob = ctx.encode()
    assert races(blob) == []
    from spyre_rt.program import program_tables

    ins = program_tables(np.asarray(blob)).instrs
    temp_dst = ins[ins["dst"]["v"] == lx.temps[0]]
    # the tile's last matmul runs in pieces (of 40 rows), each piece's program in strips of at most 32
    assert temp_dst["rows"].max() == EPI_STRIP and len(temp_dst) > -(-130 // EPI_STRIP)
    assert ins["rows"].max() <= EPI_STRIP and not ins["dst"]["reserved"].any()  # the marks stay in the record
    got = launch_built(functional_card, ctx, blob, ops, ["o1", "o2"])
    a, b, r, w, o1, o2 = (ops[x] for x in ("a", "b", "r", "w", "o1", "o2"))
    prod = (a.tensor().double() @ b.tensor().double()).half().double()
    want1, want2 = o1.values.clone(), o2.values.clone()
    torch.as_strided(want1, o1.view.sizes, o1.view.strides, o1.view.offset).copy_(
        ((prod + r.tensor().double()) * torch.as_strided(w.values, (1, 130, 96), (0, 0, 1), w.view.offset).double())
        .half())
    torch.as_strided(want2, o2.view.sizes, o2.view.strides, o2.view.offset).copy_(prod - r.tensor().double())
    assert torch.equal(got["o1"], want1) and torch.equal(got["o2"], want2)


def test_the_record_check_refuses_a_strip_too_tall_and_unknown_operand_flags(functional_card):
    from spyre_rt.construct.matmul.record import decide

    ops, spec, ctx = _strip_case(functional_card)
    rec = decide(ctx, spec)
    rec.cdata.epi_strip = 1 << 20
    with pytest.raises(SpyreError, match="epi_strip"):
        rec.build(ctx)
    rec = decide(ctx, spec)
    rec.cdata.program[0].ins.dst.reserved = 2
    with pytest.raises(SpyreError, match="flags 2 are unknown"):
        rec.build(ctx)


# ---- one load per tile ------------------------------------------------------------------------

def rms_norm_residual(x, r, w):
    h = x + r
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w, h * 0.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_a_kernel_loads_each_tile_once(dtype):
    """The kernel's nodes (the sum of squares, the scaling, the scaled residual) each load
    x and r: one load of each."""
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(37, 200, dtype=dtype, generator=g), torch.randn(37, 200, dtype=dtype, generator=g),
            torch.randn(200, dtype=dtype, generator=g))
    out, desc = _compile_and_run(rms_norm_residual, args, fuse=True)
    (k,) = _loops(desc)
    loads = [(o.access, o.dtype) for o in k.ops if o.op == "load"]
    assert len(loads) == len(set(loads)) == 3
    want = rms_norm_residual(*(a.float() for a in args))
    tol = 1e-2 if dtype == torch.float16 else 1e-5
    for mode in MODES:
        for a, b in zip(out[mode], want, strict=True):
            torch.testing.assert_close(a.float(), b, rtol=tol, atol=tol)
        assert all(_same_bits(a, b) for a, b in zip(out[mode], out["prebuilt"], strict=True))


# ---- a merged gate-and-up GEMM: two GEMMs, the activation an epilogue ----------------------


def merged_gate_up(x, w, wd):
    """vLLM's MLP: one GEMM over the gate and up weights stacked, SiluAndMul on its halves."""
    y = x @ w.t()
    d = y.shape[-1] // 2
    return (F.silu(y[:, :d]) * y[:, d:]) @ wd.t()


def chunked_gate_up(x, w, wd):
    """A Hugging Face MLP with a merged projection (Phi-3): a 3-D input, the product chunked."""
    gate, up = (x @ w.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ wd.t()


def merged_returned(x, w, wd):
    y = x @ w.t()
    return F.silu(y[:, :65]) * y[:, 65:], y


def merged_apart(x, w, wd):
    """Two projections stacked whose halves are read apart (a Mamba block's x and z)."""
    y = x @ w.t()
    return y[:, :65] * 2, y[:, 65:] + 1


def merged_thirds(x, w, wd):
    q, k, v = (x @ w.t()).split([40, 50, 40], dim=-1)
    return q * k[:, :40] + v


MERGED = {
    "prefill": (merged_gate_up, (100, 72)),
    "decode_row": (merged_gate_up, (1, 72)),
    "chunked": (chunked_gate_up, (2, 50, 72)),
}


def _compile_with(fn, args, **options):
    torch._dynamo.reset()
    before = set(executor.live_steps())
    compiled = torch.compile(fn, backend="spyre_rt", dynamic=False, options=options)
    res = compiled(*(a.to("spyre") for a in args))
    (step,) = set(executor.live_steps()) - before
    return [t.cpu() for t in (res if isinstance(res, tuple) else (res,))], step.desc


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", list(MERGED))
def test_a_merged_gate_and_up_gemm_is_split_and_its_activation_fused(case, dtype):
    fn, x_shape = MERGED[case]
    g = torch.Generator().manual_seed(11)
    args = (torch.randn(*x_shape, dtype=dtype, generator=g), torch.randn(130, 72, dtype=dtype, generator=g),
            torch.randn(48, 65, dtype=dtype, generator=g))
    split, desc = _compile_with(fn, args)
    whole, whole_desc = _compile_with(fn, args, split_gated_gemms=False)
    matmuls = [k for k in desc.kernels.values() if isinstance(k, MatmulKernel)]
    assert len(matmuls) == 3 and len(_fused(desc)) == 1 and not _loops(desc), "the activation is not an epilogue"
    # unsplit, the activation is no epilogue: a kernel of its own, or (one row of A, its halves
    # a tile and a vector) the next GEMM's prologue
    prologues = [k for k in whole_desc.kernels.values() if isinstance(k, MatmulKernel) and k.prologue is not None]
    assert not _fused(whole_desc) and (_loops(whole_desc) or prologues), "the merged GEMM's activation is lost"
    if dtype == torch.float32:  # each element the same dot product, the activation the same ops
        assert _same_bits(split[0], whole[0])
    want = fn(*(a.double() for a in args))
    tol = 0.05 if dtype == torch.float16 else 1e-4
    for got in (split[0], whole[0]):
        assert (got.double() - want).abs().max().item() <= tol * (1 + want.abs().max().item())


def test_a_merged_gate_and_up_gemm_of_symbolic_shapes_is_split():
    """Phi-3's merged projection under Dynamo's automatic dynamic shapes: at a second batch
    size the batch is symbolic, and the halves' reshape holds it (a size node of the graph,
    which the split once handed to the fake reshape as is, failing the compile)."""
    g = torch.Generator().manual_seed(3)
    w, wd = torch.randn(130, 72, generator=g), torch.randn(48, 65, generator=g)
    torch._dynamo.reset()
    compiled = torch.compile(chunked_gate_up, backend="spyre_rt")
    for batch in (1, 2, 3):
        x = torch.randn(batch, 50, 72, generator=g)
        before = set(executor.live_steps())
        got = compiled(x.to("spyre"), w.to("spyre"), wd.to("spyre")).cpu()
        torch.testing.assert_close(got, chunked_gate_up(x, w, wd), rtol=1e-4, atol=1e-4)
        for step in set(executor.live_steps()) - before:  # each step the call built
            matmuls = [k for k in step.desc.kernels.values() if isinstance(k, MatmulKernel)]
            assert len(matmuls) == 3 and len(_fused(step.desc)) == 1, f"batch {batch}: not split"


@pytest.mark.parametrize("fn", [merged_returned, merged_apart, merged_thirds])
def test_a_merged_gemm_read_otherwise_is_left_whole(fn):
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(20, 72, generator=g), torch.randn(130, 72, generator=g), torch.randn(48, 65, generator=g))
    out, desc = _compile_with(fn, args)
    assert len([k for k in desc.kernels.values() if isinstance(k, MatmulKernel)]) == 1
    for a, b in zip(out, (fn(*args) if isinstance(fn(*args), tuple) else (fn(*args),)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---- a residual sum several ops read: computed once, in the matmul's epilogue ------------------

def residual_block(x, h, w, nw, w2):
    """A decoder layer's residual stream: the sum is read by the norm and by the next add."""
    h2 = h + (x @ w.t()) * 0.25
    n = h2.float()
    n = (n * torch.rsqrt(n.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype) * nw
    return h2 + (n @ w2.t()) * 0.25


def embedded_residual(ids, table, x, w, nw, w2):
    """The same, its stream starting from a token embedding (a gather an epilogue cannot load)."""
    return residual_block(x, F.embedding(ids, table) * 12.0, w, nw, w2)


HIDDEN = 256  # 2,048 rows of it: a sum of 1 MiB in fp16, above lowering.RESIDUAL_MIN_BYTES
RESIDUAL_ROWS = {"prefill": (2048,), "batched": (2, 1024)}


def _residual_args(rows, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*rows, 72, dtype=dtype, generator=g), torch.randn(*rows, HIDDEN, dtype=dtype, generator=g),
            torch.randn(HIDDEN, 72, dtype=dtype, generator=g) / 8, 1 + torch.rand(HIDDEN, dtype=dtype, generator=g),
            torch.randn(HIDDEN, HIDDEN, dtype=dtype, generator=g) / 16)


def _norm_loads(desc: StepDesc) -> list[str]:
    """The (M, N)-sized buffers the norm's kernel (the one reduction) loads."""
    (norm,) = [k for k in _loops(desc) if k.reduce]
    sizes = {b.name: b.sizes for b in norm.buffers}
    return sorted({o.access.buf for o in norm.ops if o.op == "load" and len(sizes[o.access.buf]) > 1})


def _close(got, want, dtype):
    tol = 0.02 if dtype == torch.float16 else 1e-5
    assert (got.double() - want).abs().max().item() <= tol * (1 + want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("rows", list(RESIDUAL_ROWS))
def test_a_residual_sum_read_twice_is_the_matmuls_epilogue(rows, dtype):
    args = _residual_args(RESIDUAL_ROWS[rows], dtype)
    fused, desc = _compile_with(residual_block, args)
    inline, inline_desc = _compile_with(residual_block, args, fuse_residuals=False)
    # fused: the first matmul stores the sum, the norm loads it alone, the second matmul adds it
    assert len(_fused(desc)) == 2 and len(_loops(desc)) == 1, "the sum is not the first matmul's epilogue"
    assert len(_norm_loads(desc)) == 1
    # inlined: the norm loads both terms, the second matmul's epilogue adds both again
    assert len(_norm_loads(inline_desc)) == 2
    if dtype == torch.float32:  # the same ops in the same order, the sum stored in fp32
        assert _same_bits(fused[0], inline[0])
    want = residual_block(*(a.double() for a in args))
    for got in (fused[0], inline[0]):
        _close(got, want, dtype)


def test_a_decode_rows_residual_sum_stays_inlined():
    """A few rows (a decode step's): the read saved is smaller than the epilogue costs."""
    args = _residual_args((4,), torch.float16)
    out, desc = _compile_with(residual_block, args)
    assert len(_norm_loads(desc)) == 2
    _close(out[0], residual_block(*(a.double() for a in args)), torch.float16)


def test_a_residual_stream_from_a_gather_stays_inlined():
    """A sum with a gathered term realized apart would be a kernel of its own, reading both
    terms and writing the sum before the norm reads it: the rule leaves it to Inductor."""
    g = torch.Generator().manual_seed(4)
    x, h, w, nw, w2 = _residual_args((2048,), torch.float32)
    args = (torch.randint(0, 50, (2048,), generator=g), torch.randn(50, HIDDEN, generator=g), x, w, nw, w2)
    out, desc = _compile_with(embedded_residual, args)
    off, off_desc = _compile_with(embedded_residual, args, fuse_residuals=False)
    assert sorted(k.kind for k in desc.kernels.values()) == sorted(k.kind for k in off_desc.kernels.values())
    assert _same_bits(out[0], off[0])
    _close(out[0], embedded_residual(*(a.double() if a.is_floating_point() else a for a in args)), torch.float32)
