"""Attentions whose masks the step proves causal (compiler/causal.py): a static cache's mask
``kv <= q + C`` with C bounded by the cache write's index check.

A Granite decoder run as `spyre-profile models` runs it (a prefill and greedy decode steps
on a static cache) gives the same bits with the pass on and off, its attentions marked
causal with the offset the cache's length leaves; an attention whose position is written
between the mask and the cache write, or whose mask is no such conjunction, is left alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from spyre_rt.compiler.causal import bound_causal_masks

from spyre_rt import config, executor
from spyre_rt.ir import Access, AttentionKernel, Buffer, LoopKernel, Op, StepDesc
from spyre_rt.profiler import models, parity


def _attentions(steps) -> list[AttentionKernel]:
    return [k for s in steps for k in s.desc.kernels.values() if isinstance(k, AttentionKernel)]


@pytest.mark.parametrize("dtype, regional", [(torch.float32, False), (torch.float16, True)],
                         ids=["fp32", "fp16_layers_compiled_once"])
def test_a_static_caches_attention_is_causal_by_its_bound_with_the_same_bits(dtype, regional, monkeypatch,
                                                                              quiet_functional_compile):
    """The mask is the model's, the cache write each layer's: with the layers compiled once,
    the write is in the region and the mask in the step that calls it."""
    from spyre_rt.regional import compile_layers_once

    fam = models.FAMILIES["granite"]
    fam = dataclasses.replace(fam, config={**fam.config, "num_hidden_layers": 2})
    cfg, model = fam.build()
    if regional:
        assert compile_layers_once(model) == 2
    runs, attns = {}, {}
    for on in (True, False):
        monkeypatch.setenv("SPYRE_RT_BOUND_CAUSAL_MASKS", "1" if on else "0")
        # plans built here: a plan file of this model another test wrote may name kernels its
        # builds refused, which then run on the host (another order of additions)
        monkeypatch.setenv("SPYRE_RT_CACHE", "0")
        config.reload()  # (the environment is read once a process)
        torch._dynamo.reset()
        before = set(executor.live_steps())
        runs[on] = parity.runner(fam, model.to(dtype).to("spyre"), cfg, dtype, "spyre", True).run(3)
        attns[on] = _attentions(set(executor.live_steps()) - before)
    # the prefill's: a decode step's one query sees every key its cache holds, nothing to skip
    prefill = [a for a in attns[True] if a.q[2][2] > 1]
    assert len(prefill) == 2 and all(a.causal and a.mask is not None and a.blocks for a in prefill)
    assert not any(a.causal for a in attns[False])
    for a in prefill:  # the cache's length less the step's queries
        assert a.q_offset == a.k[2][2] - a.q[2][2], a
    for x, y in zip(runs[True].outputs(), runs[False].outputs(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    assert runs[True].tokens == runs[False].tokens
    monkeypatch.undo()
    config.reload()


# ---- the pass on hand-made steps ------------------------------------------------------------

Q, KV = 8, 12


def _mask_kernel(c="pos", bound="le") -> LoopKernel:
    ops = [Op("c", "load", (), "int64", Access(c, 0, (0, 0))), Op("q", "index", (), "int64", Access("", 0, (1, 0))),
           Op("s", "add", ("q", "c")), Op("k", "index", (), "int64", Access("", 0, (0, 1)))]
    ops += [Op("m", "le", ("k", "s"))] if bound == "le" else [Op("m", "lt", ("k", "s"))]
    ops += [Op("p", "load", (), "bool", Access("pad", 0, (0, 1))), Op("a", "bitwise_and", ("m", "p")),
            Op("w", "store", ("a",), "bool", Access("mask", 0, (KV, 1)))]
    return LoopKernel("mk", (Q, KV), 1, False, tuple(ops),
                      (Buffer(c, "int64", (), ()), Buffer("pad", "bool", (KV,), (1,)),
                       Buffer("mask", "bool", (Q, KV), (KV, 1))))


def _scatter(c="pos", size=KV) -> LoopKernel:
    ops = (Op("c", "load", (), "int64", Access(c, 0, (0, 0))), Op("q", "index", (), "int64", Access("", 0, (1, 0))),
           Op("s", "add", ("q", "c")), Op("i", "indirect", ("s",), attrs={"size": size, "wrap_neg": True}),
           Op("v", "load", (), "float32", Access("new", 0, (16, 1))),
           Op("w", "store", ("v",), "float32", Access("cache", 0, (0, 1), (("i", 16),))))
    return LoopKernel("sc", (Q, 16), 1, False, ops,
                      (Buffer(c, "int64", (), ()), Buffer("new", "float32", (Q, 16), (16, 1)),
                       Buffer("cache", "float32", (KV, 16), (16, 1))))


def _bump(c="pos") -> LoopKernel:
    return LoopKernel("up", (), 0, False, (Op("c", "load", (), "int64", Access(c, 0, ())),
                                            Op("one", "constant", (), "int64", attrs={"value": 1}),
                                            Op("s", "add", ("c", "one")),
                                            Op("w", "store", ("s",), "int64", Access(c, 0, ()))),
                      (Buffer(c, "int64", (), ()),))


def _attention() -> AttentionKernel:
    return AttentionKernel("at", ("qb", 0, (1, 2, Q, 16), (2 * Q * 16, Q * 16, 16, 1)),
                           ("cache", 0, (1, 1, KV, 16), (KV * 16, KV * 16, 16, 1)),
                           ("cache", 0, (1, 1, KV, 16), (KV * 16, KV * 16, 16, 1)),
                           ("o", 0, (1, 2, Q, 16), (2 * Q * 16, Q * 16, 16, 1)), "float32", 0.25,
                           mask=("mask", 0, (1, 2, Q, KV), (0, 0, KV, 1)), mask_dtype="bool",
                           buffers=(Buffer("qb", "float32", (1, 2, Q, 16), (2 * Q * 16, Q * 16, 16, 1)),
                                    Buffer("cache", "float32", (KV, 16), (16, 1)),
                                    Buffer("mask", "bool", (Q, KV), (KV, 1)),
                                    Buffer("o", "float32", (1, 2, Q, 16), (2 * Q * 16, Q * 16, 16, 1))))


def _step(kernels, order) -> StepDesc:
    by = {k.name: k for k in kernels}
    bufs = {b.name: b for k in kernels for b in k.buffers}
    inputs = tuple((bufs[n], n in ("pos", "cache")) for n in ("qb", "pos", "pad", "new", "cache") if n in bufs)
    if "other" in bufs:
        inputs += ((bufs["other"], False),)
    return StepDesc(inputs=inputs, outputs=(("o", 0, (1, 2, Q, 16), (2 * Q * 16, Q * 16, 16, 1)),),
                    buffers={n: b for n, b in bufs.items() if n in ("mask", "o")}, aliases={}, constants={},
                    kernels=by, sequence=tuple(("run", n) for n in order))


def test_the_pass_marks_the_attention_causal_with_the_caches_bound(functional_card):
    step = _step([_mask_kernel(), _scatter(), _attention()], ["mk", "sc", "at"])
    got = bound_causal_masks(step).kernels["at"]
    assert got.causal and got.q_offset == KV - Q and got.blocks


@pytest.mark.parametrize("case", ["position_written_between", "strict_bound", "another_position",
                                  "no_scatter", "scatter_after"])
def test_the_pass_leaves_an_attention_it_cannot_prove_causal(case, functional_card):
    kernels, order = [_mask_kernel(), _scatter(), _attention()], ["mk", "sc", "at"]
    if case == "position_written_between":  # the cache write reads another value of C
        kernels.append(_bump())
        order = ["mk", "up", "sc", "at"]
    elif case == "strict_bound":  # kv < q + C is no conjunct this pass reads
        kernels[0] = _mask_kernel(bound="lt")
    elif case == "another_position":
        kernels[1] = _scatter(c="other")
    elif case == "no_scatter":
        kernels, order = [kernels[0], kernels[2]], ["mk", "at"]
    elif case == "scatter_after":
        order = ["mk", "at", "sc"]
    step = _step(kernels, order)
    assert not bound_causal_masks(step).kernels["at"].causal


def padded_static_cache_attention(q, k_new, k_cache, position, pad):
    """A static cache's write and a batch's mask: kv <= q + position, and each element's padding."""
    at = torch.arange(q.shape[2], device=q.device) + position
    k_cache.index_copy_(2, at, k_new)
    kv = torch.arange(k_cache.shape[2], device=q.device)
    causal = kv[None, :] <= (torch.arange(q.shape[2], device=q.device) + position)[:, None]
    mask = causal[None] & pad[:, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k_cache, k_cache, attn_mask=mask[:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_batchs_padded_masks_are_causal_by_the_bound_with_the_same_bits(dtype, quiet_functional_compile):
    """Each batch element its own mask (left padding: keys it never sees): still causal up to
    the cache's bound, the padding still applied, the same bits as the whole square."""
    g = torch.Generator().manual_seed(3)
    pad = torch.ones(3, 72, dtype=torch.bool)
    pad[1, :5], pad[2, :17] = False, False
    args = (torch.randn(3, 2, 64, 32, generator=g).to(dtype), torch.randn(3, 2, 64, 32, generator=g).to(dtype),
            torch.zeros(3, 2, 72, 32, dtype=dtype), torch.tensor(6), pad)
    outs, offsets = {}, {}
    for on in (True, False):
        torch._dynamo.reset()
        before = set(executor.live_steps())
        f = torch.compile(padded_static_cache_attention, backend="spyre_rt", dynamic=False,
                          options={"bound_causal_masks": on})
        outs[on] = f(*(a.to("spyre") for a in args)).cpu()
        (step,) = set(executor.live_steps()) - before
        offsets[on] = [k.q_offset for k in step.desc.kernels.values() if getattr(k, "causal", False)]
    assert offsets == {True: [72 - 64], False: []}
    assert torch.equal(outs[True].reshape(-1).view(torch.uint8), outs[False].reshape(-1).view(torch.uint8))
    want = padded_static_cache_attention(*(a.double() if a.is_floating_point() else a for a in args))
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    assert (outs[True].double() - want).abs().max().item() <= tol
