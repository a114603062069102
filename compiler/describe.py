"""From Inductor's fused loop nodes to :class:`~spyre_rt.kernels.LoopKernel`.

Each SchedulerNode's LoopBody is run under a recording ops handler, which yields an SSA
list of its operations with sympy index expressions. Then, at compile time and once:

* the loop variables of all nodes of the kernel are replaced by one set of *canonical*
  variables: the common refinement of every node's loop nest, further split wherever an
  index uses ``//`` or ``%`` of a variable, so that every index becomes affine;
* each index expression is turned into integer coefficients over the canonical variables
  (found by evaluating it, and checked at sampled points);
* loads of masked bodies get the box of the iteration space where their mask can be true
  when the full box would read outside the buffer;
* values stored to kernel-local buffers are forwarded to the loads that read them, so
  those buffers never exist in device memory.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import sympy
import torch
from torch._inductor.ops_handler import DefaultHandler
from torch._inductor.virtualized import V

from spyre_rt.kernels import Access, Buffer, LoopKernel, Op

MAX_POINTWISE_COLUMNS = 8192  # a pointwise tile's row is at most this many elements


class NotSupported(Exception):
    """The kernel uses something the card's construction cannot express."""


def dtype_name(d) -> str:
    return str(d).removeprefix("torch.") if isinstance(d, torch.dtype) else str(d)


# ---- recording ---------------------------------------------------------------------------


class _Recorder(DefaultHandler):
    """An ops handler that records a LoopBody as SSA operations."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.ops: list[dict] = []
        self.nind = 0
        self.mask_stack: list[str] = []

    def _add(self, rec: dict) -> str:
        rec["id"] = f"{self.prefix}{len(self.ops)}"
        if self.mask_stack:
            rec["masks"] = list(self.mask_stack)
        self.ops.append(rec)
        return rec["id"]

    def _default(self, name, args, kwargs):
        if kwargs:
            raise NotSupported(f"op {name} with keyword arguments {sorted(kwargs)}")
        for a in args:
            if not isinstance(a, str):
                raise NotSupported(f"op {name} with a non-value argument {a!r}")
        return self._add({"op": name, "args": list(args)})

    def load(self, name, index):
        return self._add({"op": "load", "buf": name, "index": index})

    def store(self, name, index, value, mode=None):
        if mode not in (None,):
            raise NotSupported(f"store with mode {mode!r} (accumulating scatter)")
        self._add({"op": "store", "buf": name, "index": index, "args": [value]})

    def store_reduction(self, name, index, value):
        self._add({"op": "store", "buf": name, "index": index, "args": [value]})

    def reduction(self, dtype, src_dtype, reduction_type, value):
        if reduction_type == "welford_reduce":
            # mean and m2 over the row, computed exactly from the row in the scratchpad
            mean = self._add({"op": "reduction", "args": [value], "kind": "mean", "dtype": dtype_name(dtype)})
            m2 = self._add({"op": "reduction", "args": [value, mean], "kind": "m2", "dtype": dtype_name(dtype)})
            count = self._add({"op": "reduction", "args": [value], "kind": "count", "dtype": dtype_name(dtype)})
            return mean, m2, count
        if reduction_type not in ("sum", "max", "min", "prod", "any", "argmax", "argmin", "xor_sum"):
            raise NotSupported(f"reduction {reduction_type}")
        if reduction_type == "xor_sum":
            raise NotSupported("reduction xor_sum")
        return self._add({"op": "reduction", "args": [value], "kind": reduction_type, "dtype": dtype_name(dtype)})

    def constant(self, value, dtype):
        return self._add({"op": "constant", "value": value, "dtype": dtype_name(dtype)})

    def index_expr(self, expr, dtype):
        return self._add({"op": "index", "index": expr, "dtype": dtype_name(dtype)})

    def indirect_indexing(self, x, size, check=True, wrap_neg=True):
        sym = sympy.Symbol(f"{self.prefix}ind{self.nind}", integer=True)
        self.nind += 1
        self._add({"op": "indirect", "args": [x], "size": int(size), "wrap_neg": bool(wrap_neg),
                   "symbol": sym.name})
        return sym

    def masked(self, mask, body, other):
        self.mask_stack.append(mask)
        try:
            result = body()
        finally:
            self.mask_stack.pop()
        other_id = self._add({"op": "constant", "value": other, "dtype": ""})
        return self._add({"op": "where", "args": [mask, result, other_id]})

    def to_dtype(self, x, dtype, src_dtype=None, use_compute_types=True):
        return self._add({"op": "to_dtype", "args": [x], "dtype": dtype_name(dtype)})

    def to_dtype_bitcast(self, x, dtype, src_dtype):
        raise NotSupported("bitcast")

    def check_bounds(self, expr, size, lower, upper):
        return None

    def device_assert_async(self, cond, msg):
        return None


def record(snode, prefix: str) -> tuple[list[int], list[int], list[sympy.Symbol], list[dict]]:
    """Run one SchedulerNode's body under the recorder."""
    sizes, rsizes = snode._sizes
    sizes, rsizes = [int(s) for s in sizes], [int(s) for s in rsizes]
    syms = [sympy.Symbol(f"{prefix}v{k}", integer=True, nonnegative=True) for k in range(len(sizes) + len(rsizes))]
    rec = _Recorder(prefix)
    with V.set_ops_handler(rec):
        snode._body(syms[: len(sizes)], syms[len(sizes):])
    return sizes, rsizes, syms, rec.ops


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
    names = [s.name for s in symbols]
    text = sympy.printing.str.sstr(expr)
    code = compile(f"lambda {', '.join(names)}: {text}", "<index>", "eval")
    return eval(code, _eval_namespace())  # our own sympy output, evaluated on ints


def _split_points(expr: sympy.Expr, var_stride: dict[sympy.Symbol, int]) -> set[int]:
    """Flat boundaries implied by // and % applied to single loop variables."""
    points = set()
    for node in sympy.preorder_traversal(expr):
        name = type(node).__name__
        if name in ("FloorDiv", "ModularIndexing", "CleanDiv"):
            x, d = node.args[0], node.args[1]
            if x in var_stride and d.is_Integer:
                points.add(var_stride[x] * int(d))
                if name == "ModularIndexing" and node.args[2].is_Integer:
                    points.add(var_stride[x] * int(d) * int(node.args[2]))
    return points


def _row_points(expr, syms, sizes, var_stride, buf, real_name) -> set[int]:
    """Where a loop that walks a buffer contiguously crosses the rows of its stick layout
    (the size of the buffer's stride-1 dimension): tiles then follow the storage rows."""
    try:
        info = buffer_info(real_name(buf))
    except NotSupported:
        return set()
    row = next((n for n, s in zip(info.sizes, info.strides, strict=True) if s == 1 and n > 1), 0)
    if row <= 1:
        return set()
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
    return out


def canonical_sizes(total: int, boundaries: set[int]) -> list[int]:
    """Sizes (outermost first) of the variables cut at `boundaries` of a flat range."""
    pts = sorted({b for b in boundaries if 1 < b < total} | {1, total})
    for lo, hi in zip(pts, pts[1:], strict=False):
        if hi % lo:
            raise NotSupported(f"loop nests of the fused nodes do not nest ({lo} does not divide {hi})")
    return [hi // lo for lo, hi in zip(pts, pts[1:], strict=False)][::-1]


def affine_coefficients(expr: sympy.Expr, node_syms, node_sub, canon_sizes, extra_syms=()) -> tuple[int, list[int], list[int]]:
    """(constant, coefficient per canonical variable, coefficient per extra symbol) of an
    index expression; raises NotSupported if it is not affine in them."""
    ncan = len(canon_sizes)
    canon = [sympy.Symbol(f"c{j}", integer=True) for j in range(ncan)]
    extra = list(extra_syms)
    sub = {s: node_sub[s](canon) for s in node_syms}
    full = expr.xreplace(sub) if sub else expr
    f = _compile_expr(full, canon + extra)
    zero = [0] * (ncan + len(extra))
    base = int(f(*zero))
    coeffs = []
    for j in range(ncan + len(extra)):
        if j < ncan and canon_sizes[j] == 1:
            coeffs.append(0)
            continue
        pt = list(zero)
        pt[j] = 1
        coeffs.append(int(f(*pt)) - base)
    rng = random.Random(hash((str(expr), tuple(canon_sizes))) & 0xFFFFFFFF)
    for trial in range(48):
        pt = [rng.randrange(n) for n in canon_sizes] + [rng.randrange(0, 7) for _ in extra]
        if trial < ncan:  # also the far corner along each variable
            pt[trial] = canon_sizes[trial] - 1
        want = base + sum(c * x for c, x in zip(coeffs, pt, strict=True))
        if int(f(*pt)) != want:
            raise NotSupported(f"index {expr} is not affine in the loop variables")
    return base, coeffs[:ncan], coeffs[ncan:]


# ---- a kernel -----------------------------------------------------------------------------


def buffer_info(name: str) -> Buffer:
    buf = V.graph.get_buffer(name)
    if buf is None and name in V.graph.graph_inputs:
        buf = V.graph.graph_inputs[name]
    if buf is None:
        raise NotSupported(f"unknown buffer {name}")
    layout = buf.get_layout()
    return Buffer(name, dtype_name(buf.get_dtype()), tuple(int(s) for s in layout.size),
                  tuple(int(s) for s in layout.stride), int(layout.offset))


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


def describe_kernel(name: str, snodes, numel: int, rnumel: int, local: set[str],
                    real_name: Callable[[str], str]) -> LoopKernel:
    """A LoopKernel for one fused group of SchedulerNodes."""
    recorded = []
    for k, sn in enumerate(snodes):
        sizes, rsizes, syms, ops = record(sn, f"n{k}_")
        recorded.append((sizes, rsizes, syms, ops))
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
                    boundaries |= _row_points(rec["index"], syms, all_sizes, var_stride, rec["buf"], real_name)
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

    for (sizes, rsizes, syms, ops), var_stride in zip(recorded, flat, strict=True):
        # each node variable is a sum of canonical variables (a mixed-radix group)
        def sub_for(sym, _vs=var_stride, _sizes=sizes + rsizes, _syms=syms):
            s = _vs[sym]
            n = _sizes[_syms.index(sym)]
            terms = [(j, cstrides[j] // s) for j in range(len(canon)) if s <= cstrides[j] < s * n]
            return lambda canon_syms: sum((canon_syms[j] * w for j, w in terms), sympy.Integer(0))

        node_sub = {s: sub_for(s) for s in syms}
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
                const, coeffs, ecoeffs = affine_coefficients(expr, syms, node_sub, canon, extras)
                ind = tuple((ind_syms[s.name], c) for s, c in zip(extras, ecoeffs, strict=True) if c)
                if op == "index":
                    if ind:
                        raise NotSupported("an index expression of an indirect index")
                    out_ops.append(Op(rid, "index", (), rec["dtype"], Access("", const, tuple(coeffs))))
                    continue
                bufname = real_name(rec["buf"])
                if bufname not in buffers and bufname not in local:
                    buffers[bufname] = buffer_info(bufname)
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
        for rid, masks in masks_of.items():
            _restrict_masked_load(out_ops, rid, masks, canon, buffers)
    used = {a for o in out_ops for a in o.args} | {a.access.ind[i][0] for a in out_ops if a.access
                                                  for i in range(len(a.access.ind))}
    kept = [o for o in out_ops if o.op in ("store",) or o.id in used]
    return LoopKernel(name, tuple(canon), ncols, rnumel > 1, tuple(_prune(kept)),
                      tuple(buffers.values()), tuple(sorted(_origins(snodes))))


def _prune(ops: list[Op]) -> list[Op]:
    """Drop operations whose values nothing uses (e.g. index math of dropped stores)."""
    needed = set()
    for o in reversed(ops):
        if o.op == "store" or o.id in needed:
            needed.update(o.args)
            if o.access:
                needed.update(i for i, _ in o.access.ind)
    return [o for o in ops if o.op == "store" or o.id in needed]


def _origins(snodes) -> set[str]:
    out = set()
    for sn in snodes:
        for o in getattr(sn.node, "origins", ()):
            if getattr(o, "op", "") == "call_function":
                out.add(str(o.target))
    return out


def _storage_numel(b: Buffer) -> int:
    if any(s == 0 for s in b.sizes):
        return 0
    return b.offset + 1 + sum((s - 1) * st for s, st in zip(b.sizes, b.strides, strict=True))


def _restrict_masked_load(ops: list[Op], rid: str, masks: list[str], canon: list[int],
                          buffers: dict[str, Buffer]) -> None:
    """Give a masked load the box where all its masks can be true, if the whole box would
    read outside its buffer. The masks must depend on loop indices only."""
    pos = next(i for i, o in enumerate(ops) if o.id == rid)
    load = ops[pos]
    acc = load.access
    hi = acc.const + sum(c * (n - 1) for c, n in zip(acc.coeffs, canon, strict=True) if c > 0)
    lo = acc.const + sum(c * (n - 1) for c, n in zip(acc.coeffs, canon, strict=True) if c < 0)
    if lo >= 0 and hi < _storage_numel(buffers[acc.buf]):
        return  # reading the full box is safe; the mask picks the values
    by_id = {o.id: o for o in ops}
    deps = set()

    def visit(i: str):
        o = by_id[i]
        if o.op == "index":
            deps.update(j for j, c in enumerate(o.access.coeffs) if c)
        elif o.op in ("load", "indirect", "reduction"):
            raise NotSupported("a load masked by a data-dependent condition may read out of bounds")
        for a in o.args:
            visit(a)

    for m in masks:
        visit(m)
    deps = sorted(deps)
    grid = math.prod(canon[j] for j in deps)
    if grid > 1 << 16:
        raise NotSupported("a mask over too many loop indices to analyse")
    import itertools

    import numpy as np

    true_pts = []
    for pt in itertools.product(*[range(canon[j]) for j in deps]):
        env = dict(zip(deps, pt, strict=True))
        if all(_eval_mask(by_id, m, env) for m in masks):
            true_pts.append(pt)
    if not true_pts:
        ops[pos] = Op(load.id, "constant", (), load.dtype, None, {"value": 0})
        return
    arr = np.array(true_pts)
    box = [(j, int(arr[:, k].min()), int(arr[:, k].max()) + 1) for k, j in enumerate(deps)]
    if len(true_pts) != math.prod(h - lo_ for _, lo_, h in box):
        raise NotSupported("a mask that is not a box of loop indices")
    ops[pos] = Op(load.id, "load", (), load.dtype, Access(acc.buf, acc.const, acc.coeffs, acc.ind, tuple(box)))


_MASK_OPS = {
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "and_": lambda a, b: a and b,
    "logical_and": lambda a, b: a and b, "or_": lambda a, b: a or b, "logical_or": lambda a, b: a or b,
    "logical_not": lambda a: not a, "add": lambda a, b: a + b, "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
}


def _eval_mask(by_id: dict[str, Op], i: str, env: dict[int, int]):
    o = by_id[i]
    if o.op == "index":
        return o.access.const + sum(c * env.get(j, 0) for j, c in enumerate(o.access.coeffs))
    if o.op == "constant":
        return o.attrs["value"]
    if o.op == "to_dtype":
        return _eval_mask(by_id, o.args[0], env)
    fn = _MASK_OPS.get(o.op)
    if fn is None:
        raise NotSupported(f"mask operation {o.op}")
    return fn(*[_eval_mask(by_id, a, env) for a in o.args])
