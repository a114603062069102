"""The tiles of a loop kernel: which rows each tile holds, and which core runs it.

A tile is a box of the kernel's loop variables: one row variable, the *block* variable, is
cut into blocks; the row variables inside it and all column variables are whole; the row
variables outside it are fixed per tile. Tiles hold as many rows as the scratchpad layout
lets them (at most an even share of the rows per core) and go round-robin to the cores.

A stick of a stored buffer may hold the results of more rows than a tile can (16 int64
indices of an argmax over rows of 49,155 columns): the cores write sticks back whole, so
no two cores may store into one. The tiles of such rows then form a *group* (:class:`Merge`):
each sends its staged rows of those stores over the ring to a region on one core, which
stores the group's rows once (see ``spy_loop_merge`` in native/spyre.h).

The tiling depends only on the kernel and the target: it is chosen once, at the first
construction, and every later construction of the kernel takes it back.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ...cost import CostModel
from ...dtypes import ITEMSIZE
from ...ir import Access
from ..context import ScratchpadOverflow
from ..sfu import COL, TILE
from .analysis import Analysis, Unsupported, Value
from .scratchpad import ScratchNeed, lay_out, scratch_needs


@dataclass(frozen=True)
class Tile:
    """The rows one core computes at once."""

    fixed: tuple[int, ...]  # the values of the row variables outside the block variable
    start: int              # its first index of the block variable
    size: int               # its indices of the block variable (the last block may be short)
    core: int
    seq: int                # its position on its core
    merge: int = -1         # its group of merged stores (Tiling.merges), or -1: it stores its own

    def rows(self, inner: int) -> int:
        return self.size * inner


@dataclass(frozen=True)
class Merge:
    """Tiles whose stores share sticks: their rows, as a tile's, and the core that stores
    them from its `region` (which of that core's groups it is)."""

    fixed: tuple[int, ...]
    start: int
    size: int
    core: int
    region: int


@dataclass(frozen=True)
class Tiling:
    """How a kernel is cut into tiles, for the analysis it was chosen for."""

    analysis: Analysis
    block: int          # the block variable; -1 when the kernel has no row variables
    block_size: int     # indices of the block variable per tile
    inner_rows: int     # rows per index of the block variable (the variables inside it)
    rows_per_tile: int  # rows of the largest tile: what the scratchpad layout holds
    tiles: tuple[Tile, ...]              # in per-core order
    scratch_needs: frozenset[ScratchNeed]
    merges: tuple[Merge, ...] = ()       # groups of merged stores, by index
    merged: frozenset[str] = frozenset()  # the stores (op ids) the groups store

    @property
    def merge_rows(self) -> int:
        """Rows of the largest group: what a group's region holds."""
        return max((m.size for m in self.merges), default=0) * self.inner_rows

    @property
    def merge_regions(self) -> int:
        """Group regions per core: the most groups one core stores."""
        return max((m.region + 1 for m in self.merges), default=0)

    def tile_rows(self, size: int) -> list[tuple[int, int, int]]:
        """The row variables of a tile of `size` blocks, outermost first, as (variable,
        count, stride in tile rows)."""
        sizes = self.analysis.kernel.sizes
        out, stride = [], 1
        for j in range(self.analysis.n_row_vars - 1, self.block, -1):
            out.append((j, sizes[j], stride))
            stride *= sizes[j]
        if self.block >= 0:
            out.append((self.block, size, stride))
        return out[::-1]

    def tile_cols(self) -> list[tuple[int, int, int]]:
        """The column variables, outermost first, as (variable, count, stride in columns)."""
        sizes = self.analysis.kernel.sizes
        out, stride = [], 1
        for j in range(self.analysis.n_vars - 1, self.analysis.n_row_vars - 1, -1):
            out.append((j, sizes[j], stride))
            stride *= sizes[j]
        return out[::-1]

    def gathered_columns(self, acc: Access, kind: str) -> tuple[int, tuple[tuple[int, int, int, int], ...]]:
        """The columns a gathered or scattered access of value kind `kind` moves per row:
        how far its mask's box moves its first element, and per column variable
        (variable, count, stride in tile columns, first index)."""
        if kind not in (TILE, COL):
            return 0, ()
        dom = {j: (lo, hi) for j, lo, hi in acc.domain}
        shift, cols = 0, []
        for j, count, stride in self.tile_cols():
            lo, hi = dom.get(j, (0, count))
            shift += acc.coeffs[j] * lo
            cols.append((j, hi - lo, stride, lo))
        return shift, tuple(cols)

    def origin(self, acc: Access, tile: Tile | Merge) -> int:
        """The element `acc` reads at the tile's first row and column, from the start of
        its buffer."""
        base = acc.const
        for j, x in enumerate(tile.fixed):
            base += acc.coeffs[j] * x
        if self.block >= 0:
            base += acc.coeffs[self.block] * tile.start
        return base

    def origins(self, acc: Access, fixed: np.ndarray, start: np.ndarray, offset: int = 0) -> np.ndarray:
        """`offset` + :meth:`origin` of every tile at once (`fixed`: tiles x outer variables)."""
        base = np.full(len(start), acc.const + offset, dtype=np.int64)
        if fixed.shape[1]:
            base += fixed @ np.asarray(acc.coeffs[: fixed.shape[1]], dtype=np.int64)
        if self.block >= 0:
            base += acc.coeffs[self.block] * start
        return base


def choose_tiling(a: Analysis, target: CostModel) -> Tiling:
    """Rows per tile: as many as the scratchpad layout holds (found by laying it out, so
    reused temporaries count once), at most an even share of the rows per core."""
    needs = scratch_needs(a)
    sizes, nrow = a.kernel.sizes, a.n_row_vars
    total_rows = math.prod(sizes[:nrow]) if nrow else 1
    cap = _rows_that_fit(a, needs, target, want=max(1, -(-total_rows // target.num_cores)))
    block, block_size, inner = _block(sizes, nrow, cap, align=target.stick_bytes // 2)
    need = _store_alignment(a, block, target.stick_bytes)
    if need > 1 and block_size % need and block_size < sizes[block]:
        # each tile's stores must fill sticks of their own: two cores storing into one stick
        # would each write the whole stick back, and the later would undo the other's part
        whole = block_size - block_size % need if block_size > need else min(need, sizes[block])
        if _rows_that_fit(a, needs, target, want=whole * inner) < whole * inner:
            # tiles of whole sticks do not fit: the tiles of a stick's rows merge their stores
            return _merged(a, target, needs, block, block_size, inner, need)
        block_size = whole
    tiles = _tiles(sizes, block, block_size, target.num_cores)
    tiling = Tiling(a, block, block_size, inner, block_size * inner, tiles, needs)
    _check_stores_own_their_sticks(tiling, target.stick_bytes)
    return tiling


def _merged(a: Analysis, target: CostModel, needs: frozenset[ScratchNeed], block: int, cap: int, inner: int,
            need: int) -> Tiling:
    """Tiles of at most `cap` indices of the block variable inside groups of `need` (the
    indices whose results share sticks), cut evenly and dealt round-robin to the cores; a
    group of more than one tile merges its stores on the core of its first tile."""
    sizes = a.kernel.sizes
    n, cores = sizes[block], target.num_cores
    boxes, groups = [], []
    for fixed in np.ndindex(*sizes[:block]) if block > 0 else [()]:
        fixed = tuple(int(x) for x in fixed)
        for g0 in range(0, n, need):
            glen = min(need, n - g0)
            pieces = -(-glen // cap)
            size = -(-glen // pieces)
            merge = len(groups) if pieces > 1 else -1
            if pieces > 1:
                groups.append((fixed, g0, glen, len(boxes) % cores))
            boxes += [(fixed, s, min(size, g0 + glen - s), merge) for s in range(g0, g0 + glen, size)]
    tiles = [Tile(fixed, start, size, i % cores, i // cores, merge)
             for i, (fixed, start, size, merge) in enumerate(boxes)]
    owned: Counter[int] = Counter()
    merges = []
    for fixed, start, size, core in groups:
        merges.append(Merge(fixed, start, size, core, owned[core]))
        owned[core] += 1
    largest = max(t.size for t in tiles)
    merged = frozenset(v.op.id for v, _, _ in _stick_sharing(a, block, target.stick_bytes)) if merges else frozenset()
    tiling = Tiling(a, block, largest, inner, largest * inner, tuple(sorted(tiles, key=lambda t: (t.core, t.seq))),
                    needs, tuple(merges), merged)
    _check_stores_own_their_sticks(tiling, target.stick_bytes)
    peak = lay_out(a, tiling.rows_per_tile, needs, target.stick_bytes, merge_rows=tiling.merge_rows,
                   merge_regions=tiling.merge_regions, merged=tiling.merged).peak
    if peak > target.scratchpad_bytes:
        raise Unsupported(f"kernel {a.kernel.name}: tiles of its output's sticks ({need} rows of the block) do not "
                          f"fit the scratchpad, and neither do their merged stores")
    return tiling


def _splits_sticks(b, coeff: int, per_stick: int) -> int:
    """The length of `b`'s rows (its stride-1 dimension) if steps of `coeff` elements can
    land inside one stick of a row (a step of whole sticks, or of whole rows, cannot), else 0."""
    row = next((n for n, st in zip(b.sizes, b.strides, strict=True) if st == 1 and n > 1), 0)
    return row if row > 1 and coeff % row and coeff % per_stick else 0


def _stick_sharing(a: Analysis, block: int, stick_bytes: int) -> list[tuple[Value, int, int]]:
    """The stores where the block variable moves along a stored buffer's rows inside its
    sticks (the kept dimension of a reduction over the last one, say), as (store, the
    block variable's coefficient, elements per stick)."""
    buffers = {b.name: b for b in a.kernel.buffers}
    out = []
    for v in a.stores:
        acc = v.op.access
        c = acc.coeffs[block]
        b = buffers[acc.buf]
        per_stick = stick_bytes // ITEMSIZE[b.dtype]
        if c and _splits_sticks(b, c, per_stick):
            out.append((v, c, per_stick))
    return out


def _store_alignment(a: Analysis, block: int, stick_bytes: int) -> int:
    """Indices of the block variable a tile must start at a multiple of, so that no two
    tiles store into one stick."""
    if block < 0:
        return 1
    need = 1
    for _, c, per_stick in _stick_sharing(a, block, stick_bytes):
        need = math.lcm(need, per_stick // math.gcd(c, per_stick))
    return need


def _check_stores_own_their_sticks(t: Tiling, stick_bytes: int) -> None:
    """Refuses a tiling in which a tile's first store falls inside a stick that the tile
    before it along the block variable also stores into (a view's offset that no block
    size can align): construction then fails, and the kernel runs another way. The stores a
    group merges are the group's, not its tiles'."""
    if t.block < 0 or len(t.tiles) < 2:
        return
    buffers = {b.name: b for b in t.analysis.kernel.buffers}
    for v in t.analysis.stores:
        acc = v.op.access
        c = acc.coeffs[t.block]
        b = buffers[acc.buf]
        per_stick = stick_bytes // ITEMSIZE[b.dtype]
        row = _splits_sticks(b, c, per_stick) if c else 0
        if not row:
            continue
        merged = v.op.id in t.merged
        storing = [tile for tile in t.tiles if not (merged and tile.merge >= 0)] + (list(t.merges) if merged else [])
        for tile in storing:
            if tile.start and ((b.offset + t.origin(acc, tile)) % row) % per_stick:
                raise Unsupported(f"kernel {t.analysis.kernel.name}: its tiles would store into one stick "
                                  f"of {b.name} from two cores")


def _rows_that_fit(a: Analysis, needs: frozenset[ScratchNeed], target: CostModel, want: int) -> int:
    """The largest row count up to `want` whose layout fits (the layout grows with the rows)."""
    def peak(rows: int) -> int:
        return lay_out(a, rows, needs, target.stick_bytes).peak

    one_row = peak(1)
    if one_row > target.scratchpad_bytes:
        raise ScratchpadOverflow(
            f"one row of {a.columns} columns of kernel {a.kernel.name} needs {one_row} bytes of scratchpad")
    if want > 1 and peak(want) <= target.scratchpad_bytes:  # a small kernel: every row it wants fits
        return want
    lo, hi = 1, want
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak(mid) <= target.scratchpad_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _block(sizes: tuple[int, ...], nrow: int, cap: int, align: int) -> tuple[int, int, int]:
    """(block variable, block size, inner rows) for tiles of at most `cap` rows: the row
    variables inside the block variable fit whole in a tile, and the block variable is cut
    into blocks of as many indices as then fit."""
    if not nrow:
        return -1, 1, 1
    inner, j = 1, nrow - 1
    while j >= 0 and inner * sizes[j] <= cap:
        inner *= sizes[j]
        j -= 1
    if j < 0:  # every row fits in one tile
        return 0, sizes[0], inner // sizes[0]
    block_size = max(1, cap // inner)
    if block_size > align:
        # blocks that start on stick boundaries keep every DMA one compact pattern
        block_size -= block_size % align
    return j, block_size, inner


def _tiles(sizes: tuple[int, ...], block: int, block_size: int, cores: int) -> tuple[Tile, ...]:
    """Every tile, dealt round-robin to the cores, in per-core order."""
    outer = sizes[:block] if block > 0 else ()
    nblock = sizes[block] if block >= 0 else 1
    boxes = [(tuple(int(x) for x in fixed), start, min(block_size, nblock - start))
             for fixed in (np.ndindex(*outer) if outer else [()])
             for start in range(0, nblock, block_size)]
    tiles = [Tile(fixed, start, size, i % cores, i // cores) for i, (fixed, start, size) in enumerate(boxes)]
    return tuple(sorted(tiles, key=lambda t: (t.core, t.seq)))
