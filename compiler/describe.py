"""From recorded loop bodies to :class:`~spyre_rt.ir.LoopKernel`.

The Inductor adapter (:mod:`spyre_rt.compiler.inductor.record`) runs each fused group of
nodes under a recording ops handler: a :class:`RecordedKernel` is their SSA operations with
sympy index expressions, their loop sizes and the buffers they touch, all of which may
depend on size symbols (``s0``) when the graph has dynamic shapes. :func:`describe` then,
for concrete sizes (at compile time for a static graph; at the first call with new sizes
for a dynamic one):

* replaces the loop variables of all nodes of the kernel by one set of *canonical*
  variables: the common refinement of every node's loop nest, further split wherever an
  index uses ``//`` or ``%`` of a variable, so that every index becomes affine;
* turns each index expression into integer coefficients over the canonical variables
  (found by evaluating it, and checked at sampled points);
* gives loads of masked bodies the box of the iteration space where their mask can be
  true when the full box would read outside the buffer;
* forwards values stored to kernel-local buffers to the loads that read them, so those
  buffers never exist in device memory.

Nothing here imports torch: a recorded kernel is plain data (its expressions are sympy
text when it is stored), and so is what comes out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy

from spyre_rt.ir import Access, Buffer, LoopKernel, Op, description
from spyre_rt.layout import storage_numel

MAX_POINTWISE_COLUMNS = 8192  # a pointwise tile's row is at most this many elements


class NotSupported(Exception):
    """The kernel uses something the card's construction cannot express."""


# ---- sizes that may be symbolic ------------------------------------------------------------


@description
@dataclass(frozen=True)
class Sym:
    """A size, stride or offset that depends on size symbols: sympy text (``"64*s0"``)."""

    text: str


def value(x, env: Mapping[str, int]) -> int:
    """The integer a size takes for concrete size symbols."""
    if isinstance(x, Sym):
        return _value_of(x.text, tuple(sorted(env.items())))
    if isinstance(x, sympy.Basic):
        x = x.xreplace({s: sympy.Integer(env[s.name]) for s in x.free_symbols if s.name in env})
        if x.free_symbols:
            raise NotSupported(f"size {x} depends on {sorted(s.name for s in x.free_symbols)}, which no input gives")
        return int(x)
    return int(x)


@functools.lru_cache(maxsize=4096)
def _value_of(text: str, env: tuple[tuple[str, int], ...]) -> int:
    """:func:`value` of a size's text (a step's sizes repeat a few expressions)."""
    return value(parse(text), dict(env))


def concrete(b: Buffer, env: Mapping[str, int]) -> Buffer:
    return Buffer(b.name, b.dtype, tuple(value(s, env) for s in b.sizes), tuple(value(s, env) for s in b.strides),
                  value(b.offset, env))


# Inductor's index functions, as sympy functions that evaluate on integers: stored text
# parses back into these, and evaluation of an index maps them to Python arithmetic.
class FloorDiv(sympy.Function):
    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))


class CleanDiv(FloorDiv):
    pass


class ModularIndexing(sympy.Function):
    @classmethod
    def eval(cls, x, d, m):
        if x.is_Integer and d.is_Integer and m.is_Integer:
            return sympy.Integer((int(x) // int(d)) % int(m))


class PythonMod(sympy.Function):
    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) % int(b))


class Identity(sympy.Function):
    @classmethod
    def eval(cls, x):
        return x


_FUNCTIONS = {"FloorDiv": FloorDiv, "CleanDiv": CleanDiv, "ModularIndexing": ModularIndexing,
              "PythonMod": PythonMod, "Identity": Identity, "Min": sympy.Min, "Max": sympy.Max,
              "Mod": sympy.Mod}


@functools.lru_cache(maxsize=65536)
def parse(text: str) -> sympy.Expr:
    """Stored sympy text back to an expression. Loop variables (``n0_v3``) are the
    recorder's symbols; every other name is an integer symbol."""
    names = {}
    for token in _names(text):
        if token not in _FUNCTIONS:
            nonneg = "_v" in token
            names[token] = sympy.Symbol(token, integer=True, nonnegative=nonneg) if nonneg else \
                sympy.Symbol(token, integer=True)
    return sympy.sympify(text, locals={**_FUNCTIONS, **names})


def _names(text: str) -> set[str]:
    import re

    return set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text))


def text(x) -> Any:
    """A size or index for storage: an int stays an int, an expression becomes Sym text
    (one stored already stays as it is: a region's outputs are, when its call returns them)."""
    if isinstance(x, int) or (isinstance(x, sympy.Basic) and x.is_Integer):
        return int(x)
    if isinstance(x, Sym):
        return x
    return Sym(expr_text(x))


def expr_text(x: sympy.Basic) -> str:
    """Sympy text that :func:`parse` reads back into the same expression: index functions
    are written by name (Inductor's print FloorDiv as ``floor(a/b)``, which would parse
    back into something no longer recognised as a division)."""
    def portable(e):
        return _FUNCTIONS[type(e).__name__](*e.args)

    x = x.replace(lambda e: isinstance(e, sympy.Function) and type(e).__name__ in _FUNCTIONS
                  and type(e) is not _FUNCTIONS[type(e).__name__], portable)
    return sympy.printing.str.sstr(x)


# ---- recorded kernels ----------------------------------------------------------------------


@description
@dataclass(frozen=True)
class RecordedNode:
    """One node of a fused group: its loop sizes and its body's SSA operations. Each
    operation is a dict (``op``, ``id``, ``args`` and per kind ``buf``, ``index``,
    ``dtype``, ``value``, ``kind``, ``size``, ``masks``...); ``index`` is sympy."""

    sizes: tuple
    rsizes: tuple
    ops: tuple[dict, ...]


@description
@dataclass(frozen=True)
class RecordedKernel:
    """A fused group as the recorder saw it; :func:`describe` makes it a LoopKernel."""

    name: str
    nodes: tuple[RecordedNode, ...]
    numel: Any
    rnumel: Any
    local: tuple[str, ...]                 # buffers produced and consumed inside the kernel
    buffers: dict[str, Buffer] = field(default_factory=dict)  # every buffer its nodes touch
    origins: tuple[str, ...] = ()
    module: str = ""

    def stored(self) -> RecordedKernel:
        """The same kernel with every expression as text (for JSON)."""
        nodes = tuple(RecordedNode(tuple(text(s) for s in n.sizes), tuple(text(s) for s in n.rsizes),
                                   tuple(_stored_op(op) for op in n.ops)) for n in self.nodes)
        buffers = {k: Buffer(b.name, b.dtype, tuple(text(s) for s in b.sizes), tuple(text(s) for s in b.strides),
                             text(b.offset)) for k, b in self.buffers.items()}
        return RecordedKernel(self.name, nodes, text(self.numel), text(self.rnumel), self.local, buffers, self.origins,
                              self.module)


def _stored_op(op: dict) -> dict:
    out = dict(op)
    if isinstance(out.get("index"), sympy.Basic):
        out["index"] = expr_text(out["index"])
    if "size" in out:
        out["size"] = text(out["size"])
    return out


# ---- adapters: operations the card lacks, in terms of operations it has ----------------------
#
# Each takes the op's argument ids and a `make(name, *args, **attrs)` that appends an op and
# returns its id; it returns the id of the result. The forms are the textbook identities
# (the CPU's own libm differs from them by a few ulps).

_LN2_INV, _LN10_INV, _HALF_PI = 1.4426950408889634, 0.4342944819032518, 1.5707963267948966


def _asin(x, make):
    one_minus = make("sub", make("constant", value=1.0), make("mul", x, x))
    return make("atan", make("mul", x, make("rsqrt", one_minus)))


ADAPTERS: dict[str, Callable] = {
    "log2": lambda x, make: make("mul", make("log", x), make("constant", value=_LN2_INV)),
    "log10": lambda x, make: make("mul", make("log", x), make("constant", value=_LN10_INV)),
    "erfc": lambda x, make: make("sub", make("constant", value=1.0), make("erf", x)),
    "tan": lambda x, make: make("truediv", make("sin", x), make("cos", x)),
    "sinh": lambda x, make: make("mul", make("sub", make("exp", x), make("exp", make("neg", x))),
                                 make("constant", value=0.5)),
    "cosh": lambda x, make: make("mul", make("add", make("exp", x), make("exp", make("neg", x))),
                                 make("constant", value=0.5)),
    "asinh": lambda x, make: make("log", make("add", x, make("sqrt", make("add", make("mul", x, x),
                                                                          make("constant", value=1.0))))),
    "acosh": lambda x, make: make("log", make("add", x, make("sqrt", make("sub", make("mul", x, x),
                                                                          make("constant", value=1.0))))),
    "atanh": lambda x, make: make("mul", make("log", make("truediv", make("add", make("constant", value=1.0), x),
                                                          make("sub", make("constant", value=1.0), x))),
                                  make("constant", value=0.5)),
    "asin": _asin,
    "acos": lambda x, make: make("sub", make("constant", value=_HALF_PI), _asin(x, make)),
    "hypot": lambda x, y, make: make("sqrt", make("add", make("mul", x, x), make("mul", y, y))),
    "copysign": lambda x, y, make: make("where", make("lt", y, make("constant", value=0.0)),
                                        make("neg", make("abs", x)), make("abs", x)),
    "isinf": lambda x, make: make("eq", make("abs", x), make("constant", value=float("inf"))),
    "fma": lambda x, y, z, make: make("add", make("mul", x, y), z),
    # atan(y/x), moved by pi into the left half-plane (x = 0 gives atan(+-inf) = +-pi/2)
    "atan2": lambda y, x, make: make("add", make("atan", make("truediv", y, x)), make(
        "where", make("lt", x, make("constant", value=0.0)),
        make("where", make("ge", y, make("constant", value=0.0)), make("constant", value=math.pi),
             make("constant", value=-math.pi)),
        make("constant", value=0.0))),
}


def adapt(ops: list[dict]) -> list[dict]:
    """The ops with every adapted operation replaced by its form in the card's operations
    (its result keeps the op's id, so whatever reads it reads the form's result)."""
    out: list[dict] = []
    for op in ops:
        adapter = ADAPTERS.get(op["op"])
        out.extend(_expand(op, adapter) if adapter else [op])
    return out


def _expand(op: dict, adapter: Callable) -> list[dict]:
    made: list[dict] = []

    def make(name: str, *args: str, **attrs) -> str:
        rec = {"op": name, "id": f"{op['id']}_{len(made)}", "args": list(args), **attrs}
        if name == "constant":
            rec["dtype"] = "float32"
        if "masks" in op:
            rec["masks"] = op["masks"]
        made.append(rec)
        return rec["id"]

    result = adapter(*op["args"], make)
    return [dict(m, id=op["id"]) if m["id"] == result else m for m in made]


def loop_symbols(prefix: str, n: int) -> list[sympy.Symbol]:
    """The loop variables a node's body is recorded with (the recorder makes the same)."""
    return [sympy.Symbol(f"{prefix}v{k}", integer=True, nonnegative=True) for k in range(n)]


def _concrete_op(op: dict, env: Mapping[str, int]) -> dict:
    out = dict(op)
    index = out.get("index")
    if isinstance(index, str):
        index = parse(index)
    if isinstance(index, sympy.Basic):
        out["index"] = _with_sizes(index, tuple(sorted(env.items())))
    if "size" in out:
        out["size"] = value(out["size"], env)
    return out


@functools.lru_cache(maxsize=4096)
def _with_sizes(index: sympy.Basic, env: tuple[tuple[str, int], ...]) -> sympy.Basic:
    """An index with the size symbols of `env` replaced by their values (the nodes of a
    step index with a few expressions)."""
    sizes = dict(env)
    subs = {s: sympy.Integer(sizes[s.name]) for s in index.free_symbols if s.name in sizes}
    return index.xreplace(subs) if subs else index


def describe(rec: RecordedKernel, env: Mapping[str, int] | None = None) -> LoopKernel:
    """The LoopKernel of a recorded kernel for concrete size symbols `env`."""
    env = env or {}
    numel, rnumel = value(rec.numel, env), value(rec.rnumel, env)
    known = {name: concrete(b, env) for name, b in rec.buffers.items()}
    recorded = []
    for k, node in enumerate(rec.nodes):
        sizes, rsizes = [value(s, env) for s in node.sizes], [value(s, env) for s in node.rsizes]
        syms = loop_symbols(f"n{k}_", len(sizes) + len(rsizes))
        recorded.append((sizes, rsizes, syms, adapt([_concrete_op(op, env) for op in node.ops])))
    kernel = _describe(rec.name, recorded, numel, rnumel, set(rec.local), known, rec.origins)
    return dataclasses.replace(kernel, module=rec.module)


def copy_kernel(name: str, src: Buffer, dst: Buffer) -> LoopKernel:
    """A kernel copying `src` into `dst` (same sizes), element by element over dst's sizes."""
    if src.sizes != dst.sizes:
        raise NotSupported(f"a copy from {src.sizes} into {dst.sizes}")
    sizes, src_strides, dst_strides = list(dst.sizes or (1,)), list(src.strides or (0,)), list(dst.strides or (0,))
    n = sizes[-1]
    if n > MAX_POINTWISE_COLUMNS:  # a tile's row stays a reasonable scratchpad area
        cols = max(c for c in range(1, MAX_POINTWISE_COLUMNS + 1) if n % c == 0)
        sizes[-1:] = [n // cols, cols]
        src_strides[-1:] = [src_strides[-1] * cols, src_strides[-1]]
        dst_strides[-1:] = [dst_strides[-1] * cols, dst_strides[-1]]
    ops = (Op("c0", "load", (), src.dtype, Access(src.name, 0, tuple(src_strides))),
           Op("c1", "store", ("c0",), dst.dtype, Access(dst.name, 0, tuple(dst_strides))))
    if src.dtype != dst.dtype:
        ops = (ops[0], Op("c2", "to_dtype", ("c0",), dst.dtype), Op("c1", "store", ("c2",), dst.dtype, ops[1].access))
    return LoopKernel(name, tuple(sizes), 1, False, ops, (src, dst),
                      ("aten.copy_.default",))


def buffer_of(known: dict[str, Buffer], name: str) -> Buffer:
    b = known.get(name)
    if b is None:
        raise NotSupported(f"unknown buffer {name}")
    return b


# ---- canonical variables -----------------------------------------------------------------


def _eval_namespace() -> dict[str, Callable]:
    return {
        "FloorDiv": lambda a, b: a // b,
        "ModularIndexing": lambda x, d, m: (x // d) % m,
        "PythonMod": lambda a, b: a % b,
        "Mod": lambda a, b: a % b,
        "CleanDiv": lambda a, b: a // b,
        "Identity": lambda x: x,
        "Min": min,
        "Max": max,
        "floor": math.floor,
        "ceiling": math.ceil,
    }


def _compile_expr(expr: sympy.Expr, symbols: list[sympy.Symbol]) -> Callable[..., int]:
    return _compiled(_python(expr), tuple(s.name for s in symbols))


@functools.lru_cache(maxsize=4096)
def _compiled(text: str, names: tuple[str, ...]) -> Callable[..., int]:
    """An index expression's Python text as a function of `names` (kernels of one layer
    repeat the same expressions: each is compiled once)."""
    code = compile(f"lambda {', '.join(names)}: {text}", "<index>", "eval")
    return eval(code, _eval_namespace())  # our own sympy output, evaluated on ints


_CALLS = frozenset(_eval_namespace())


def _python(expr: sympy.Expr) -> str:
    """Python text of an index expression: sums, products and the calls of
    :func:`_eval_namespace` written directly (sympy's printer orders the terms of every
    sum first, which is most of the time a description takes); anything else as sympy
    prints it."""
    if expr.is_Integer:
        return str(int(expr))
    if expr.is_Symbol:
        return expr.name
    if expr.is_Add or expr.is_Mul:
        return "(" + (" + " if expr.is_Add else " * ").join(_python(a) for a in expr.args) + ")"
    name = type(expr).__name__
    if name in _CALLS:
        return f"{name}({', '.join(_python(a) for a in expr.args)})"
    return f"({sympy.printing.str.sstr(expr)})"


def _split_points(expr: sympy.Expr, var_stride: dict[sympy.Symbol, int]) -> set[int]:
    """Flat boundaries implied by // and % applied to single loop variables."""
    return set(_split_points_of(expr, tuple(var_stride.items())))


@functools.lru_cache(maxsize=4096)
def _split_points_of(expr: sympy.Expr, var_stride: tuple[tuple[sympy.Symbol, int], ...]) -> frozenset[int]:
    """:func:`_split_points`, once per expression and loop nest (the layers of a model
    repeat them)."""
    var_stride = dict(var_stride)
    points = set()
    for node in sympy.preorder_traversal(expr):
        name = type(node).__name__
        if name in ("FloorDiv", "ModularIndexing", "CleanDiv"):
            x, d = node.args[0], node.args[1]
            while type(x).__name__ == "Identity":  # torch's marker around a masked body's index
                x = x.args[0]
            if x in var_stride and d.is_Integer:
                points.add(var_stride[x] * int(d))
                if name == "ModularIndexing" and node.args[2].is_Integer:
                    points.add(var_stride[x] * int(d) * int(node.args[2]))
    return frozenset(points)


def _row_points(expr, syms, sizes, var_stride, buf, known: dict[str, Buffer]) -> set[int]:
    """Where a loop that walks a buffer contiguously crosses the rows of its stick layout
    (the size of the buffer's stride-1 dimension): tiles then follow the storage rows."""
    info = known.get(buf)
    if info is None:
        return set()
    row = next((n for n, s in zip(info.sizes, info.strides, strict=True) if s == 1 and n > 1), 0)
    if row <= 1:
        return set()
    return set(_row_points_of(expr, tuple(syms), tuple(sizes), tuple(var_stride[s] for s in syms), row))


@functools.lru_cache(maxsize=4096)
def _row_points_of(expr: sympy.Expr, syms: tuple, sizes: tuple[int, ...], strides: tuple[int, ...],
                   row: int) -> frozenset[int]:
    """:func:`_row_points` for rows of `row` elements, the variables' flat strides given
    (once per expression, loop nest and row: the layers of a model repeat them)."""
    var_stride = dict(zip(syms, strides, strict=True))
    f = _compile_expr(expr, [s for s in syms] + [x for x in expr.free_symbols if x not in syms])
    nargs = len(syms) + len([x for x in expr.free_symbols if x not in syms])
    zero = [0] * nargs
    out = set()
    for k, (sym, n) in enumerate(zip(syms, sizes, strict=True)):
        if n <= row or n % row:
            continue
        pt = list(zero)
        pt[k] = 1
        try:
            if f(*pt) - f(*zero) == 1:
                out.add(var_stride[sym] * row)
        except Exception:
            continue
    return frozenset(out)


def canonical_sizes(total: int, boundaries: set[int]) -> list[int]:
    """Sizes (outermost first) of the variables cut at `boundaries` of a flat range."""
    pts = sorted({b for b in boundaries if 1 < b < total} | {1, total})
    for lo, hi in zip(pts, pts[1:], strict=False):
        if hi % lo:
            raise NotSupported(f"loop nests of the fused nodes do not nest ({lo} does not divide {hi})")
    return [hi // lo for lo, hi in zip(pts, pts[1:], strict=False)][::-1]


_AFFINE_TRIALS = 48  # points at which an index expression must equal its affine form
_ELEMENTWISE = ("Min(", "Max(", "floor(", "ceiling(")  # calls that take no arrays


@dataclass(frozen=True, eq=False)
class _Points:
    """The points an index expression is checked at: as rows of Python ints, as int64
    columns (one per variable), and their largest value."""

    rows: tuple[tuple[int, ...], ...]
    cols: np.ndarray
    top: int


@functools.lru_cache(maxsize=1024)
def _affine_points(canon_sizes: tuple[int, ...], nextra: int) -> _Points:
    """The points an index expression over variables of these sizes (and `nextra` symbols,
    drawn below 7) is checked at: the far corner along each variable, then random ones,
    drawn the same in every process (a seed from the sizes: str hashes are salted per
    process). Kernels of one shape share them."""
    rng = random.Random(zlib.crc32(f"{canon_sizes}|{nextra}".encode()))
    sizes = [*canon_sizes, *[7] * nextra]
    pts = [[int(rng.random() * n) for n in sizes] for _ in range(_AFFINE_TRIALS)]
    for trial in range(min(len(canon_sizes), _AFFINE_TRIALS)):
        pts[trial][trial] = canon_sizes[trial] - 1
    cols = np.array(pts, dtype=np.int64).T
    cols.flags.writeable = False
    return _Points(tuple(map(tuple, pts)), cols, int(cols.max()) if cols.size else 0)


def _affine_at(f: Callable[..., int], base: int, coeffs: list[int], pts: _Points, text: str) -> bool:
    """Whether `f` equals base + coeffs . x at every point x of `pts`: evaluated once on
    int64 columns (floor division and modulo as on ints) where the expression takes them and
    no value can overflow, else point by point."""
    small = (abs(base) + sum(abs(c) for c in coeffs)) * (pts.top + 1) < 2**40
    if pts.rows and small and not any(c in text for c in _ELEMENTWISE):
        try:
            with np.errstate(all="raise"):
                got = f(*pts.cols)
        except (FloatingPointError, ArithmeticError):
            got = None
        if got is not None and np.asarray(got).dtype.kind in "iu":  # else as int() truncates, below
            want = base + np.array(coeffs, dtype=np.int64) @ pts.cols
            return bool(np.all(np.asarray(got) == want))
    return all(int(f(*pt)) == base + sum(c * x for c, x in zip(coeffs, pt, strict=True)) for pt in pts.rows)


def affine_coefficients(expr: sympy.Expr, node_syms, node_sub, canon_sizes, extra_syms=()) -> tuple[int, list[int], list[int]]:
    """(constant, coefficient per canonical variable, coefficient per extra symbol) of an
    index expression; raises NotSupported if it is not affine in them."""
    canon = canonical_symbols(len(canon_sizes))
    sub = {s: node_sub[s](canon) for s in node_syms}
    return _affine_in(expr, expr.xreplace(sub) if sub else expr, canon_sizes, extra_syms)


@functools.lru_cache(maxsize=64)
def canonical_symbols(n: int) -> tuple[sympy.Symbol, ...]:
    """The canonical variables c0, c1, ... of a kernel with `n` of them."""
    return tuple(sympy.Symbol(f"c{j}", integer=True) for j in range(n))


def _affine_in(expr: sympy.Expr, full: sympy.Expr, canon_sizes, extra_syms) -> tuple[int, list[int], list[int]]:
    """:func:`affine_coefficients` of `expr`, which is `full` in the canonical variables."""
    ncan = len(canon_sizes)
    names = tuple(s.name for s in canonical_symbols(ncan)) + tuple(s.name for s in extra_syms)
    found = _affine_of(_python(full), names, tuple(canon_sizes))
    if found is None:
        raise NotSupported(f"index {expr} is not affine in the loop variables")
    base, coeffs = found
    return base, list(coeffs[:ncan]), list(coeffs[ncan:])


@functools.lru_cache(maxsize=4096)
def _affine_of(text: str, names: tuple[str, ...], canon_sizes: tuple[int, ...]) -> tuple[int, tuple[int, ...]] | None:
    """(constant, coefficients) of an index expression's Python text over `names` (the
    canonical variables, of these sizes, then the extra symbols), or None when it is not
    affine at the checked points. A kernel's nodes, and the layers of a model, index with the
    same few expressions: each is analysed once."""
    ncan = len(canon_sizes)
    f = _compiled(text, names)
    zero = [0] * len(names)
    base = int(f(*zero))
    coeffs = []
    for j in range(len(names)):
        if j < ncan and canon_sizes[j] == 1:
            coeffs.append(0)
            continue
        pt = list(zero)
        pt[j] = 1
        coeffs.append(int(f(*pt)) - base)
    if not _affine_at(f, base, coeffs, _affine_points(canon_sizes, len(names) - ncan), text):
        return None
    return base, tuple(coeffs)


def _describe(name: str, recorded: list, numel: int, rnumel: int, local: set[str], known: dict[str, Buffer],
              origins: tuple[str, ...]) -> LoopKernel:
    total = numel * rnumel
    boundaries = {rnumel} if rnumel > 1 else set()
    flat = []
    for sizes, rsizes, syms, ops in recorded:
        all_sizes = sizes + rsizes
        # A node over the reduced values only (e.g. `x.sum(-1) + 1` fused into the
        # reduction) walks the rows: its flat index scales by the row length.
        acc = rnumel if (rnumel > 1 and math.prod(all_sizes) == numel) else 1
        if math.prod(all_sizes) * acc != total:
            raise NotSupported(f"a fused node iterates {math.prod(all_sizes)} points, the kernel {total}")
        strides = []
        for n in reversed(all_sizes):
            strides.append(acc)
            acc *= n
        strides.reverse()
        var_stride = dict(zip(syms, strides, strict=True))
        flat.append(var_stride)
        boundaries |= {s * n for s, n in zip(strides, all_sizes, strict=True)} | set(strides)
        for rec in ops:
            if isinstance(rec.get("index"), sympy.Expr):
                boundaries |= _split_points(rec["index"], var_stride)
                if rec["op"] in ("load", "store"):
                    boundaries |= _row_points(rec["index"], syms, all_sizes, var_stride, rec["buf"], known)
    canon = canonical_sizes(total, boundaries)
    cstrides, acc = [], 1
    for n in reversed(canon):
        cstrides.append(acc)
        acc *= n
    cstrides.reverse()
    # Columns: the reduced variables. For pointwise kernels, the variables inside the first
    # node's innermost loop (so a split of it does not become a row variable), as long as
    # a row stays a reasonable scratchpad tile.
    if not canon:
        ncols = 0
    elif rnumel > 1:
        ncols = sum(1 for s in cstrides if s < rnumel)
    else:
        width = (recorded[0][0] + recorded[0][1] or [1])[-1]
        ncols, cols = 0, 1
        for n, s in zip(reversed(canon), reversed(cstrides), strict=True):
            if s >= width or (ncols and cols * n > MAX_POINTWISE_COLUMNS):
                break
            ncols, cols = ncols + 1, cols * n
        ncols = max(ncols, 1)

    buffers: dict[str, Buffer] = {}
    out_ops: list[Op] = []
    stored: dict[tuple, str] = {}  # (buffer, access key) -> value id, for forwarding
    rename: dict[str, str] = {}
    masked: list[tuple[str, list[str]]] = []  # (load, its masks)

    for (sizes, rsizes, syms, ops), var_stride in zip(recorded, flat, strict=True):
        # each node variable is a sum of canonical variables (a mixed-radix group)
        canon_syms = canonical_symbols(len(canon))
        node_sub = {}
        for sym, n in zip(syms, sizes + rsizes, strict=True):
            s = var_stride[sym]
            node_sub[sym] = sum((canon_syms[j] * (cstrides[j] // s) for j in range(len(canon))
                                 if s <= cstrides[j] < s * n), sympy.Integer(0))
        ind_syms = {}
        masks_of = {}
        for rec in ops:
            rid = rec["id"]
            args = tuple(rename.get(a, a) for a in rec.get("args", ()))
            op = rec["op"]
            if op == "indirect":
                ind_syms[rec["symbol"]] = rid
            if op in ("load", "store", "index"):
                expr = rec["index"]
                extras = [s for s in expr.free_symbols if s.name in ind_syms]
                try:
                    const, coeffs, ecoeffs = _affine_in(expr, expr.xreplace(node_sub) if node_sub else expr,
                                                        canon, extras)
                except NotSupported as e:
                    e.op_id, e.indirect = rid, bool(extras)  # the compiler runs that op's node elsewhere
                    raise
                ind = tuple((ind_syms[s.name], c) for s, c in zip(extras, ecoeffs, strict=True) if c)
                if op == "index":
                    if ind:
                        raise NotSupported("an index expression of an indirect index")
                    out_ops.append(Op(rid, "index", (), rec["dtype"], Access("", const, tuple(coeffs))))
                    continue
                bufname = rec["buf"]
                if bufname not in buffers and bufname not in local:
                    buffers[bufname] = buffer_of(known, bufname)
                access = Access(bufname, const, tuple(coeffs), ind)
                key = (bufname, const, tuple(coeffs), ind)
                if op == "store":
                    stored[key] = args[0]
                    if bufname not in local:
                        out_ops.append(Op(rid, "store", args, buffers[bufname].dtype, access))
                    continue
                forward = stored.get(key)
                if forward is not None:
                    rename[rid] = forward
                    continue
                if bufname in local:
                    raise NotSupported(f"kernel-local buffer {bufname} read at another index than written")
                if any(k[0] == bufname for k in stored):
                    raise NotSupported(f"{bufname} is written and read at different places in one kernel")
                if rec.get("masks"):
                    masks_of[rid] = [rename.get(m, m) for m in rec["masks"]]
                out_ops.append(Op(rid, "load", (), buffers[bufname].dtype, access))
                continue
            attrs = {k: v for k, v in rec.items() if k in ("value", "kind", "size", "wrap_neg")}
            if op == "constant":
                v = rec["value"]
                attrs["value"] = v if not isinstance(v, float) or math.isfinite(v) else repr(v)
            out_ops.append(Op(rid, op, args, rec.get("dtype", ""), None, attrs))
        masked += masks_of.items()
    if rnumel <= 1:
        ncols = _columns_for_gathers(out_ops, canon, ncols, buffers)
    for rid, masks in masked:
        _restrict_masked_load(out_ops, rid, masks, canon, buffers, ncols)
    out_ops = _one_load_per_access(out_ops)
    used = {a for o in out_ops for a in o.args} | {a.access.ind[i][0] for a in out_ops if a.access
                                                  for i in range(len(a.access.ind))}
    kept = [o for o in out_ops if o.op in ("store",) or o.id in used]
    return LoopKernel(name, tuple(canon), ncols, rnumel > 1, tuple(_prune(kept)),
                      tuple(buffers.values()), tuple(origins))


def _one_load_per_access(ops: list[Op]) -> list[Op]:
    """Loads of the same elements (same access, box and dtype) as one load, its value used
    by every reader: Inductor's nodes each load what they read (an RMSNorm reads its row
    for the sum of squares and again to scale it), and each load is a transfer. A kernel
    never reads a buffer it writes elsewhere than where it writes it, and a read where it
    wrote is forwarded, so no store comes between two such loads."""
    first: dict[tuple, str] = {}
    rename: dict[str, str] = {}
    out = []
    for o in ops:
        if rename:
            acc = o.access
            if acc is not None and any(i in rename for i, _ in acc.ind):
                acc = dataclasses.replace(acc, ind=tuple((rename.get(i, i), c) for i, c in acc.ind))
            if acc is not o.access or any(a in rename for a in o.args):
                o = dataclasses.replace(o, args=tuple(rename.get(a, a) for a in o.args), access=acc)
        if o.op == "load":
            key = (o.access, o.dtype)
            if key in first:
                rename[o.id] = first[key]
                continue
            first[key] = o.id
        out.append(o)
    return out


def _prune(ops: list[Op]) -> list[Op]:
    """Drop operations whose values nothing uses (e.g. index math of dropped stores)."""
    needed = set()
    for o in reversed(ops):
        if o.op == "store" or o.id in needed:
            needed.update(o.args)
            if o.access:
                needed.update(i for i, _ in o.access.ind)
    return [o for o in ops if o.op == "store" or o.id in needed]


def _restrict_masked_load(ops: list[Op], rid: str, masks: list[str], canon: list[int],
                          buffers: dict[str, Buffer], ncols: int = 0) -> None:
    """Give a masked load the box where all its masks can be true, if the whole box would
    read outside its buffer, or, for a gathered load, outside the rows it gathers. The
    masks must depend on loop indices only."""
    pos = next(i for i, o in enumerate(ops) if o.id == rid)
    load = ops[pos]
    acc = load.access
    hi = acc.const + sum(c * (n - 1) for c, n in zip(acc.coeffs, canon, strict=True) if c > 0)
    lo = acc.const + sum(c * (n - 1) for c, n in zip(acc.coeffs, canon, strict=True) if c < 0)
    b = buffers[acc.buf]
    if lo >= 0 and hi < storage_numel(b.sizes, b.strides, b.offset) and not _leaves_its_row(acc, canon, ncols, b):
        return  # reading the full box is safe; the mask picks the values
    by_id = {o.id: o for o in ops}

    def deps_of(i: str, deps: set[int]) -> set[int]:
        o = by_id[i]
        if o.op == "index":
            deps.update(j for j, c in enumerate(o.access.coeffs) if c)
        elif o.op in ("load", "indirect", "reduction"):
            raise NotSupported("a load masked by a data-dependent condition may read out of bounds")
        for a in o.args:
            deps_of(a, deps)
        return deps

    # masks over disjoint loop indices (a cat's along the rows and a rotation's along the
    # columns) are boxes of their own: each group of masks sharing indices is analysed alone
    groups: list[tuple[set[int], list[str]]] = []
    for m in masks:
        deps, group = deps_of(m, set()), [m]
        for other in [g for g in groups if g[0] & deps]:
            groups.remove(other)
            deps |= other[0]
            group += other[1]
        groups.append((deps, group))
    box = []
    for deps, group in groups:
        part = _mask_box(by_id, group, sorted(deps), canon)
        if part is None:
            ops[pos] = Op(load.id, "constant", (), load.dtype, None, {"value": 0})
            return
        box += part
    ops[pos] = Op(load.id, "load", (), load.dtype, Access(acc.buf, acc.const, acc.coeffs, acc.ind, tuple(sorted(box))))


def _mask_box(by_id: dict[str, Op], masks: list[str], deps: list[int], canon: list[int]):
    """The box (loop index, lo, hi) of the points where all `masks` (over loop indices
    `deps` only) are true; None when they never are."""
    grid = math.prod(canon[j] for j in deps)
    if grid > 1 << 20:
        raise NotSupported("a mask over too many loop indices to analyse")
    # every point of the grid at once: each loop index an array along its own axis
    env = {j: np.arange(canon[j]).reshape([-1 if k == a else 1 for k in range(len(deps))])
           for a, j in enumerate(deps)}
    true = np.ones([canon[j] for j in deps], dtype=bool)
    for m in masks:
        true &= np.asarray(_eval_mask(by_id, m, env), dtype=bool)
    if not true.any():
        return None
    where = np.nonzero(true)
    box = [(j, int(w.min()), int(w.max()) + 1) for j, w in zip(deps, where, strict=True)]
    if len(where[0]) != math.prod(h - lo_ for _, lo_, h in box):
        raise NotSupported("a mask that is not a box of loop indices")
    return box


def _row_length(b: Buffer) -> int:
    """The row of a buffer's stick layout: its stride-1 dimension (0 when it has none)."""
    return next((n for n, s in zip(b.sizes, b.strides, strict=True) if s == 1 and n > 1), 0)


def _columns_for_gathers(ops: list[Op], canon: list[int], ncols: int, buffers: dict[str, Buffer]) -> int:
    """The columns of a pointwise kernel widened to every variable that moves inside a row
    of a gathered or scattered buffer: construction moves a gather's columns within the
    rows its index picks, so such a variable is a column (the cos and sin of an interleaved
    rotary embedding are read at half the column of the output)."""
    first = len(canon) - ncols
    for o in ops:
        acc = o.access
        if acc is None or not acc.ind:
            continue
        row = _row_length(buffers[acc.buf])
        first = next((j for j in range(first) if row > 1 and acc.coeffs[j] % row), first)
    return len(canon) - first


def _leaves_its_row(acc: Access, canon: list[int], ncols: int, b: Buffer) -> bool:
    """Whether a gathered load's columns run outside the row its index picks (a rotary
    embedding's ``sin`` half of a cos-sin row, read over all the columns of a ``cat`` and
    masked to half of them, would run into the next row)."""
    if not acc.ind or not ncols:
        return False
    row = _row_length(b)
    if row <= 1 or any(c % row for _, c in acc.ind):
        return False
    first = acc.const % row
    cols = range(len(canon) - ncols, len(canon))
    lo = first + sum(min(0, acc.coeffs[j] * (canon[j] - 1)) for j in cols)
    hi = first + sum(max(0, acc.coeffs[j] * (canon[j] - 1)) for j in cols)
    return lo < 0 or hi >= row


# on arrays of loop-index values (the grid of a mask's indices, broadcast): the logical
# operations elementwise
_MASK_OPS = {
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "and_": np.logical_and,
    "logical_and": np.logical_and, "or_": np.logical_or, "logical_or": np.logical_or,
    "logical_not": np.logical_not, "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
}


def _eval_mask(by_id: dict[str, Op], i: str, env: dict):
    """The value of mask operation `i` at every point of `env` (loop index -> its values)."""
    o = by_id[i]
    if o.op == "index":
        return o.access.const + sum(c * env[j] for j, c in enumerate(o.access.coeffs) if c)
    if o.op == "constant":
        return o.attrs["value"]
    if o.op == "to_dtype":
        return _eval_mask(by_id, o.args[0], env)
    fn = _MASK_OPS.get(o.op)
    if fn is None:
        raise NotSupported(f"mask operation {o.op}")
    return fn(*[_eval_mask(by_id, a, env) for a in o.args])
