"""DMA commands that move many boxes of one operand between DRAM and the scratchpads."""

from __future__ import annotations

import numpy as np

from ...program import DESC, DMA_DESCS, OP_LOAD, OP_STORE, empty_cmds
from ..access import NotAffine, Pattern, descriptor_runs, pattern
from ..context import BuildContext
from .graph import unique_rows
from .spec import View


class Patterns:
    """The DMA patterns of one operand over many tiles: boxes alike in what shapes a pattern
    (`_keys`) share one and differ only by where they start. A box with no compact pattern (its columns wrap into the next storage
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
        keys = self._keys()
        first, self.pid = unique_rows(keys)
        self.patterns: list[Pattern | None] = []
        for u, key in enumerate(keys[first]):
            try:
                p = pattern(layout, int(bases[first[u]]), (int(key[0]), int(key[1])), self.strides, self.lx_strides)
            except NotAffine:
                p = None
            if writes and p is not None and self._overruns(p, key, itemsize):
                p = None
            self.patterns.append(p)
        phys = layout.phys(bases)
        # device byte offset of each tile relative to its pattern's first base
        self.start = phys - phys[first][self.pid]
        self.nbases = np.array([len(p.bases) if p else 1 for p in self.patterns], dtype=np.int64)[self.pid]

    def _keys(self) -> np.ndarray:
        """What a box's pattern depends on besides where it starts: its shape, where it
        starts inside a stick, whether its columns reach past its storage row's end (no
        pattern then) and whether its last column is the row's last (the padding after it
        may be written). Boxes alike in these share a pattern, moved. A one-row storage is
        linear: every start shares it."""
        lay, boxes = self.layout, self.boxes
        if lay.rows <= 1:
            return np.column_stack([boxes, np.zeros((len(boxes), 3), dtype=np.int64)])
        column = self.bases % lay.row_len
        span = (boxes - 1) @ (np.array(self.strides) % lay.row_len)
        ends = (column + boxes[:, 1] >= lay.row_len) & (self.strides[1] == 1)
        return np.column_stack([boxes, column % lay.stick_elems, column + span >= lay.row_len, ends])

    def _overruns(self, p: Pattern, key: np.ndarray, itemsize: int) -> bool:
        """Does the pattern move bytes outside its box that are not the row's padding?"""
        rows, cols, _, _, ends = (int(x) for x in key)
        return p.bytes != rows * cols * itemsize and not ends

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
    (tiles or chunks) of an operand; lx_off is each item's scratchpad region. Fields are
    written through column views, in place."""
    pid = pats.pid[items]
    slot_field, dev_field, lx_field = ("src_slot", "src_off", "dst_off") if load else ("dst_slot", "dst_off", "src_off")
    for u, p in enumerate(pats.patterns):
        sel = np.flatnonzero(pid == u) if len(pats.patterns) > 1 else np.arange(len(items))
        if not sel.size:
            continue
        if p is None:
            for s_ in sel:
                first, n = pats.descriptors(int(items[s_]), int(lx_off[s_]), load)
                r = rows[s_]
                cmds["flags"][r] = DMA_DESCS
                cmds[slot_field][r] = slot
                cmds["src_off"][r], cmds["desc_count"][r] = first, n
            continue
        for j, (dram, lxb) in enumerate(p.bases):
            r = rows[sel] + j
            cmds[slot_field][r] = slot
            cmds[dev_field][r] = pats.start[items[sel]] + dram
            cmds[lx_field][r] = lx_off[sel] + lxb
            cmds["run_bytes"][r] = p.run
            cmds["ndims"][r] = len(p.dims)
            for k, d in enumerate(p.dims):
                cmds["count"][r, k] = d.count
                cmds["src_stride"][r, k] = d.src if load else d.dst
                cmds["dst_stride"][r, k] = d.dst if load else d.src


def dma_block(pats: Patterns, items: np.ndarray, core: np.ndarray, slot: int, lx_off: np.ndarray,
              load: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The commands moving each item's box (a run of one or more commands per item):
    (commands, first command of each item, commands per item)."""
    count = pats.nbases[items]
    first = np.cumsum(count) - count
    cmds = empty_cmds(int(count.sum()), OP_LOAD if load else OP_STORE, np.repeat(core, count))
    fill_dmas(cmds, first, pats, items, slot, lx_off, load)
    return cmds, first, count
