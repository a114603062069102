"""What a failed call puts back: the inputs a step mutates, saved before anything writes them.

A call is all-or-nothing for the inputs it mutates. Before its first kernel, the step's
first jobs save what it will write, in its arena; if anything fails after them, restore
jobs copy it back before the error reaches the caller.

Saving a whole mutated input costs a device copy of it on every call: for a KV cache that
a decode step writes one row of, a copy of the whole cache (2 % of a Granite 3.3 8B decode
token at batch 1, a quarter of it at batch 32, and a served model's whole KV budget). So
an input written only by scatters is saved row by row: for each scatter store into it, a
*save* kernel gathers exactly the elements the store will write (the same indirect access,
its indices computed as the writing kernel computes them) into an arena buffer, and its
*restore* kernel scatters them back. That needs the indices to be known when the save
runs, before any kernel: each load the indices come from must read an input or constant
that no earlier item of the step writes and that is not itself saved by rows (an index
input the step advances, such as a decode position, is saved whole and restored first,
so the restores compute the same indices). Every other mutated input (written by a
matmul, attention, a CPU op, an affine store, a masked store) is saved whole: the byte
range it covers, copied through the scratchpads.

Saves only read the mutated inputs, so a failure inside them needs no restore; restores
run the whole copies back first, then the row restores.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..construct import copy
from ..ir import Access, Buffer, LoopKernel, MatmulKernel, Op, StepDesc
from . import memory

SAVE, RESTORE = "<save>", "<unsave>"  # prefixes of the row kernels' names


@dataclass(frozen=True)
class RowSave:
    """The elements one scatter store will write, saved into ``buffer`` and put back."""

    save: LoopKernel
    restore: LoopKernel
    buffer: Buffer


@dataclass(frozen=True)
class Undo:
    """How a step's mutated inputs are saved: whole ranges and rows."""

    copies: tuple[copy.Copy, ...]   # whole byte ranges (filled in by the executable)
    whole: tuple[Buffer, ...]       # the inputs saved whole
    rows: tuple[RowSave, ...]


def _writers(desc: StepDesc, bases: set[str]) -> dict[str, list[tuple[int, object]]]:
    """For each of `bases`: (position in the sequence, what writes it there), a LoopKernel
    store op, or the item itself when something other than a loop kernel writes it. One
    pass over the sequence for all of them (a decoder writes one cache per layer)."""
    out: dict[str, list] = {b: [] for b in bases}

    def written(name: str) -> list | None:
        return out.get(memory.base_of(desc, name))

    for i, (kind, x) in enumerate(desc.sequence):
        if kind == "run":
            k = desc.kernels[x]
            if isinstance(k, LoopKernel):
                for op in k.ops:
                    if op.op == "store" and op.access and (ws := written(op.access.buf)) is not None:
                        ws.append((i, (k, op)))
            else:
                for ws in {id(ws): ws for v in _written_views(k) if (ws := written(v[0])) is not None}.values():
                    ws.append((i, x))
        elif kind == "cpu":
            for ws in {id(ws): ws for n in x.written_names() if (ws := written(n)) is not None}.values():
                ws.append((i, x))
        elif (ws := written(x[2])) is not None:  # a pick writes its buffer
            ws.append((i, x))
    return out


def _written_views(k) -> list:
    """The views a matmul or attention kernel writes."""
    ep = getattr(k, "epilogue", None)
    if ep is not None:
        return list(ep.outputs)
    return k.outs() if isinstance(k, MatmulKernel) else [k.out]


def _index_ops(k: LoopKernel, store: Op) -> list[Op] | None:
    """The ops the store's indices are computed from, in the kernel's order; None when
    they read something a save cannot (an indirect load, a masked one)."""
    by_id = {o.id: o for o in k.ops}
    need, todo = set(), [i for i, _ in store.access.ind]
    while todo:
        i = todo.pop()
        if i in need:
            continue
        need.add(i)
        op = by_id[i]
        if op.op in ("store", "reduction"):
            return None
        if op.access is not None and (op.access.ind or op.access.domain):
            return None
        todo += [a for a in op.args if a in by_id]
    return [o for o in k.ops if o.id in need]


def _contiguous(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(sizes):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _row_save(k: LoopKernel, store: Op, number: int) -> RowSave:
    index = _index_ops(k, store)
    name = f"{SAVE}{number}"
    buf = Buffer(f"{name}rows", store.dtype, k.sizes, _contiguous(k.sizes))
    rows = Access(buf.name, 0, buf.strides)
    used = {o.access.buf for o in index if o.access is not None and o.access.buf} | {store.access.buf}
    buffers = (*(b for b in k.buffers if b.name in used), buf)
    # op ids name no save: the saves of a decoder's layers are then one form, built once
    # per plan (executor.distinct)
    save = LoopKernel(name, k.sizes, k.ncols, False,
                      (*index, Op(f"{SAVE}v", "load", (), store.dtype, store.access),
                       Op(f"{SAVE}s", "store", (f"{SAVE}v",), store.dtype, rows)),
                      buffers, k.origins, k.module)
    restore = LoopKernel(f"{RESTORE}{number}", k.sizes, k.ncols, False,
                         (*index, Op(f"{SAVE}r", "load", (), store.dtype, rows),
                          Op(f"{SAVE}w", "store", (f"{SAVE}r",), store.dtype, store.access)),
                         buffers, k.origins, k.module)
    return RowSave(save, restore, buf)


def plan(desc: StepDesc, rows_allowed: bool = True) -> Undo:
    """How each mutated input of the step is saved (see the module docstring); with
    `rows_allowed` false, every one whole (when construction refuses a row save)."""
    inputs = {b.name for b, _ in desc.inputs} | set(desc.constants)
    mutated = [b for b, m in desc.inputs if m]
    writers = _writers(desc, {b.name for b in mutated})

    def by_rows(b: Buffer) -> bool:
        ws = writers[b.name]
        return bool(ws) and all(isinstance(w, tuple) and isinstance(w[0], LoopKernel) and not w[0].reduce
                                and w[1].access.ind and not w[1].access.domain
                                and _index_ops(*w) is not None for _, w in ws)

    rows = {b.name for b in mutated if rows_allowed and by_rows(b)}
    # the indices must read what the step has not written yet and does not restore by rows
    changed = True
    while changed:
        changed = False
        for name in sorted(rows):
            for pos, (k, store) in writers[name]:
                for op in _index_ops(k, store):
                    if op.op != "load":
                        continue
                    src = memory.base_of(desc, op.access.buf)
                    early = any(p < pos for p, _ in writers.get(src, ()))  # only mutated inputs are written
                    if src not in inputs or src in rows or early:
                        rows.discard(name)
                        changed = True
                        break
                if name not in rows:
                    break
    saves = []
    for b in mutated:
        if b.name in rows:
            saves += [_row_save(k, store, len(saves)) for _, (k, store) in writers[b.name]]
    return Undo((), tuple(b for b in mutated if b.name not in rows), tuple(saves))
