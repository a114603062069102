"""A loop kernel's decision record: what construction decides once, as the native builder
takes it (``spy_loop_record``, native/spyre.h).

Deciding is Python's: the analysis, the tiles, the scratchpad layout, the SFU stage
programs (instructions for any tile of a parity, :class:`~.stages.Template`), each access
as an affine box with its mask and regions, the tile constants as formulas, and the order
of the program's slots. Building is C's (``spy_build_loop``, native/build_loop.c): per
launch it makes every tile's boxes and their DMA patterns or descriptor lists, the gathers'
row pieces, the SFU instructions of each tile's rows and its prologue, the dependencies,
and encodes the block. The record is made once per kernel and target, with the cffi
structures and the arrays they point into, and every later build hands it over as it is.
"""

from __future__ import annotations

import functools
import operator
import weakref
from dataclasses import dataclass

import numpy as np

from ...ir import LoopKernel
from ...native import ffi, lib
from ...program import INSTR, LOOP_INSTR, LOOP_MERGE, LOOP_TILE, OP_GATHER, OP_LOAD, OP_SCATTER, OP_STORE
from ..context import BuildContext, ScratchpadOverflow
from ..sfu import ITEMSIZE, KIND_CODE, ROW, TILE
from .analysis import Unsupported, Value, analyse
from .reuse import Broadcast, plan_reuse
from .scratchpad import ScratchpadLayout, lay_out
from .stages import StagePrograms, element_rows
from .tiling import Tile, Tiling, choose_tiling

MAX_VARS = lib.SPY_LOOP_MAX_VARS
# A record's arrays live as long as the record does, whoever holds it (cffi pointers in a
# structure keep nothing alive by themselves).
_ARRAYS_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LoopRecord:
    """Everything a build of one loop kernel on one target and buffer geometry needs."""

    tiling: Tiling
    layout: ScratchpadLayout
    slot_of: dict[str, int]  # the program's slots: the buffers, in the order tiles first use them
    record: object           # the spy_loop_record (cffi), its arrays kept alive with it


def decide(ctx: BuildContext, k: LoopKernel) -> LoopRecord:
    """The decision record of `k` for the context's target, layouts and offsets; raises
    :class:`~spyre_rt.construct.Refused` for a kernel construction cannot build there."""
    a = analyse(k)
    if a.n_vars > MAX_VARS:
        raise Unsupported(f"kernel {k.name} has {a.n_vars} loop variables, more than {MAX_VARS}")
    target = ctx.target
    tiling = choose_tiling(a, target)
    layout = lay_out(a, tiling.rows_per_tile, tiling.scratch_needs, target.stick_bytes, merge_rows=tiling.merge_rows,
                     merge_regions=tiling.merge_regions, merged=tiling.merged)
    if layout.peak > target.scratchpad_bytes:
        raise ScratchpadOverflow(f"kernel {k.name} needs {layout.peak} bytes of scratchpad")
    reuse = plan_reuse(tiling, target)
    stages = StagePrograms(ctx, tiling, layout, reuse)
    programs = [[stages.stage(lvl, slot) for slot in (0, 1)] for lvl in range(a.levels)]
    moving = [v for v in a.loads + a.stores if v.op.id not in reuse.views
              and (v.op.access.ind or any(_moves(tiling, v, t) for t in tiling.tiles))]
    for v in moving:
        if v.op.access.ind:
            _check_gather(ctx, tiling, v)
    buffers = _slot_order(tiling, moving)
    slot_of = {b: i for i, b in enumerate(buffers)}

    instrs = _instrs([p for pair in programs for p in pair])
    stage_arr = ffi.new("spy_loop_stage[]", max(1, a.levels))
    at = 0
    for lvl, (p0, p1) in enumerate(programs):
        stage_arr[lvl].first = [at, at + len(p0)]
        stage_arr[lvl].count = len(p0)
        at += len(p0) + len(p1)
    accesses = ffi.new("spy_loop_access[]", max(1, len(moving)))
    for i, v in enumerate(moving):
        _fill_access(accesses[i], ctx, tiling, layout, v, slot_of, reuse.broadcasts.get(v.op.id))
    consts = ffi.new("spy_loop_const[]", max(1, len(layout.tile_consts)))
    for i, c in enumerate(layout.tile_consts):
        _fill_const(consts[i], ctx, tiling, layout, stages, c)
    tiles = np.zeros(max(1, len(tiling.tiles)), dtype=LOOP_TILE)
    for i, t in enumerate(tiling.tiles):
        tiles[i]["core"], tiles[i]["size"], tiles[i]["start"] = t.core, t.size, t.start
        tiles[i]["fixed"][: len(t.fixed)] = t.fixed
    extents = ffi.new("uint64_t[]", [ctx.layouts[b].nbytes for b in buffers] or [0])
    merges, tile_merge, merge_off = _merges(tiling, layout, moving)
    tile_buf, instr_buf = ffi.from_buffer(tiles), ffi.from_buffer(instrs)
    merge_buf, tile_merge_buf, merge_off_buf = (ffi.from_buffer(x) for x in (merges, tile_merge, merge_off))
    rec = ffi.new("spy_loop_record *", {
        "num_cores": target.num_cores, "stick_bytes": target.stick_bytes,
        "scratchpad_bytes": target.scratchpad_bytes, "lx_bytes": layout.peak,
        "nvars": a.n_vars, "nrow": a.n_row_vars, "block": tiling.block, "rows_per_tile": tiling.rows_per_tile,
        "levels": a.levels, "nslots": len(buffers), "naccesses": len(moving), "ntiles": len(tiling.tiles),
        "ninstrs": at, "nconsts": len(layout.tile_consts),
        "sizes": list(k.sizes), "slot_extent": extents, "accesses": accesses,
        "tiles": ffi.cast("spy_loop_tile *", tile_buf), "stages": stage_arr,
        "instrs": ffi.cast("spy_loop_instr *", instr_buf), "consts": consts, "nmerges": len(tiling.merges),
        "merges": ffi.cast("spy_loop_merge *", merge_buf), "tile_merge": ffi.cast("int32_t *", tile_merge_buf),
        "merge_off": ffi.cast("uint32_t *", merge_off_buf)})
    _ARRAYS_OF[rec] = (extents, accesses, consts, stage_arr, tiles, tile_buf, instrs, instr_buf, merges, tile_merge,
                       merge_off, merge_buf, tile_merge_buf, merge_off_buf)
    return LoopRecord(tiling, layout, slot_of, rec)


def _merges(tiling: Tiling, layout: ScratchpadLayout, moving: list[Value]) -> tuple[np.ndarray, ...]:
    """The record's groups of merged stores: each group's rows and region, each tile's
    group, where each merged access's rows sit in a region (see spy_loop_merge)."""
    merges = np.zeros(max(1, len(tiling.merges)), dtype=LOOP_MERGE)
    for i, m in enumerate(tiling.merges):
        box = merges[i]["box"]
        box["core"], box["size"], box["start"] = m.core, m.size, m.start
        box["fixed"][: len(m.fixed)] = m.fixed
        merges[i]["lx_off"] = layout.merge_region(m.region)
    tile_merge = np.array([t.merge for t in tiling.tiles] or [-1], dtype=np.int32)
    merge_off = np.array([layout.merge_off.get(v.op.id, lib.SPY_LOOP_UNMERGED) for v in moving] or [0],
                         dtype=np.uint32)
    return merges, tile_merge, merge_off


def _instrs(programs: list) -> np.ndarray:
    rows = [r for p in programs for r in p.rows]
    out = np.zeros(max(1, len(rows)), dtype=LOOP_INSTR)
    if rows:
        out["instr"] = np.array(rows, dtype=INSTR)
        out["tile_rows"] = [w for p in programs for w in p.tile_rows]
    return out


def _moves(tiling: Tiling, v: Value, tile: Tile) -> bool:
    """Whether the tile's box of a direct load or store holds anything: its fixed
    variables inside the mask, and (for values along the rows) some rows of the tile."""
    acc = v.op.access
    dom = {j: (lo, hi) for j, lo, hi in acc.domain}
    if any(j in dom and not dom[j][0] <= x < dom[j][1] for j, x in enumerate(tile.fixed)):
        return False
    if v.kind in (TILE, ROW):
        for j, count, _ in tiling.tile_rows(tile.size):
            if j in dom:
                lo, hi = dom[j]
                if j == tiling.block:
                    lo, hi = max(0, lo - tile.start), min(count, hi - tile.start)
                if hi <= lo:
                    return False
    return True


def _slot_order(tiling: Tiling, moving: list[Value]) -> tuple[str, ...]:
    """The buffers in the order the tiles' commands first use them: per tile, its direct
    loads, its gathers by stage, its stores and scatters."""
    a = tiling.analysis
    loads = [v for v in moving if v.op.op == "load"]
    stores = [v for v in moving if v.op.op == "store"]
    gathers = [v for lvl in range(1, a.levels) for v in loads if v.op.access.ind and v.level == lvl]
    order: dict[str, None] = {}
    for tile in tiling.tiles:
        for v in [v for v in loads if not v.op.access.ind] + gathers + stores:
            if v.op.access.buf not in order and (v.op.access.ind or _moves(tiling, v, tile)):
                order[v.op.access.buf] = None
    return tuple(order)


def _check_gather(ctx: BuildContext, tiling: Tiling, v: Value) -> None:
    """Refuses a gather or scatter the card cannot move: a block of columns that reaches
    more rows than its table has, or columns that step backwards through a table of rows."""
    acc = v.op.access
    table = ctx.layouts[acc.buf]
    if element_rows(table, acc, v.kind, tiling.analysis.n_row_vars):
        return
    shift, cols = tiling.gathered_columns(acc, v.kind)
    reach = sum(max(0, acc.coeffs[j] * (n - 1)) for j, n, _, _ in cols)
    for tile in tiling.tiles:
        c0 = (ctx.offset(acc.buf) + tiling.origin(acc, tile) + shift) % table.row_len
        if table.rows - (c0 + reach) // table.row_len < 1:
            raise Unsupported("a gathered block taller than its table")
    if all(n > 0 for _, n, _, _ in cols) and table.rows > 1 and any(acc.coeffs[j] < 0 for j, _, _, _ in cols):
        raise Unsupported("gather/scatter columns that leave the row their index picks")


def _fill_access(rec, ctx: BuildContext, tiling: Tiling, layout: ScratchpadLayout, v: Value,
                 slot_of: dict[str, int], broadcast: Broadcast | None) -> None:
    """The access as the builder takes it; a broadcast load's box is masked to index 0 of the
    variables it is broadcast along (the tile's SFU copies the rest)."""
    acc = v.op.access
    table = ctx.layouts[acc.buf]
    load = v.op.op == "load"
    rec.op = (OP_GATHER if load else OP_SCATTER) if acc.ind else (OP_LOAD if load else OP_STORE)
    rec.kind = KIND_CODE[v.kind]
    rec.slot = slot_of[acc.buf]
    rec.level = v.level
    rec.layout = {"rows": table.rows, "row_len": table.row_len, "itemsize": table.itemsize,
                  "stick_bytes": table.stick_bytes}
    rec.base = acc.const + ctx.offset(acc.buf)
    rec.itemsize = ITEMSIZE[v.dtype]
    domain = list(acc.domain) + [(j, 0, 1) for j in (broadcast.variables if broadcast else ())]
    rec.masked = functools.reduce(operator.or_, (1 << j for j, _, _ in domain), 0)
    for j, lo, hi in domain:
        rec.lo[j], rec.hi[j] = lo, hi
    rec.coeffs = list(acc.coeffs)
    slots = layout.slots[v.op.id]
    rec.lx_off, rec.lx_pitch = list(slots.off), slots.pitch
    if acc.ind:
        rec.idx_off = list(layout.index_slots[v.op.id].off)
        rec.element_rows = element_rows(table, acc, v.kind, tiling.analysis.n_row_vars)


def _fill_const(rec, ctx: BuildContext, tiling: Tiling, layout: ScratchpadLayout, stages: StagePrograms,
                const: tuple[str, str]) -> None:
    """The prologue's constant of a tile: its origin in index terms, or the first table row
    of a gather or scatter (see StagePrograms)."""
    vid, what = const
    v = tiling.analysis.values[vid]
    acc = v.op.access
    rec.lx_off = layout.const_off[const]
    rec.coeffs = list(acc.coeffs)
    if what == "index":
        rec.base, rec.unit = acc.const, 1
    else:
        shift, _ = tiling.gathered_columns(acc, v.kind)
        rec.base, rec.unit = acc.const + ctx.offset(acc.buf) + shift, stages.row_unit(v)

