"""The SFU stage programs of a kernel's tiles: one per stage and tile parity.

Stage ``level`` computes the values of that level (a gather's result is one level after
its index, so gathers run between stages); the last stage also moves every stored value
into its store's staging slot. Index arithmetic is written in terms of the tile's origin,
a per-tile constant the tile's *prologue* writes (one IOTA per constant, made by the native
builder from the record's formulas), so all tiles of a parity share one program per
stage: a :class:`Template`, whose instructions over the tile's rows the native builder
writes for each tile's row count.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...cost import round_up
from ...ir import Access
from ...native import lib
from ..context import BuildContext
from ..sfu import (
    BINARY,
    COL,
    COMPARE,
    FLOATS,
    ITEMSIZE,
    REDUCE,
    ROW,
    SCALAR,
    TILE,
    UNARY,
    Operand,
    Program,
    compute_type,
)
from .analysis import Unsupported, Value
from .reuse import Broadcast, Reuse, View
from .scratchpad import ScratchpadLayout
from .tiling import Tiling


def _imm(value, dtype: str) -> Operand:
    return Operand(SCALAR, dtype, imm=value)


@dataclass(frozen=True)
class TileRows:
    """The rows of an instruction that covers one in `every` of the tile's rows, whichever
    tile (`every` divides the rows per index of the block variable)."""

    every: int = 1


TILE_ROWS = TileRows()  # all of the tile's rows


class Template(Program):
    """A stage's instructions for every tile of one parity: an instruction over the tile's
    rows says so (the native builder writes each tile's row count into it)."""

    def __init__(self) -> None:
        super().__init__()
        self.tile_rows: list[int] = []  # per instruction: TileRows.every, or 0 for rows of its own

    def emit(self, op: int, rows, cols: int, dst: Operand, *srcs: Operand, aux: int = 0) -> None:
        whole = isinstance(rows, TileRows)
        super().emit(op, 0 if whole else rows, cols, dst, *srcs, aux=aux)
        self.tile_rows.append(rows.every if whole else 0)


class StagePrograms:
    """Writes the SFU programs of one kernel's tiles under one scratchpad layout."""

    def __init__(self, ctx: BuildContext, tiling: Tiling, layout: ScratchpadLayout, reuse: Reuse):
        self.ctx = ctx
        self.tiling = tiling
        self.analysis = tiling.analysis
        self.layout = layout
        self.reuse = reuse
        self.columns = tiling.analysis.columns

    def dims(self, kind: str) -> tuple[int | TileRows, int]:
        """(rows, columns) an instruction on a value of `kind` covers."""
        return {TILE: (TILE_ROWS, self.columns), ROW: (TILE_ROWS, 1), COL: (1, self.columns), SCALAR: (1, 1)}[kind]

    def stage(self, level: int, slot: int) -> Template:
        """The instructions of stage `level` for the tiles of parity `slot`."""
        a, layout = self.analysis, self.layout
        prog = Template()
        if level == 0:  # the loads served from the scratchpad, before anything reads them
            for b in self.reuse.broadcasts.values():
                self._broadcast(prog, b, slot)
            for view in self.reuse.views.values():
                self._view(prog, view, slot)
        for v in a.values.values():
            if v.level == level and v.op.op not in ("load", "store", "constant"):
                self._compute(prog, v, slot)
        if level == a.levels - 1:
            for v in a.stores:  # into the staging slots the stores move out
                r, c = self.dims(v.kind)
                prog.emit(lib.SPY_SFU_MOV, r, c, layout.slots[v.op.id].operand(slot),
                          layout.operand(v.op.args[0], slot))
        for v in a.values.values():
            if v.op.op in ("load", "store") and v.op.access.ind:
                # a gather's rows before the gather, a scatter's with the stored values
                target = v.level - 1 if v.op.op == "load" else a.levels - 1
                if target == level:
                    self._buffer_rows(prog, v, slot)
        return prog

    def _broadcast(self, prog: Template, b: Broadcast, slot: int) -> None:
        """The rows the DMA fetched (index 0 of the broadcast variables, the innermost)
        copied to each other index: rows k, k + copies, ... from rows 0, copies, ..."""
        loaded = self.layout.slots[b.load].operand(slot)
        step = loaded.pitch * ITEMSIZE[loaded.dtype]  # bytes per tile row
        _, cols = self.dims(loaded.kind)
        src = Operand(loaded.kind, loaded.dtype, loaded.off, loaded.pitch * b.copies)
        for k in range(1, b.copies):
            prog.emit(lib.SPY_SFU_MOV, TileRows(b.copies), cols, src.at(loaded.off + k * step), src)

    def _view(self, prog: Template, view: View, slot: int) -> None:
        """The view's columns copied from its source's slot."""
        dst = self.layout.slots[view.load].operand(slot)
        src = self.layout.slots[view.source].operand(slot)
        e = ITEMSIZE[dst.dtype]
        prog.emit(lib.SPY_SFU_MOV, TILE_ROWS, view.count, dst.at(dst.off + view.first * e),
                  src.at(src.off + (view.first + view.shift) * e))

    def _compute(self, prog: Program, v: Value, slot: int) -> None:
        op = v.op
        r, c = self.dims(v.kind)
        dst = self.layout.temporaries[op.id]
        args = [self.layout.operand(a, slot) for a in op.args]
        name = op.op
        if name == "index":
            self._index(prog, v, dst)
        elif name == "indirect":
            self._indirect(prog, v, args[0], r, c, dst)
        elif name == "reduction":
            self._reduction(prog, v, args)
        elif name == "to_dtype":
            prog.emit(lib.SPY_SFU_MOV, r, c, dst, args[0])
        elif name in COMPARE:
            prog.emit(lib.SPY_SFU_CMP, r, c, dst, *args, aux=COMPARE[name])
        elif name == "where":
            prog.emit(lib.SPY_SFU_SELECT, r, c, dst, *args)
        elif name == "relu":
            prog.emit(lib.SPY_SFU_MAX, r, c, dst, args[0], _imm(0.0 if dst.dtype in FLOATS else 0, dst.dtype))
        elif name == "square":
            prog.emit(lib.SPY_SFU_MUL, r, c, dst, args[0], args[0])
        elif name == "exp2":
            prog.emit(lib.SPY_SFU_POW, r, c, dst, _imm(2.0, "float32"), args[0])
        elif name in UNARY:
            prog.emit(UNARY[name], r, c, dst, *args)
        elif name in BINARY:
            prog.emit(BINARY[name], r, c, dst, *args)
        else:
            raise Unsupported(f"operation {name}")

    def _indirect(self, prog: Program, v: Value, x: Operand, r: int, c: int, dst: Operand) -> None:
        """An index into a dimension of `size`; negative ones count from its end."""
        size = int(v.op.attrs["size"])
        prog.emit(lib.SPY_SFU_MOV, r, c, dst, x)
        if v.op.attrs.get("wrap_neg", True):
            scratch = self.layout.scratch
            neg = Operand(v.kind, "bool", scratch[("bool", 0)], dst.pitch)
            prog.emit(lib.SPY_SFU_CMP, r, c, neg, dst, _imm(0, "int64"), aux=lib.SPY_CMP_LT)
            wrapped = Operand(v.kind, "int64", scratch[("i64", 1)], dst.pitch)
            prog.emit(lib.SPY_SFU_ADD, r, c, wrapped, dst, _imm(size, "int64"))
            prog.emit(lib.SPY_SFU_SELECT, r, c, dst, neg, wrapped, dst)

    def _reduction(self, prog: Program, v: Value, args: list[Operand]) -> None:
        kind = v.op.attrs["kind"]
        src = self.analysis.values[v.op.args[0]]
        x, dst, columns, scratch = args[0], self.layout.temporaries[v.op.id], self.columns, self.layout.scratch
        rows = TILE_ROWS
        r = rows if v.kind == ROW else 1
        if src.kind != TILE:  # broadcast over the columns first
            floats = compute_type(src.dtype) == "float32"
            tmp = Operand(TILE, "float32" if floats else "int64", scratch[("f32", 0) if floats else ("i64", 1)],
                          round_up(columns, 8))
            prog.emit(lib.SPY_SFU_MOV, rows, columns, tmp, x)
            x = tmp
        if kind == "count":
            prog.emit(lib.SPY_SFU_MOV, r, 1, dst, _imm(float(columns), "float32"))
        elif kind == "mean":
            prog.emit(lib.SPY_SFU_RSUM, r, columns, dst, x)
            prog.emit(lib.SPY_SFU_DIV, r, 1, dst, dst, _imm(float(columns), "float32"))
        elif kind == "m2":  # the sum of squared differences from the mean (args[1])
            mean = self.layout.operand(v.op.args[1], 0)
            tmp = Operand(TILE, "float32", scratch[("f32", 1)], round_up(columns, 8))
            prog.emit(lib.SPY_SFU_SUB, rows, columns, tmp, x, mean)
            prog.emit(lib.SPY_SFU_MUL, rows, columns, tmp, tmp, tmp)
            prog.emit(lib.SPY_SFU_RSUM, r, columns, dst, tmp)
        else:
            prog.emit(REDUCE[kind], r, columns, dst, x)

    def _affine(self, prog: Program, coeffs, dst: Operand, base: Operand, kind: str) -> None:
        """dst[r, c] = base + sum of coeffs * (the loop variables' values inside the tile)."""
        r_all, c_all = self.dims(kind)
        prog.emit(lib.SPY_SFU_MOV, r_all, c_all, dst, base)
        term = Operand(kind, "int64", self.layout.scratch[("i64", 0)],
                       round_up(self.columns, 8) if kind in (TILE, COL) else 1)
        zero, one = _imm(0, "int64"), _imm(1, "int64")
        if kind in (TILE, ROW):
            for j, count, stride in self.tiling.tile_rows(0):  # the block's count is the tile's: not used
                if coeffs[j]:  # the block variable's count is the tile's, never wrapped
                    self._add_term(prog, r_all, c_all, dst, term, (one, zero), stride,
                                   count if j != self.tiling.block else None, coeffs[j])
        if kind in (TILE, COL):
            for j, count, stride in self.tiling.tile_cols():
                if coeffs[j]:
                    self._add_term(prog, r_all, c_all, dst, term, (zero, one), stride, count, coeffs[j])

    @staticmethod
    def _add_term(prog: Program, r: int, c: int, dst: Operand, term: Operand, steps: tuple[Operand, Operand],
                  stride: int, count: int | None, coeff: int) -> None:
        """dst += coeff * ((row or column position // stride) % count)."""
        prog.emit(lib.SPY_SFU_IOTA, r, c, term, _imm(0, "int64"), *steps)
        if stride > 1:
            prog.emit(lib.SPY_SFU_FLOORDIV, r, c, term, term, _imm(stride, "int64"))
        if count is not None:
            prog.emit(lib.SPY_SFU_MOD, r, c, term, term, _imm(count, "int64"))
        prog.emit(lib.SPY_SFU_MUL, r, c, term, term, _imm(coeff, "int64"))
        prog.emit(lib.SPY_SFU_ADD, r, c, dst, dst, term)

    def _index(self, prog: Program, v: Value, dst: Operand) -> None:
        base = Operand(SCALAR, "int64", self.layout.const_off[(v.op.id, "index")])
        coeffs = v.op.access.coeffs
        if dst.dtype == "int64":
            self._affine(prog, coeffs, dst, base, v.kind)
        else:  # computed in int64, then converted
            tmp = Operand(v.kind, "int64", self.layout.scratch[("i64", 1)], dst.pitch)
            self._affine(prog, coeffs, tmp, base, v.kind)
            r, c = self.dims(v.kind)
            prog.emit(lib.SPY_SFU_MOV, r, c, dst, tmp)

    def _buffer_rows(self, prog: Program, v: Value, slot: int) -> None:
        """The buffer row each tile row of a gather or scatter reads or writes: the row of
        its first element plus, per index tensor, the index times the rows it steps. An
        index outside its dimension that the table's bounds would not catch (a second
        index, or one of a dimension inside the table's rows) makes the row -1, which the
        card refuses (SpyreIndexError), rather than an element of another row. For an
        element gather of a one-row table (see :func:`element_rows`) a "row" is an element."""
        acc = v.op.access
        table = self.ctx.layouts[acc.buf]
        unit = self.row_unit(v)
        rows = TILE_ROWS
        n_units = table.row_len if unit == 1 else table.rows
        row_coeffs = [0] * self.analysis.n_vars
        for j in range(self.analysis.n_row_vars):
            if acc.coeffs[j] % unit:
                err = Unsupported("a gather/scatter whose rows are not whole rows of its buffer")
                err.indirect = True  # gathered into a buffer of its own, its rows are whole
                raise err
            row_coeffs[j] = acc.coeffs[j] // unit
        if any(coef % unit for _, coef in acc.ind):
            err = Unsupported("a gather/scatter index that moves inside a row of its buffer (an element scatter)")
            err.indirect = True  # the indexing op is what cannot be built, not the arithmetic around it
            raise err
        dst = self.layout.index_slots[v.op.id].operand(slot)
        base = Operand(SCALAR, "int64", self.layout.const_off[(v.op.id, "rowbase")])
        self._affine(prog, row_coeffs, dst, base, ROW)
        tmp = Operand(ROW, "int64", self.layout.scratch[("row", 0)], 1)
        for idx, coef in acc.ind:
            prog.emit(lib.SPY_SFU_MUL, rows, 1, tmp, self.layout.operand(idx, slot), _imm(coef // unit, "int64"))
            prog.emit(lib.SPY_SFU_ADD, rows, 1, dst, dst, tmp)
        ok = Operand(ROW, "bool", self.layout.scratch[("row", 1)], 1)
        for idx, coef in acc.ind:
            extent = self._index_extent(idx)
            if extent is None or (len(acc.ind) == 1 and extent * (coef // unit) >= n_units):
                continue  # the table's bounds catch an index past its dimension
            x = self.layout.operand(idx, slot)
            prog.emit(lib.SPY_SFU_MIN, rows, 1, tmp, x, _imm(extent - 1, "int64"))
            prog.emit(lib.SPY_SFU_MAX, rows, 1, tmp, tmp, _imm(0, "int64"))
            prog.emit(lib.SPY_SFU_CMP, rows, 1, ok, tmp, x, aux=lib.SPY_CMP_EQ)
            prog.emit(lib.SPY_SFU_SELECT, rows, 1, dst, ok, dst, _imm(-1, "int64"))

    def _index_extent(self, vid: str) -> int | None:
        """The size of the dimension an index value indexes, if it is an indirect index."""
        op = self.analysis.values[vid].op
        return int(op.attrs["size"]) if op.op == "indirect" and "size" in op.attrs else None

    def row_unit(self, v: Value) -> int:
        """Elements per row index of a gather or scatter: the table's row length, or one
        element (see :func:`element_rows`)."""
        table = self.ctx.layouts[v.op.access.buf]
        return 1 if element_rows(table, v.op.access, v.kind, self.analysis.n_row_vars) else table.row_len


def element_rows(table, acc: Access, kind: str, n_row_vars: int) -> bool:
    """Whether a gather or scatter picks single elements of a one-row table (a 1-D tensor
    indexed by a tensor: an expert's routing weight at each pair's position). Such a row
    is contiguous in its layout, so each element is a "row" of one item, moved by the same
    GATHER command with the item as its row stride. Whole rows keep row indices."""
    if table.rows != 1 or kind != ROW:
        return False
    return any(coef % table.row_len for _, coef in acc.ind) or any(
        acc.coeffs[j] % table.row_len for j in range(n_row_vars))
