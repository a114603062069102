"""Epilogues in column slices (compiler/slicing.py): a rotary embedding on a projection's
heads runs as the projection's epilogue, bit for bit what the kernels apart compute.

A rotate-half reads each head's other half, and the table's angle repeats for every head:
the kernel's masks and selections are decided in each slice of a head's columns, and the
matmul's tiles are cut in whole heads. Fused and unfused give the same bits in every
dispatch mode, in fp16 and fp32, at head sizes 64 and 128, with rows off the grid and a
batch; `slice_epilogues=False` keeps the kernels apart. The reference evaluation agrees,
the native record check refuses a slice wider than the tiles and a per-row load whose
columns are not one value, and a body the slices cannot decide stays a kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_epilogue_fusion import MODES, _compile_and_run, _fused, _loops, _same_bits

from spyre_rt.errors import SpyreError
from spyre_rt.ir import MatmulKernel


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_projection(x, w, pos, inv_freq, heads: int):
    """Hugging Face's rotary embedding applied to a query projection: (batch, heads, seq, dim)."""
    b, s, _ = x.shape
    q = (x @ w.t()).view(b, s, heads, -1).transpose(1, 2)
    freqs = pos[:, :, None].float() * inv_freq[None, None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    return q * cos + _rotate_half(q) * sin


def _args(dtype, batch: int, seq: int, hidden: int, heads: int, dim: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, hidden, dtype=dtype, generator=g)
    w = torch.randn(heads * dim, hidden, dtype=dtype, generator=g) * hidden ** -0.5
    pos = torch.arange(seq).repeat(batch, 1) + 3
    inv_freq = (1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)).to(dtype)
    return x, w, pos, inv_freq


def _rope(heads):
    def fn(x, w, pos, inv_freq):
        return rope_projection(x, w, pos, inv_freq, heads)
    return fn


def _sliced(desc) -> list[MatmulKernel]:
    return [k for k in _fused(desc) if k.epilogue.slices]


SHAPES = {  # batch, seq, hidden, heads, head dim
    "dim128": (1, 40, 256, 4, 128),
    "dim64_batch2": (2, 33, 192, 6, 64),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_rotary_embedding_runs_as_its_projections_epilogue_with_the_same_bits(shape, dtype):
    batch, seq, hidden, heads, dim = SHAPES[shape]
    args = _args(dtype, batch, seq, hidden, heads, dim)
    fn = _rope(heads)
    options = {"fuse_prologues": False, "group_matmuls": False}
    fused, desc = _compile_and_run(fn, args, fuse=True, **options)
    plain, plain_desc = _compile_and_run(fn, args, fuse=False, option="slice_epilogues", **options)
    (mm,) = _sliced(desc)
    assert mm.epilogue.period == dim and mm.epilogue.slice_cols == dim // 2
    assert any(op.attrs.get("shift") for body in mm.epilogue.slices for op in body)  # the other half
    assert not _sliced(plain_desc) and any(k.shape == "pointwise" for k in _loops(plain_desc))
    assert len(desc.kernels) < len(plain_desc.kernels)
    for mode in MODES:
        assert _same_bits(fused[mode][0], plain["prebuilt"][0]), f"{mode}: fused and unfused results differ"
    want = fn(*(a.double() if a.is_floating_point() else a for a in args))
    got = fused["prebuilt"][0].double()
    tol = 0.02 if dtype == torch.float16 else 1e-4
    assert (got - want).abs().max().item() <= tol * (1 + want.abs().max().item())


def _on_host(step, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every kernel of `step` by its reference evaluation (what runs when construction
    refuses one at a call), on buffers of values drawn from their names."""
    import zlib

    from spyre_rt import reference
    from spyre_rt.dtypes import torch_dtype

    memory = {}
    for b in {b.name: b for k in step.kernels.values() for b in k.buffers}.values():
        g = torch.Generator().manual_seed(seed + zlib.crc32(b.name.encode()))
        n = torch.Size(b.sizes).numel()
        dt = torch_dtype(b.dtype)
        flat = torch.randn(n, generator=g).to(dt) if dt.is_floating_point else torch.randint(0, 50, (n,), generator=g)
        memory[b.name] = reference.Place(flat.to(dt), 0)
    for kind, name in step.sequence:
        if kind == "run":
            reference.run(step.kernels[name], memory)
    return {n: p.flat for n, p in memory.items()}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_the_reference_evaluation_of_a_sliced_epilogue_gives_the_unfused_steps_bits(dtype):
    """The host's evaluation of a step's kernels (what a kernel construction refuses runs
    as) computes a sliced body slice by slice, as the kernels apart compute it."""
    from spyre_rt.compiler.fusion import fuse_epilogues

    args = _args(dtype, 1, 40, 256, 4, 128, seed=9)
    _, plain = _compile_and_run(_rope(4), args, fuse=False, option="slice_epilogues", fuse_prologues=False)
    fused = fuse_epilogues(plain)
    (mm,) = _sliced(fused)
    out = mm.epilogue.outputs[0][0]
    assert _same_bits(_on_host(fused)[out], _on_host(plain)[out])


def rotate_within_a_quarter(x, w):
    """A mask every slice of the innermost variable cuts: a rotation by a quarter of 128."""
    y = (x @ w.t()).view(x.shape[0], -1, 128)
    return torch.cat((-y[..., 32:], y[..., :32]), dim=-1) * 2 + y


def test_a_body_the_slices_cannot_decide_stays_a_kernel_and_right():
    g = torch.Generator().manual_seed(2)
    args = (torch.randn(20, 64, generator=g), torch.randn(256, 64, generator=g))
    fused, desc = _compile_and_run(rotate_within_a_quarter, args, fuse=True)
    want = rotate_within_a_quarter(*args)
    assert torch.allclose(fused["prebuilt"][0], want, atol=1e-4, rtol=1e-4)
    for k in _sliced(desc):  # if sliced at all, then in slices that decide every mask
        assert k.epilogue.slice_cols <= 32


def test_the_record_check_refuses_a_slice_wider_than_the_tiles_and_a_per_row_load_of_columns():
    from spyre_rt import card
    from spyre_rt.construct.context import BuildContext
    from spyre_rt.construct.matmul import spec_of
    from spyre_rt.construct.matmul.record import decide
    from spyre_rt.cost import CostModel
    from spyre_rt.dtypes import ITEMSIZE
    from spyre_rt.layout import layout_for
    from spyre_rt.native import lib

    args = _args(torch.float16, 1, 40, 256, 4, 128)
    _, desc = _compile_and_run(_rope(4), args, fuse=True, fuse_prologues=False, group_matmuls=False)
    (mm,) = _sliced(desc)
    target = CostModel.of_figures(card.card_set().profile)
    layouts = {b.name: layout_for(b.sizes, b.strides, torch.Size(b.sizes).numel(), ITEMSIZE[b.dtype])
               for b in mm.buffers}
    ctx = BuildContext(target, layouts)
    rec = decide(ctx, spec_of(mm))
    assert any(rec.cdata.program[i].ins.cols for i in range(rec.cdata.ninstrs))
    rec.cdata.program[0].ins.cols = 1 << 20
    with pytest.raises(SpyreError, match="columns"):
        rec.build(ctx)
    rec = decide(BuildContext(target, layouts), spec_of(mm))
    per_row = next(i for i in range(rec.cdata.nloads) if rec.cdata.loads[i].row == lib.SPY_MM_TILES_PER_ROW)
    rec.cdata.loads[per_row].view.strides[2] = 1
    with pytest.raises(SpyreError, match="not a kind of loaded tile"):
        rec.build(BuildContext(target, layouts))


# ---- the builder's sliced epilogue against torch ----------------------------------------------

def _half(shift: int, at: int, negate: bool):
    """A slice's body: (product * table + partner * vector) * per-row value, the partner the
    product `shift` columns away (negated in the first half of a period)."""
    from spyre_rt.ir import Op

    partner = "n" if negate else "x"
    return (Op("p", "product", dtype="float16"), Op("x", "product", dtype="float16", attrs={"shift": shift}),
            *((Op("n", "neg", ("x",)),) if negate else ()),
            Op("c", "load", dtype="float16", attrs={"input": 1, "at": at}), Op("y", "mul", ("p", "c")),
            Op("w", "load", dtype="float16", attrs={"input": 2, "at": 0}), Op("z", "mul", (partner, "w")),
            Op("r", "load", dtype="float32", attrs={"input": 0}), Op("t", "add", ("y", "z")),
            Op("u", "mul", ("t", "r")), Op("v", "store", ("u",), attrs={"output": 0}))


@pytest.mark.parametrize("rows, tiling", [(130, None), (130, (1, 1, 1, 1, 1, 2, 64, 2)), (40, (1, 2, 1, 1, 2, 2, 32, 2))],
                         ids=["chosen", "one_tall_tile_in_strips", "split_k"])
def test_the_builders_sliced_epilogue_equals_torch(functional_card, rows, tiling):
    """Every kind of load a sliced body reads (values per row, a table of one period per row,
    a vector of one period) and the product half a period away, on tiles of whole periods:
    one tall tile run in strips of 32 rows and pieces, split-K, the cost model's choice."""
    from scratchpad_races import races
    from test_matmul_build import launch_built, operand

    from spyre_rt import dtypes
    from spyre_rt.construct.context import BuildContext
    from spyre_rt.construct.matmul import MatmulSpec, Tiling, View, build
    from spyre_rt.cost import CostModel
    from spyre_rt.ir import Epilogue

    n, k = 256, 64
    g = torch.Generator().manual_seed(rows)
    a = operand("a", torch.float16, 1, rows, k, gen=g)
    b = operand("b", torch.float16, 1, k, n, gen=g, transposed=True)
    p = operand("p", torch.float16, 1, rows, n, gen=g)
    s = operand("s", torch.float32, 1, 1, rows, gen=g)
    c = operand("c", torch.float16, 1, rows, 128, gen=g)
    w = operand("w", torch.float16, 1, 1, 64, gen=g)
    o = operand("o", torch.float16, 1, rows, n, gen=g)
    ep = Epilogue((), (View("s", s.view.offset, (1, rows, n), (0, 1, 0)), View("c", c.view.offset, (1, rows, 128),
                                                                               (0, c.row_len, 1)),
                       View("w", w.view.offset, (1, 1, 64), (0, 0, 1))), ("float32", "float16", "float16"),
                  (o.view,), ("float16",), slices=(_half(64, 0, True), _half(-64, 64, False)), slice_cols=64,
                  periodic=(1, 2))
    ops = {"a": a, "b": b, "p": p, "s": s, "c": c, "w": w, "o": o}
    spec = MatmulSpec(a.view, b.view, p.view, dtypes.CODE["float16"], dtypes.CODE["float16"], epilogue=ep)
    ctx = BuildContext(CostModel.of_figures(functional_card.profile), {x: op.layout for x, op in ops.items()})
    rec = build(ctx, spec, Tiling(*tiling) if tiling else None)
    assert n // rec.tiling.n_tiles % 128 == 0  # tiles of whole periods
    if tiling:
        assert rec.tiling == Tiling(*tiling)
    blob = ctx.encode()
    assert races(blob) == []
    got = launch_built(functional_card, ctx, blob, ops, ["o"])["o"]
    prod = (a.tensor().double() @ b.tensor().double()).half().float()[0]
    partner = torch.cat([torch.cat((-prod[:, h + 64:h + 128], prod[:, h:h + 64]), 1) for h in range(0, n, 128)], 1)
    table = c.tensor()[0].float().repeat(1, n // 128)
    vector = w.tensor()[0, 0].float().repeat(n // 64)
    per_row = s.tensor()[0, 0].float()[:, None]
    want = o.values.clone()
    torch.as_strided(want, o.view.sizes, o.view.strides, o.view.offset).copy_(
        ((prod * table + partner * vector) * per_row).half()[None])
    assert torch.equal(got, want)


def test_a_rotation_whose_projection_would_need_other_tiles_stays_a_kernel_and_right():
    """At 24 rows by 256 columns the matmul alone takes tiles that are not whole heads: the
    sliced epilogue would need another tiling, which is not worth its risk (fusion._pays),
    so the rotation stays a kernel of its own."""
    from spyre_rt.compiler.fusion import _fusion

    from spyre_rt import card
    from spyre_rt.construct.matmul import Problem, spec_of
    from spyre_rt.construct.matmul.record import exact_tiling
    from spyre_rt.construct.matmul.tiling import choose
    from spyre_rt.cost import CostModel

    args = _args(torch.float32, 1, 24, 128, 2, 128, seed=9)
    fused, desc = _compile_and_run(_rope(2), args, fuse=True, fuse_prologues=False)
    assert not _sliced(desc) and any(k.shape == "pointwise" for k in _loops(desc))
    rope = next(i for i, (_, n) in enumerate(desc.sequence) if getattr(desc.kernels.get(n), "shape", "") == "pointwise")
    _, mm = _fusion(desc, dict(desc.kernels), list(desc.sequence), rope)  # what the slices would be
    target = CostModel.of_figures(card.card_set().profile)
    spec = spec_of(mm)
    assert exact_tiling(target, spec) != choose(target, Problem.of(dataclasses.replace(spec, epilogue=None)))
    want = _rope(2)(*(a.double() if a.is_floating_point() else a for a in args))
    assert (fused["prebuilt"][0].double() - want).abs().max().item() <= 1e-4 * (1 + want.abs().max().item())


def rotated_pair(x, wq, wk, pos, inv_freq):
    """q and k rotated alike: Inductor computes both rotations in one loop kernel, which
    reads the other projection's other half through masked loads of its own."""
    def rope(y):
        y = y.view(1, x.shape[1], -1, 64).transpose(1, 2)
        freqs = pos[:, :, None].float() * inv_freq[None, None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        return y * cos + _rotate_half(y) * sin
    return rope(x @ wq.t()), rope(x @ wk.t())


@pytest.mark.parametrize("seq", [37, 64])
def test_a_rotation_that_also_reads_another_tensors_other_half_is_right(seq):
    """A slice cannot take the other tensor's masked loads (its tiles would be loaded from
    before the tensor's first column): the kernel stays whole or apart, and right (this once
    failed the compile with a negative view offset)."""
    g = torch.Generator().manual_seed(seq)
    args = (torch.randn(1, seq, 256, generator=g), torch.randn(256, 256, generator=g) / 16,
            torch.randn(256, 256, generator=g) / 16, torch.arange(seq)[None], 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64))
    got, _ = _compile_and_run(rotated_pair, args, fuse=True)
    for a, b in zip(got["prebuilt"], rotated_pair(*args), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_decode_rows_rotation_over_wide_tiles_stays_a_kernel_within_the_program_limit():
    """One row (a decode step) of 32 heads of 64 in fp16: the projection's tiles are 1,024
    columns wide, 32 slices whose bodies would make a per-tile program past the card's 256
    instructions (the build failed). The pass counts it and keeps the rotation a kernel; at
    four rows the tiles are narrower and it fuses. A user trial's find."""
    for rows, fused in ((1, False), (4, True)):
        args = _args(torch.float16, 1, rows, 2048, 32, 64, seed=rows)
        got, desc = _compile_and_run(_rope(32), args, fuse=True, fuse_prologues=False)
        assert bool(_sliced(desc)) == fused, rows
        want = _rope(32)(*(a.double() if a.is_floating_point() else a for a in args))
        assert (got["prebuilt"][0].double() - want).abs().max().item() <= 0.02 * (1 + want.abs().max().item())
