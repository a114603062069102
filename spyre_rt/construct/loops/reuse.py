"""Loads a tile serves from its own scratchpad instead of from DRAM.

Two kinds of load make a tile's DMAs fetch bytes its scratchpad already holds:

* a *broadcast* load does not vary along the innermost row variables of the tile (cos and
  sin of a rotary embedding: one row per position, read by every head at it). Its box
  would fetch each distinct row once per index of those variables; instead the record
  masks them to index 0, so the DMA fetches each row once, and SFU moves copy the rows
  of index 0 to the others (:class:`Broadcast`);
* a *shifted view* is a load masked to some columns that reads the same buffer, with the
  same coefficients, as an unmasked load of the tile, moved along one column variable
  (the halves of rotate_half, ``x[..., 64:]`` and ``x[..., :64]``, beside ``x``). One SFU
  move from that load's slot fills its own over the mask's columns, and it has no DMA
  (:class:`View`).

Either way the SFU copies what the DMA would have written, so every later instruction
reads the same values. A copy is chosen only where the cost model says it costs the SFU
less than the DMA its bytes would take at a core's share of the DRAM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...cost import CostModel
from ..sfu import ITEMSIZE, ROW, TILE
from .analysis import Value
from .tiling import Tiling


@dataclass(frozen=True)
class Broadcast:
    """A load fetched at index 0 of the innermost row variables it does not vary along."""

    load: str                    # its op id
    variables: tuple[int, ...]   # those row variables
    copies: int                  # the rows per fetched row: the product of their counts


@dataclass(frozen=True)
class View:
    """A masked load copied from another load's slot: tile columns [first, first + count) of
    its slot from columns [first + shift, ...) of the source's."""

    load: str
    source: str
    first: int
    count: int
    shift: int


@dataclass(frozen=True)
class Reuse:
    """The kernel's loads served from the scratchpad, by op id."""

    broadcasts: dict[str, Broadcast]
    views: dict[str, View]


def plan_reuse(tiling: Tiling, target: CostModel) -> Reuse:
    """The broadcasts and views worth making for the kernel's tiles."""
    a = tiling.analysis
    direct = [v for v in a.loads if not v.op.access.ind]
    views = {}
    sources = [v for v in direct if v.kind == TILE and not v.op.access.domain]
    for v in direct:
        view = next((w for w in (_view(tiling, v, s) for s in sources if s is not v) if w is not None), None)
        if view is not None and _cheaper(target, v, tiling.rows_per_tile, view.count, 1):
            views[v.op.id] = view
    broadcasts = {}
    for v in direct:
        b = None if v.op.id in views else _broadcast(tiling, v)
        if b is not None and _cheaper(target, v, tiling.rows_per_tile * (b.copies - 1) // b.copies,
                                      a.columns if v.kind == TILE else 1, b.copies - 1):
            broadcasts[v.op.id] = b
    return Reuse(broadcasts, views)


def _cheaper(target: CostModel, v: Value, rows: int, cols: int, moves: int) -> bool:
    """Whether `moves` SFU moves over `rows` x `cols` elements take a core less time than
    fetching them would at its share of the DRAM (every core fetching at once)."""
    fetched = target.charged_bytes(rows, cols, ITEMSIZE[v.dtype])
    share = target.dram_bytes_per_ns / target.num_cores
    return target.sfu_ns(rows * cols, fp32=False, instrs=moves) < fetched / share


def _broadcast(tiling: Tiling, v: Value) -> Broadcast | None:
    """The innermost row variables (inside the block variable) along which the load of a
    tile or row value does not vary and which its mask leaves whole; None if they make a
    single row each."""
    if v.kind not in (TILE, ROW):
        return None
    acc = v.op.access
    masked = {j for j, _, _ in acc.domain}
    variables = []
    for j, _, _ in reversed(tiling.tile_rows(tiling.block_size)):
        if j == tiling.block or acc.coeffs[j] or j in masked:
            break
        variables.append(j)
    sizes = tiling.analysis.kernel.sizes
    copies = math.prod(sizes[j] for j in variables)
    return Broadcast(v.op.id, tuple(sorted(variables)), copies) if copies > 1 else None


def _view(tiling: Tiling, v: Value, s: Value) -> View | None:
    """`v` as `s` moved along one column variable, if it is a tile value masked along the
    columns only, to a box of contiguous tile columns that the move keeps inside the tile."""
    a = tiling.analysis
    acc, src = v.op.access, s.op.access
    if (v.kind != TILE or not acc.domain or acc.buf != src.buf or acc.coeffs != src.coeffs or v.dtype != s.dtype
            or any(j < a.n_row_vars for j, _, _ in acc.domain)):
        return None
    box = {j: (lo, hi) for j, lo, hi in acc.domain}
    cols = tiling.tile_cols()
    span = _contiguous(cols, box)
    if span is None:
        return None
    first, count = span
    delta = acc.const - src.const
    for j, n, stride in cols:
        c = acc.coeffs[j]
        if c and delta % c == 0:
            lo, hi = box.get(j, (0, n))
            d = delta // c
            if 0 <= lo + d and hi + d <= n:
                return View(v.op.id, s.op.id, first, count, d * stride)
    return None


def _contiguous(cols: list[tuple[int, int, int]], box: dict[int, tuple[int, int]]) -> tuple[int, int] | None:
    """(first tile column, count) of a box of the column variables, if its columns are one
    run: every variable inside the outermost one it cuts to more than one index is whole."""
    first, span = 0, 1
    for j, n, stride in reversed(cols):
        lo, hi = box.get(j, (0, n))
        if hi <= lo:
            return None
        first += lo * stride
        if span == stride:
            span = (hi - lo) * stride
        elif hi - lo > 1:
            return None
    return first, span
