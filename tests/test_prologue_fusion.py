"""Prologue fusion: the loop kernel that makes a matmul's A, where only matmuls read it as
their A, runs inside them (compiler/prologue.py): a normalization keeps its per-row part as
a kernel that stores a few bytes a row, and each matmul rewrites its A chunks in place
(construct/matmul/record.py, native/build_matmul.c).

Compiled functions give the same bits fused as unfused in every dispatch mode (RMSNorm into
q, k and v; LayerNorm with its mean and scale; a pointwise scaling; batched rows; a decode
row; fp16 and fp32), and the fused step has no normalized tensor. What the pass must leave
alone stays apart: a normalized tensor something else reads, rows gathered from an
embedding, a kernel that would move past a write of what it reads. The builder's prologue
equals torch exactly under random tilings (split-K, buffers, strips), with no scratchpad
races, and the record's checks refuse a prologue that does not fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scratchpad_races import races
from spyre_rt.compiler.prologue import fuse_prologues
from test_epilogue_fusion import _compile_and_run as compile_and_run
from test_epilogue_fusion import _same_bits
from test_matmul_build import launch_built, operand, tilings

from spyre_rt import dispatch, dtypes, executor
from spyre_rt.construct.context import BuildContext
from spyre_rt.construct.matmul import MatmulSpec, View, build
from spyre_rt.cost import CostModel
from spyre_rt.errors import SpyreError
from spyre_rt.ir import Access, Buffer, LoopKernel, MatmulKernel, Op, Prologue, StepDesc, from_json, to_json

MODES = dispatch.NAMES


def rms_qkv(h, w, wq, wk, wv):
    """A Hugging Face RMSNorm (fp32 statistics, rounded back to h's dtype) and three
    projections of its result."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    x = w * x.to(h.dtype)
    return x @ wq.t(), x @ wk.t(), x @ wv.t()


def layer_norm_proj(h, w, b, wq):
    return F.layer_norm(h, h.shape[-1:], w, b) @ wq.t()


def scaled_proj(h, s, wq):
    return (h * s) @ wq.t()


def _qkv(m: int, k: int, batch: int = 0):
    shape = (batch, m, k) if batch else (m, k)
    return lambda dt, g: (torch.randn(*shape, dtype=dt, generator=g), (torch.rand(k, generator=g) + 0.5).to(dt),
                          torch.randn(96, k, dtype=dt, generator=g) / k ** 0.5,
                          torch.randn(32, k, dtype=dt, generator=g) / k ** 0.5,
                          torch.randn(40, k, dtype=dt, generator=g) / k ** 0.5)


CASES = {  # (function, arguments, the prologues and loop kernels of the fused step)
    "rms_qkv": (rms_qkv, _qkv(200, 136), 3, 1),
    "rms_batched": (rms_qkv, _qkv(33, 72, batch=2), 3, 1),
    "rms_decode_row": (rms_qkv, _qkv(1, 136), 3, 1),
    "layer_norm": (layer_norm_proj, lambda dt, g: (torch.randn(70, 96, dtype=dt, generator=g),
                                                   torch.randn(96, dtype=dt, generator=g),
                                                   torch.randn(96, dtype=dt, generator=g),
                                                   torch.randn(50, 96, dtype=dt, generator=g) / 10), 1, 1),
    "pointwise": (scaled_proj, lambda dt, g: (torch.randn(70, 96, dtype=dt, generator=g),
                                              torch.randn(96, dtype=dt, generator=g),
                                              torch.randn(50, 96, dtype=dt, generator=g) / 10), 1, 0),
}


def _compile_and_run(fn, args, fuse: bool):
    """{mode: outputs on the CPU}, and the step's description (each projection a matmul of its
    own: not grouped, so that they count apart)."""
    return compile_and_run(fn, args, fuse, "fuse_prologues", group_matmuls=False)


def _with_prologue(desc: StepDesc) -> list[MatmulKernel]:
    return [k for k in desc.kernels.values() if isinstance(k, MatmulKernel) and k.prologue is not None]


def _loops(desc: StepDesc) -> list[LoopKernel]:
    return [k for k in desc.kernels.values() if isinstance(k, LoopKernel)]


def _stored_elements(k: LoopKernel, desc: StepDesc) -> list[int]:
    """The elements of each buffer the kernel stores."""
    return [torch.Size(desc.buffers[o.access.buf].sizes).numel() for o in k.ops if o.op == "store"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_that_makes_a_runs_in_its_matmuls(case, dtype):
    fn, make, prologues, loops = CASES[case]
    args = make(dtype, torch.Generator().manual_seed(11))
    fused, desc = _compile_and_run(fn, args, fuse=True)
    plain, plain_desc = _compile_and_run(fn, args, fuse=False)
    assert len(_with_prologue(desc)) == prologues and len(_loops(desc)) == loops
    assert not _with_prologue(plain_desc) and len(_loops(plain_desc)) == 1
    (made,) = _loops(plain_desc)
    rows = args[0].shape[:-1].numel()
    assert _stored_elements(made, plain_desc) == [rows * args[0].shape[-1]]
    for k in _loops(desc):  # the per-row part: a value (or two) per row, not the rows
        assert set(_stored_elements(k, desc)) == {rows}
    for mode in MODES:
        for a, b in zip(fused[mode], plain["prebuilt"], strict=True):
            assert _same_bits(a, b), f"{case} {mode}: fused and unfused results differ"
    want = fn(*(a.double() for a in args))
    want = want if isinstance(want, tuple) else (want,)
    tol = 0.05 if dtype == torch.float16 else 1e-4
    for got, w in zip(fused["prebuilt"], want, strict=True):
        assert (got.double() - w).abs().max().item() <= tol * (1 + w.abs().max().item())


def normed_also_returned(h, w, wq):
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return x @ wq.t(), x


def normed_also_added(h, w, wq):
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return x @ wq.t() + x[:, :50]


def normed_embedding(ids, emb, w, wq):
    h = emb[ids]
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w) @ wq.t()


@pytest.mark.parametrize("fn", [normed_also_returned, normed_also_added, normed_embedding])
def test_what_the_pass_must_leave_alone_stays_apart(fn):
    g = torch.Generator().manual_seed(4)
    w, wq = torch.rand(96, generator=g) + 0.5, torch.randn(50, 96, generator=g) / 10
    if fn is normed_embedding:
        args = (torch.randint(0, 30, (40,), generator=g), torch.randn(30, 96, generator=g), w, wq)
    else:
        args = (torch.randn(40, 96, generator=g), w, wq)
    out, desc = _compile_and_run(fn, args, fuse=True)
    assert not _with_prologue(desc)
    want = fn(*args)
    want = want if isinstance(want, tuple) else (want,)
    for mode in MODES:
        for a, b in zip(out[mode], want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def granite_logits(option: str, count, **more) -> tuple[dict, dict]:
    """A small Granite in fp32 at 512 tokens (residual sums large enough to be realized, so
    that a norm reads one tensor), its layers compiled once as the main job compiles them,
    with `option` on and off (and the options `more`): {on: logits}, {on: count(desc) summed
    over the new steps}."""
    from transformers import GraniteConfig, GraniteForCausalLM

    from spyre_rt.regional import compile_layers_once

    cfg = GraniteConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = GraniteForCausalLM(cfg).eval().to("spyre")
    compile_layers_once(model)
    ids = torch.randint(0, 128, (1, 512)).to("spyre")
    logits, counted = {}, {}
    for on in (True, False):
        torch._dynamo.reset()
        before = set(executor.live_steps())
        f = torch.compile(lambda i: model(i).logits, backend="spyre_rt", dynamic=False, options={option: on, **more})
        with torch.no_grad():
            logits[on] = f(ids).cpu()
        counted[on] = sum(count(s.desc) for s in set(executor.live_steps()) - before)
    return logits, counted


def test_a_granite_model_gives_the_same_bits_with_its_norms_in_the_projections(quiet_functional_compile):
    """Each layer's two norms become prologues of the projections after them (q, k, v and
    gate, up), the final norm the LM head's, and the logits are bit for bit those of the
    unfused step."""
    logits, prologues = granite_logits("fuse_prologues", lambda d: len(_with_prologue(d)), group_matmuls=False)
    assert prologues == {True: 2 * (3 + 2) + 1, False: 0}
    assert torch.equal(logits[True].view(torch.int32), logits[False].view(torch.int32))


# ---- the pass on hand-made steps ------------------------------------------------------------

M, K, N = 20, 64, 30


def _buf(name, shape=(M, K)):
    return Buffer(name, "float32", shape, (shape[1], 1) if len(shape) == 2 else (1,))


def _norm(name="n", x="x", out="p"):
    """out = x * rsqrt(sum(x * x)) over (M, K), a row reduction."""
    row = lambda buf: Access(buf, 0, (K, 1))  # noqa: E731
    return LoopKernel(name, (M, K), 1, True, (
        Op("0", "load", (), "float32", row(x)), Op("1", "mul", ("0", "0")),
        Op("2", "reduction", ("1",), "float32", attrs={"kind": "sum"}), Op("3", "rsqrt", ("2",)),
        Op("4", "load", (), "float32", row(x)), Op("5", "mul", ("4", "3")),
        Op("6", "store", ("5",), "float32", row(out))), (_buf(x), _buf(out)))


def _scale(name, src, out):
    acc = lambda buf: Access(buf, 0, (K, 1))  # noqa: E731
    return LoopKernel(name, (M, K), 1, False, (
        Op("0", "load", (), "float32", acc(src)), Op("1", "mul", ("0", "0")),
        Op("2", "store", ("1",), "float32", acc(out))), (_buf(src), _buf(out)))


def _mm(name="mm", a="p"):
    return MatmulKernel(name, (a, 0, (1, M, K), (0, K, 1)), ("b", 0, (1, K, N), (0, N, 1)),
                        ("o", 0, (1, M, N), (0, N, 1)), "float32", "float32",
                        buffers=(_buf(a), _buf("b", (K, N)), _buf("o", (M, N))))


def _step(kernels, order):
    return StepDesc(inputs=((_buf("x"), True), (_buf("b", (K, N)), False)),
                    outputs=(("o", 0, (M, N), (N, 1)),), buffers={"p": _buf("p"), "o": _buf("o", (M, N))},
                    aliases={}, constants={}, kernels={k.name: k for k in kernels},
                    sequence=tuple(("run", n) for n in order))


def test_the_pass_splits_a_norm_into_its_row_part_and_a_prologue():
    step = _step([_norm(), _mm()], ["n", "mm"])
    fused = fuse_prologues(step)
    assert fused.sequence == step.sequence and "p" not in fused.buffers
    stats = fused.kernels["n"]
    (store,) = [o for o in stats.ops if o.op == "store"]
    assert [o.op for o in stats.ops] == ["load", "mul", "reduction", "rsqrt", "store"]
    assert fused.buffers[store.access.buf].sizes == (M,) and store.access.coeffs == (1, 0)
    mm = fused.kernels["mm"]
    assert mm.a == ("x", 0, (1, M, K), (0, K, 1)) and mm.prologue.inputs[0] == mm.a
    assert mm.prologue.inputs[1] == (store.access.buf, 0, (1, M, K), (0, 1, 0))   # one value per row
    assert [o.op for o in mm.prologue.ops] == ["load", "load", "mul", "store"]
    assert from_json(to_json(fused)) == fused


def _on_host(step: StepDesc, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every kernel of `step` run by its reference evaluation (what a kernel construction
    refused at a call runs) on random buffers (each buffer's values drawn from its name):
    each buffer's values after the step."""
    import zlib

    from spyre_rt import reference

    names = {b.name: b for k in step.kernels.values() for b in k.buffers}
    memory = {n: reference.Place(torch.randn(torch.Size(b.sizes).numel(),
                                             generator=torch.Generator().manual_seed(seed + zlib.crc32(n.encode()))), 0)
              for n, b in names.items()}
    for _, name in step.sequence:
        reference.run(step.kernels[name], memory)
    return {n: p.flat for n, p in memory.items()}


def test_the_reference_evaluation_of_a_prologue_gives_the_unfused_steps_bits():
    step = _step([_norm(), _mm()], ["n", "mm"])
    assert torch.equal(_on_host(step)["o"], _on_host(fuse_prologues(step))["o"])


def test_the_pass_does_not_move_the_work_past_a_write_of_what_it_reads():
    # x is written between the norm and the matmul: the elementwise part cannot run later
    step = _step([_norm(), _scale("w", "x", "x"), _mm()], ["n", "w", "mm"])
    assert fuse_prologues(step) == step
    step = _step([_norm(), _scale("w", "x", "x"), _mm()], ["w", "n", "mm"])
    assert fuse_prologues(step).kernels["mm"].prologue is not None


def test_a_fusion_that_does_not_fit_the_cards_scratchpad_leaves_the_kernels_apart():
    """On a card of 17 KiB scratchpads the plain matmul has a tiling and the fused one, its
    prologue's regions beside it, has none: the pass leaves the norm a kernel of its own
    (checked when the step compiles, not when its plan is built)."""
    from small_profiles import profile_text_with

    from spyre_rt import device_profile

    step = _step([_norm(), _mm()], ["n", "mm"])
    small = CostModel.of_figures(device_profile.parse(profile_text_with(scratchpad_mib=17 / 1024)))
    assert fuse_prologues(step, small) == step
    roomier = CostModel.of_figures(device_profile.parse(profile_text_with(scratchpad_mib=18 / 1024)))
    assert fuse_prologues(step, roomier).kernels["mm"].prologue is not None


def test_a_pointwise_kernel_is_gone_into_its_matmul():
    step = _step([_scale("s", "x", "p"), _mm()], ["s", "mm"])
    fused = fuse_prologues(step)
    assert fused.sequence == (("run", "mm"),) and fused.kernels["mm"].prologue.fused == "s"


# ---- the builder's prologue against torch -------------------------------------------------

def _prologue(dtype: str) -> Prologue:
    """A = to(dtype)(float32(x) * row) * col, in A's dtype."""
    return Prologue((
        Op("x", "load", (), dtype, attrs={"input": 0}), Op("f", "to_dtype", ("x",), "float32"),
        Op("r", "load", (), "float32", attrs={"input": 1}), Op("m", "mul", ("f", "r")),
        Op("h", "to_dtype", ("m",), dtype), Op("c", "load", (), dtype, attrs={"input": 2}),
        Op("y", "mul", ("h", "c")), Op("a", "store", ("y",), dtype, attrs={"output": 0})),
        (), (dtype, "float32", dtype))


@st.composite
def prologue_cases(draw):
    batch = draw(st.sampled_from([1, 1, 2]))
    m = draw(st.sampled_from([1, 7, 65, 130]))
    n = draw(st.sampled_from([1, 5, 100, 130]))
    k = draw(st.sampled_from([3, 100, 300]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    return batch, m, n, k, dtype, draw(tilings(batch, m, n, k)), draw(st.integers(0, 999))


def _build(card, ops, spec, tiling):
    ctx = BuildContext(CostModel.of_figures(card.profile), {x: o.layout for x, o in ops.items()})
    tiling = build(ctx, spec, tiling).tiling
    return ctx, ctx.encode(), tiling


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(prologue_cases())
def test_the_builders_prologue_equals_torch_exactly(functional_card, case):
    batch, m, n, k, dtype, tiling, seed = case
    card, g = functional_card, torch.Generator().manual_seed(seed)
    x = operand("x", dtype, batch, m, k, gen=g, col0=3)
    b = operand("b", dtype, batch, k, n, gen=g, transposed=True)
    out = operand("o", dtype, batch, m, n, gen=g)
    rows = operand("r", torch.float32, 1, 1, batch * m, gen=g)   # a value per row of A
    cols = operand("c", dtype, 1, 1, k, gen=g)                   # a value per column
    name = dtypes.of(dtype).name
    pro = dataclasses.replace(_prologue(name), inputs=(
        x.view, View("r", rows.view.offset, (batch, m, k), (m, 1, 0)), View("c", cols.view.offset, (batch, m, k),
                                                                             (0, 0, 1))))
    ops = {"x": x, "b": b, "o": out, "r": rows, "c": cols}
    code = dtypes.of(dtype).code
    spec = MatmulSpec(x.view, b.view, out.view, code, code, prologue=pro)
    ctx, blob, tiling = _build(card, ops, spec, tiling)
    assert races(blob) == [], f"scratchpad races under {tiling}"
    got = launch_built(card, ctx, blob, ops, ["o", "x"])
    r = torch.as_strided(rows.values, (batch, m, 1), (m, 1, 0), rows.view.offset)
    c = torch.as_strided(cols.values, (1, 1, k), (0, 0, 1), cols.view.offset)
    a = ((x.tensor().float() * r).to(dtype).float() * c.float()).to(dtype)
    want = out.values.clone()
    torch.as_strided(want, out.view.sizes, out.view.strides, out.view.offset).copy_(
        (a.double() @ b.tensor().double()).to(dtype))
    assert torch.equal(got["o"], want), f"{tiling}: the product of the rewritten A is off"
    assert torch.equal(got["x"], x.values), "the prologue wrote its input in DRAM"


def test_a_prologue_that_does_not_fit_is_refused_by_the_record_check(functional_card):
    g = torch.Generator().manual_seed(1)
    x = operand("x", torch.float16, 1, 64, 128, gen=g)
    b = operand("b", torch.float16, 1, 128, 64, gen=g, transposed=True)
    out = operand("o", torch.float16, 1, 64, 64, gen=g)
    cols = operand("c", torch.float16, 1, 1, 128, gen=g)
    pro = Prologue((Op("x", "load", (), "float16", attrs={"input": 0}), Op("c", "load", (), "float16",
                                                                            attrs={"input": 1}),
                    Op("y", "mul", ("x", "c")), Op("a", "store", ("y",), "float16", attrs={"output": 0})),
                   (x.view, View("c", 0, (1, 64, 128), (0, 0, 1))), ("float16", "float16"))
    spec = MatmulSpec(x.view, b.view, out.view, dtypes.CODE["float16"], dtypes.CODE["float16"], prologue=pro)
    ops = {"x": x, "b": b, "o": out, "c": cols}
    ctx = BuildContext(CostModel.of_figures(functional_card.profile), {n: o.layout for n, o in ops.items()})
    from spyre_rt.construct.matmul.record import decide

    rec = decide(ctx, spec)
    vectors = rec.cdata.pro_vectors
    vectors[0].lx[0] = ctx.target.scratchpad_bytes - 64  # a vector region past the scratchpad's end
    with pytest.raises(SpyreError, match="pro_vectors"):
        rec.build(ctx)
