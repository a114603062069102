"""DMA commands that move many boxes of one operand between DRAM and the scratchpads."""

from __future__ import annotations

import numpy as np

from ...program import DESC, DMA_DESCS, OP_LOAD, OP_STORE, empty_cmds
from ..access import NotAffine, Pattern, descriptor_runs, pattern
from ..context import BuildContext
from .spec import View


class Patterns:
    """The DMA patterns of one operand over many tiles: tiles whose boxes have the same
    shape and start at the same column of a storage row share a pattern and differ only by
    where they start. A box with no compact pattern (its columns wrap into the next storage
    row, as in a matmul over a reshaped input) is moved by a descriptor list of its own.

    A pattern may move whole sticks where the box ends inside one. A load may read the
    rest of the stick; a store (`writes`) must not write it unless it is the padding past
    the row's end, since a neighbouring tile's columns live there: such a store is moved
    by a descriptor list instead."""

    def __init__(self, ctx: BuildContext, view: View, dims: tuple[int, int], boxes: np.ndarray,
                 lx_pitch: int, itemsize: int, bases: np.ndarray, writes: bool = False):
        layout = ctx.layouts[view.buf]
        self.ctx, self.layout = ctx, layout
        self.strides = (view.strides[dims[0]], view.strides[dims[1]])
        self.lx_strides = (lx_pitch, itemsize)
        self.boxes = boxes
        self.bases = bases = np.asarray(bases, dtype=np.int64)
        # A pattern depends on the box and on where it starts in its storage row (how it
        # meets the sticks and whether it reaches the row's end); boxes a whole number of
        # rows apart share it. A one-row storage is linear: every start shares it.
        column = bases % layout.row_len if layout.rows > 1 else np.zeros_like(bases)
        keys = np.stack([boxes[:, 0], boxes[:, 1], column], axis=1)
        uniq, self.pid = np.unique(keys, axis=0, return_inverse=True)
        self.pid = self.pid.ravel()
        self.patterns: list[Pattern | None] = []
        origin = np.zeros(len(uniq), dtype=np.int64)
        for u, key in enumerate(uniq):
            first = int(np.flatnonzero(self.pid == u)[0])
            try:
                p = pattern(layout, int(bases[first]), (int(key[0]), int(key[1])), self.strides, self.lx_strides)
            except NotAffine:
                p = None
            if writes and p is not None and self._overruns(p, key, itemsize):
                p = None
            self.patterns.append(p)
            origin[u] = layout.phys(int(bases[first]))
        # device byte offset of each tile relative to its pattern's first base
        self.start = layout.phys(bases) - origin[self.pid]
        self.nbases = np.array([len(p.bases) if p else 1 for p in self.patterns], dtype=np.int64)[self.pid]

    def _overruns(self, p: Pattern, key: np.ndarray, itemsize: int) -> bool:
        """Does the pattern move bytes outside its box that are not the row's padding?"""
        rows, cols, column = (int(x) for x in key)
        if p.bytes == rows * cols * itemsize:
            return False
        return not (self.strides[1] == 1 and column + cols >= self.layout.row_len)

    def descriptors(self, item: int, lx_off: int, load: bool) -> tuple[int, int]:
        """(first descriptor, count) of a descriptor-list DMA moving one item's box."""
        dev, lx, nbytes = descriptor_runs(self.layout, int(self.bases[item]), tuple(int(c) for c in self.boxes[item]),
                                          self.strides, lx_off, self.lx_strides)
        descs = np.zeros(nbytes.size, dtype=DESC)
        descs["src_off"], descs["dst_off"] = (dev, lx) if load else (lx, dev)
        descs["bytes"] = nbytes
        return self.ctx.program.add_descs(descs), int(nbytes.size)


def fill_dmas(cmds: np.ndarray, rows: np.ndarray, pats: Patterns, items: np.ndarray, slot: int,
               lx_off: np.ndarray, load: bool) -> None:
    """Fill the DMA commands at `rows` (one run of len(bases) rows per item) for the items
    (tiles or chunks) of an operand; lx_off is each item's scratchpad region."""
    for u, p in enumerate(pats.patterns):
        sel = np.flatnonzero(pats.pid[items] == u)
        if not sel.size:
            continue
        if p is None:
            for s_ in sel:
                first, n = pats.descriptors(int(items[s_]), int(lx_off[s_]), load)
                c = cmds[rows[s_]]
                c["flags"] = DMA_DESCS
                c["src_slot"], c["dst_slot"] = (slot, 0) if load else (0, slot)
                c["src_off"], c["desc_count"] = first, n
                cmds[rows[s_]] = c
            continue
        for j, (dram, lxb) in enumerate(p.bases):
            r = rows[sel] + j
            dev = pats.start[items[sel]] + dram
            lxo = lx_off[sel] + lxb
            c = cmds[r]
            if load:
                c["src_slot"], c["src_off"], c["dst_off"] = slot, dev, lxo
            else:
                c["dst_slot"], c["dst_off"], c["src_off"] = slot, dev, lxo
            c["run_bytes"] = p.run
            c["ndims"] = len(p.dims)
            for k, d in enumerate(p.dims):
                c["count"][:, k] = d.count
                c["src_stride"][:, k] = d.src if load else d.dst
                c["dst_stride"][:, k] = d.dst if load else d.src
            cmds[r] = c


def dma_block(pats: Patterns, items: np.ndarray, core: np.ndarray, slot: int, lx_off: np.ndarray,
              load: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The commands moving each item's box (a run of one or more commands per item):
    (commands, first command of each item, commands per item)."""
    count = pats.nbases[items]
    first = np.cumsum(count) - count
    cmds = empty_cmds(int(count.sum()), OP_LOAD if load else OP_STORE, np.repeat(core, count))
    fill_dmas(cmds, first, pats, items, slot, lx_off, load)
    return cmds, first, count
