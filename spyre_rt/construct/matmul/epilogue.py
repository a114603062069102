"""A matmul's fused epilogue (:class:`~spyre_rt.ir.Epilogue`): the storage of its
values and its SFU program over one output tile.

Values are computed as loop construction computes them (:mod:`..loops.stages`): floats in
fp32, rounded only at explicit conversions and stores; ``product`` is the accumulator
rounded to the matmul's output dtype, as the loop kernel the epilogue came from loaded it.
Every computed value is a whole tile in one of a few temporaries (reused once a value is
dead, or written over by the op that reads it last), or, when only a store reads it, in the
store's staging tile; the temporaries are most of an epilogue's scratchpad, and every one
the plan saves leaves room for larger matmul tiles. Loads land in double-buffered tiles (a
row, for an operand broadcast over the rows), and each other stored value moves into a
double-buffered staging tile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

from ...ir import Epilogue, Prologue
from ...native import lib
from ..loops.analysis import _dtype
from ..sfu import (
    BINARY,
    COL,
    COMPARE,
    FLOATS,
    ITEMSIZE,
    NONE,
    ROW,
    SCALAR,
    TILE,
    UNARY,
    Operand,
    parse_constant,
)


@dataclass(frozen=True)
class Plan:
    """Where each value of an epilogue lives (all per core, per tile)."""

    ops: tuple            # the epilogue's ops, each value computed once (arguments renamed to match)
    dtypes: dict          # value id -> storage dtype
    temp: dict            # computed value id -> temporary index
    stored: dict          # computed value id -> the output it is written to directly (no temporary)
    ntemps: int
    temp_itemsize: int    # bytes per element of a temporary
    input_kinds: tuple    # TILE, COL for an input broadcast over the rows, ROW for one
                          # broadcast over the columns, PERIODIC for one period's columns
    instrs: int           # SFU instructions of the epilogue's body (stores' moves included);
                          # a sliced one's: of a whole tile's, on average over its slices
    slices: tuple = ()    # a sliced epilogue's: each slice's plan (its ops, values and
                          # temporaries; the temporaries shared, each slice in its columns)


PERIODIC = "periodic"  # an input kind: one period of columns, read by every period of a tile
PERIODIC_ROWS = "periodic rows"  # one period of columns of each of the tile's rows


def input_kinds(ep: Epilogue) -> tuple:
    """How each input of an epilogue lands in a tile: a TILE; one row broadcast over the
    rows (COL); one value per row broadcast over the columns (ROW); or, for a sliced
    epilogue's periodic input, one period's columns (PERIODIC), of each row (PERIODIC_ROWS)."""
    out = []
    for i, (_, _, sizes, strides) in enumerate(ep.inputs):
        if i in ep.periodic:
            out.append(PERIODIC_ROWS if strides[1] and sizes[1] > 1 else PERIODIC)
        elif strides[1] == 0 and sizes[1] > 1:
            out.append(COL)
        elif strides[2] == 0 and sizes[2] > 1:
            out.append(ROW)
        else:
            out.append(TILE)
    return tuple(out)


def prologue_plan(pro: Prologue, in_dtype: str) -> Plan:
    """An A prologue's plan, as an epilogue's whose one output is A's chunk (its dtype the
    matmul's operands'), written in place over the first input: each input read in A's
    chunk is a TILE, a vector one value per row of A a ROW, per column a COL."""
    kinds = tuple(TILE if i == 0 else ROW if view[3][2] == 0 else COL for i, view in enumerate(pro.inputs))
    ops = tuple(dataclasses.replace(op, attrs={**op.attrs, "output": 0}) if op.op == "store" else op
                for op in pro.ops)
    body = SimpleNamespace(ops=_widened_in_place(ops, pro.input_dtypes), inputs=pro.inputs,
                           input_dtypes=pro.input_dtypes, output_dtypes=(in_dtype,))
    return plan(body, kinds)


def _widened_in_place(ops, input_dtypes) -> tuple:
    """`ops` without their conversions of a float value to fp32: the SFU reads every float
    operand as fp32 (a narrower one exactly), so the readers read the value itself. Each
    such move of a chunk is a pass of the SFU on the prologue's share of the pipeline."""
    dtypes: dict[str, str] = {}
    same: dict[str, str] = {}
    out = []
    for op in ops:
        op = _renamed(op, same)
        if op.op == "store":
            out.append(op)
            continue
        if op.op == "to_dtype" and op.dtype == "float32" and dtypes[op.args[0]] in FLOATS:
            same[op.id] = op.args[0]
            continue
        if op.op == "load":
            dtypes[op.id] = input_dtypes[op.attrs["input"]]
        else:
            dtypes[op.id] = _dtype(op, [SimpleNamespace(dtype=dtypes[a]) for a in op.args], {})
        out.append(op)
    return tuple(out)


def _renamed(op, same: dict):
    """`op` reading, for each argument `same` maps, the value it maps it to."""
    args = tuple(same.get(a, a) for a in op.args)
    return op if args == op.args else dataclasses.replace(op, args=args)


def plan(ep: Epilogue, kinds: tuple | None = None) -> Plan:
    """The values' storage, with as few temporaries as the scratchpad needs: an op that
    repeats an earlier one (the same operation of the same values) is that value; an
    elementwise op may write over an argument read last by it whose elements are as wide
    (the SFU reads each row before it writes it); and a float value whose only reader is a
    store, computed in fp32 or in the stored dtype, is written into the staging tile (the
    SFU rounds once, to the destination's dtype, as the store's move would). A sliced
    epilogue's slices each have a plan of their own over the same temporaries: a slice's
    instructions touch its own columns of them (and read the product at others)."""
    if kinds is None:
        kinds = input_kinds(ep)
    if not getattr(ep, "slices", ()):  # (a prologue's body has none)
        return _plan_body(ep, ep.ops, kinds)
    parts = tuple(_plan_body(ep, body, kinds) for body in ep.slices)
    return Plan((), {}, {}, {}, max(q.ntemps for q in parts), max(q.temp_itemsize for q in parts), kinds,
                -(-sum(q.instrs for q in parts) // len(parts)), parts)


def _plan_body(ep: Epilogue, body: tuple, kinds: tuple) -> Plan:
    ops = _computed_once(body)
    readers: dict[str, list] = {}
    for op in ops:
        for a in op.args:
            readers.setdefault(a, []).append(op)
    last = {a: max(i for i, op in enumerate(ops) if a in op.args) for a in readers}
    dtypes: dict[str, str] = {}
    temp: dict[str, int] = {}
    stored: dict[str, int] = {}
    free: list[int] = []
    live: list[str] = []
    ntemps, instrs = 0, 0
    for i, op in enumerate(ops):
        for v in list(live):  # a temporary is free once its value's last reader ran
            if last.get(v, -1) < i:
                live.remove(v)
                free.append(temp[v])
        if op.op == "load":
            dtypes[op.id] = ep.input_dtypes[op.attrs["input"]]
            continue
        if op.op == "store":
            instrs += op.args[0] not in stored
            continue
        if op.op == "product":
            dtypes[op.id] = op.dtype
        elif op.op == "constant":
            dtypes[op.id] = _dtype(op, [], {})
            continue
        else:
            dtypes[op.id] = _dtype(op, [SimpleNamespace(dtype=dtypes[a]) for a in op.args], {})
        instrs += 1
        store = _only_store(readers.get(op.id, []))
        out_dtype = ep.output_dtypes[store.attrs["output"]] if store is not None else None
        if (store is not None and dtypes[op.id] in ("float32", out_dtype) and out_dtype in FLOATS
                and all(dtypes[a] in FLOATS for a in (op.id, *op.args))):
            stored[op.id] = store.attrs["output"]
            continue
        over = next((a for a in op.args if a in live and last[a] == i
                     and ITEMSIZE[dtypes[a]] == ITEMSIZE[dtypes[op.id]]), None)
        if over is not None:
            live.remove(over)
            temp[op.id] = temp[over]
        elif free:
            temp[op.id] = free.pop(0)
        else:
            temp[op.id] = ntemps
            ntemps += 1
        live.append(op.id)
    itemsize = max([ITEMSIZE[dtypes[v]] for v in temp] + [4])
    return Plan(tuple(ops), dtypes, temp, stored, ntemps, itemsize, kinds, instrs)


def _computed_once(ops) -> list:
    """`ops` with each repeat of an earlier operation left out and its readers reading the
    earlier value (every op of an epilogue is pure)."""
    same: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    out = []
    for op in ops:
        op = _renamed(op, same)
        if op.op != "store":
            key = (op.op, op.args, op.dtype, repr(sorted(op.attrs.items())))
            if key in seen:
                same[op.id] = seen[key]
                continue
            seen[key] = op.id
        out.append(op)
    return out


def _only_store(readers: list):
    return readers[0] if len(readers) == 1 and readers[0].op == "store" else None


def program(ep: Epilogue, p: Plan, rows: int, cols: int, acc: Operand, temps: list[int], temp_pitch: int,
            inputs: list[tuple[int, int]], stages: list[tuple[int, int]], strips: bool = False,
            tile_cols: int = 0) -> list[tuple]:
    """The body's instructions for one tile: `temps` are the temporaries' offsets, `inputs`
    each input's landing (offset, pitch), `stages` each output's staging (offset, pitch).
    With `strips`, the temporaries hold one strip of rows and are marked to stay put while
    the program runs strip by strip (an A prologue's; a tile's with epi_strip). A sliced
    epilogue's: each slice's body over its columns of a tile of `tile_cols` columns (a
    whole number of periods), in slice order; each instruction names its columns."""
    if not getattr(ep, "slices", ()):
        return _body_program(ep, p, rows, cols, acc, temps, temp_pitch, inputs, stages, strips)
    width = ep.slice_cols
    if tile_cols % ep.period:
        raise ValueError(f"a tile of {tile_cols} columns is no whole number of {ep.period}-column periods")
    out = []
    for q in range(tile_cols // width):
        out += _body_program(ep, p.slices[q % len(ep.slices)], rows, width, acc, temps, temp_pitch, inputs, stages,
                             strips, col0=q * width)
    return out


def _body_program(ep: Epilogue, p: Plan, rows: int, cols: int, acc: Operand, temps: list[int], temp_pitch: int,
                  inputs: list[tuple[int, int]], stages: list[tuple[int, int]], strips: bool,
                  col0: int | None = None) -> list[tuple]:
    """One body's instructions: over a whole tile, or (`col0` given) over the slice of
    `cols` columns from `col0` on, every tile-wide operand moved to those columns."""
    rows_ = []

    def at(o: Operand, shift: int = 0) -> Operand:
        if col0 is None or o.kind not in (TILE, COL):
            return o
        return o.at(o.off + (col0 + shift) * ITEMSIZE[o.dtype])

    def emit(op, dst: Operand, *srcs: Operand, aux: int = 0) -> None:
        enc = [s.encode() for s in srcs] + [NONE] * (3 - len(srcs))
        rows_.append((op, aux, 0, 0, rows, cols, dst.encode(), enc))

    operands: dict[str, Operand] = {}
    for op in p.ops:
        name = op.op
        if name == "load":
            i = op.attrs["input"]
            off, pitch = inputs[i]
            kind = p.input_kinds[i]
            if kind in (PERIODIC, PERIODIC_ROWS):  # a slice reads its columns of the period
                operands[op.id] = Operand(COL if kind == PERIODIC else TILE, p.dtypes[op.id],
                                          off + op.attrs.get("at", 0) * ITEMSIZE[p.dtypes[op.id]], pitch)
            else:
                operands[op.id] = at(Operand(kind, p.dtypes[op.id], off, pitch))
            continue
        if name == "constant":
            dt = p.dtypes[op.id]
            operands[op.id] = Operand(SCALAR, dt, imm=parse_constant(op.attrs.get("value"), dt))
            continue
        if name == "store":
            if op.args[0] not in p.stored:
                off, pitch = stages[op.attrs["output"]]
                emit(lib.SPY_SFU_MOV, at(Operand(TILE, ep.output_dtypes[op.attrs["output"]], off, pitch)),
                     operands[op.args[0]])
            continue
        if op.id in p.stored:
            out = p.stored[op.id]
            dst = at(Operand(TILE, ep.output_dtypes[out], *stages[out]))
        else:
            dst = at(Operand(TILE, p.dtypes[op.id], temps[p.temp[op.id]], temp_pitch, fixed=strips))
        args = [operands[a] for a in op.args]
        if name == "product":
            emit(lib.SPY_SFU_MOV, dst, at(acc, op.attrs.get("shift", 0)))
        elif name == "to_dtype":
            emit(lib.SPY_SFU_MOV, dst, args[0])
        elif name in COMPARE:
            emit(lib.SPY_SFU_CMP, dst, *args, aux=COMPARE[name])
        elif name == "where":
            emit(lib.SPY_SFU_SELECT, dst, *args)
        elif name == "relu":
            emit(lib.SPY_SFU_MAX, dst, args[0], Operand(SCALAR, dst.dtype, imm=0.0 if dst.dtype in FLOATS else 0))
        elif name == "square":
            emit(lib.SPY_SFU_MUL, dst, args[0], args[0])
        elif name == "exp2":
            emit(lib.SPY_SFU_POW, dst, Operand(SCALAR, "float32", imm=2.0), args[0])
        elif name in UNARY:
            emit(UNARY[name], dst, *args)
        elif name in BINARY:
            emit(BINARY[name], dst, *args)
        else:
            raise ValueError(f"an epilogue cannot compute {name}")
        operands[op.id] = dst
    return rows_
