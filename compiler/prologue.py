"""Prologue fusion: the loop kernel that makes a matmul's A, where only matmuls read it as
their A, becomes those matmuls' prologue (:class:`~spyre_rt.ir.Prologue`).

A decoder layer normalizes the residual stream and multiplies the result by its q, k and v
(or gate and up) weights: RMSNorm is ``w * (x * rsqrt(mean(x^2) + eps))``, one loop
kernel that reduces each row, then writes the normalized rows for the matmuls to read
back. Fused, the loop kernel keeps only its per-row work: it stores each row's statistic
(``rsqrt(...)``, a few bytes a row) and no longer writes A; each matmul loads the
residual rows in A's place, with the statistic and the weight as vectors, and its loader
core rewrites each A chunk in place (``w * (x * rstd)``, rounded to A's dtype) before it
forwards and multiplies it. The normalized activations never go to DRAM and back.

The values are the same: the per-row part is computed by the same loop kernel ops and
stored in its own dtype, and the elementwise part by the same ops in the same order,
computed as loop construction computes them (an epilogue's SFU semantics), rounded to A's
dtype where the loop kernel's store rounded them. A pointwise loop kernel (no reduction)
becomes a prologue whole and is gone.

A fusion moves the elementwise work to each matmul's place, so nothing in between may
write what it reads. It applies when A is K-contiguous and exactly one input is read in
A's place; every other input must be a vector (one value per row, or per column of A).
Layer 0's first norm, whose rows are gathered from the token embedding, stays a kernel.
And the fused matmul must have a tiling that fits the scratchpad of the card the step is
compiled for, its prologue's regions beside its own: checked here, so that a fusion that
does not fit leaves the kernels apart instead of failing when the plan is built.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from spyre_rt import dtypes
from spyre_rt.construct.loops.analysis import Unsupported, _dtype
from spyre_rt.cost import CostModel
from spyre_rt.ir import Access, Buffer, LoopKernel, MatmulKernel, Op, Prologue, StepDesc

from .fusion import COMPUTES, _parts, _view, card_target, keeps_its_bits
from .step_buffers import base, touches, writes

MAX_VECTORS = 4  # the vectors a matmul's prologue loads beside its tile (SPY_MM_MAX_VECTORS)


def fuse_prologues(step: StepDesc, target: CostModel | None = None) -> StepDesc:
    """The step with every loop kernel whose result only matmuls read, as their A, folded
    into them as a prologue: the kernel reduced to its per-row part, or gone. `target`: the
    card whose scratchpad the fused matmuls must fit (the current card set's by default)."""
    target = card_target(target)
    kernels = dict(step.kernels)
    seq = list(step.sequence)
    buffers = dict(step.buffers)
    changed = False
    i = 0
    while i < len(seq):
        kind, name = seq[i]
        if kind == "run" and isinstance(kernels.get(name), LoopKernel):
            found = _fusion(step, kernels, seq, buffers, i)
            if found is not None and all(keeps_its_bits(m, target) for m in found[1]):
                stats, fused, new_buffers, product = found
                changed = True
                kernels.update((m.name, m) for m in fused)
                buffers.update((b.name, b) for b in new_buffers)
                buffers.pop(product, None)
                if stats is None:
                    del kernels[name]
                    del seq[i]
                    continue
                kernels[name] = stats
        i += 1
    if not changed:
        return step
    return dataclasses.replace(step, kernels=kernels, sequence=tuple(seq), buffers=buffers)


def _fusion(step: StepDesc, kernels: dict, seq: list, buffers: dict, i: int):
    """(the loop kernel's per-row part or None, the matmuls with their prologue, the new
    buffers, the buffer no longer written), or None when the kernel cannot be a prologue."""
    k: LoopKernel = kernels[seq[i][1]]
    stores = [o for o in k.ops if o.op == "store"]
    if len(stores) != 1 or any(o.op not in COMPUTES and o.op not in ("load", "store", "reduction") for o in k.ops):
        return None
    if any(o.access.ind or o.access.domain or not o.access.buf for o in k.ops if o.op in ("load", "store")):
        return None
    store = stores[0]
    product = store.access.buf
    if product not in step.buffers or product in step.aliases or any(v[0] == product for v in step.aliases.values()):
        return None
    if any(isinstance(o, (tuple, list)) and o and o[0] == product for o in step.outputs):
        return None
    readers = _readers(step, kernels, seq, i, product)
    if not readers:
        return None
    a = kernels[seq[readers[0]][1]].a
    if any(kernels[seq[j][1]].a != a for j in readers) or a[3][2] != 1 or store.access.const != a[1]:
        return None
    parts = _parts(k, store.access.coeffs, a)
    if parts is None or any(n > 1 and v not in {p[0] for p in parts} for v, n in enumerate(k.sizes)):
        return None
    try:
        split = _split(k, store, buffers, step)
    except Unsupported:
        return None
    if split is None:
        return None
    stats, stats_buffers, replaced = split
    prologue = _prologue(k, store, parts, a, replaced, kernels[seq[readers[0]][1]].in_dtype, stats_buffers)
    if prologue is None:
        return None
    read = {base(step, v[0]) for v in prologue.inputs} - {b.name for b in stats_buffers}
    for j in readers:  # the elementwise work moves to each matmul's place
        if any(writes(step, kernels, seq[t]) & read for t in range(i + 1, j)):
            return None
    mine = {b.name: b for b in (*k.buffers, *stats_buffers)}
    fused = []
    for j in readers:
        m = kernels[seq[j][1]]
        bufs = {b.name: b for b in m.buffers if b.name != product}
        for v in prologue.inputs:
            bufs.setdefault(v[0], mine[v[0]])
        fused.append(dataclasses.replace(m, a=prologue.inputs[0], prologue=prologue, buffers=tuple(bufs.values()),
                                         origins=tuple(sorted({*m.origins, *k.origins}))))
    return stats, fused, stats_buffers, product


def _readers(step: StepDesc, kernels: dict, seq: list, i: int, product: str) -> list[int] | None:
    """Positions of the matmuls that read `product` as their A after `i`, when nothing else
    ever touches it."""
    readers = []
    for t, item in enumerate(seq):
        if t == i or product not in touches(step, kernels, item):
            continue
        m = kernels.get(item[1]) if item[0] == "run" else None
        if t < i or not isinstance(m, MatmulKernel) or m.prologue is not None or m.a[0] != product:
            return None
        others = [m.b, m.bias, *m.outs(), *(v for part in m.parts for v in part),
                  *(m.epilogue.inputs + m.epilogue.outputs if m.epilogue else ())]
        if any(v is not None and base(step, v[0]) == product for v in others):
            return None
        if dtypes.ITEMSIZE.get(m.in_dtype) is None or step.buffers[product].dtype != m.in_dtype:
            return None
        readers.append(t)
    return readers


def _value_dtypes(k: LoopKernel) -> dict[str, str]:
    by_buf = {b.name: b for b in k.buffers}
    out: dict[str, str] = {}
    for op in k.ops:
        out[op.id] = _dtype(op, [SimpleNamespace(dtype=out[a]) for a in op.args], by_buf)
    return out


def _cone(by_id: dict, roots, stop=frozenset()) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if v not in stop:
            todo.extend(by_id[v].args)
    return seen


def _split(k: LoopKernel, store: Op, buffers: dict, step: StepDesc):
    """(the per-row part as a loop kernel, the buffers it stores, {value: its buffer}) for a
    reduction kernel; (None, (), {}) for a pointwise one; None when the store's elementwise
    part does not read its per-row part through values of its own."""
    by_id = {op.id: op for op in k.ops}
    if not k.reduce:
        return None if any(o.op == "reduction" for o in k.ops) else (None, (), {})
    ncols = k.ncols
    row: dict[str, bool] = {}
    for op in k.ops:  # values alike along the reduced (column) variables
        if op.op == "reduction":
            row[op.id] = True
        elif op.op == "load":
            row[op.id] = not any(op.access.coeffs[-ncols:])
        elif op.op != "store":
            row[op.id] = all(row[a] for a in op.args)
    after: set[str] = set()  # values computed from a reduction (the ops are in order)
    for op in k.ops:
        if op.op != "store" and (op.op == "reduction" or any(a in after for a in op.args)):
            after.add(op.id)
    cone = _cone(by_id, store.args)
    frontier = sorted({a for v in cone if v in by_id and by_id[v].op != "store" and not row[v]
                       for a in by_id[v].args if row[a] and a in after}, key=list(by_id).index)
    if not frontier or store.args[0] in after and row[store.args[0]]:
        return None
    dtype_of = _value_dtypes(k)
    taken = {*buffers, *step.constants, *(b.name for b, _ in step.inputs)}
    rows = list(k.sizes[:len(k.sizes) - ncols])
    coeffs, stride = [0] * len(k.sizes), 1
    for v in range(len(rows) - 1, -1, -1):  # the stats of each row, row-major over the row variables
        coeffs[v] = stride
        stride *= rows[v]
    needed = _cone(by_id, frontier)
    stats_buffers, replaced, ops = [], {}, [op for op in k.ops if op.id in needed]
    for n, v in enumerate(frontier):
        dtype = dtype_of[v]
        if dtype not in dtypes.CODE:
            return None
        name = _fresh(f"{store.access.buf}_rows{n}", taken)
        taken.add(name)
        # shaped as the kernel's rows, as Inductor shapes a reduction's result: its storage
        # rows are the loop's (a core's tile of rows stores whole sticks)
        buf = Buffer(name, dtype, tuple(rows), tuple(coeffs[:len(rows)]))
        stats_buffers.append(buf)
        replaced[v] = buf
        ops.append(Op(f"{v}_row", "store", (v,), dtype, Access(name, 0, tuple(coeffs))))
    bufs = {b.name: b for b in k.buffers if any(o.access and o.access.buf == b.name for o in ops)}
    bufs.update((b.name, b) for b in stats_buffers)
    stats = dataclasses.replace(k, ops=tuple(ops), buffers=tuple(bufs.values()))
    return stats, tuple(stats_buffers), {v: (buf, Access(buf.name, 0, tuple(coeffs))) for v, buf in replaced.items()}


def _fresh(name: str, taken) -> str:
    n, out = 0, name
    while out in taken:
        n += 1
        out = f"{name}_{n}"
    return out


def _prologue(k: LoopKernel, store: Op, parts, a, replaced: dict, in_dtype: str, stats_buffers) -> Prologue | None:
    """The store's elementwise part over A's (batch, M, K) elements, the per-row values it
    reads loaded from their buffers; None unless it reads exactly one tile in A's place,
    K-contiguous and of A's dtype, and vectors beside it."""
    by_id = {op.id: op for op in k.ops}
    needed = _cone(by_id, store.args, stop=frozenset(replaced))
    dtype_of = {b.name: b.dtype for b in (*k.buffers, *stats_buffers)}
    _, _, (nb, nm, nk), _ = a
    tiles, vectors, loads = [], [], []
    for op in k.ops:
        if op.id not in needed or (op.op != "load" and op.id not in replaced):
            continue
        access = replaced[op.id][1] if op.id in replaced else op.access
        view = _view(access, parts, a)
        if view is None:
            return None
        sb, sm, sk = view[3]
        if nb > 1 and sb == 0:
            return None  # broadcast over batches
        if sk == 1 or nk == 1:
            # one row of A: a vector along K is a tile of that row; the first of A's dtype
            # is read in A's place, the others as vectors (the same values either way)
            if (nm > 1 and sm == 0) or (nm == 1 and (tiles and view not in tiles
                                                     or dtype_of[access.buf] != in_dtype)):
                kind = "col"
            else:
                kind = "tile"
        elif sk == 0:
            kind = "row"
        else:
            return None
        group = tiles if kind == "tile" else vectors
        if view not in group:
            group.append(view)
        loads.append((op, view, dtype_of[access.buf]))
    if len(tiles) != 1 or dtype_of[tiles[0][0]] != in_dtype or len(vectors) > MAX_VECTORS:
        return None
    inputs = [tiles[0], *vectors]
    input_dtypes = [in_dtype] + [None] * len(vectors)
    load_ops = {}
    for op, view, dtype in loads:
        idx = inputs.index(view)
        input_dtypes[idx] = dtype
        load_ops[op.id] = Op(op.id, "load", dtype=dtype, attrs={"input": idx})
    body = []
    for op in k.ops:  # in the kernel's order: loads where they were
        if op.id in load_ops:
            body.append(load_ops[op.id])
        elif op.id in needed and op.id not in replaced and op.op != "store":
            body.append(dataclasses.replace(op, access=None))
    body.append(Op(store.id, "store", store.args, in_dtype, attrs={"output": 0}))
    return Prologue(tuple(body), tuple(tuple(v) for v in inputs), tuple(input_dtypes), k.name)
