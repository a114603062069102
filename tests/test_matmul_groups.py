"""Grouped matmuls: matmuls of one A, each cut as it would be alone, computed as one
(compiler/grouping.py; construct/matmul/record.py and native/build_matmul.c build B and the
output in parts).

Compiled functions give the same bits grouped as apart in every dispatch mode (two
projections of one input, with and without a norm before them, fp16 and fp32, a small
Granite whose k and v projections group), and the grouped step has one matmul where there
were two; matmuls cut unlike (other widths) stay apart, and so does one that would move
past a write of what it reads. The builder's parts equal torch exactly under random
tilings with no scratchpad races, and the record's checks refuse a tile that crosses two
parts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scratchpad_races import races
from spyre_rt.compiler.grouping import group_matmuls, joined_modules
from test_epilogue_fusion import _compile_and_run, _same_bits
from test_matmul_build import launch_built, operand
from test_prologue_fusion import granite_logits

from spyre_rt import dtypes
from spyre_rt.construct.context import BuildContext
from spyre_rt.construct.matmul import MatmulSpec, Tiling, build
from spyre_rt.cost import CostModel
from spyre_rt.errors import SpyreError
from spyre_rt.ir import Buffer, LoopKernel, MatmulKernel, StepDesc


def kv(x, wk, wv):
    return x @ wk.t(), x @ wv.t()


def normed_kv(x, w, wk, wv):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return h @ wk.t(), h @ wv.t()


def unlike(x, wq, wk):
    return x @ wq.t(), x @ wk.t()


def _grouped(desc: StepDesc) -> list[MatmulKernel]:
    return [k for k in desc.kernels.values() if isinstance(k, MatmulKernel) and k.parts]


def _matmuls(desc: StepDesc) -> list[MatmulKernel]:
    return [k for k in desc.kernels.values() if isinstance(k, MatmulKernel)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("fn", [kv, normed_kv])
def test_two_projections_of_one_input_are_one_matmul(fn, dtype):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(300, 256, dtype=dtype, generator=g)
    w = [torch.randn(128, 256, dtype=dtype, generator=g) / 16 for _ in range(2)]
    args = (x, *w) if fn is kv else (x, (torch.rand(256, generator=g) + 0.5).to(dtype), *w)
    grouped, desc = _compile_and_run(fn, args, True, "group_matmuls")
    apart, apart_desc = _compile_and_run(fn, args, False, "group_matmuls")
    assert len(_matmuls(desc)) == 1 and len(_grouped(desc)) == 1 and len(_matmuls(apart_desc)) == 2
    for mode, outs in grouped.items():
        for a, b in zip(outs, apart["prebuilt"], strict=True):
            assert _same_bits(a, b), f"{fn.__name__} {mode}: grouped and apart results differ"
    want = fn(*(a.double() for a in args))
    tol = 0.05 if dtype == torch.float16 else 1e-4
    for got, w_ in zip(grouped["prebuilt"], want, strict=True):
        assert (got.double() - w_).abs().max().item() <= tol * (1 + w_.abs().max().item())


def test_matmuls_cut_unlike_stay_apart():
    g = torch.Generator().manual_seed(2)
    args = (torch.randn(300, 256, generator=g), torch.randn(512, 256, generator=g), torch.randn(64, 256, generator=g))
    out, desc = _compile_and_run(unlike, args, True, "group_matmuls")
    assert len(_matmuls(desc)) == 2 and not _grouped(desc)
    for a, b in zip(out["prebuilt"], unlike(*args), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_granite_models_k_and_v_projections_group_and_keep_their_bits(quiet_functional_compile):
    modules = []

    def count(desc):
        modules.extend(k.module for k in _grouped(desc))
        return len(_grouped(desc))

    # (this model's k rotation is a kernel of its own, which a sliced epilogue would take
    # into the k projection, leaving v alone: here the grouping is what is tried)
    logits, groups = granite_logits("group_matmuls", count, slice_epilogues=False)
    assert groups == {True: 2, False: 0}  # each layer's k and v
    assert torch.equal(logits[True].view(torch.int32), logits[False].view(torch.int32))
    # a group names every member's module: a profile by module counts v_proj's time as its own
    assert sorted(modules) == [f"model.layers.{i}.self_attn.k_proj+v_proj" for i in range(2)]


@pytest.mark.parametrize("members, joined", [
    (["model.layers.3.self_attn.k_proj", "model.layers.3.self_attn.v_proj"], "model.layers.3.self_attn.k_proj+v_proj"),
    (["m.q", "m.k", "m.q"], "m.q+k"),
    (["a.b", "a.b"], "a.b"),
    (["", "x.v"], "x.v"),
    (["p.a.b", "p.c.d"], "p.a.b+c.d"),
])
def test_a_groups_module_joins_its_members(members, joined):
    assert joined_modules(members) == joined


# ---- the pass on hand-made steps ------------------------------------------------------------

M, K, N = 64, 128, 128


def _buf(name, shape):
    return Buffer(name, "float32", shape, (shape[1], 1))


def _mm(name, b, out):
    return MatmulKernel(name, ("x", 0, (1, M, K), (0, K, 1)), (b, 0, (1, K, N), (0, 1, K)),
                        (out, 0, (1, M, N), (0, N, 1)), "float32", "float32",
                        buffers=(_buf("x", (M, K)), _buf(b, (N, K)), _buf(out, (M, N))))


def _writer(name, buf):
    from spyre_rt.ir import Access, Op

    acc = Access(buf, 0, (K, 1))
    return LoopKernel(name, (N, K), 1, False, (Op("0", "load", (), "float32", acc), Op("1", "add", ("0", "0")),
                                               Op("2", "store", ("1",), "float32", acc)), (_buf(buf, (N, K)),))


def _step(kernels, order):
    return StepDesc(inputs=((_buf("x", (M, K)), False), (_buf("w1", (N, K)), True), (_buf("w2", (N, K)), True)),
                    outputs=(("o1", 0, (M, N), (N, 1)), ("o2", 0, (M, N), (N, 1))),
                    buffers={"o1": _buf("o1", (M, N)), "o2": _buf("o2", (M, N))}, aliases={}, constants={},
                    kernels={k.name: k for k in kernels}, sequence=tuple(("run", n) for n in order))


def test_the_reference_evaluation_of_a_grouped_matmul_gives_each_parts_bits():
    from test_prologue_fusion import _on_host

    step = _step([_mm("m1", "w1", "o1"), _mm("m2", "w2", "o2")], ["m1", "m2"])
    apart, grouped = _on_host(step), _on_host(group_matmuls(step))
    assert torch.equal(apart["o1"], grouped["o1"]) and torch.equal(apart["o2"], grouped["o2"])


def test_the_pass_groups_and_does_not_move_a_member_past_a_write_of_what_it_reads():
    step = _step([_mm("m1", "w1", "o1"), _mm("m2", "w2", "o2")], ["m1", "m2"])
    grouped = group_matmuls(step)
    assert grouped.sequence == (("run", "m1"),)
    assert grouped.kernels["m1"].parts == ((step.kernels["m2"].b, step.kernels["m2"].out),)
    # w2 is written between the two: the second cannot run at the first one's place
    step = _step([_mm("m1", "w1", "o1"), _writer("w", "w2"), _mm("m2", "w2", "o2")], ["m1", "w", "m2"])
    assert group_matmuls(step) == step


# ---- the builder's parts against torch ------------------------------------------------------

@st.composite
def part_cases(draw):
    m = draw(st.sampled_from([1, 7, 65, 130]))
    n = draw(st.sampled_from([5, 64, 100]))
    k = draw(st.sampled_from([3, 100, 300]))
    nparts = draw(st.sampled_from([2, 3]))
    pk = draw(st.sampled_from([d for d in (1, 2, 4) if d <= k]))
    pm = draw(st.sampled_from([d for d in (1, 2, 4) if d <= m]))
    pn = draw(st.sampled_from([d for d in (1, 2) if d <= n]))
    per = pn * draw(st.integers(1, max(1, min(3, n // pn))))
    tiling = Tiling(32 // (pk * pm * pn * 2) or 1, pk, pm, pn, pm, per * nparts, draw(st.sampled_from([64, 128])),
                    draw(st.sampled_from([2, 3])))
    return m, n, k, nparts, draw(st.sampled_from([torch.float16, torch.float32])), tiling, draw(st.integers(0, 99))


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(part_cases())
def test_the_builders_parts_equal_torch_exactly(functional_card, case):
    m, n, k, nparts, dtype, tiling, seed = case
    g = torch.Generator().manual_seed(seed)
    a = operand("a", dtype, 1, m, k, gen=g)
    ops = {"a": a}
    parts = []
    for i in range(nparts):
        ops[f"b{i}"] = operand(f"b{i}", dtype, 1, k, n, gen=g, transposed=True)
        ops[f"o{i}"] = operand(f"o{i}", dtype, 1, m, n, gen=g, pad=i)
        parts.append((ops[f"b{i}"].view, ops[f"o{i}"].view))
    code = dtypes.of(dtype).code
    spec = MatmulSpec(a.view, parts[0][0], parts[0][1], code, code, parts=tuple(parts[1:]))
    ctx = BuildContext(CostModel.of_figures(functional_card.profile), {x: o.layout for x, o in ops.items()})
    tiling = build(ctx, spec, tiling).tiling
    blob = ctx.encode()
    assert races(blob) == [], f"scratchpad races under {tiling}"
    got = launch_built(functional_card, ctx, blob, ops, [f"o{i}" for i in range(nparts)])
    for i in range(nparts):
        o = ops[f"o{i}"]
        want = o.values.clone()
        torch.as_strided(want, o.view.sizes, o.view.strides, o.view.offset).copy_(
            (a.tensor().double() @ ops[f"b{i}"].tensor().double()).to(dtype))
        assert torch.equal(got[f"o{i}"], want), f"{tiling}: part {i} is off"


def test_a_tile_across_two_parts_is_refused(functional_card):
    g = torch.Generator().manual_seed(1)
    ops = {"a": operand("a", torch.float16, 1, 64, 128, gen=g)}
    for i in range(2):
        ops[f"b{i}"] = operand(f"b{i}", torch.float16, 1, 128, 96, gen=g, transposed=True)
        ops[f"o{i}"] = operand(f"o{i}", torch.float16, 1, 64, 96, gen=g)
    spec = MatmulSpec(ops["a"].view, ops["b0"].view, ops["o0"].view, dtypes.CODE["float16"], dtypes.CODE["float16"],
                      parts=((ops["b1"].view, ops["o1"].view),))
    ctx = BuildContext(CostModel.of_figures(functional_card.profile), {x: o.layout for x, o in ops.items()})
    from spyre_rt.construct.matmul.record import decide

    rec = decide(ctx, spec, Tiling(8, 1, 2, 2, 2, 4, 64, 2))  # two tiles of 48 columns per part
    rec.cdata.n_size[0], rec.cdata.n_size[1] = 64, 48          # the second tile now reaches into the second part
    rec.cdata.n_size[2], rec.cdata.n_size[3] = 16, 64
    with pytest.raises(SpyreError, match="crosses the end of part"):
        rec.build(ctx)
