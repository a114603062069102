"""Attentions whose mask the step proves causal: the blocks past the diagonal are skipped.

Hugging Face's static-cache mask is data: ``kv <= q + C`` (and the padding), where ``C`` is
the cache's position, a tensor. The attention kernel cannot know from the mask alone that
the keys past ``q + C`` are masked, so it visits every block of the square (322 µs a layer
at a 1,024-token Granite prefill, where the causal pairs are 118). But the step bounds
``C``: before the attention, the KV cache write scatters the new rows at ``q + C`` for
every query ``q``, and the scatter checks each index against the cache's length ``Z``
(``SPY_E_INDEX`` otherwise, and the call fails before anything reads the attention's
result). So in every call that succeeds, ``C <= Z - q_len``, and key ``j`` is masked for
query ``i`` whenever ``j > i + Z - q_len``.

:func:`bound_causal_masks` finds that proof in a step: an attention whose boolean mask is
stored by a loop kernel as a conjunction with ``index_kv <= index_q + load(C)``, and a
scatter before the attention whose row index is ``indirect(index_q' + load(C), size Z)``
over its ``n`` queries, reading the same ``C`` (nothing writes it between the two). The
attention is then marked ``causal`` with ``q_offset = Z - n``, its mask still applied: the
same keys are kept, and the blocks wholly past the diagonal are not visited. It keeps the
key blocks of the kernel it was (``AttentionKernel.blocks``), and no row's keys are split
over cores, so that each row's sums are added in the same order: the values are the same
bits. The query rows per tile are free: a row's sums do not depend on which rows share its
tile, and a block a row sees none of adds exact zeros to them (scaled by exactly one). Tiles
of causal queries differ in length, and smaller ones balance the cores (tasks._shared).
"""

from __future__ import annotations

import dataclasses

from spyre_rt.cost import CostModel
from spyre_rt.ir import AttentionKernel, LoopKernel, Op, StepDesc, View

from .fusion import card_target
from .step_buffers import base, resolve, writes


def bound_causal_masks(step: StepDesc, target: CostModel | None = None) -> StepDesc:
    """The step with every attention whose mask it proves causal up to a bound marked so."""
    target = card_target(target)
    kernels = dict(step.kernels)
    changed = False
    for i, (kind, name) in enumerate(step.sequence):
        a = kernels.get(name) if kind == "run" else None
        if not isinstance(a, AttentionKernel) or a.causal or a.page or a.mask is None or a.mask_dtype != "bool":
            continue
        offset = _bound(step, kernels, i, a)
        if offset is None or offset < 0:
            continue
        marked = _same_blocks(a, dataclasses.replace(a, causal=True, q_offset=offset), target)
        if marked is not None:
            kernels[name] = marked
            changed = True
    return dataclasses.replace(step, kernels=kernels) if changed else step


def _bound(step: StepDesc, kernels: dict, at: int, a: AttentionKernel) -> int | None:
    """The offset D with mask[i, j] false for every j > i + D in every call that reaches
    the attention at position `at`, or None."""
    mask_buf = base(step, a.mask[0])
    writers = [j for j in range(at) if mask_buf in writes(step, kernels, step.sequence[j])]
    if not writers:
        return None
    w = writers[-1]
    mk = kernels.get(step.sequence[w][1]) if step.sequence[w][0] == "run" else None
    if not isinstance(mk, LoopKernel):
        return None
    source = _mask_source(step, mk, a)
    if source is None:
        return None
    for j in range(at):
        s = kernels.get(step.sequence[j][1]) if step.sequence[j][0] == "run" else None
        if not isinstance(s, LoopKernel) or j == w:
            continue
        bound = _scatter_bound(step, s, source)
        if bound is None:
            continue
        lo, hi = min(j, w), max(j, w)
        c = base(step, source[0])
        if any(c in writes(step, kernels, step.sequence[t]) for t in range(lo, hi + 1)):
            continue  # the two may read other values of the position
        return bound
    return None


def _by_id(k: LoopKernel) -> dict[str, Op]:
    return {o.id: o for o in k.ops}


def _index_of(op: Op | None, var: int, nvars: int) -> bool:
    """Whether `op` is the loop variable `var` itself."""
    if op is None or op.op != "index" or op.access.const or op.access.ind:
        return False
    return op.access.coeffs == tuple(1 if v == var else 0 for v in range(nvars))


def _scalar(op: Op | None) -> tuple[str, int] | None:
    """(buffer, element) of a load of one value for every iteration."""
    if op is None or op.op != "load" or op.access.ind or op.access.domain or any(op.access.coeffs):
        return None
    return (op.access.buf, op.access.const)


def _plus(k: LoopKernel, ops: dict, op: Op | None, var: int) -> tuple[str, int] | None:
    """The scalar C of ``op = index(var) + load(C)``, or None."""
    if op is None or op.op != "add" or len(op.args) != 2:
        return None
    x, y = (ops.get(a) for a in op.args)
    for i, c in ((x, y), (y, x)):
        if _index_of(i, var, len(k.sizes)) and _scalar(c) is not None:
            return _scalar(c)
    return None


def _mask_source(step: StepDesc, mk: LoopKernel, a: AttentionKernel) -> tuple[str, int] | None:
    """The scalar C (in its storage) of a mask kernel that stores, as the attention's mask, a
    conjunction with ``index_kv <= index_q + C``."""
    mask = resolve(step, a.mask[0], a.mask[1])
    stores = [o for o in mk.ops if o.op == "store" and resolve(step, o.access.buf, 0)[0] == mask[0]]
    if len(stores) != 1 or stores[0].access.ind or stores[0].access.domain:
        return None
    store, (_, _, (batch, _, q_len, kv_len), (sb, sh, sq, skv)) = stores[0], a.mask
    # the kernel's rows the queries and its columns the keys (a mask of each batch element's
    # own, or one for all of them), one for every head
    shape, coeffs = ((batch, q_len, kv_len), (sb, sq, skv)) if sb and batch > 1 else ((q_len, kv_len), (sq, skv))
    if sh or mk.sizes != shape or store.access.coeffs != coeffs or \
            resolve(step, store.access.buf, store.access.const) != mask:
        return None
    q, kv, n = len(shape) - 2, len(shape) - 1, len(shape)
    ops = _by_id(mk)
    todo, seen = [store.args[0]], set()
    while todo:  # the conjuncts of the stored value
        op = ops.get(todo.pop())
        if op is None or op.id in seen:
            continue
        seen.add(op.id)
        if op.op in ("bitwise_and", "logical_and"):
            todo += list(op.args)
        elif op.op == "le" and _index_of(ops.get(op.args[0]), kv, n):
            c = _plus(mk, ops, ops.get(op.args[1]), q)
            if c is not None:
                return resolve(step, *c)
        elif op.op == "ge" and _index_of(ops.get(op.args[1]), kv, n):
            c = _plus(mk, ops, ops.get(op.args[0]), q)
            if c is not None:
                return resolve(step, *c)
    return None


def _scatter_bound(step: StepDesc, s: LoopKernel, source: tuple[str, int]) -> int | None:
    """Z - n for a scatter whose store's row index is ``indirect(index_q + C, size Z)``
    over its `n` values of q, with C `source`: in every call that gets past it, C <= Z - n."""
    ops = _by_id(s)
    for store in s.ops:
        if store.op != "store" or not store.access.ind or store.access.domain:
            continue
        for ind, _ in store.access.ind:
            op = ops.get(ind)
            if op is None or op.op != "indirect" or "size" not in op.attrs:
                continue
            x = ops.get(op.args[0]) if op.args else None
            for var, n in enumerate(s.sizes):
                c = _plus(s, ops, x, var)
                if c is not None and resolve(step, *c) == source and n >= 1:
                    return int(op.attrs["size"]) - n
    return None


def _same_blocks(before: AttentionKernel, after: AttentionKernel, target: CostModel) -> AttentionKernel | None:
    """`after` pinned to the key blocks `before` is cut in, when neither splits a row's
    keys over cores (each row's sums are then added in the same order), else None."""
    from spyre_rt.construct.attention import Shape, choose
    from spyre_rt.construct.context import ScratchpadOverflow

    def shape(k):
        return Shape.of(k, *(getattr(k, n) and View(*getattr(k, n)) for n in ("q", "k", "v", "mask")))

    try:
        t = choose(shape(before), target)
        pinned = dataclasses.replace(after, blocks=(0, t.kv_block))
        u = choose(shape(pinned), target)
    except ScratchpadOverflow:
        return None
    if t.max_parts > 1 or u.max_parts > 1 or u.kv_block != t.kv_block:
        return None
    return pinned

