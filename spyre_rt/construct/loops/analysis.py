"""The values of a loop kernel's body: what each varies along, its storage type, its stage.

A value's *kind* says how it spreads over a tile of R rows x C columns: ``tile`` (R x C),
``row`` (one per row), ``col`` (one per column) or ``scalar``. It follows from the loop
variables the value depends on: the kernel's leading variables are rows, its trailing
``ncols`` variables columns. A value's *level* is the SFU stage that computes it: a
gathered load comes one stage after the index it reads, so a body with gathers runs as
several stages with gathers between them.

Analysis depends on the kernel alone: it is compile-time work (:func:`check_kernel` runs
it when a kernel is lowered), made once and carried by the tiling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...ir import Buffer, LoopKernel, Op
from ..context import Refused
from ..sfu import BINARY, COL, COMPARE, DTYPE, FLOATS, ROW, SCALAR, TESTS, TILE, UNARY, compute_type


class Unsupported(Refused, NotImplementedError):
    """Construction cannot express this kernel; the compiler runs it another way."""


LOGICAL = {"logical_and", "logical_or", "logical_not", "logical_xor", "and_", "or_", "xor", "isnan"}
_COMPOSED = {"relu", "square", "sigmoid", "exp2"}  # elementwise ops written as other instructions
# Every operation a loop kernel's body may use: what construction emits SFU code for.
CARD_OPS = frozenset({"load", "store", "reduction", "constant", "index", "indirect", "to_dtype", "where"}
                     | _COMPOSED | set(UNARY) | set(BINARY) | set(COMPARE) | LOGICAL)
# Elementwise ops whose result is a float even for integer operands (torch's promotion).
_FLOAT_RESULT = {"truediv", "div", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos", "erf", "exp2",
                 "log1p", "expm1", "atan", "reciprocal", "pow"}


@dataclass(frozen=True)
class Value:
    """One SSA value of the body."""

    op: Op
    deps: frozenset[int]  # the loop variables it varies along
    kind: str             # TILE, ROW, COL or SCALAR
    dtype: str            # its storage type in the scratchpad
    level: int = 0        # the SFU stage that computes it


@dataclass(frozen=True)
class Analysis:
    """A kernel's values, and the shape of the tiles they live in."""

    kernel: LoopKernel
    values: dict[str, Value]   # by SSA id, in body order
    n_row_vars: int            # the leading loop variables, which index a tile's rows
    columns: int               # elements of a tile row: the product of the column sizes
    levels: int                # SFU stages
    loads: tuple[Value, ...]
    stores: tuple[Value, ...]

    @property
    def n_vars(self) -> int:
        return len(self.kernel.sizes)


def analyse(k: LoopKernel) -> Analysis:
    """The values of `k`'s body; raises :class:`Unsupported` for what the card cannot do."""
    nrow = len(k.sizes) - k.ncols
    row_vars, col_vars = set(range(nrow)), set(range(nrow, len(k.sizes)))
    buffers = {b.name: b for b in k.buffers}
    for b in k.buffers:
        if b.dtype not in DTYPE:
            raise Unsupported(f"{b.name} holds {b.dtype}, which the card does not compute in")
    values: dict[str, Value] = {}
    for op in k.ops:
        try:
            values[op.id] = _value(op, values, buffers, row_vars, col_vars)
        except Unsupported as e:
            e.op_id = getattr(e, "op_id", op.id)  # the compiler runs that op's node elsewhere
            raise
        except ValueError as e:  # a dtype the card does not compute in
            err = Unsupported(f"operation {op.op}: {e}")
            err.op_id = op.id
            raise err from None
    return Analysis(
        kernel=k,
        values=values,
        n_row_vars=nrow,
        columns=math.prod(k.sizes[nrow:]) if k.ncols else 1,
        levels=max((v.level for v in values.values()), default=0) + 1,
        loads=tuple(v for v in values.values() if v.op.op == "load"),
        stores=tuple(v for v in values.values() if v.op.op == "store"),
    )


def _value(op: Op, values: dict[str, Value], buffers: dict[str, Buffer], row_vars: set[int],
           col_vars: set[int]) -> Value:
    args = [values[a] for a in op.args]
    deps = frozenset().union(*[a.deps for a in args]) if args else frozenset()
    level = max((a.level for a in args), default=0)
    if op.op in ("load", "store"):
        deps, level = _access_deps_and_level(op, values, col_vars, deps, level)
    elif op.op == "index":
        deps = _varying(op.access.coeffs)
    elif op.op == "reduction":
        deps = deps - col_vars
    dtype = _dtype(op, args, buffers)
    r, c = bool(deps & row_vars), bool(deps & col_vars)
    kind = TILE if r and c else ROW if r else COL if c else SCALAR
    return Value(op, deps, kind, dtype, level)


def _varying(coeffs) -> frozenset[int]:
    return frozenset(j for j, c in enumerate(coeffs) if c)


def _access_deps_and_level(op: Op, values: dict[str, Value], col_vars: set[int], deps: frozenset,
                           level: int) -> tuple[frozenset, int]:
    """A load or store varies along its own index and its indirect indices; a gathered load
    is computed one stage after its index (the gather runs between the two stages)."""
    acc = op.access
    deps = deps | _varying(acc.coeffs)
    for idx, _ in acc.ind:
        iv = values[idx]
        deps |= iv.deps
        if iv.deps & col_vars:
            err = Unsupported("an indirect index that varies along the columns")
            err.indirect = True
            raise err
        level = max(level, iv.level + (1 if op.op == "load" else 0))
    return deps, level


def _dtype(op: Op, args: list[Value], buffers: dict[str, Buffer]) -> str:
    """The storage type of an op's result: buffers keep their dtype, computed values are
    fp32, int64 or bool (see :func:`~spyre_rt.construct.sfu.compute_type`)."""
    name = op.op
    if name in ("load", "store"):
        return buffers[op.access.buf].dtype
    if name in ("index", "indirect"):
        return "int64"
    if name == "constant":
        return compute_type(op.dtype or ("float32" if isinstance(op.attrs.get("value"), float) else "int64"))
    if name == "reduction":
        return _reduction_dtype(op, args)
    if name == "to_dtype":
        return op.dtype if op.dtype in ("float16", "bfloat16") else compute_type(op.dtype)
    if name in COMPARE or name in LOGICAL or name in TESTS:
        return "bool"
    if name == "where":
        return _promote(args[1].dtype, args[2].dtype)
    if name in UNARY or name in BINARY or name in _COMPOSED:
        dtype = args[0].dtype if len(args) == 1 else _promote(*[a.dtype for a in args])
        if name in _FLOAT_RESULT and dtype not in FLOATS:
            dtype = "float32"
        return compute_type(dtype)
    raise Unsupported(f"operation {name}")


def _reduction_dtype(op: Op, args: list[Value]) -> str:
    kind = op.attrs.get("kind")
    if kind in ("argmax", "argmin"):
        return "int64"
    dtype = compute_type(op.dtype or args[0].dtype)
    return "bool" if kind == "any" else dtype


def _promote(a: str, b: str) -> str:
    if a in FLOATS or b in FLOATS:
        return "float32"
    if a == "bool" and b == "bool":
        return "bool"
    return "int64"
