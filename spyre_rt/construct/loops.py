"""Construction of loop kernels: pointwise, reductions, gathers and scatters.

A tile is a box of the kernel's canonical loop variables: one row variable (the *block*
variable) is cut into blocks, the row variables inside it and all column variables are
whole, the ones outside it are fixed per tile. Tiles go round-robin to the cores. Per tile
a core runs:

    LOAD (inputs)  ->  SFU stage 0  ->  GATHER  ->  SFU stage 1 ... ->  STORE / SCATTER

Loads, gathered rows, gather indices and store staging have two scratchpad slots (tile
t uses slot t % 2), so tile t+1 loads while tile t computes; a load waits only for the
last SFU command of tile t-2, and a tile's first SFU command for the stores of tile t-2.
Values computed on the SFU live in temporaries reused by liveness. Per-tile constants
(the tile's position, for index arithmetic and gather rows) are written by a one-
instruction-per-value prologue, so every tile of a class shares one main program.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..kernels import Access, LoopKernel, Op
from ..native import lib
from ..program import (
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
from .access import NotAffine, Pattern, descriptor_runs, pattern
from .context import BuildContext, ScratchpadOverflow, round_up
from .sfu import (
    BINARY,
    COL,
    COMPARE,
    DTYPE,
    FLOATS,
    ITEMSIZE,
    REDUCE,
    ROW,
    SCALAR,
    TESTS,
    TILE,
    UNARY,
    Operand,
    Program,
    compute_type,
    parse_constant,
)


class Unsupported(NotImplementedError):
    pass


LOGICAL = {"logical_and", "logical_or", "logical_not", "logical_xor", "and_", "or_", "xor", "isnan"}
# Every operation a loop kernel's body may use: what construction emits SFU code for.
CARD_OPS = frozenset({"load", "store", "reduction", "constant", "index", "indirect", "to_dtype", "where",
                      "relu", "square", "sigmoid", "exp2"}
                     | set(UNARY) | set(BINARY) | set(COMPARE) | LOGICAL)


@dataclass
class Value:
    op: Op
    deps: frozenset
    kind: str
    dtype: str          # storage dtype in the scratchpad
    level: int = 0
    operand: Operand | None = None   # for computed values (filled by allocation)


@dataclass
class Tile:
    fixed: tuple[int, ...]  # values of the row variables outside the block variable
    start: int              # first index of the block variable
    blk: int                # block size
    core: int = 0
    seq: int = 0            # position on its core

    def rows(self, inner: int) -> int:
        return self.blk * inner


@dataclass
class Region:
    off: int
    size: int


@dataclass
class _Slots:
    """A value with two scratchpad copies (one per tile slot)."""

    kind: str
    dtype: str
    off: tuple[int, int]
    pitch: int

    def operand(self, slot: int) -> Operand:
        return Operand(self.kind, self.dtype, self.off[slot], self.pitch)


@dataclass
class Builder:
    ctx: BuildContext
    k: LoopKernel
    values: dict[str, Value] = field(default_factory=dict)

    # ---- analysis ----------------------------------------------------------------------
    def analyse(self) -> None:
        k = self.k
        self.nvars = len(k.sizes)
        self.nrow = self.nvars - k.ncols
        self.rowvars = set(range(self.nrow))
        self.colvars = set(range(self.nrow, self.nvars))
        self.C = math.prod(k.sizes[self.nrow:]) if k.ncols else 1
        self.bufs = {b.name: b for b in k.buffers}
        for b in k.buffers:
            if b.dtype not in DTYPE:
                raise Unsupported(f"{b.name} holds {b.dtype}, which the card does not compute in")
        for op in k.ops:
            try:
                self.values[op.id] = self._value(op)
            except ValueError as e:  # a dtype the card does not compute in
                raise Unsupported(f"operation {op.op}: {e}") from None
        self.levels = max((v.level for v in self.values.values()), default=0) + 1

    def _kind(self, deps) -> str:
        r, c = bool(deps & self.rowvars), bool(deps & self.colvars)
        return TILE if r and c else ROW if r else COL if c else SCALAR

    def _value(self, op: Op) -> Value:
        args = [self.values[a] for a in op.args]
        deps = frozenset().union(*[a.deps for a in args]) if args else frozenset()
        level = max((a.level for a in args), default=0)
        if op.op in ("load", "store"):
            acc = op.access
            deps = deps | {j for j, c in enumerate(acc.coeffs) if c}
            for idx, _ in acc.ind:
                iv = self.values[idx]
                deps |= iv.deps
                if iv.deps & self.colvars:
                    raise Unsupported("an indirect index that varies along the columns")
                level = max(level, iv.level + (1 if op.op == "load" else 0))
            dtype = self.bufs[acc.buf].dtype
            if op.op == "store":
                return Value(op, deps, self._kind(deps), dtype, level)
            return Value(op, deps, self._kind(deps), dtype, level)
        if op.op == "index":
            deps = frozenset(j for j, c in enumerate(op.access.coeffs) if c)
            return Value(op, deps, self._kind(deps), "int64", 0)
        if op.op == "constant":
            dtype = op.dtype or ("float32" if isinstance(op.attrs.get("value"), float) else "int64")
            return Value(op, frozenset(), SCALAR, compute_type(dtype), 0)
        if op.op == "reduction":
            deps = deps - self.colvars
            kind = op.attrs.get("kind")
            dtype = "int64" if kind in ("argmax", "argmin") else compute_type(op.dtype or args[0].dtype)
            if kind == "any":
                dtype = "bool"
            return Value(op, deps, self._kind(deps), dtype, level)
        if op.op == "indirect":
            return Value(op, deps, self._kind(deps), "int64", level)
        if op.op == "to_dtype":
            target = op.dtype
            dtype = target if target in ("float16", "bfloat16") else compute_type(target)
            return Value(op, deps, self._kind(deps), dtype, level)
        if op.op in COMPARE or op.op in LOGICAL or op.op in TESTS:
            return Value(op, deps, self._kind(deps), "bool", level)
        if op.op == "where":
            a, b = args[1].dtype, args[2].dtype
            return Value(op, deps, self._kind(deps), _promote(a, b), level)
        if op.op in UNARY or op.op in BINARY or op.op in ("relu", "square", "sigmoid", "exp2"):
            dtype = args[0].dtype if len(args) == 1 else _promote(*[a.dtype for a in args])
            if op.op in ("truediv", "div", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "sin",
                         "cos", "erf", "exp2", "log1p", "expm1", "atan", "reciprocal", "pow") and dtype not in FLOATS:
                dtype = "float32"
            return Value(op, deps, self._kind(deps), compute_type(dtype), level)
        raise Unsupported(f"operation {op.op}")

    # ---- tiling -----------------------------------------------------------------------
    def scratch_needs(self) -> set[tuple[str, int]]:
        """The working areas the SFU programs will use (see the ``_scratch_*`` accessors)."""
        needs: set[tuple[str, int]] = set()
        for v in self.values.values():
            op = v.op
            if op.op == "index":
                needs.add(("i64", 0))
                if v.dtype != "int64":
                    needs.add(("i64", 1))
            elif op.op == "indirect" and op.attrs.get("wrap_neg", True):
                needs |= {("bool", 0), ("i64", 1)}
            elif op.op == "reduction":
                if self.values[op.args[0]].kind != TILE:
                    src = self.values[op.args[0]].dtype
                    needs.add(("f32", 0) if compute_type(src) == "float32" else ("i64", 1))
                if op.attrs.get("kind") == "m2":
                    needs.add(("f32", 1))
            if op.op in ("load", "store") and op.access.ind:
                needs |= {("i64", 0), ("row", 0)}
        return needs

    def _fits(self, rows: int) -> bool:
        self.rmax = rows
        try:
            self.allocate()
        except ScratchpadOverflow:
            return False
        return True

    def choose_tiles(self) -> None:
        """Rows per tile: as many as the scratchpad plan holds (found by laying it out, so
        reused temporaries count once), at most an even share of the rows per core."""
        k = self.k
        self.needs = self.scratch_needs()
        total_rows = math.prod(k.sizes[: self.nrow]) if self.nrow else 1
        want = max(1, -(-total_rows // self.ctx.target.num_cores))
        if not self._fits(1):
            raise ScratchpadOverflow(
                f"one row of {self.C} columns of kernel {k.name} needs {self.lx_top} bytes of scratchpad")
        lo, hi = 1, want
        while lo < hi:  # the largest row count that fits: the layout grows with the rows
            mid = (lo + hi + 1) // 2
            if self._fits(mid):
                lo = mid
            else:
                hi = mid - 1
        cap = lo
        inner, j = 1, self.nrow - 1
        while j >= 0 and inner * k.sizes[j] <= cap:
            inner *= k.sizes[j]
            j -= 1
        if j < 0:  # everything fits in one tile
            self.block, self.blk = (0 if self.nrow else -1), (k.sizes[0] if self.nrow else 1)
            self.inner = inner // (k.sizes[0] if self.nrow else 1) if self.nrow else 1
        else:
            self.block, self.blk = j, max(1, cap // inner)
            self.inner = inner
            align = self.ctx.target.stick_bytes // 2  # elements of the narrowest stick
            if self.blk > align:
                # blocks that start on stick boundaries keep every DMA one compact pattern
                self.blk -= self.blk % align
        self.rmax = self.blk * self.inner
        tiles = []
        outer = k.sizes[: self.block] if self.block > 0 else ()
        nblock = k.sizes[self.block] if self.block >= 0 else 1
        for fixed_vals in np.ndindex(*outer) if outer else [()]:
            for start in range(0, nblock, self.blk):
                tiles.append(Tile(tuple(int(x) for x in fixed_vals), start, min(self.blk, nblock - start)))
        cores = self.ctx.target.num_cores
        per_core = [0] * cores
        for i, t in enumerate(tiles):
            t.core = i % cores
            t.seq = per_core[t.core]
            per_core[t.core] += 1
        self.tiles = sorted(tiles, key=lambda t: (t.core, t.seq))

    # row variables inside a tile: (var, count, stride in tile rows)
    def tile_rows(self, blk: int) -> list[tuple[int, int, int]]:
        out, stride = [], 1
        for j in range(self.nrow - 1, self.block, -1):
            out.append((j, self.k.sizes[j], stride))
            stride *= self.k.sizes[j]
        if self.block >= 0:
            out.append((self.block, blk, stride))
        return out[::-1]

    def tile_cols(self) -> list[tuple[int, int, int]]:
        out, stride = [], 1
        for j in range(self.nvars - 1, self.nrow - 1, -1):
            out.append((j, self.k.sizes[j], stride))
            stride *= self.k.sizes[j]
        return out[::-1]

    def tile_base(self, acc: Access, tile: Tile) -> int:
        base = acc.const + self.ctx.offset(acc.buf)
        for j, x in enumerate(tile.fixed):
            base += acc.coeffs[j] * x
        if self.block >= 0:
            base += acc.coeffs[self.block] * tile.start
        return base

    # ---- scratchpad ---------------------------------------------------------------------
    def allocate(self) -> None:
        s = self.ctx.target.stick_bytes
        top = 0

        def take(n: int) -> int:
            nonlocal top
            off = top
            top += round_up(max(n, 1), 128)
            return off

        def region_bytes(kind: str, dtype: str, pitch: int) -> int:
            e = ITEMSIZE[dtype]
            return {TILE: self.rmax * pitch * e, ROW: self.rmax * e, COL: pitch * e, SCALAR: e}[kind]

        self.slots: dict[str, _Slots] = {}
        self.index_slots: dict[str, _Slots] = {}
        for v in self.values.values():
            op = v.op
            if op.op not in ("load", "store"):
                continue
            e = ITEMSIZE[v.dtype]
            pitch = round_up(self.C, s // e) if v.kind in (TILE, COL) else 1
            n = region_bytes(v.kind, v.dtype, pitch)
            self.slots[op.id] = _Slots(v.kind, v.dtype, (take(n), take(n)), pitch)
            if op.access.ind:
                self.index_slots[op.id] = _Slots(ROW, "int64", (take(self.rmax * 8), take(self.rmax * 8)), 1)
        # per-tile constants written by the prologue
        self.tile_consts: list[tuple[str, str]] = []  # (value id, what)
        self.const_off: dict[str, int] = {}
        for v in self.values.values():
            if v.op.op == "index":
                self.tile_consts.append((v.op.id, "index"))
            if v.op.op in ("load", "store") and v.op.access.ind:
                self.tile_consts.append((v.op.id, "rowbase"))
        for vid, what in self.tile_consts:
            self.const_off[(vid, what)] = take(8)
        # temporaries: a linear scan over the SFU programs, stage by stage
        order = [v for lvl in range(self.levels) for v in self.values.values()
                 if v.level == lvl and v.op.op not in ("load", "store")]
        last_use: dict[str, int] = {}
        for i, v in enumerate(order):
            for a in v.op.args:
                last_use[a] = i
        for v in self.values.values():
            for a in v.op.args:
                if v.op.op == "store":
                    last_use[a] = len(order) + 1  # read by the staging move after the program
            if v.op.op in ("load", "store"):
                for idx, _ in v.op.access.ind:
                    last_use[idx] = len(order) + 1
        free: list[Region] = []
        base = top
        self.temp_top = top
        live: list[tuple[int, str]] = []
        for i, v in enumerate(order):
            # free temporaries whose last use is behind us
            for end, vid in list(live):
                if end < i:
                    free.append(self._temp_region[vid])
                    live.remove((end, vid))
            if v.op.op == "constant":
                v.operand = Operand(SCALAR, v.dtype, imm=parse_constant(v.op.attrs.get("value"), v.dtype))
                continue
            e = ITEMSIZE[v.dtype]
            pitch = round_up(self.C, 8) if v.kind in (TILE, COL) else 1
            n = round_up(region_bytes(v.kind, v.dtype, pitch), 128)
            reg = next((r for r in free if r.size >= n), None)
            if reg is not None:
                free.remove(reg)
            else:
                reg = Region(self.temp_top, n)
                self.temp_top += n
            self._temp_region[v.op.id] = reg
            v.operand = Operand(v.kind, v.dtype, reg.off, pitch)
            live.append((last_use.get(v.op.id, i), v.op.id))
        del base
        cells = self.rmax * round_up(self.C, 8)
        top = self.temp_top

        def area(n: int) -> int:
            nonlocal top
            off = top
            top += round_up(n, 128)
            return off

        sizes = {"f32": cells * 4, "i64": cells * 8, "bool": cells, "row": self.rmax * 8}
        self.scratch = {need: area(sizes[need[0]]) for need in sorted(self.needs)}
        self.lx_top = top
        if self.lx_top > self.ctx.target.scratchpad_bytes:
            raise ScratchpadOverflow(f"kernel {self.k.name} needs {self.lx_top} bytes of scratchpad")

    _temp_region: dict = None  # set in __post_init__

    def __post_init__(self):
        self._temp_region = {}

    def operand(self, vid: str, slot: int) -> Operand:
        v = self.values[vid]
        if v.op.op == "load":
            return self.slots[vid].operand(slot)
        return v.operand

    # ---- SFU programs ---------------------------------------------------------------------
    def dims_of(self, kind: str, rows: int) -> tuple[int, int]:
        return {TILE: (rows, self.C), ROW: (rows, 1), COL: (1, self.C), SCALAR: (1, 1)}[kind]

    def stage_program(self, level: int, slot: int, rows: int, blk: int) -> Program:
        """The instructions of SFU stage `level` for a tile of `rows` rows (block `blk`)."""
        prog = Program()
        for v in self.values.values():
            if v.level != level or v.op.op in ("load", "store", "constant"):
                continue
            self._emit(prog, v, slot, rows, blk)
        if level == self.levels - 1:
            # the last stage also fills the staging slots of stores and the gather/scatter rows
            for v in self.values.values():
                if v.op.op == "store":
                    src = self.operand(v.op.args[0], slot)
                    dst = self.slots[v.op.id].operand(slot)
                    r, c = self.dims_of(v.kind, rows)
                    prog.emit(lib.SPY_SFU_MOV, r, c, dst, src)
        for v in self.values.values():
            if v.op.op in ("load", "store") and v.op.access.ind:
                target = v.level - 1 if v.op.op == "load" else self.levels - 1
                if target == level:
                    self._emit_rowindex(prog, v, slot, rows, blk)
        return prog

    def _emit(self, prog: Program, v: Value, slot: int, rows: int, blk: int) -> None:
        op = v.op
        r, c = self.dims_of(v.kind, rows)
        dst = v.operand
        args = [self.operand(a, slot) for a in op.args]
        name = op.op
        if name == "index":
            self._emit_index(prog, v, rows, blk, op.access.coeffs, (op.id, "index"), dst)
        elif name == "indirect":
            x = args[0]
            size = int(op.attrs["size"])
            prog.emit(lib.SPY_SFU_MOV, r, c, dst, x)
            if op.attrs.get("wrap_neg", True):
                neg = Operand(v.kind, "bool", self._scratch_bool(v), dst.pitch)
                prog.emit(lib.SPY_SFU_CMP, r, c, neg, dst, _imm(0, "int64"), aux=lib.SPY_CMP_LT)
                wrapped = Operand(v.kind, "int64", self._scratch_i64(v), dst.pitch)
                prog.emit(lib.SPY_SFU_ADD, r, c, wrapped, dst, _imm(size, "int64"))
                prog.emit(lib.SPY_SFU_SELECT, r, c, dst, neg, wrapped, dst)
        elif name == "reduction":
            self._emit_reduction(prog, v, args, rows)
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

    def _emit_reduction(self, prog: Program, v: Value, args, rows: int) -> None:
        kind = v.op.attrs["kind"]
        src = self.values[v.op.args[0]]
        x = args[0]
        dst = v.operand
        r = rows if v.kind == ROW else 1
        if src.kind != TILE:  # broadcast over the columns first
            tmp = Operand(TILE, "float32" if compute_type(src.dtype) == "float32" else "int64",
                          self._scratch_tile(v) if compute_type(src.dtype) == "float32" else self._scratch_i64(v),
                          round_up(self.C, 8))
            prog.emit(lib.SPY_SFU_MOV, rows, self.C, tmp, x)
            x = tmp
        if kind == "count":
            prog.emit(lib.SPY_SFU_MOV, r, 1, dst, _imm(float(self.C), "float32"))
        elif kind == "mean":
            prog.emit(lib.SPY_SFU_RSUM, r, self.C, dst, x)
            prog.emit(lib.SPY_SFU_DIV, r, 1, dst, dst, _imm(float(self.C), "float32"))
        elif kind == "m2":
            mean = self.operand(v.op.args[1], 0)
            tmp = Operand(TILE, "float32", self._scratch_tile(v, 1), round_up(self.C, 8))
            prog.emit(lib.SPY_SFU_SUB, rows, self.C, tmp, x, mean)
            prog.emit(lib.SPY_SFU_MUL, rows, self.C, tmp, tmp, tmp)
            prog.emit(lib.SPY_SFU_RSUM, r, self.C, dst, tmp)
        else:
            prog.emit(REDUCE[kind], r, self.C, dst, x)

    # Scratch areas past the temporaries, for instructions that need working space
    # (broadcasts before a reduction, index arithmetic, negative-index wrapping).
    # Each area exists only where ``scratch_needs`` foresaw it: a KeyError here is a
    # construction bug, caught by the op tests.
    def _scratch_tile(self, v: Value, which: int = 0) -> int:
        return self.scratch[("f32", which)]

    def _scratch_bool(self, v: Value) -> int:
        return self.scratch[("bool", 0)]

    def _scratch_i64(self, v: Value, which: int = 1) -> int:
        return self.scratch[("i64", which)]

    def _emit_affine(self, prog: Program, rows: int, blk: int, coeffs, dst: Operand, base: Operand | None,
                     kind: str) -> None:
        """dst[r, c] = base + sum of coeffs * (loop variable values inside the tile)."""
        r_all, c_all = self.dims_of(kind, rows)
        if base is not None:
            prog.emit(lib.SPY_SFU_MOV, r_all, c_all, dst, base)
        else:
            prog.emit(lib.SPY_SFU_MOV, r_all, c_all, dst, _imm(0, "int64"))
        term = Operand(kind, "int64", self._scratch_i64(None, 0), round_up(self.C, 8) if kind in (TILE, COL) else 1)
        for j, count, stride in self.tile_rows(blk):
            if not coeffs[j] or kind in (COL, SCALAR):
                continue
            prog.emit(lib.SPY_SFU_IOTA, r_all, c_all, term, _imm(0, "int64"), _imm(1, "int64"), _imm(0, "int64"))
            if stride > 1:
                prog.emit(lib.SPY_SFU_FLOORDIV, r_all, c_all, term, term, _imm(stride, "int64"))
            if j != self.block:
                prog.emit(lib.SPY_SFU_MOD, r_all, c_all, term, term, _imm(count, "int64"))
            prog.emit(lib.SPY_SFU_MUL, r_all, c_all, term, term, _imm(coeffs[j], "int64"))
            prog.emit(lib.SPY_SFU_ADD, r_all, c_all, dst, dst, term)
        for j, count, stride in self.tile_cols():
            if not coeffs[j] or kind in (ROW, SCALAR):
                continue
            prog.emit(lib.SPY_SFU_IOTA, r_all, c_all, term, _imm(0, "int64"), _imm(0, "int64"), _imm(1, "int64"))
            if stride > 1:
                prog.emit(lib.SPY_SFU_FLOORDIV, r_all, c_all, term, term, _imm(stride, "int64"))
            prog.emit(lib.SPY_SFU_MOD, r_all, c_all, term, term, _imm(count, "int64"))
            prog.emit(lib.SPY_SFU_MUL, r_all, c_all, term, term, _imm(coeffs[j], "int64"))
            prog.emit(lib.SPY_SFU_ADD, r_all, c_all, dst, dst, term)

    def _emit_index(self, prog, v, rows, blk, coeffs, const_key, dst) -> None:
        base = Operand(SCALAR, "int64", self.const_off[const_key])
        if dst.dtype == "int64":
            self._emit_affine(prog, rows, blk, coeffs, dst, base, v.kind)
        else:
            tmp = Operand(v.kind, "int64", self._scratch_i64(v), dst.pitch)
            self._emit_affine(prog, rows, blk, coeffs, tmp, base, v.kind)
            r, c = self.dims_of(v.kind, rows)
            prog.emit(lib.SPY_SFU_MOV, r, c, dst, tmp)

    def _emit_rowindex(self, prog, v, slot, rows, blk) -> None:
        """The buffer row each tile row of a gather/scatter reads or writes."""
        acc = v.op.access
        n_row = self.ctx.layouts[acc.buf].row_len
        (idx, coef), = acc.ind
        row_coeffs = [0] * self.nvars
        for j in range(self.nrow):
            if acc.coeffs[j] % n_row:
                raise Unsupported("a gather/scatter whose rows are not whole rows of its buffer")
            row_coeffs[j] = acc.coeffs[j] // n_row
        dst = self.index_slots[v.op.id].operand(slot)
        base = Operand(SCALAR, "int64", self.const_off[(v.op.id, "rowbase")])
        self._emit_affine(prog, rows, blk, row_coeffs, dst, base, ROW)
        ind = self.operand(idx, slot)
        tmp = Operand(ROW, "int64", self.scratch[("row", 0)], 1)
        prog.emit(lib.SPY_SFU_MUL, rows, 1, tmp, ind, _imm(coef // n_row, "int64"))
        prog.emit(lib.SPY_SFU_ADD, rows, 1, dst, dst, tmp)

    def tile_bases(self, acc: Access, fixed: np.ndarray, start: np.ndarray, in_buffer: bool = True) -> np.ndarray:
        """`tile_base` of every tile at once (`fixed`: tiles x outer variables); without the
        buffer's offset in its storage for index values."""
        base = np.full(len(start), acc.const + (self.ctx.offset(acc.buf) if in_buffer else 0), dtype=np.int64)
        if fixed.shape[1]:
            base += fixed @ np.asarray(acc.coeffs[: fixed.shape[1]], dtype=np.int64)
        if self.block >= 0:
            base += acc.coeffs[self.block] * start
        return base

    def prologue_column(self, vid: str, what: str, fixed: np.ndarray, start: np.ndarray) -> np.ndarray:
        """One tile constant of every tile (see `prologue_values`)."""
        acc = self.values[vid].op.access
        if what == "index":
            return self.tile_bases(acc, fixed, start, in_buffer=False)
        return self.tile_bases(acc, fixed, start) // self.ctx.layouts[acc.buf].row_len

    def prologue_values(self, tile: Tile) -> list[int]:
        """The per-tile constants: the tile's origin in index terms, and the first buffer
        row of each gather/scatter."""
        vals = []
        for vid, what in self.tile_consts:
            acc = self.values[vid].op.access
            if what == "index":
                val = acc.const + sum(acc.coeffs[j] * x for j, x in enumerate(tile.fixed))
                if self.block >= 0:
                    val += acc.coeffs[self.block] * tile.start
            else:
                val = self.tile_base(acc, tile) // self.ctx.layouts[acc.buf].row_len
            vals.append(int(val))
        return vals

    def prologue(self, tile: Tile) -> Program | None:
        """One instruction per tile constant (the immediates differ from tile to tile)."""
        if not self.tile_consts:
            return None
        prog = Program()
        for (vid, what), val in zip(self.tile_consts, self.prologue_values(tile), strict=True):
            dst = Operand(SCALAR, "int64", self.const_off[(vid, what)])
            prog.emit(lib.SPY_SFU_IOTA, 1, 1, dst, _imm(val, "int64"), _imm(0, "int64"), _imm(0, "int64"))
        return prog

    # ---- DMA ------------------------------------------------------------------------------
    def box(self, v: Value, tile: Tile, lx: _Slots) -> tuple[int, list, list, list, int] | None:
        """(base element, counts, strides, scratchpad strides, scratchpad offset) of the part of
        a load/store this tile moves, or None when its mask excludes the whole tile."""
        acc = v.op.access
        e = ITEMSIZE[lx.dtype]
        dom = {j: (lo, hi) for j, lo, hi in acc.domain}
        for j, x in enumerate(tile.fixed):
            if j in dom and not dom[j][0] <= x < dom[j][1]:
                return None
        base = self.tile_base(acc, tile)
        counts, strides, lxs = [], [], []
        lx_off = 0
        if v.kind in (TILE, ROW):
            row_pitch = lx.pitch * e if v.kind == TILE else e
            for j, count, stride in self.tile_rows(tile.blk):
                lo, hi = 0, count
                if j in dom:
                    if j == self.block:
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
            for j, count, stride in self.tile_cols():
                lo, hi = dom.get(j, (0, count))
                base += acc.coeffs[j] * lo
                lx_off += lo * stride * e
                counts.append(hi - lo)
                strides.append(acc.coeffs[j])
                lxs.append(stride * e)
        if not counts:
            counts, strides, lxs = [1], [1], [e]
        return base, counts, strides, lxs, lx_off


def _promote(a: str, b: str) -> str:
    if a in FLOATS or b in FLOATS:
        return "float32"
    if a == "bool" and b == "bool":
        return "bool"
    return "int64"


def _imm(value, dtype: str) -> Operand:
    return Operand(SCALAR, dtype, imm=value)


# ---- emission --------------------------------------------------------------------------


_ZERO3 = (0, 0, 0)
_PAD = (0,) * 16
_SFU_RES = (0,) * 22
_GATHER_RES = (0, 0, 0, 0)


FREE_IN, FREE_OUT = -1, -2  # template dependencies on the tile two places back on the core


class _Template:
    """The commands of one tile, recorded once per class of alike tiles and replicated over
    the class with numpy (see :func:`build`).

    Tiles of a class differ only in their core, the DRAM offsets of their loads and stores
    (by a per-access shift: the class fixes each box and its column in the row, so tiles
    are whole rows apart and the stick layout maps them by a constant), their prologue
    immediates and the commands they depend on. Commands are collected as plain tuples
    per command format and turned into one array at the end."""

    def __init__(self, b: Builder, programs: dict, pattern_cache: dict):
        self.b = b
        self.ctx = b.ctx
        self.rows: dict[np.dtype, list] = {CMD_DMA: [], CMD_SFU: [], CMD_GATHER: []}
        self.where: dict[np.dtype, list[int]] = {CMD_DMA: [], CMD_SFU: [], CMD_GATHER: []}
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
        self.rows[fmt].append(head + (len(self.deps), len(deps), 0) + body)
        self.where[fmt].append(i)
        self.deps.extend(deps)
        self.n += 1
        return i

    def sfu(self, prog: Program, key, deps: list[int]) -> list[int]:
        if key is None:  # the prologue: instructions of its own for every tile
            i = self._push(CMD_SFU, (OP_SFU, 0, 0), (0, len(prog), _SFU_RES, _PAD), deps)
            self.prologue = (i, prog.array())
            return [i]
        first = self.programs.get(key)
        if first is None:
            first = self.programs[key] = self.ctx.program.add_instrs(prog.array())
        return [self._push(CMD_SFU, (OP_SFU, 0, 0), (first, len(prog), _SFU_RES, _PAD), deps)]

    def dma(self, op: int, access: int, buf: str, box, lx_base: int, deps: list[int]) -> list[int]:
        base, counts, strides, lxs, lx_off = box
        layout = self.ctx.layouts[buf]
        slot = self.ctx.slot(buf)
        # Everything the cached pattern and stride tuples depend on: a store's source and
        # destination strides are a load's swapped, so the direction is part of the key.
        key = (op, buf, tuple(counts), tuple(strides), tuple(lxs), base % layout.row_len)
        hit = self.pattern_cache.get(key)
        if hit is None:
            try:
                p = pattern(layout, base, counts, strides, lxs)
                hit = (p, layout.phys(base), _dims_tuples(p, op == OP_LOAD))
            except NotAffine:
                hit = (None, 0, None)
            self.pattern_cache[key] = hit
        p, origin, dims = hit
        load = op == OP_LOAD
        field = "src_off" if load else "dst_off"
        if p is None:
            return self._descs(op, access, slot, layout, base, counts, strides, lxs, lx_base + lx_off, load, deps)
        shift = layout.phys(base) - origin
        count, sstr, dstr, ndims = dims
        out = []
        for dram, lxb in p.bases:
            dev, lxo = dram + shift, lx_base + lx_off + lxb
            if load:
                src_slot, dst_slot, src, dst = slot, 0, dev, lxo
            else:
                src_slot, dst_slot, src, dst = 0, slot, lxo, dev
            i = self._push(CMD_DMA, (op, 0, 0), (src_slot, dst_slot, src, dst, p.run, ndims, count, 0,
                                                 sstr, dstr, _PAD), deps)
            self.shifted.append((i, access, field))
            out.append(i)
        return out

    def _descs(self, op, access, slot, layout, base, counts, strides, lxs, lx_base, load, deps):
        """A descriptor-list DMA for accesses with no compact pattern (one run per element
        run that is contiguous on both sides)."""
        dev, lx, lengths = descriptor_runs(layout, base, counts, strides, lx_base, lxs)
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

    def gather(self, op: int, v: Value, tile: Tile, data_off: int, idx_off: int, deps: list[int]) -> list[int]:
        b = self.b
        acc = v.op.access
        layout = self.ctx.layouts[acc.buf]
        c0 = b.tile_base(acc, tile) % layout.row_len
        e = layout.itemsize
        sl = b.slots[v.op.id]
        cols = b.tile_cols() if v.kind in (TILE, COL) else []
        counts = [c for _, c, _ in cols] or [1]
        strides = [acc.coeffs[j] for j, _, _ in cols] or [1]
        lxs = [s * e for _, _, s in cols] or [e]
        key = ("gather", acc.buf, tuple(counts), tuple(strides), c0)
        p = self.pattern_cache.get(key)
        if p is None:
            try:
                p = pattern(layout, c0, counts, strides, lxs)
            except NotAffine as err:
                raise Unsupported(f"gather/scatter columns: {err}") from None
            if len(p.dims) > 2 or any(d.dst != p.run * math.prod(x.count for x in p.dims[:i])
                                      for i, d in enumerate(p.dims)):
                raise Unsupported("gather/scatter rows that are not packed in the scratchpad")
            self.pattern_cache[key] = p
        rows = tile.rows(b.inner)
        pitch = (sl.pitch * e) if v.kind == TILE else e
        count = tuple(d.count for d in p.dims) + (0,) * (2 - len(p.dims))
        stride = tuple(d.src for d in p.dims) + (0,) * (2 - len(p.dims))
        table_slot = self.ctx.slot(acc.buf)
        out = []
        for dram, lxb in p.bases:
            out.append(self._push(CMD_GATHER, (op, 0, 0), (
                table_slot, idx_off, lib.SPY_DT_I64, rows, dram, layout.stick_bytes, layout.rows, data_off + lxb,
                pitch, p.run, len(p.dims), count, stride, _GATHER_RES, _PAD), deps))
        return out

    def commands(self) -> np.ndarray:
        cmds = np.zeros(self.n, dtype=CMD_DMA)
        for fmt, rows in self.rows.items():
            if rows:
                cmds.view(fmt)[np.array(self.where[fmt])] = np.array(rows, dtype=fmt)
        return cmds


def _dims_tuples(p: Pattern, load: bool):
    count = tuple(d.count for d in p.dims) + (0,) * (3 - len(p.dims))
    src = tuple(d.src if load else d.dst for d in p.dims) + (0,) * (3 - len(p.dims))
    dst = tuple(d.dst if load else d.src for d in p.dims) + (0,) * (3 - len(p.dims))
    return count, src, dst, len(p.dims)


def check_kernel(k: LoopKernel) -> None:
    """Raise Unsupported if construction could not express this kernel (compile time)."""
    Builder(None, k).analyse()


@dataclass
class _Class:
    """Tiles whose commands share one template."""

    template: _Template
    cmds: np.ndarray
    deps: np.ndarray
    rep_phys: np.ndarray   # the physical offset of each access's box in the recorded tile
    last_sfu: int | None   # within the tile: what a load two tiles later waits for
    last_out: int | None   # within the tile: what a first SFU command two tiles later waits for
    tiles: list[int] = field(default_factory=list)


def _record_tile(b: Builder, em: _Template, tile: Tile, accesses: dict[str, int], has_in: bool,
                 has_out: bool, stage_programs: dict) -> tuple[int | None, int | None]:
    """Record one tile's commands in `em`; the tile's last SFU and last store commands.

    Per tile a core runs: loads -> prologue -> per level (SFU stage, gathers) -> stores."""
    slot = tile.seq % 2
    rows = tile.rows(b.inner)
    free_in = [FREE_IN] if has_in else []
    free_out = [FREE_OUT] if has_out else []
    issued: dict[int, list[int]] = {lvl: [] for lvl in range(b.levels + 1)}
    for v in b.loads:
        if v.op.access.ind:
            continue
        box = b.box(v, tile, b.slots[v.op.id])
        if box is not None:
            issued[0] += em.dma(OP_LOAD, accesses[v.op.id], v.op.access.buf, box, b.slots[v.op.id].off[slot],
                                free_in)
    prev: list[int] = []
    pro = b.prologue(tile)
    if pro is not None:
        prev = em.sfu(pro, None, [])
    for lvl in range(b.levels):
        deps = issued[lvl] + prev + (free_out if lvl == 0 else [])
        key = (lvl, slot, rows, tile.blk)
        prog = stage_programs.get(key)
        if prog is None:
            prog = stage_programs[key] = b.stage_program(lvl, slot, rows, tile.blk)
        prev = em.sfu(prog, key, deps) if prog.rows else deps
        for v in b.loads:
            if v.op.access.ind and v.level == lvl + 1:
                sl = b.slots[v.op.id]
                issued[lvl + 1] += em.gather(OP_GATHER, v, tile, sl.off[slot], b.index_slots[v.op.id].off[slot],
                                             prev + free_in)
    own = [i for i in prev if i >= 0]
    last_sfu = max(own) if own else (max(issued[0]) if issued[0] else None)
    outs: list[int] = []
    for v in b.stores:
        sl = b.slots[v.op.id]
        if v.op.access.ind:
            outs += em.gather(OP_SCATTER, v, tile, sl.off[slot], b.index_slots[v.op.id].off[slot], prev)
            continue
        box = b.box(v, tile, sl)
        if box is not None:
            outs += em.dma(OP_STORE, accesses[v.op.id], v.op.access.buf, box, sl.off[slot], prev)
    return last_sfu, (max(outs) if outs else None)


def memo() -> dict:
    """A construction memo (tile classes, stage programs, DMA patterns): each key holds
    everything its value depends on, so a build that never hits one (tests swap this for
    such a dict) makes the same commands tile by tile."""
    return {}


# What analysis and tiling decide for a kernel: it depends only on the kernel and the
# target, so it is compile-time work, made once and reused by every construction.
_TILING = ("values", "nvars", "nrow", "rowvars", "colvars", "C", "bufs", "levels", "needs", "block", "blk",
           "inner", "rmax", "tiles")


def build(ctx: BuildContext, k: LoopKernel, tiling: dict | None = None) -> dict:
    """All tiles' commands, in per-core order, with their dependencies; returns the tiling
    (pass it back to build the same kernel on the same target again without re-deciding it).

    Tiles are sorted into classes by everything that shapes their commands; each class's
    commands are recorded once (from its first tile) and replicated over its tiles with
    array arithmetic: the per-tile work in Python is a few integer operations."""
    b = Builder(ctx, k)
    if tiling is None:
        b.analyse()
        b.choose_tiles()
        tiling = {name: getattr(b, name) for name in _TILING}
    else:
        b.__dict__.update(tiling)
    b.allocate()
    b.loads = [v for v in b.values.values() if v.op.op == "load"]
    b.stores = [v for v in b.values.values() if v.op.op == "store"]
    direct = [v for v in b.loads + b.stores if not v.op.access.ind]
    accesses = {v.op.id: i for i, v in enumerate(direct)}
    layouts = [ctx.layouts[v.op.access.buf] for v in direct]
    indirect = [v for v in b.loads + b.stores if v.op.access.ind]
    classes: dict[tuple, _Class] = memo()
    stage_programs: dict = memo()
    programs: dict = memo()
    pattern_cache: dict = memo()
    ntiles = len(b.tiles)
    first = np.zeros(ntiles, dtype=np.int64)
    dfirst = np.zeros(ntiles, dtype=np.int64)
    free_in = np.zeros(ntiles, dtype=np.int64)
    free_out = np.zeros(ntiles, dtype=np.int64)
    phys = np.zeros((ntiles, max(1, len(direct))), dtype=np.int64)  # each access's box, per tile
    last_sfu: list[int | None] = [None] * ntiles
    last_out: list[int | None] = [None] * ntiles
    # Per access and tile: what fixes the commands (box and column in the row) and the
    # physical offset of the box, computed for all tiles at once where the access has no
    # mask (a masked access clips its box tile by tile).
    fixed = np.array([tile.fixed for tile in b.tiles], dtype=np.int64).reshape(ntiles, -1)
    start = np.array([tile.start for tile in b.tiles], dtype=np.int64)
    blks = [tile.blk for tile in b.tiles]
    key_cols: list[list] = []
    for a, (v, layout) in enumerate(zip(direct, layouts, strict=True)):
        acc = v.op.access
        if not acc.domain:
            base = b.tile_bases(acc, fixed, start)
            phys[:, a] = layout.phys(base)
            # a one-row storage is linear: any two boxes are a constant apart
            key_cols.append((base % layout.row_len).tolist() if layout.rows > 1 else [0] * ntiles)
            continue
        col = []
        for t, tile in enumerate(b.tiles):
            box = b.box(v, tile, b.slots[v.op.id])
            if box is None:
                col.append(None)
                continue
            base, counts, strides, lxs, lx_off = box
            col.append((tuple(counts), tuple(strides), tuple(lxs), lx_off,
                        base % layout.row_len if layout.rows > 1 else 0))
            phys[t, a] = layout.phys(base)
        key_cols.append(col)
    for v in indirect:
        acc = v.op.access
        key_cols.append((b.tile_bases(acc, fixed, start) % ctx.layouts[acc.buf].row_len).tolist())
    tile_keys = list(zip(blks, *key_cols, strict=True))
    n = nd = 0
    for t, tile in enumerate(b.tiles):
        has_in = tile.seq >= 2 and last_sfu[t - 2] is not None
        has_out = tile.seq >= 2 and last_out[t - 2] is not None
        key = (tile.seq % 2, has_in, has_out, tile_keys[t])
        c = classes.get(key)
        if c is None:
            em = _Template(b, programs, pattern_cache)
            ls, lo = _record_tile(b, em, tile, accesses, has_in, has_out, stage_programs)
            c = classes[key] = _Class(em, em.commands(), np.asarray(em.deps, dtype=np.int64),
                                      phys[t].copy(), ls, lo)
        c.tiles.append(t)
        first[t], dfirst[t] = n, nd
        if has_in:
            free_in[t] = last_sfu[t - 2]
        if has_out:
            free_out[t] = last_out[t - 2]
        last_sfu[t] = None if c.last_sfu is None else n + c.last_sfu
        last_out[t] = None if c.last_out is None else n + c.last_out
        n += len(c.cmds)
        nd += len(c.deps)
    cmds = np.zeros(n, dtype=CMD_DMA)
    deps = np.zeros(nd, dtype=np.int64)
    cores = np.array([tile.core for tile in b.tiles], dtype=np.uint16)
    prologue_first = None
    if b.tile_consts:
        values = np.stack([b.prologue_column(vid, what, fixed, start) for vid, what in b.tile_consts], axis=1)
    for c in classes.values():
        idx = np.array(c.tiles)
        em = c.template
        block = np.repeat(c.cmds[None, :], len(idx), axis=0)
        block["core"] = cores[idx][:, None]
        block["dep_begin"] += dfirst[idx][:, None].astype(np.uint32)
        moved = phys[idx] - c.rep_phys  # how far each tile's boxes are from the recorded tile's
        for j, a, fld in em.shifted:
            block[fld][:, j] = (block[fld][:, j].astype(np.int64) + moved[:, a]).astype(np.uint64)
        for j, a, fld, descs in em.descs:
            rep = np.repeat(descs[None, :], len(idx), axis=0)
            rep[fld] = (rep[fld].astype(np.int64) + moved[:, a][:, None]).astype(np.uint64)
            d0 = ctx.program.add_descs(rep.reshape(-1))
            block["src_off"][:, j] = d0 + np.arange(len(idx), dtype=np.uint64) * len(descs)
        if em.prologue is not None:
            j, instrs = em.prologue
            if prologue_first is None:
                every = np.repeat(instrs[None, :], len(b.tiles), axis=0)
                every["src"][:, :, 0]["v"] = values.view(np.uint64)
                prologue_first = ctx.program.add_instrs(every.reshape(-1))
            block.view(CMD_SFU)["instr_begin"][:, j] = prologue_first + idx * len(instrs)
        cmds[first[idx][:, None] + np.arange(len(c.cmds))] = block
        if len(c.deps):
            d = np.where(c.deps == FREE_IN, free_in[idx][:, None],
                         np.where(c.deps == FREE_OUT, free_out[idx][:, None], first[idx][:, None] + c.deps))
            deps[dfirst[idx][:, None] + np.arange(len(c.deps))] = d
    ctx.program.add(cmds, deps.astype(np.uint32))
    ctx.scratchpad_peak = b.lx_top
    return tiling
