"""The commands of one tile, recorded as a template for the tiles of its class.

Per tile a core runs:

    LOAD (inputs) -> prologue -> SFU stage 0 -> GATHER -> SFU stage 1 ... -> STORE / SCATTER

A load waits only for the last SFU command of the tile two places back on its core (the
tile that used the same slot), a tile's first SFU command for the stores of that tile:
the template names those two dependencies FREE_IN and FREE_OUT, and replication fills
them in per tile.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ...kernels import Access
from ...layout import StickLayout
from ...native import lib
from ...program import (
    CMD_DMA,
    CMD_GATHER,
    CMD_SFU,
    DESC,
    DMA_DESCS,
    OP_GATHER,
    OP_LOAD,
    OP_SCATTER,
    OP_SFU,
    OP_STORE,
)
from ..access import NotAffine, Pattern, descriptor_runs, pattern
from ..context import BuildContext
from ..sfu import COL, ITEMSIZE, ROW, TILE, Program
from .analysis import Unsupported, Value
from .scratchpad import ScratchpadLayout, Slots
from .stages import StagePrograms, element_rows
from .tiling import Tile, Tiling

FREE_IN, FREE_OUT = -1, -2  # template dependencies on the tile two places back on the core

_ZERO3 = (0, 0, 0)
_PAD = (0,) * 16
_SFU_RES = (0,) * 22
_GATHER_RES = (0, 0, 0, 0)


class Box(NamedTuple):
    """The part of a load or store one tile moves."""

    base: int            # its first element in the buffer's storage
    counts: list[int]    # its dimensions, outermost first
    strides: list[int]   # in elements of the storage
    lx_strides: list[int]  # in bytes of the scratchpad slot
    lx_off: int          # where it starts in the slot (a mask may cut its first rows)


def box(tiling: Tiling, v: Value, tile: Tile, lx: Slots, buffer_offset: int) -> Box | None:
    """The box of load/store `v` that `tile` moves, or None when its mask excludes the
    whole tile."""
    acc = v.op.access
    e = ITEMSIZE[lx.dtype]
    dom = {j: (lo, hi) for j, lo, hi in acc.domain}
    for j, x in enumerate(tile.fixed):
        if j in dom and not dom[j][0] <= x < dom[j][1]:
            return None
    base = buffer_offset + tiling.origin(acc, tile)
    counts, strides, lxs = [], [], []
    lx_off = 0
    if v.kind in (TILE, ROW):
        row_pitch = lx.pitch * e if v.kind == TILE else e
        for j, count, stride in tiling.tile_rows(tile.size):
            lo, hi = 0, count
            if j in dom:
                if j == tiling.block:  # the mask's range, seen from the tile's first block
                    lo = max(0, dom[j][0] - tile.start)
                    hi = min(count, dom[j][1] - tile.start)
                else:
                    lo, hi = dom[j]
                if hi <= lo:
                    return None
            base += acc.coeffs[j] * lo
            lx_off += lo * stride * row_pitch
            counts.append(hi - lo)
            strides.append(acc.coeffs[j])
            lxs.append(stride * row_pitch)
    if v.kind in (TILE, COL):
        for j, count, stride in tiling.tile_cols():
            lo, hi = dom.get(j, (0, count))
            base += acc.coeffs[j] * lo
            lx_off += lo * stride * e
            counts.append(hi - lo)
            strides.append(acc.coeffs[j])
            lxs.append(stride * e)
    if not counts:
        counts, strides, lxs = [1], [1], [e]
    return Box(base, counts, strides, lxs, lx_off)


class TileTemplate:
    """The commands of one tile, recorded once per class of alike tiles and replicated over
    the class with numpy (see :mod:`.replication`).

    Tiles of a class differ only in their core, the DRAM offsets of their loads and stores
    (by a per-access shift: the class fixes each box and its column in the row, so tiles
    are whole rows apart and the stick layout maps them by a constant), their prologue
    immediates and the commands they depend on. Commands are collected as plain tuples
    per command format and turned into one array at the end."""

    def __init__(self, ctx: BuildContext, tiling: Tiling, programs: dict, pattern_cache: dict):
        self.ctx = ctx
        self.tiling = tiling
        self.records: dict[np.dtype, list[tuple]] = {CMD_DMA: [], CMD_SFU: [], CMD_GATHER: []}
        self.positions: dict[np.dtype, list[int]] = {CMD_DMA: [], CMD_SFU: [], CMD_GATHER: []}
        self.deps: list[int] = []      # >= 0: a command of this tile; FREE_IN / FREE_OUT
        self.n = 0
        self.programs = programs       # stage program key -> first instruction
        self.pattern_cache = pattern_cache
        self.shifted: list[tuple[int, int, str]] = []   # (command, access, field moved by the shift)
        self.descs: list[tuple[int, int, str, np.ndarray]] = []  # (command, access, field, descriptors)
        self.prologue: tuple[int, np.ndarray] | None = None      # (command, instructions)

    def _push(self, fmt: np.dtype, head: tuple, body: tuple, deps: list[int]) -> int:
        """Append one command: (op, flags, core) + its dependency range + the format's fields."""
        i = self.n
        self.records[fmt].append(head + (len(self.deps), len(deps), 0) + body)
        self.positions[fmt].append(i)
        self.deps.extend(deps)
        self.n += 1
        return i

    def sfu(self, prog: Program, key, deps: list[int]) -> list[int]:
        """An SFU command running `prog`; `key` names a stage program all tiles share,
        None the prologue (instructions of its own for every tile, filled in later)."""
        if key is None:
            i = self._push(CMD_SFU, (OP_SFU, 0, 0), (0, len(prog), _SFU_RES, _PAD), deps)
            self.prologue = (i, prog.array())
            return [i]
        first = self.programs.get(key)
        if first is None:
            first = self.programs[key] = self.ctx.program.add_instrs(prog.array())
        return [self._push(CMD_SFU, (OP_SFU, 0, 0), (first, len(prog), _SFU_RES, _PAD), deps)]

    def dma(self, op: int, access: int, buf: str, b: Box, lx_base: int, deps: list[int]) -> list[int]:
        """The DMA commands of a load or store box: a compact pattern where the stick
        layout allows one, else a descriptor list."""
        layout = self.ctx.layouts[buf]
        slot = self.ctx.slot(buf)
        # Everything the cached pattern and stride tuples depend on: a store's source and
        # destination strides are a load's swapped, so the direction is part of the key.
        key = (op, buf, tuple(b.counts), tuple(b.strides), tuple(b.lx_strides), b.base % layout.row_len)
        hit = self.pattern_cache.get(key)
        if hit is None:
            try:
                p = pattern(layout, b.base, b.counts, b.strides, b.lx_strides)
                hit = (p, layout.phys(b.base), _dims_tuples(p, op == OP_LOAD))
            except NotAffine:
                hit = (None, 0, None)
            self.pattern_cache[key] = hit
        p, origin, dims = hit
        load = op == OP_LOAD
        if p is None:
            return self._descriptor_dma(op, access, slot, layout, b, lx_base + b.lx_off, load, deps)
        field = "src_off" if load else "dst_off"
        shift = layout.phys(b.base) - origin
        count, sstr, dstr, ndims = dims
        out = []
        for dram, lxb in p.bases:
            dev, lxo = dram + shift, lx_base + b.lx_off + lxb
            if load:
                src_slot, dst_slot, src, dst = slot, 0, dev, lxo
            else:
                src_slot, dst_slot, src, dst = 0, slot, lxo, dev
            i = self._push(CMD_DMA, (op, 0, 0), (src_slot, dst_slot, src, dst, p.run, ndims, count, 0,
                                                 sstr, dstr, _PAD), deps)
            self.shifted.append((i, access, field))
            out.append(i)
        return out

    def _descriptor_dma(self, op: int, access: int, slot: int, layout: StickLayout, b: Box, lx_base: int,
                        load: bool, deps: list[int]) -> list[int]:
        """A descriptor-list DMA for accesses with no compact pattern (one run per element
        run that is contiguous on both sides)."""
        dev, lx, lengths = descriptor_runs(layout, b.base, b.counts, b.strides, lx_base, b.lx_strides)
        descs = np.zeros(lengths.size, dtype=DESC)
        if load:
            descs["src_off"], descs["dst_off"] = dev, lx
        else:
            descs["src_off"], descs["dst_off"] = lx, dev
        descs["bytes"] = lengths
        src_slot, dst_slot = (slot, 0) if load else (0, slot)
        i = self._push(CMD_DMA, (op, DMA_DESCS, 0), (src_slot, dst_slot, 0, 0, 0, 0, _ZERO3, int(lengths.size),
                                                     _ZERO3, _ZERO3, _PAD), deps)
        self.descs.append((i, access, "src_off" if load else "dst_off", descs))
        return [i]

    def gather(self, op: int, v: Value, tile: Tile, lx: Slots, data_off: int, idx_off: int,
               deps: list[int]) -> list[int]:
        """The GATHER (or SCATTER) commands moving the tile's rows of an indirect access:
        one per piece of a row (see :func:`row_pieces`), the buffer rows read from the
        index slot."""
        acc = v.op.access
        layout = self.ctx.layouts[acc.buf]
        e = layout.itemsize
        rows = tile.rows(self.tiling.inner_rows)
        pitch = (lx.pitch * e) if v.kind == TILE else e
        table_slot = self.ctx.slot(acc.buf)
        if element_rows(layout, acc, v.kind, self.tiling.analysis.n_row_vars):
            # one item per index, the index counting items of the table's one row
            return [self._push(CMD_GATHER, (op, 0, 0), (
                table_slot, idx_off, lib.SPY_DT_I64, rows, 0, e, layout.row_len, data_off, pitch, e, 0,
                (0, 0), (0, 0), _GATHER_RES, _PAD), deps)]
        # the rows an index may pick: a row's columns can reach rows below it (a gathered
        # (5, 6) block of a (4, 5, 6) tensor spans five rows of its layout)
        limit = layout.rows - self._rows_below(acc, v.kind, tile, layout)
        if limit < 1:
            raise Unsupported("a gathered block taller than its table")
        out = []
        for dram, lxb, run, dims in self._row_pieces(acc, v.kind, tile, layout):
            count = tuple(d.count for d in dims) + (0,) * (2 - len(dims))
            stride = tuple(d.src for d in dims) + (0,) * (2 - len(dims))
            out.append(self._push(CMD_GATHER, (op, 0, 0), (
                table_slot, idx_off, lib.SPY_DT_I64, rows, dram, layout.stick_bytes, limit, data_off + lxb,
                pitch, run, len(dims), count, stride, _GATHER_RES, _PAD), deps))
        return out

    def _rows_below(self, acc: Access, kind: str, tile: Tile, layout: StickLayout) -> int:
        """The rows of its table a gathered row's columns reach below the row its index picks."""
        shift, cols = self.tiling.gathered_columns(acc, kind)
        c0 = (self.ctx.offset(acc.buf) + self.tiling.origin(acc, tile) + shift) % layout.row_len
        last = c0 + sum(max(0, acc.coeffs[j] * (n - 1)) for j, n, _, _ in cols)
        return last // layout.row_len

    def _row_pieces(self, acc: Access, kind: str, tile: Tile, layout: StickLayout) -> tuple:
        """The pieces of one gathered row's columns, packed in the scratchpad."""
        shift, cols = self.tiling.gathered_columns(acc, kind)
        c0 = (self.ctx.offset(acc.buf) + self.tiling.origin(acc, tile) + shift) % layout.row_len
        key = ("gather", acc.buf, cols, c0)
        pieces = self.pattern_cache.get(key)
        if pieces is None:
            pieces = self.pattern_cache[key] = row_pieces(layout, c0, acc, cols)
        return pieces

    def commands(self) -> np.ndarray:
        cmds = np.zeros(self.n, dtype=CMD_DMA)
        for fmt, records in self.records.items():
            if records:
                cmds.view(fmt)[np.array(self.positions[fmt])] = np.array(records, dtype=fmt)
        return cmds


def row_pieces(layout: StickLayout, c0: int, acc: Access, cols: tuple) -> tuple:
    """The patterns of the commands moving one gathered row's columns, each (DRAM offset
    from the row's start, scratchpad offset from the row's, run bytes, outer dimensions),
    its scratchpad side packed: one compact pattern where the stick layout allows it, else
    the columns cut where they cross a stick boundary (a contiguous run that starts at an
    unaligned column, as the ``sin`` half of an fp16 rotary row of 96 does at column 48),
    into as few pieces as the patterns allow."""
    e = layout.itemsize
    counts = [c for _, c, _, _ in cols] or [1]
    strides = [acc.coeffs[j] for j, _, _, _ in cols] or [1]
    lx_strides = [s * e for _, _, s, _ in cols] or [e]
    lx0 = sum(lo * s * e for _, _, s, lo in cols)
    if any(n <= 0 for n in counts):
        return ()
    return tuple(_pieces(layout, c0, counts, strides, lx_strides, lx0))


def _packed(layout: StickLayout, c0: int, counts, strides, lx_strides) -> Pattern | None:
    """The pattern of a box of a row if it is one whose scratchpad side is packed."""
    try:
        p = pattern(layout, c0, counts, strides, lx_strides)
    except NotAffine:
        return None
    if len(p.dims) > 2 or any(d.dst != p.run * math.prod(x.count for x in p.dims[:i]) for i, d in enumerate(p.dims)):
        return None
    return p


def _pieces(layout: StickLayout, c0: int, counts: list[int], strides: list[int], lx_strides: list[int],
            lx0: int) -> list[tuple]:
    p = _packed(layout, c0, counts, strides, lx_strides)
    if p is not None:
        return [(dram, lx0 + lxb, p.run, p.dims) for dram, lxb in p.bases]
    outer = next((k for k, n in enumerate(counts) if n > 1), None)
    if outer is None:
        raise Unsupported("gather/scatter columns that leave the row their index picks")
    # cut the outermost dimension: first where its steps cross a stick boundary
    n, st, lst = counts[outer], strides[outer], lx_strides[outer]
    s = layout.stick_elems
    cuts = sorted({m for m in range(1, n) if (c0 + m * st) % s == 0} | {n})
    out: list[tuple] = []
    i = 0
    while i < n:
        for b in reversed([m for m in cuts if m > i]):
            sub = counts[:outer] + [b - i] + counts[outer + 1:]
            p = _packed(layout, c0 + i * st, sub, strides, lx_strides)
            if p is not None:
                out += [(dram, lx0 + i * lst + lxb, p.run, p.dims) for dram, lxb in p.bases]
                i = b
                break
        else:  # not even up to the next boundary: one step of it, cut further inside
            one = counts[:outer] + [1] + counts[outer + 1:]
            out += _pieces(layout, c0 + i * st, one, strides, lx_strides, lx0 + i * lst)
            i += 1
    return out


def _dims_tuples(p: Pattern, load: bool):
    """A pattern's (counts, source strides, destination strides, dimensions), padded to
    the three a DMA command holds."""
    count = tuple(d.count for d in p.dims) + (0,) * (3 - len(p.dims))
    src = tuple(d.src if load else d.dst for d in p.dims) + (0,) * (3 - len(p.dims))
    dst = tuple(d.dst if load else d.src for d in p.dims) + (0,) * (3 - len(p.dims))
    return count, src, dst, len(p.dims)


def record_tile(em: TileTemplate, stages: StagePrograms, layout: ScratchpadLayout, tile: Tile,
                accesses: dict[str, int], has_in: bool, has_out: bool,
                stage_programs: dict) -> tuple[int | None, int | None]:
    """Record one tile's commands in `em`: loads, the prologue, per level an SFU stage and
    its gathers, then stores. Returns the tile's last SFU and last store commands (what
    the tile two places later waits for)."""
    a, tiling, ctx = stages.analysis, stages.tiling, em.ctx
    slot = tile.seq % 2
    rows = tile.rows(tiling.inner_rows)
    free_in = [FREE_IN] if has_in else []
    free_out = [FREE_OUT] if has_out else []
    issued: dict[int, list[int]] = {lvl: [] for lvl in range(a.levels + 1)}
    for v in a.loads:
        if v.op.access.ind:
            continue
        sl = layout.slots[v.op.id]
        b = box(tiling, v, tile, sl, ctx.offset(v.op.access.buf))
        if b is not None:
            issued[0] += em.dma(OP_LOAD, accesses[v.op.id], v.op.access.buf, b, sl.off[slot], free_in)
    prev: list[int] = []
    pro = stages.prologue(tile)
    if pro is not None:
        prev = em.sfu(pro, None, [])
    for lvl in range(a.levels):
        deps = issued[lvl] + prev + (free_out if lvl == 0 else [])
        key = (lvl, slot, rows, tile.size)
        prog = stage_programs.get(key)
        if prog is None:
            prog = stage_programs[key] = stages.stage(lvl, slot, rows, tile.size, Program)
        prev = em.sfu(prog, key, deps) if prog.rows else deps
        for v in a.loads:
            if v.op.access.ind and v.level == lvl + 1:
                sl = layout.slots[v.op.id]
                issued[lvl + 1] += em.gather(OP_GATHER, v, tile, sl, sl.off[slot],
                                             layout.index_slots[v.op.id].off[slot], prev + free_in)
    own = [i for i in prev if i >= 0]
    last_sfu = max(own) if own else (max(issued[0]) if issued[0] else None)
    outs: list[int] = []
    for v in a.stores:
        sl = layout.slots[v.op.id]
        if v.op.access.ind:
            outs += em.gather(OP_SCATTER, v, tile, sl, sl.off[slot], layout.index_slots[v.op.id].off[slot], prev)
            continue
        b = box(tiling, v, tile, sl, ctx.offset(v.op.access.buf))
        if b is not None:
            outs += em.dma(OP_STORE, accesses[v.op.id], v.op.access.buf, b, sl.off[slot], prev)
    return last_sfu, (max(outs) if outs else None)
