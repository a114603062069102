"""Attention on the card: ``F.scaled_dot_product_attention`` as one kernel.

* Parity: compiled on spyre in every dispatch mode (bit for bit alike) against CPU eager,
  over shapes off the 64 grid, grouped-query ratios 1, 4 and 8, one query row and a
  thousand, causal, boolean, additive, per-head and padding masks, fp32 and fp16.
* The Hugging Face pattern (``repeat_kv``, a boolean mask made from the cache position,
  ``transpose(1, 2).contiguous()``) becomes one attention kernel that reads the static
  cache in place and whose output the next matmul reads as it lies.
* The builder, run directly on a functional card: causal masks with a query offset
  (decode against a longer cache), keys split over cores and combined over the ring.
* The tiling: decode spreads one KV head's keys over several cores; every choice fits
  the scratchpad; prefill keeps every core busy.
* Dynamic shapes: a symbolic sequence length compiles once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from spyre_rt import card as cards
from spyre_rt import device_profile, dispatch, dtypes, executor, fallback, jobs
from spyre_rt.construct import attention as A
from spyre_rt.construct.context import BuildContext
from spyre_rt.cost import CostModel
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.errors import SpyreError
from spyre_rt.ir import AttentionKernel, LoopKernel
from spyre_rt.layout import StickLayout
from spyre_rt.native import ffi, lib
from spyre_rt.program import block_sections

MODES = dispatch.NAMES  # every dispatch mode, from the table
F32, F16 = torch.float32, torch.float16
# fp32: both sides sum in fp32 in other orders (see SUMS in test_ops); fp16: two ulps
TOL = {F32: (1e-5, 2e-5), F16: (2e-3, 2e-3)}


@pytest.fixture(autouse=True)
def functional():
    with cards.configured(sim_mode="functional") as cs:
        yield cs


# ---- parity against CPU eager ---------------------------------------------------------------


def causal_from(q_len: int, kv_len: int, offset: int) -> torch.Tensor:
    """Hugging Face's mask over a static cache: key j for query i when j <= i + offset."""
    return (torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + offset)[None, None]


def padding(b: int, kv_len: int) -> torch.Tensor:
    """A padding mask per batch element: the first 3 * i keys of element i are padding."""
    keep = torch.arange(kv_len)[None, :] >= 3 * torch.arange(b)[:, None]
    return keep[:, None, None, :]


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    dim: int
    mask: str = ""          # "", "padding", "hf", "float", "per_head", "2d", "empty_rows"
    causal: bool = False
    scale: float | None = None
    dtypes: tuple = (F32, F16)

    def inputs(self, dtype, g):
        b, h, kv = self.batch, self.heads, self.kv_heads
        q = torch.randn(b, h, self.q_len, self.dim, generator=g).to(dtype)
        k = torch.randn(b, kv, self.kv_len, self.dim, generator=g).to(dtype)
        v = torch.randn(b, kv, self.kv_len, self.dim, generator=g).to(dtype)
        return q, k, v, self.make_mask(dtype, g)

    def make_mask(self, dtype, g):
        lq, lk = self.q_len, self.kv_len
        if self.mask == "padding":
            return padding(self.batch, lk)
        if self.mask == "hf":
            return causal_from(lq, lk, lk - lq - 5)
        if self.mask == "float":
            m = torch.randn(self.batch, 1, lq, lk, generator=g).to(dtype)
            return m.masked_fill(~causal_from(lq, lk, lk - lq), float("-inf"))
        if self.mask == "per_head":
            m = torch.rand(self.batch, self.heads, lq, lk, generator=g) < 0.6
            m[..., 0] = True
            return m
        if self.mask == "2d":
            return torch.rand(lq, lk, generator=g) < 0.5
        if self.mask == "empty_rows":  # rows that see no key: torch's CPU kernel gives 0
            m = causal_from(lq, lk, 0).clone()
            m[..., 1::3, :] = False
            return m
        return None


CASES = [
    Case("mha_causal_ragged", 2, 3, 3, 70, 70, 72, causal=True),
    Case("gqa4_decode_padding", 2, 8, 2, 1, 1000, 100, mask="padding"),
    Case("gqa8_prefill_1000_causal", 1, 8, 1, 1000, 1000, 64, causal=True),
    Case("gqa4_chunk_against_static_cache", 1, 8, 2, 37, 130, 40, mask="hf"),
    Case("gqa4_prefill_keys_shared_by_cores", 1, 8, 2, 300, 310, 64, mask="hf"),
    Case("gqa4_float_mask", 1, 4, 1, 50, 77, 64, mask="float"),
    Case("per_head_mask", 1, 4, 2, 20, 65, 32, mask="per_head", dtypes=(F32,)),
    Case("mask_2d", 2, 2, 2, 9, 33, 33, mask="2d", dtypes=(F32,)),
    Case("rows_without_keys", 1, 4, 4, 12, 12, 16, mask="empty_rows", dtypes=(F32,)),
    Case("gqa8_decode_1000_scaled", 1, 16, 2, 1, 1000, 128, scale=0.3),
]


def _params():
    for case in CASES:
        for dtype in case.dtypes:
            yield pytest.param(case, dtype, id=f"{case.name}-{str(dtype).removeprefix('torch.')}")


def sdpa(case: Case):
    def f(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=case.causal, scale=case.scale,
                                              enable_gqa=case.heads != case.kv_heads)
    return f


def attention_kernels(step) -> list[AttentionKernel]:
    (exe,) = step.executables()
    return [k for k in exe.desc.kernels.values() if isinstance(k, AttentionKernel)]


@pytest.mark.parametrize(("case", "dtype"), list(_params()))
def test_attention_matches_cpu_eager_in_every_dispatch_mode(case, dtype):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(len(case.name))
    q, k, v, mask = case.inputs(dtype, g)
    f = sdpa(case)
    want = f(q, k, v, mask)
    compiled = torch.compile(f, backend="spyre_rt", dynamic=False, fullgraph=True)
    before = set(executor.live_steps())
    eager = sum(fallback.calls.values())
    outs = {}
    for mode in MODES:
        args = [x.to("spyre") if x is not None else None for x in (q, k, v, mask)]
        with dispatch_mode(mode):
            outs[mode] = compiled(*args).cpu()
    assert sum(fallback.calls.values()) == eager, "an op ran as an eager CPU fallback"
    (step,) = set(executor.live_steps()) - before
    assert len(attention_kernels(step)) == 1
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(outs["prebuilt"], want, rtol=rtol, atol=atol)
    for mode in (m for m in MODES if m != "prebuilt"):
        assert torch.equal(outs[mode].view(torch.uint8), outs["prebuilt"].view(torch.uint8)), mode


# ---- the Hugging Face pattern ---------------------------------------------------------------


class _Attention(torch.nn.Module):
    num_key_value_groups = 4
    is_causal = True


def hf_layer(q, cache_k, cache_v, position, o_proj):
    """Hugging Face's SDPA attention over a static cache, then the output projection."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, kv_len = q.shape[2], cache_k.shape[2]
    q_pos = torch.arange(q_len, device=q.device) + position
    mask = (torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None])[None, None]
    out, _ = sdpa_attention_forward(_Attention(), q, cache_k, cache_v, mask, scaling=0.125)
    return out.reshape(1, q_len, -1) @ o_proj


@pytest.mark.parametrize("q_len", [1, 6])
def test_hugging_face_attention_reads_the_cache_in_place_and_its_output_as_it_lies(q_len):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(q_len)
    heads, kv_heads, dim, kv_len = 8, 2, 64, 24
    q = torch.randn(1, heads, q_len, dim, generator=g)
    ck, cv = (torch.randn(1, kv_heads, kv_len, dim, generator=g) for _ in range(2))
    w = torch.randn(heads * dim, 32, generator=g) / 16
    position = torch.tensor(kv_len - q_len - 2)
    want = hf_layer(q, ck, cv, position, w)
    before = set(executor.live_steps())
    f = torch.compile(hf_layer, backend="spyre_rt", dynamic=False, fullgraph=True)
    got = f(*(x.to("spyre") for x in (q, ck, cv, position, w))).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    (step,) = set(executor.live_steps()) - before
    (exe,) = step.executables()
    (att,) = attention_kernels(step)
    inputs = {b.name for b, _ in exe.desc.inputs}
    cache_k, cache_v = att.k[0], att.v[0]
    assert {cache_k, cache_v} <= inputs, "attention reads a copy of the cache"
    for kernel in exe.desc.kernels.values():
        if isinstance(kernel, LoopKernel):  # the mask; no repeat_kv copy, no transpose of the output
            touched = {b.name for b in kernel.buffers}
            assert not touched & {cache_k, cache_v, att.out[0]}, f"a loop kernel copies {touched}"


# ---- the builder, run directly -------------------------------------------------------------


@pytest.fixture(scope="module")
def card():
    return cards.Card(device_profile.load("spyre"), "functional", 0)


def _upload(card, values: torch.Tensor, row_len: int) -> tuple[int, StickLayout]:
    layout = StickLayout(values.numel() // row_len, row_len, values.element_size())
    raw = np.zeros(layout.nbytes, np.uint8)
    phys = layout.phys(np.arange(values.numel()))
    raw[(phys[:, None] + np.arange(layout.itemsize)).ravel()] = values.reshape(-1).view(torch.uint8).numpy()
    addr = card.malloc(layout.nbytes)
    card.write(addr, raw.tobytes())
    return addr, layout


def _download(card, addr: int, layout: StickLayout, like: torch.Tensor) -> torch.Tensor:
    raw = np.frombuffer(card.read(addr, layout.nbytes), np.uint8)
    phys = layout.phys(np.arange(like.numel()))
    return torch.from_numpy(raw[(phys[:, None] + np.arange(layout.itemsize)).ravel()].copy()).view(like.dtype)


def run_direct(card, q, k, v, *, causal=False, q_offset=0, mask=None, tiling=None, blocks=()):
    """The builder's program for one attention, on the card; (output, tiling, program)."""
    batch, heads, q_len, dim = q.shape
    out = torch.zeros(batch, q_len, heads, v.shape[-1], dtype=q.dtype)
    host = {"q": q, "k": k, "v": v, "out": out} | ({"mask": mask} if mask is not None else {})
    views = {n: (n, 0, tuple(t.shape), tuple(t.stride())) for n, t in host.items()}
    views["out"] = ("out", 0, (batch, heads, q_len, out.shape[-1]), tuple(out.transpose(1, 2).stride()))
    if mask is not None:
        m = mask.expand(batch, heads, q_len, k.shape[2])
        views["mask"] = ("mask", 0, tuple(m.shape), tuple(m.stride()))
    kernel = AttentionKernel("attention", views["q"], views["k"], views["v"], views["out"], dtypes.name(q.dtype),
                             1 / math.sqrt(dim), causal, q_offset, views.get("mask"),
                             dtypes.name(mask.dtype) if mask is not None else "", blocks=blocks)
    return _launch(card, kernel, host, tiling)


def _launch(card, kernel, host: dict, record=None):
    """`kernel` built and run once on the card over the host tensors `host` (each its own
    buffer; "out" (batch, q_len, heads, dim)); (output as (batch, heads, q_len, dim), the
    decision record, the program)."""
    placed = {n: _upload(card, t.contiguous(), t.shape[-1]) for n, t in host.items()}
    ctx = BuildContext(CostModel.of_figures(card.profile), {n: lay for n, (_, lay) in placed.items()})
    record = A.build(ctx, kernel, record)
    blob = ctx.encode()
    try:
        program = jobs.ResidentProgram(card, blob, "attention")
        try:
            program.launch([placed[n][0] for n in ctx.buffers()])
            card.synchronize()
        finally:
            program.free()
        out = host["out"]
        got = _download(card, *placed["out"], out).view(out.shape).transpose(1, 2)
    finally:
        for addr, _ in placed.values():
            card.free(addr)
    return got, record, blob


def _no_races(blob):
    """The scratchpad race detector of the matmul tests, where the tree has it."""
    try:
        from scratchpad_races import races
    except ImportError:
        return
    assert races(blob) == []


@pytest.mark.parametrize(("q_len", "kv_len", "offset"), [(1, 300, 299), (5, 300, 295), (40, 700, 600),
                                                         (64, 64, -10)])
def test_causal_with_a_query_offset_keeps_each_querys_keys_up_to_its_position(card, q_len, kv_len, offset):
    g = torch.Generator().manual_seed(kv_len)
    q = torch.randn(1, 8, q_len, 40, generator=g)
    k, v = (torch.randn(1, 2, kv_len, 40, generator=g) for _ in range(2))
    got, tiling, blob = run_direct(card, q, k, v, causal=True, q_offset=offset)
    keep = (torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + offset)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
    _no_races(blob)


def test_a_task_split_over_cores_is_combined_over_the_ring(card):
    """Decode of two KV heads: each head's keys on 16 cores, combined on the first."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 1, 64, generator=g).half()
    k, v = (torch.randn(1, 2, 2100, 64, generator=g).half() for _ in range(2))
    mask = torch.rand(1, 1, 1, 2100, generator=g) < 0.9
    got, tiling, blob = run_direct(card, q, k, v, mask=mask)
    assert tiling.tasks[:, A.PARTS].max() == 16 and len(np.unique(tiling.tasks[:, A.CORE])) == 32
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
    _no_races(blob)


def test_cores_of_a_kv_head_share_its_keys_over_the_ring(card):
    """Prefill with a mask: the tiles of a KV head are dealt to a group of cores that walk
    its keys together, one of them loading each block and sending it to the others."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 8, 300, 64, generator=g).half()
    k, v = (torch.randn(1, 2, 310, 64, generator=g).half() for _ in range(2))
    mask = causal_from(300, 310, 10)
    got, tiling, blob = run_direct(card, q, k, v, mask=mask)
    tasks = tiling.tasks
    assert (tasks[:, A.GROUP] >= 0).all() and tasks[:, A.STEP].max() >= 1
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
    _no_races(blob)


@pytest.mark.parametrize("mask", [False, True], ids=["causal", "causal_and_mask"])
def test_causal_tiles_of_a_kv_head_share_its_keys_each_to_its_diagonal(card, mask):
    """Causal prefill: the tiles of a KV head walk its keys together as far as each sees,
    one member holding the most keys of each block loading it and sending the others the
    keys they hold; a step's members end at different keys."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 8, 300, 64, generator=g).half()
    k, v = (torch.randn(1, 2, 310, 64, generator=g).half() for _ in range(2))
    m = causal_from(300, 310, 10) & (torch.rand(300, 310, generator=g) > 0.1) if mask else None
    if m is not None:
        m[..., 0] = True  # every query keeps a key
    got, record, blob = run_direct(card, q, k, v, causal=True, q_offset=10, mask=m)
    tasks = record.tiling.tasks
    assert (tasks[:, A.GROUP] >= 0).all()
    ends = {}
    for t in tasks:
        ends.setdefault((int(t[A.GROUP]), int(t[A.STEP])), set()).add(int(t[A.KV1]))
    assert any(len(e) > 1 for e in ends.values())  # members of a step end at different keys
    keep = causal_from(300, 310, 10) if m is None else m
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep, enable_gqa=True)
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
    _no_races(blob)


@pytest.mark.parametrize("dtype", [F32, F16])
def test_a_causal_attention_gives_the_bits_of_its_whole_square_whatever_its_query_tiles(card, dtype):
    """What the causal bound (compiler/causal.py) relies on: with the key blocks kept, the
    blocks past a tile's diagonal add nothing to its rows, so the causal kernel in query
    tiles of any size gives the bits of the masked whole square (left padding included:
    rows whose first blocks they see none of)."""
    g = torch.Generator().manual_seed(8)
    q_len, kv_len, offset = 300, 310, 10
    q = torch.randn(1, 16, q_len, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 8, kv_len, 64, generator=g).to(dtype) for _ in range(2))
    mask = causal_from(q_len, kv_len, offset) & (torch.arange(kv_len) >= 150)  # 150 keys of padding
    whole, record, _ = run_direct(card, q, k, v, mask=mask, blocks=(64, 64))
    assert record.tiling.kv_block == 64 and record.tiling.max_parts == 1  # no row's keys split
    for rows in (16, 32, 64):
        got, causal, blob = run_direct(card, q, k, v, causal=True, q_offset=offset, mask=mask, blocks=(rows, 64))
        assert causal.tiling.q_rows == rows and causal.tiling.max_parts == 1
        assert causal.tiling.tasks[:, A.KV1].min() < kv_len  # blocks past the diagonal skipped
        assert torch.equal(got, whole), rows
        _no_races(blob)


def test_causal_tiles_are_dealt_so_the_members_of_a_group_work_alike():
    """A KV head's causal tiles see more keys the later their queries: dealt in order, the
    last core of a group would take the longest tile of every step. Each step's longest
    tile goes to the member with the least work so far."""
    shape = granite(1024, 1029, causal=True, q_offset=5, blocks=(128, 128))
    tiling = A.choose(shape, _target())
    tasks = tiling.tasks
    assert (tasks[:, A.GROUP] >= 0).all() and tasks[:, A.STEP].max() >= 1
    work = np.bincount(tasks[:, A.CORE], weights=tasks[:, A.ROWS] * (tasks[:, A.KV1] - tasks[:, A.KV0]))
    assert work.max() / work.min() < 1.05  # in order: 6:8:10:12
    for t in tasks:  # each member walks the keys of its step's tiles from the first
        assert t[A.KV0] == 0


def _decided(card, q, k, v, **kw):
    """The decision record of one attention on `card` (tiles of the cost model's choice),
    with the host tensors to launch it on: as :func:`run_direct` makes them."""
    batch, heads, q_len, dim = q.shape
    out = torch.zeros(batch, q_len, heads, v.shape[-1], dtype=q.dtype)
    host = {"q": q, "k": k, "v": v, "out": out}
    views = {n: (n, 0, tuple(t.shape), tuple(t.stride())) for n, t in host.items()}
    views["out"] = ("out", 0, (batch, heads, q_len, out.shape[-1]), tuple(out.transpose(1, 2).stride()))
    kernel = AttentionKernel("attention", views["q"], views["k"], views["v"], views["out"], dtypes.name(q.dtype),
                             1 / math.sqrt(dim), **kw)
    layouts = {n: StickLayout(t.numel() // t.shape[-1], t.shape[-1], t.element_size()) for n, t in host.items()}
    return A.decide(BuildContext(CostModel.of_figures(card.profile), layouts), kernel), kernel, host


def _loads_from(blob, slot: int) -> int:
    """Bytes the program loads from a DRAM slot (affine DMA: a run over up to 3 dims)."""
    cmds = block_sections(blob)[0]
    dma = cmds[(cmds["op"] == lib.SPY_OP_LOAD) & (cmds["src_slot"] == slot)]
    counts = np.where(np.arange(3)[None, :] < dma["ndims"][:, None], dma["count"], 1)
    return int((dma["run_bytes"].astype(np.int64) * counts.prod(axis=1)).sum())


@pytest.mark.parametrize("dtype", [F32, F16])
def test_a_kv_heads_keys_stay_resident_across_its_cores_tasks(card, dtype):
    """Causal prefill in sharing groups of several steps: each core keeps its KV head's keys
    in the scratchpad (a slot for every block of them), so each step loads only the keys
    past those of the steps before. The values are the bits of the same tiles with two
    slots, which load every step's keys again; no scratchpad races."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 16, 520, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 8, 530, 64, generator=g).to(dtype) for _ in range(2))
    record, kernel, host = _decided(card, q, k, v, causal=True, q_offset=10)
    tiling = record.tiling
    assert tiling.resident and tiling.tasks[:, A.STEP].max() >= 1
    assert record.lx.kv_slots == -(-530 // tiling.kv_block)
    two = dataclasses.replace(tiling, resident=False)
    target = CostModel.of_figures(card.profile)
    apart = A.Record(target, record.shape, two, A.Scratchpad(record.shape, target, two), record.views,
                     record.layouts, kernel.scale)
    assert apart.lx.kv_slots == 2
    got, _, blob = _launch(card, kernel, dict(host), record)
    want, _, blob2 = _launch(card, kernel, dict(host), apart)
    assert torch.equal(got, want)
    _no_races(blob)
    # K as loaded: each block once a group (but the last, again by a last step of fewer
    # members: 520 rows are 17 tiles of 32 over 4 cores), against every step's walk
    k_slot = record.slot_of["k"]
    assert _loads_from(blob, k_slot) < 0.7 * _loads_from(blob2, k_slot)
    once = 8 * 530 * 64 * dtype.itemsize  # every key of the 8 KV heads, once
    assert once <= _loads_from(blob, k_slot) < 1.05 * once
    keep = causal_from(520, 530, 10)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep, enable_gqa=True)
    torch.testing.assert_close(got.float(), ref, rtol=2e-3, atol=2e-3)


def test_the_record_check_refuses_keys_resident_where_a_slot_would_hold_two_things(card):
    """Keys resident put block j of a core's keys in slot j: the native record check refuses
    a record where that is not one thing: a slot count other than the blocks of the keys,
    a core of two KV heads, a task not starting on a block of the keys."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 16, 520, 64, generator=g)
    k, v = (torch.randn(1, 8, 530, 64, generator=g) for _ in range(2))
    record, kernel, host = _decided(card, q, k, v, causal=True, q_offset=10)
    assert record.tiling.resident

    def refused(mutate, words):
        again, _, _ = _decided(card, q, k, v, causal=True, q_offset=10)
        mutate(again)
        with pytest.raises(SpyreError, match=words):
            _launch(card, kernel, dict(host), again)

    refused(lambda r: setattr(r.c.lx, "kv_slots", r.c.lx.kv_slots + 1), "kv_slots")
    refused(lambda r: setattr(r.c.lx, "kv_slots", 1), "kv_slots 1")

    def with_tasks(change):  # the record pointed at a changed copy of its task table
        def mutate(r):
            tasks = r._keep[0].copy()
            change(tasks)
            r._keep[0] = tasks
            r.c.tasks = ffi.cast("spy_attention_task *", ffi.from_buffer(tasks))
        return mutate

    def two_heads(tasks):
        first = np.flatnonzero(tasks[:, A.CORE] == 0)
        tasks[first[-1], A.KV_HEAD] = (tasks[first[0], A.KV_HEAD] + 1) % 8

    refused(with_tasks(two_heads), "KV head")

    def off_block(tasks):
        tasks[:, A.KV0] = np.minimum(1, tasks[:, A.KV1] - 1)

    refused(with_tasks(off_block), "first key")


# ---- paged keys and values: gathered through the block table --------------------------------


def run_paged(card, q, cache, table, mask, tiling=None):
    """The builder's program for one paged attention (q (batch, heads, q_len, dim), cache
    (2, kv_heads, pages, page, dim) as serving lays it out, table (batch, width) of page
    numbers, mask (batch, 1, q_len, width * page)); (output, tiling, program)."""
    batch, heads, q_len, dim = q.shape
    _, kv_heads, pages, page, _ = cache.shape
    out = torch.zeros(batch, q_len, heads, dim, dtype=q.dtype)
    host = {"q": q, "cache": cache, "table": table, "mask": mask, "out": out}
    views = {n: (n, 0, tuple(t.shape), tuple(t.stride())) for n, t in host.items()}
    k, v = (cache[i].transpose(0, 1) for i in range(2))  # (pages, kv_heads, page, dim)
    kv_len = table.shape[1] * page
    m = mask.expand(batch, heads, q_len, kv_len)
    kernel = AttentionKernel(
        "attention", views["q"], ("cache", 0, tuple(k.shape), tuple(k.stride())),
        ("cache", cache[1].storage_offset(), tuple(v.shape), tuple(v.stride())),
        ("out", 0, (batch, heads, q_len, dim), tuple(out.transpose(1, 2).stride())), dtypes.name(q.dtype),
        1 / math.sqrt(dim), mask=("mask", 0, tuple(m.shape), tuple(m.stride())), mask_dtype="bool", page=page,
        block_table=views["table"], table_dtype=dtypes.name(table.dtype))
    return _launch(card, kernel, host, tiling)


def paged_case(g, *, batch, heads, kv_heads, q_len, width, page, pages, dim=64, dtype=F16, table_dtype=torch.int64):
    """Random queries and cache, each element's pages drawn without repeats, and its
    positions: element b's last query sits at a random length (the keys past it masked)."""
    q = torch.randn(batch, heads, q_len, dim, generator=g).to(dtype)
    cache = torch.randn(2, kv_heads, pages, page, dim, generator=g).to(dtype)
    table = torch.stack([torch.randperm(pages, generator=g)[:width] for _ in range(batch)]).to(table_dtype)
    seen = torch.randint(q_len, width * page + 1, (batch,), generator=g)
    pos = seen[:, None] - q_len + torch.arange(q_len)[None, :]
    mask = (torch.arange(width * page)[None, None, :] <= pos[:, :, None])[:, None]
    return q, cache, table, mask


def paged_want(q, cache, table, mask):
    """The dense attention over each element's pages, in fp32."""
    k, v = (cache[i].float()[:, table.long()].permute(1, 0, 2, 3, 4).flatten(2, 3) for i in range(2))
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize(("batch", "kv_heads", "q_len", "width", "page", "dtype", "table_dtype", "expect"), [
    (1, 2, 1, 33, 64, F16, torch.int64, "split"),       # decode, one element: its keys over 16 cores each
    (4, 2, 1, 5, 128, F32, torch.int32, "split"),       # decode of a batch, an int32 table
    (32, 4, 1, 3, 64, F16, torch.int64, "rows"),        # more tasks than cores: a core reads several rows
    (32, 4, 1, 20, 64, F16, torch.int64, "rows"),       # ... each of more than a stick (whole sticks loaded)
    (2, 2, 1, 2, 1024, F16, torch.int64, "in-page"),    # blocks of one page's rows
    (1, 2, 100, 4, 192, F32, torch.int64, "in-page"),   # pages of 192 keys: 64-key blocks
    (2, 2, 37, 6, 64, F16, torch.int64, "split"),       # a prefill chunk per element
    (1, 2, 300, 8, 64, F16, torch.int64, "shared"),     # a chunk's tiles walk the keys together
])
def test_paged_attention_gathers_each_block_through_the_block_table(card, batch, kv_heads, q_len, width, page, dtype,
                                                                     table_dtype, expect):
    g = torch.Generator().manual_seed(batch * 1000 + q_len + page)
    q, cache, table, mask = paged_case(g, batch=batch, heads=4 * kv_heads, kv_heads=kv_heads, q_len=q_len,
                                       width=width, page=page, pages=width * batch + 3, dtype=dtype,
                                       table_dtype=table_dtype)
    got, record, blob = run_paged(card, q, cache, table, mask)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), paged_want(q, cache, table, mask), rtol=rtol, atol=atol)
    _no_races(blob)
    tasks = record.tiling.tasks
    assert {"split": tasks[:, A.PARTS].max() > 1, "rows": record.lx.table_rows > 1,
            "in-page": record.tiling.kv_block < page, "shared": (tasks[:, A.GROUP] >= 0).any()}[expect]
    # one gather per block of keys and of values, where the dense kernel's loads were
    assert gathers(blob) == 2 * blocks_loaded(record)


def gathers(blob) -> int:
    return int((block_sections(blob)[0]["op"] == lib.SPY_OP_GATHER).sum())


def blocks_loaded(record) -> int:
    """Blocks of keys loaded: every task's, those of a sharing group's step once."""
    tiling = record.tiling
    walks = {(int(t[A.GROUP]), int(t[A.STEP])) if t[A.GROUP] >= 0 else ("task", i): (int(t[A.KV0]), int(t[A.KV1]))
             for i, t in enumerate(tiling.tasks)}
    return sum(-(-(hi - lo) // tiling.kv_block) for lo, hi in walks.values())


def test_a_page_number_outside_the_cache_fails_the_launch_naming_it(card):
    g = torch.Generator().manual_seed(9)
    q, cache, table, mask = paged_case(g, batch=2, heads=4, kv_heads=2, q_len=1, width=3, page=64, pages=6)
    table[1, 2] = 6
    with pytest.raises(SpyreError, match="index 6 .*outside the table's 6 rows"):
        run_paged(card, q, cache, table, mask)


# ---- the tiling ------------------------------------------------------------------------------


def granite(q_len: int, kv_len: int, **kw) -> A.Shape:
    """Granite 3.3 8B's attention: 32 query heads, 8 KV heads, head dim 128, fp16."""
    base = dict(batch=1, heads=32, kv_heads=8, q_len=q_len, kv_len=kv_len, dim=128, v_dim=128, dtype="float16",
                mask="bool", mask_dtype="bool", mask_heads=1, causal=False, q_offset=0)
    return A.Shape(**(base | kw))


def _target() -> CostModel:
    return CostModel.of_figures(device_profile.load("spyre"))


def test_decode_spreads_each_kv_heads_keys_over_the_cores():
    target = _target()
    tiling = A.choose(granite(1, 1029), target)
    tasks = tiling.tasks
    assert sorted(tasks[:, A.CORE]) == list(range(target.num_cores))  # one part per core
    assert set(tasks[:, A.PARTS]) == {4}
    starts = tasks[:, A.KV0]
    assert all(s % 128 == 0 for s in starts), "mask columns of a part start on a stick"
    keys = tasks[:, A.KV1] - tasks[:, A.KV0]
    assert keys.max() - keys.min() <= 128


@pytest.mark.parametrize("shape", [granite(1024, 1029), granite(1024, 1024, mask="", causal=True),
                                   granite(1, 1029, dtype="float32"), granite(1000, 1000, heads=8, kv_heads=1),
                                   granite(70, 70, heads=3, kv_heads=3, dim=72, v_dim=72)],
                         ids=["prefill", "prefill_causal", "decode_fp32", "gqa8", "mha_ragged"])
def test_every_core_works_and_the_choice_fits_the_scratchpad(shape):
    target = _target()
    tiling = A.choose(shape, target)
    assert A.Scratchpad(shape, target, tiling).top <= target.scratchpad_bytes
    busy = len(np.unique(tiling.tasks[:, A.CORE]))
    assert busy == min(target.num_cores, len(tiling.tasks))
    units = shape.batch * shape.kv_heads * -(-shape.q_len // tiling.q_rows)
    assert busy == target.num_cores or units < target.num_cores


# ---- dynamic shapes ---------------------------------------------------------------------------


def test_a_symbolic_sequence_length_compiles_once():
    torch._dynamo.reset()
    counters.clear()

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    compiled = torch.compile(f, backend="spyre_rt", dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(5)
    for n in (9, 70, 33):
        q = torch.randn(1, 8, n, 32, generator=g)
        k, v = (torch.randn(1, 2, n, 32, generator=g) for _ in range(2))
        got = compiled(q.to("spyre"), k.to("spyre"), v.to("spyre")).cpu()
        torch.testing.assert_close(got, f(q, k, v), rtol=1e-5, atol=2e-5, msg=f"length {n}")
    assert counters["stats"]["unique_graphs"] == 1
