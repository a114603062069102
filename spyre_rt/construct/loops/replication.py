"""All tiles' commands from a few recorded ones.

Tiles are sorted into classes by everything that shapes their commands: their slot,
whether they wait for the tile two places back, their block size, and per access the box
they move and its column in the storage row. Each class's commands are recorded once (from
its first tile) and replicated over its tiles with array arithmetic: per tile, Python does
a few integer operations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ...program import CMD_DMA, CMD_SFU
from ..context import BuildContext
from .commands import FREE_IN, FREE_OUT, TileTemplate, box, record_tile
from .scratchpad import ScratchpadLayout
from .stages import StagePrograms
from .tiling import Tiling


@dataclass
class TileClass:
    """Tiles whose commands share one template."""

    template: TileTemplate
    cmds: np.ndarray
    deps: np.ndarray
    rep_phys: np.ndarray   # the physical offset of each access's box in the recorded tile
    last_sfu: int | None   # within the tile: what a load two tiles later waits for
    last_out: int | None   # within the tile: what a first SFU command two tiles later waits for
    tiles: list[int] = field(default_factory=list)


@dataclass
class _Placement:
    """Where each tile's commands and dependencies go in the program, and what its
    template's FREE_IN / FREE_OUT dependencies name."""

    cmd_start: np.ndarray   # per tile: its first command
    dep_start: np.ndarray   # per tile: its first dependency
    free_in: np.ndarray     # per tile: the command its FREE_IN names
    free_out: np.ndarray    # per tile: the command its FREE_OUT names
    ncmds: int = 0
    ndeps: int = 0


def replicate(ctx: BuildContext, tiling: Tiling, layout: ScratchpadLayout, memo: Callable[[], dict]) -> None:
    """Add all tiles' commands to the context's program, in per-core order, with their
    dependencies. `memo` makes the dicts that hold tile classes, stage programs and DMA
    patterns for this construction."""
    a, tiles = tiling.analysis, tiling.tiles
    direct = [v for v in a.loads + a.stores if not v.op.access.ind]
    accesses = {v.op.id: i for i, v in enumerate(direct)}
    fixed = np.array([tile.fixed for tile in tiles], dtype=np.int64).reshape(len(tiles), -1)
    start = np.array([tile.start for tile in tiles], dtype=np.int64)
    phys, tile_keys = _tile_keys(ctx, tiling, layout, direct, fixed, start)
    stages = StagePrograms(ctx, tiling, layout)
    classes, placed = _classify(ctx, tiling, layout, stages, accesses, phys, tile_keys, memo)
    cmds = np.zeros(placed.ncmds, dtype=CMD_DMA)
    deps = np.zeros(placed.ndeps, dtype=np.int64)
    cores = np.array([tile.core for tile in tiles], dtype=np.uint16)
    tile_consts = stages.tile_consts(fixed, start) if layout.tile_consts else None
    prologue_first = None
    for c in classes.values():
        idx = np.array(c.tiles)
        block = _class_commands(ctx, c, idx, cores, phys, placed)
        if c.template.prologue is not None:
            j, instrs = c.template.prologue
            if prologue_first is None:  # every tile's prologue, written once
                every = np.repeat(instrs[None, :], len(tiles), axis=0)
                every["src"][:, :, 0]["v"] = tile_consts.view(np.uint64)
                prologue_first = ctx.program.add_instrs(every.reshape(-1))
            block.view(CMD_SFU)["instr_begin"][:, j] = prologue_first + idx * len(instrs)
        cmds[placed.cmd_start[idx][:, None] + np.arange(len(c.cmds))] = block
        if len(c.deps):
            deps[placed.dep_start[idx][:, None] + np.arange(len(c.deps))] = _class_deps(c, idx, placed)
    ctx.program.add(cmds, deps.astype(np.uint32))


def _tile_keys(ctx: BuildContext, tiling: Tiling, layout: ScratchpadLayout, direct: list, fixed: np.ndarray,
               start: np.ndarray) -> tuple[np.ndarray, list[tuple]]:
    """Per tile: the physical offset of each direct access's box, and what fixes its
    commands (block size, and per access its box and column in the row). Computed for all
    tiles at once where an access has no mask (a masked access clips its box tile by tile)."""
    tiles = tiling.tiles
    ntiles = len(tiles)
    phys = np.zeros((ntiles, max(1, len(direct))), dtype=np.int64)
    key_cols: list[list] = []
    for i, v in enumerate(direct):
        acc = v.op.access
        storage = ctx.layouts[acc.buf]
        offset = ctx.offset(acc.buf)
        if not acc.domain:
            base = tiling.origins(acc, fixed, start, offset)
            phys[:, i] = storage.phys(base)
            # a one-row storage is linear: any two boxes are a constant apart
            key_cols.append((base % storage.row_len).tolist() if storage.rows > 1 else [0] * ntiles)
            continue
        col = []
        for t, tile in enumerate(tiles):
            b = box(tiling, v, tile, layout.slots[v.op.id], offset)
            if b is None:
                col.append(None)
                continue
            col.append((tuple(b.counts), tuple(b.strides), tuple(b.lx_strides), b.lx_off,
                        b.base % storage.row_len if storage.rows > 1 else 0))
            phys[t, i] = storage.phys(b.base)
        key_cols.append(col)
    for v in tiling.analysis.loads + tiling.analysis.stores:
        acc = v.op.access
        if acc.ind:
            key_cols.append((tiling.origins(acc, fixed, start, ctx.offset(acc.buf))
                             % ctx.layouts[acc.buf].row_len).tolist())
    return phys, list(zip([tile.size for tile in tiles], *key_cols, strict=True))


def _classify(ctx: BuildContext, tiling: Tiling, layout: ScratchpadLayout, stages: StagePrograms,
              accesses: dict[str, int], phys: np.ndarray, tile_keys: list[tuple],
              memo: Callable[[], dict]) -> tuple[dict[tuple, TileClass], _Placement]:
    """Sort the tiles into classes, recording each class's template from its first tile,
    and place every tile's commands in per-core order."""
    classes: dict[tuple, TileClass] = memo()
    stage_programs: dict = memo()
    programs: dict = memo()
    pattern_cache: dict = memo()
    ntiles = len(tiling.tiles)
    placed = _Placement(*(np.zeros(ntiles, dtype=np.int64) for _ in range(4)))
    last_sfu: list[int | None] = [None] * ntiles
    last_out: list[int | None] = [None] * ntiles
    for t, tile in enumerate(tiling.tiles):
        has_in = tile.seq >= 2 and last_sfu[t - 2] is not None
        has_out = tile.seq >= 2 and last_out[t - 2] is not None
        key = (tile.seq % 2, has_in, has_out, tile_keys[t])
        c = classes.get(key)
        if c is None:
            em = TileTemplate(ctx, tiling, programs, pattern_cache)
            ls, lo = record_tile(em, stages, layout, tile, accesses, has_in, has_out, stage_programs)
            c = classes[key] = TileClass(em, em.commands(), np.asarray(em.deps, dtype=np.int64), phys[t].copy(), ls, lo)
        c.tiles.append(t)
        placed.cmd_start[t], placed.dep_start[t] = placed.ncmds, placed.ndeps
        if has_in:
            placed.free_in[t] = last_sfu[t - 2]
        if has_out:
            placed.free_out[t] = last_out[t - 2]
        last_sfu[t] = None if c.last_sfu is None else placed.ncmds + c.last_sfu
        last_out[t] = None if c.last_out is None else placed.ncmds + c.last_out
        placed.ncmds += len(c.cmds)
        placed.ndeps += len(c.deps)
    return classes, placed


def _class_commands(ctx: BuildContext, c: TileClass, idx: np.ndarray, cores: np.ndarray, phys: np.ndarray,
                    placed: _Placement) -> np.ndarray:
    """The commands of the class's tiles (tiles x template commands): the template on each
    tile's core, with its dependency range and DRAM offsets moved to the tile's."""
    em = c.template
    block = np.repeat(c.cmds[None, :], len(idx), axis=0)
    block["core"] = cores[idx][:, None]
    block["dep_begin"] += placed.dep_start[idx][:, None].astype(np.uint32)
    moved = phys[idx] - c.rep_phys  # how far each tile's boxes are from the recorded tile's
    for j, a, fld in em.shifted:
        block[fld][:, j] = (block[fld][:, j].astype(np.int64) + moved[:, a]).astype(np.uint64)
    for j, a, fld, descs in em.descs:
        rep = np.repeat(descs[None, :], len(idx), axis=0)
        rep[fld] = (rep[fld].astype(np.int64) + moved[:, a][:, None]).astype(np.uint64)
        d0 = ctx.program.add_descs(rep.reshape(-1))
        block["src_off"][:, j] = d0 + np.arange(len(idx), dtype=np.uint64) * len(descs)
    return block


def _class_deps(c: TileClass, idx: np.ndarray, placed: _Placement) -> np.ndarray:
    """The dependencies of the class's tiles (tiles x template dependencies): commands of
    the tile itself moved to its place, FREE_IN / FREE_OUT to what they name for it."""
    own = placed.cmd_start[idx][:, None] + c.deps
    return np.where(c.deps == FREE_IN, placed.free_in[idx][:, None],
                    np.where(c.deps == FREE_OUT, placed.free_out[idx][:, None], own))
