"""Epilogues in column slices: a pointwise kernel on a matmul's product whose work depends on
where a column lies in a period of the columns.

A rotary embedding applied to a projection's heads is the case: each column of a head reads
the column half a head away (rotate-half, ``cat(-x2, x1)``, which Inductor writes as masked
loads of the product 64 columns on and 64 back, chosen by the column's index), and a table
indexed by the column within the head. No whole-tile SFU instruction computes that. Cut a
tile's columns in slices of the kernel's innermost column variable, though, and in each
slice everything else is decided: the column index lies in a known range, so the masks and
the selections they drive are constants; a masked load either reads the whole slice or is
never used; the product's other half is the product ``shift`` columns away; and a table
that repeats for every head is one period's vector read from the slice's offset in it.

:func:`sliced_epilogue` specializes the kernel's body once per slice of a period (the
product of the innermost column variables it needs decided) and gives the
:class:`~spyre_rt.ir.Epilogue` those bodies. Construction then runs each tile slice by
slice, its tiles cut in whole periods (``construct.matmul.record.exact_tiling``); the
values are the loop kernel's, op for op.
"""

from __future__ import annotations

import dataclasses
import operator

from spyre_rt.ir import Epilogue, LoopKernel, MatmulKernel, Op

MAX_SLICES = 8       # slices in a period (the program has each one's body)
MIN_SLICE_COLS = 16  # columns of a slice: fewer, and the instructions are mostly overhead

_FOLD = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
         "ne": operator.ne}
_LOGIC = {"bitwise_and": all, "logical_and": all, "bitwise_or": any, "logical_or": any}


def sliced_epilogue(k: LoopKernel, mm: MatmulKernel, anchor: Op, parts: list, computes: frozenset) -> Epilogue | None:
    """`k` as a sliced epilogue of `mm`, or None. `anchor`: `k`'s load of the product at its
    own columns; `parts`: `k`'s variables regrouped into the product's (batch, M, N)
    (``fusion._parts``); `computes`: the ops an epilogue computes.
    A slice is a run of the innermost column variable (the widest that decides everything);
    a period, that variable and the column variables next to it that slices must fix."""
    (_, _, nn), p_strides = mm.out[2], mm.out[3]
    if nn <= 1 or p_strides[2] != 1:
        return None
    cols = sorted((p for p in parts if p[3] == 2), key=lambda p: p[4])
    if any(w != 1 or size != k.sizes[v] for v, w, size, _, _ in cols):
        return None  # each column part a whole variable
    inner = cols[0][2]
    for width in (w for w in range(inner, MIN_SLICE_COLS - 1, -1) if inner % w == 0):
        period = inner
        for j in range(len(cols)):  # the shortest period that decides everything
            if j:
                period *= cols[j][2]
            if period // width > MAX_SLICES:
                break
            if nn % period:
                continue
            found = _specialized(k, mm, anchor, parts, cols[:j + 1], width, period, computes)
            if found is not None:
                return found
    return None


class _Refuse(Exception):
    pass


def _specialized(k: LoopKernel, mm: MatmulKernel, anchor: Op, parts: list, inner: list, width: int, period: int,
                 computes: frozenset) -> Epilogue | None:
    """The epilogue with one body per slice of `width` columns of a `period` (`inner`: the
    column parts inside a period, innermost first), or None."""
    cut = _Slicer(k, mm, anchor, parts, inner[0][0], width, period, computes,
                  [p for p in parts if p[3] == 2])
    runs = inner[0][2] // width  # slices in the innermost variable
    try:
        bodies = []
        for s in range(period // width):
            value, rest = {}, s // runs
            for part in inner[1:]:  # the variables a slice fixes, mixed radix, innermost first
                value[part[0]], rest = rest % part[2], rest // part[2]
            bodies.append(cut.body(s, s % runs * width, value))
    except _Refuse:
        return None
    alike = all(b == bodies[0] for b in bodies[1:])
    if not cut.outputs or (alike and not cut.periodic and not any(o.attrs.get("shift") for o in bodies[0])):
        return None  # nothing depends on the slice: the plain epilogue's business
    return cut.epilogue(bodies)


@dataclasses.dataclass
class _Slicer:
    k: LoopKernel
    mm: MatmulKernel
    anchor: Op              # the product's load at its own columns
    parts: list             # the kernel's variables as the product's dimensions
    v_in: int               # the innermost column variable: a run of it is a slice's columns
    width: int              # a slice's columns
    period: int
    computes: frozenset
    cols: list = dataclasses.field(default_factory=list)  # the column parts
    inputs: list = dataclasses.field(default_factory=list)
    input_dtypes: list = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)
    output_dtypes: list = dataclasses.field(default_factory=list)
    periodic: dict = dataclasses.field(default_factory=dict)  # (buffer, coeffs) -> each slice's offset

    def __post_init__(self):
        self.dtype = {b.name: b.dtype for b in self.k.buffers}

    def view(self, acc):
        from .fusion import _view

        return _view(acc, self.parts, self.mm.out)

    def body(self, s: int, base: int, value: dict) -> tuple:
        """Slice `s`'s body (the innermost variable from `base` on; `value`: the variables it
        fixes): the kernel's ops with what the slice decides folded away."""
        known: dict[str, object] = {}  # op id -> a constant (folded) value
        ranges: dict[str, tuple] = {}  # op id -> (lo, hi) of an index over the slice
        dead: set[str] = set()         # masked loads the slice never uses
        same: dict[str, str] = {}      # op id -> the op it is (a decided selection)
        ops: list[Op] = []
        for op in self.k.ops:
            op = dataclasses.replace(op, args=tuple(same.get(a, a) for a in op.args))
            name = op.op
            if name == "index":
                ranges[op.id] = self.index_range(op.access, base, value)
                continue
            if name == "constant" and isinstance(op.attrs.get("value"), (bool, int, float)):
                known[op.id] = op.attrs["value"]
            if name in _FOLD and all(a in known or a in ranges for a in op.args):
                folded = _fold(name, [ranges.get(a, known.get(a)) for a in op.args])
                if folded is None:
                    raise _Refuse
                known[op.id] = folded
                ops.append(Op(op.id, "constant", dtype="bool", attrs={"value": folded}))
                continue
            if name in _LOGIC and all(isinstance(known.get(a), bool) for a in op.args):
                known[op.id] = _LOGIC[name](known[a] for a in op.args)
                ops.append(Op(op.id, "constant", dtype="bool", attrs={"value": known[op.id]}))
                continue
            if name == "where" and isinstance(known.get(op.args[0]), bool):
                same[op.id] = op.args[1] if known[op.args[0]] else op.args[2]
                continue
            if any(a in ranges for a in op.args):
                raise _Refuse  # an index used otherwise than to decide a mask
            if name == "load":
                if self.in_domain(op.access.domain, base, value):
                    ops.append(self.load(op, s, base, value))
                else:
                    dead.add(op.id)
            elif name == "store":
                ops.append(self.store(op))
            elif name in self.computes:
                ops.append(dataclasses.replace(op, access=None))
            else:
                raise _Refuse
        live = _live(ops)
        if any(a in dead for op in ops if op.id in live for a in op.args):
            raise _Refuse  # a masked load the slice needs but does not read
        return tuple(op for op in ops if op.id in live)

    def index_range(self, acc, base: int, value: dict) -> tuple[int, int]:
        """An index's values over the slice: only the column variables may move it."""
        lo = acc.const + self.offset(acc.coeffs, base, value)
        span = acc.coeffs[self.v_in] * (self.width - 1)
        return (lo + min(0, span), lo + max(0, span))

    def offset(self, coeffs, base: int, value: dict) -> int:
        """What the variables a slice fixes, and its start in the innermost one, add."""
        out = coeffs[self.v_in] * base
        for v, c in enumerate(coeffs):
            if c and v in value:
                out += c * value[v]
            elif c and v != self.v_in:
                raise _Refuse  # moves over rows, or over whole periods
        return out

    def in_domain(self, domain, base: int, value: dict) -> bool:
        """Whether a masked load's box holds the whole slice (True) or none of it (False)."""
        for v, lo, hi in domain:
            if v in value:
                if not lo <= value[v] < hi:
                    return False
            elif v == self.v_in:
                if hi <= base or lo >= base + self.width:
                    return False
                if not (lo <= base and hi >= base + self.width):
                    raise _Refuse  # the box cuts the slice
            elif not (lo <= 0 and hi >= self.k.sizes[v]):
                raise _Refuse  # the box cuts the rows
        return True

    def load(self, op: Op, s: int, base: int, value: dict) -> Op:
        acc, (product, p_const) = op.access, self.mm.out[:2]
        if acc.buf == product:
            if acc.coeffs != self.anchor.access.coeffs:
                raise _Refuse
            shift = acc.const - p_const
            if not (0 <= s * self.width + shift and s * self.width + shift + self.width <= self.period):
                raise _Refuse  # the product's columns it reads lie in another period
            return Op(op.id, "product", dtype=self.mm.out_dtype, attrs={"shift": shift} if shift else {})
        view = self.view(dataclasses.replace(acc, domain=()))
        nb = self.mm.out[2][0]
        if view is not None and acc.domain:
            # a masked load of another tensor's other half: its tiles would be loaded whole,
            # reading where its mask keeps it from (before the tensor's first column)
            raise _Refuse
        if view is not None and view[3][2] in (0, 1) and not (nb > 1 and view[3][0] == 0):
            if view not in self.inputs:
                self.inputs.append(view)
                self.input_dtypes.append(self.dtype[acc.buf])
            return Op(op.id, "load", dtype=self.dtype[acc.buf], attrs={"input": self.inputs.index(view)})
        # one period's values, the same for every period (of each row, or for every row): the
        # slice's part of them
        columns = {v for v, *_ in self.cols}
        rows = self.view(dataclasses.replace(acc, coeffs=tuple(0 if v in columns else c for v, c in
                                                               enumerate(acc.coeffs)), domain=()))
        if acc.coeffs[self.v_in] != 1 or rows is None or (nb > 1 and rows[3][0] == 0):
            raise _Refuse
        at = acc.const + self.offset(tuple(c if v in columns else 0 for v, c in enumerate(acc.coeffs)), base, value)
        key = (acc.buf, acc.coeffs, rows[3][:2])
        self.periodic.setdefault(key, []).append(at)
        return Op(op.id, "load", dtype=self.dtype[acc.buf], attrs={"periodic": (key, at)})

    def store(self, op: Op) -> Op:
        view = self.view(op.access)
        _, _, (nb, nm, _), _ = self.mm.out
        if view is None or view[3][2] != 1 or (nb > 1 and view[3][0] == 0) or (nm > 1 and view[3][1] == 0):
            raise _Refuse  # a store writes each element once, its columns contiguous
        if view not in self.outputs:
            self.outputs.append(view)
            self.output_dtypes.append(self.dtype[op.access.buf])
        return Op(op.id, "store", op.args, self.dtype[op.access.buf], attrs={"output": self.outputs.index(view)})

    def epilogue(self, bodies: list) -> Epilogue:
        """The Epilogue: each periodic input one view of the range every slice reads."""
        where, inputs, input_dtypes = {}, list(self.inputs), list(self.input_dtypes)
        for key, offsets in self.periodic.items():
            const = min(offsets)
            where[key] = (len(inputs), const)
            (nb, nm, _), (sb, sm) = self.mm.out[2], key[2]
            inputs.append((key[0], const, (nb if sb else 1, nm if sm else 1, max(offsets) - const + self.width),
                           (sb, sm, 1)))
            input_dtypes.append(self.dtype[key[0]])
        out = []
        for body in bodies:
            ops = []
            for op in body:
                if "periodic" in op.attrs:
                    (key, at) = op.attrs["periodic"]
                    n, const = where[key]
                    op = Op(op.id, "load", dtype=op.dtype, attrs={"input": n, "at": at - const})
                ops.append(op)
            out.append(tuple(ops))
        return Epilogue((), tuple(inputs), tuple(input_dtypes), tuple(self.outputs), tuple(self.output_dtypes),
                        self.k.name, tuple(out), self.width, tuple(n for n, _ in where.values()))


def _fold(name: str, args: list):
    """A comparison over ranges decided for the whole slice (True or False), or None."""
    (alo, ahi), (blo, bhi) = (a if isinstance(a, tuple) else (a, a) for a in args)
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (alo, ahi, blo, bhi)):
        return None
    cmp = _FOLD[name]
    corners = {cmp(a, b) for a in (alo, ahi) for b in (blo, bhi)}
    if name in ("eq", "ne") and not (alo == ahi and blo == bhi):
        # equal only if both are one value; otherwise decided only when the ranges are apart
        if ahi < blo or bhi < alo:
            return name == "ne"
        return None
    return corners.pop() if len(corners) == 1 else None


def _live(ops: list[Op]) -> set[str]:
    """The ops a store needs."""
    by_id = {op.id: op for op in ops}
    live, todo = set(), [op.id for op in ops if op.op == "store"]
    while todo:
        i = todo.pop()
        if i in live or i not in by_id:
            continue
        live.add(i)
        todo += list(by_id[i].args)
    return live

