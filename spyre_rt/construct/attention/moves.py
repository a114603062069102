"""The DMA commands of one operand of an attention."""

from __future__ import annotations

import math

import numpy as np

from ...program import DESC, DMA_DESCS, OP_LOAD, OP_STORE
from ..access import NotAffine, descriptor_runs, pattern
from ..context import BuildContext
from ..matmul.graph import unique_rows


class Moves:
    """The DMA commands of one operand, one box per item, between a buffer and the
    scratchpad. Boxes with the same counts, scratchpad strides and column in a storage row
    share one pattern (:func:`~spyre_rt.construct.access.pattern`), shifted to where each
    starts. A box with no compact pattern is a descriptor-list DMA of its own, and so is a
    store whose whole-stick runs would spill into columns past its box."""

    def __init__(self, ctx: BuildContext, buf: str, strides: tuple[int, ...], bases: np.ndarray,
                 counts: np.ndarray, lx_strides: np.ndarray, load: bool):
        self.ctx, self.buf, self.strides, self.load = ctx, buf, tuple(strides), load
        self.layout = layout = ctx.layouts[buf]
        self.bases, self.counts, self.lx_strides = bases, counts, lx_strides
        column = bases % layout.row_len if layout.rows > 1 else np.zeros_like(bases)
        firsts, self.kind = unique_rows(np.column_stack([counts, lx_strides, column]))
        self.patterns = [self._pattern(int(i)) for i in firsts]
        phys = layout.phys(bases)
        self.shift = phys - phys[firsts][self.kind]
        self.count = np.array([len(p.bases) if p else 1 for p in self.patterns], dtype=np.int64)[self.kind]

    def _pattern(self, i: int):
        counts, lxs = [int(c) for c in self.counts[i]], [int(x) for x in self.lx_strides[i]]
        base = int(self.bases[i])
        try:
            p = pattern(self.layout, base, counts, self.strides, lxs)
        except NotAffine:
            return None
        spills = p.bytes != math.prod(counts) * self.layout.itemsize
        if not self.load and spills and (base + counts[-1]) % self.layout.row_len:
            return None  # whole sticks would overwrite the columns after the box
        return p

    def fill(self, cmds: np.ndarray, rows: np.ndarray, lx_off: np.ndarray) -> None:
        """Fill the commands at rows[i] .. rows[i] + count[i] - 1 for every item."""
        slot = self.ctx.slot(self.buf)
        cmds["op"][np.repeat(rows, self.count) + _ranks(self.count)] = OP_LOAD if self.load else OP_STORE
        for u, p in enumerate(self.patterns):
            sel = np.flatnonzero(self.kind == u)
            if p is None:
                for i in sel:
                    self._descriptors(cmds, int(rows[i]), int(i), int(lx_off[i]), slot)
                continue
            for j, (dram, lxb) in enumerate(p.bases):
                c = cmds[rows[sel] + j]
                dev, lx = self.shift[sel] + dram, lx_off[sel] + lxb
                if self.load:
                    c["src_slot"], c["src_off"], c["dst_off"] = slot, dev, lx
                else:
                    c["dst_slot"], c["dst_off"], c["src_off"] = slot, dev, lx
                c["run_bytes"], c["ndims"] = p.run, len(p.dims)
                for k, d in enumerate(p.dims):
                    c["count"][:, k] = d.count
                    c["src_stride"][:, k] = d.src if self.load else d.dst
                    c["dst_stride"][:, k] = d.dst if self.load else d.src
                cmds[rows[sel] + j] = c

    def _descriptors(self, cmds: np.ndarray, row: int, i: int, lx_off: int, slot: int) -> None:
        dev, lx, nbytes = descriptor_runs(self.layout, int(self.bases[i]), tuple(int(c) for c in self.counts[i]),
                                          self.strides, lx_off, tuple(int(x) for x in self.lx_strides[i]))
        descs = np.zeros(nbytes.size, dtype=DESC)
        descs["src_off"], descs["dst_off"] = (dev, lx) if self.load else (lx, dev)
        descs["bytes"] = nbytes
        c = cmds[row]
        c["flags"] = DMA_DESCS
        c["src_slot"], c["dst_slot"] = (slot, 0) if self.load else (0, slot)
        c["src_off"], c["desc_count"] = self.ctx.program.add_descs(descs), nbytes.size
        cmds[row] = c


def _ranks(count: np.ndarray) -> np.ndarray:
    """0, 1, ..., count[i] - 1 for every i, concatenated."""
    return np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
