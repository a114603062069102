"""What a kernel description computes, evaluated with torch on the CPU.

Construction builds a card program from a kernel description (:mod:`spyre_rt.construct`);
this module computes the same values directly, on host tensors: the reference semantics of
each kind of kernel, written as the card computes them (floats in fp32, rounded to fp16 or
bf16 only at explicit conversions and stores; matmuls accumulate in fp32). A kernel that
construction refuses for a card runs this way inside its step
(:mod:`spyre_rt.executor.host_kernels`).

A kernel addresses its buffers in logical elements from each buffer's start. Here every
buffer is a flat host tensor and the position of the buffer's start in it
(:class:`Memory`), so several buffers that share one storage share one tensor.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .construct.loops.analysis import _dtype, _reduction_dtype
from .construct.sfu import compute_type, parse_constant
from .dtypes import torch_dtype
from .errors import SpyreError, SpyreIndexError
from .ir import AttentionKernel, CollectiveKernel, LoopKernel, MatmulKernel


class Place(NamedTuple):
    """Where a buffer is: a flat host tensor, and the element of it the buffer starts at."""

    flat: torch.Tensor
    start: int


Memory = dict  # buffer name -> Place


def run(kernel, memory: Memory) -> None:
    """Compute `kernel` on the host tensors of `memory`, writing its outputs into them."""
    if isinstance(kernel, LoopKernel):
        _loop(kernel, memory)
    elif isinstance(kernel, MatmulKernel):
        _matmul(kernel, memory)
    elif isinstance(kernel, AttentionKernel):
        _attention(kernel, memory)
    elif isinstance(kernel, CollectiveKernel):
        _collective(kernel, memory)
    else:
        raise SpyreError(f"no reference evaluation for a {type(kernel).__name__}")


def written(kernel) -> set[str]:
    """The buffers `kernel` writes."""
    if isinstance(kernel, LoopKernel):
        return {op.access.buf for op in kernel.ops if op.op == "store"}
    if isinstance(kernel, MatmulKernel):
        if kernel.epilogue is None:
            return {v[0] for v in kernel.outs()}
        return {v[0] for v in kernel.epilogue.outputs}
    return {kernel.out[0]}


def extents(kernel) -> dict[str, tuple[int, int] | None]:
    """Per buffer, the logical elements [lo, hi) from its start that `kernel` may touch
    (None: it cannot be told, take the whole storage)."""
    out: dict[str, tuple[int, int] | None] = {}

    def add(name: str, span: tuple[int, int] | None) -> None:
        if span is None or name in out and out[name] is None:
            out[name] = None
        elif name in out:
            out[name] = (min(out[name][0], span[0]), max(out[name][1], span[1]))
        else:
            out[name] = span

    if isinstance(kernel, LoopKernel):
        by_id = {op.id: op for op in kernel.ops}
        for op in kernel.ops:
            acc = op.access
            if acc is None or not acc.buf:
                continue
            dims = {j: (0, n) for j, n in enumerate(kernel.sizes)}
            dims.update((j, (lo, hi)) for j, lo, hi in acc.domain)
            if any(hi <= lo for lo, hi in dims.values()):
                continue
            terms = [(c, lo, hi - 1) for j, c in enumerate(acc.coeffs) for lo, hi in [dims[j]]]
            for idx, c in acc.ind:
                ind = by_id.get(idx)
                if ind is None or ind.op != "indirect":
                    add(acc.buf, None)
                    break
                terms.append((c, 0, int(ind.attrs["size"]) - 1))
            else:
                add(acc.buf, _span(acc.const, terms))
        return out
    if isinstance(kernel, MatmulKernel):  # its views (prologue, epilogue, parts), and the product it names
        views = [*kernel.views(), kernel.out]
    else:
        views = [kernel.inp] if isinstance(kernel, CollectiveKernel) else [kernel.q, kernel.k, kernel.v, kernel.mask]
        views += [kernel.out]
    for v in views:
        if v is not None:
            name, off, sizes, strides = v
            if all(n > 0 for n in sizes):
                add(name, _span(off, [(s, 0, n - 1) for n, s in zip(sizes, strides, strict=True)]))
    return out


def _span(const: int, terms) -> tuple[int, int]:
    lo = hi = const
    for c, a, b in terms:
        lo += min(c * a, c * b)
        hi += max(c * a, c * b)
    return lo, hi + 1


# ---- values --------------------------------------------------------------------------------

_TORCH = {"float32": torch.float32, "int64": torch.int64, "bool": torch.bool, "float16": torch.float32,
          "bfloat16": torch.float32}  # fp16 and bf16 results are held exactly in fp32

_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sin": torch.sin, "cos": torch.cos,
    "erf": torch.erf, "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc, "round": torch.round,
    "sign": torch.sign, "log1p": torch.log1p, "expm1": torch.expm1, "atan": torch.atan, "isnan": torch.isnan,
    "silu": F.silu, "signbit": torch.signbit, "reciprocal": torch.reciprocal, "logical_not": torch.logical_not,
    "bitwise_not": torch.bitwise_not, "identity": lambda x: x, "relu": torch.relu, "square": torch.square,
    "exp2": torch.exp2,
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide, "truediv": torch.true_divide,
    "int_truediv": torch.true_divide, "floordiv": torch.floor_divide, "mod": torch.fmod, "fmod": torch.fmod,
    "remainder": torch.remainder, "pow": torch.pow, "maximum": torch.maximum, "minimum": torch.minimum,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
    "logical_and": torch.logical_and, "logical_or": torch.logical_or, "logical_xor": torch.logical_xor,
    "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor,
    "and_": torch.bitwise_and, "or_": torch.bitwise_or, "xor": torch.bitwise_xor,
}
_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge"}


def _elementwise(name: str, dtype: str, args: list[torch.Tensor]) -> torch.Tensor:
    """One elementwise operation with the card's result type `dtype` (see analysis)."""
    want = _TORCH[dtype]
    if name == "where":
        return torch.where(args[0].bool(), args[1].to(want), args[2].to(want))
    if name in _COMPARE:
        return _BINARY[name](*args)
    if dtype == "bool" and name in ("and_", "or_", "xor", "bitwise_and", "bitwise_or", "bitwise_xor"):
        args = [a.bool() for a in args]
    elif dtype != "bool":
        args = [a.to(want) for a in args]
    fn = _UNARY.get(name) if len(args) == 1 else _BINARY.get(name)
    if fn is None:
        raise SpyreError(f"no reference evaluation for the operation {name}")
    return fn(*args).to(want)


def _constant(op, ndim: int) -> torch.Tensor:
    dtype = _dtype(op, [], {})
    return torch.tensor(parse_constant(op.attrs.get("value"), op.dtype), dtype=_TORCH[dtype]).reshape((1,) * ndim)


def _to_dtype(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """The card's conversion: to `dtype`, then held in its compute type."""
    return x.to(torch_dtype(dtype)).to(_TORCH[compute_type(dtype)])


def _computed(op, values: dict, buffers: dict) -> str:
    return _dtype(op, [SimpleNamespace(dtype=values[a][1]) for a in op.args], buffers)


# ---- loop kernels --------------------------------------------------------------------------

def _loop(k: LoopKernel, memory: Memory) -> None:
    sizes = tuple(k.sizes)
    if any(n == 0 for n in sizes):
        return
    nd = len(sizes)
    cols = tuple(range(nd - k.ncols, nd)) if k.ncols else ()
    var = [torch.arange(n).reshape(tuple(n if i == j else 1 for i in range(nd))) for j, n in enumerate(sizes)]
    buffers = {b.name: b for b in k.buffers}
    values: dict[str, tuple[torch.Tensor, str]] = {}  # id -> (value, its storage dtype on the card)

    def position(acc) -> torch.Tensor:
        place = memory[acc.buf]
        idx = torch.tensor(place.start + acc.const).reshape((1,) * nd)
        for j, c in enumerate(acc.coeffs):
            if c:
                idx = idx + c * var[j]
        for vid, c in acc.ind:
            idx = idx + c * values[vid][0]
        return idx

    for op in k.ops:
        name = op.op
        if name == "load":
            acc = op.access
            pos = position(acc)
            if acc.domain:  # outside the box where its mask holds the value is never used
                inside = torch.ones((1,) * nd, dtype=torch.bool)
                for j, lo, hi in acc.domain:
                    inside = inside & (var[j] >= lo) & (var[j] < hi)
                pos = torch.where(inside, pos, 0)
            dtype = buffers[acc.buf].dtype
            values[op.id] = (memory[acc.buf].flat[pos].to(_TORCH[compute_type(dtype)]), dtype)
        elif name == "store":
            acc = op.access
            pos, value = torch.broadcast_tensors(position(acc), values[op.args[0]][0])
            flat = memory[acc.buf].flat
            flat.index_put_((pos.reshape(-1),), value.reshape(-1).to(flat.dtype))
        elif name == "constant":
            values[op.id] = (_constant(op, nd), _dtype(op, [], buffers))
        elif name == "index":
            idx = torch.tensor(op.access.const).reshape((1,) * nd)
            for j, c in enumerate(op.access.coeffs):
                if c:
                    idx = idx + c * var[j]
            values[op.id] = (idx, "int64")
        elif name == "indirect":
            values[op.id] = (_indirect(op, values[op.args[0]][0], k), "int64")
        elif name == "reduction":
            values[op.id] = _reduction(op, values, sizes, cols)
        elif name == "to_dtype":
            dtype = _computed(op, values, buffers)
            values[op.id] = (_to_dtype(values[op.args[0]][0], op.dtype), dtype)
        else:
            dtype = _computed(op, values, buffers)
            values[op.id] = (_elementwise(name, dtype, [values[a][0] for a in op.args]), dtype)


def _indirect(op, x: torch.Tensor, k: LoopKernel) -> torch.Tensor:
    """An index into a dimension of `size`: negative ones count from its end, and one
    outside the dimension is an error, as on the card."""
    size = int(op.attrs["size"])
    x = x.to(torch.int64)
    if op.attrs.get("wrap_neg", True):
        x = torch.where(x < 0, x + size, x)
    bad = (x < 0) | (x >= size)
    if bool(bad.any()):
        value = int(x[bad].reshape(-1)[0])
        raise SpyreIndexError(f"{', '.join(k.origins) or k.name}: index {value} is outside a dimension of {size}")
    return x


def _reduction(op, values: dict, sizes: tuple[int, ...], cols: tuple[int, ...]) -> tuple[torch.Tensor, str]:
    """A reduction over the kernel's columns (its trailing variables), kept as size-1
    dimensions so that it broadcasts over them."""
    kind = op.attrs["kind"]
    src, src_dtype = values[op.args[0]]
    dtype = _reduction_dtype(op, [SimpleNamespace(dtype=src_dtype)])
    want = _TORCH[dtype]
    rows = sizes[: len(sizes) - len(cols)]
    n = math.prod(sizes[len(rows):])
    kept = (*rows, *(1 for _ in cols))
    if kind == "count":
        return torch.tensor(float(n)).reshape((1,) * len(sizes)), dtype
    x = src.expand(sizes).reshape(*rows, n)  # one row of n columns per row of the kernel
    if kind in ("argmax", "argmin"):
        picked = (torch.argmax if kind == "argmax" else torch.argmin)(x, dim=-1)
    elif kind == "any":
        picked = x.bool().any(dim=-1)
    elif kind == "sum":
        picked = x.to(want).sum(dim=-1)
    elif kind == "mean":
        picked = x.to(torch.float32).mean(dim=-1)
    elif kind == "m2":
        mean = values[op.args[1]][0].reshape(*rows, 1)
        picked = ((x.to(torch.float32) - mean) ** 2).sum(dim=-1)
    elif kind == "max":
        picked = x.to(want).amax(dim=-1)
    elif kind == "min":
        picked = x.to(want).amin(dim=-1)
    elif kind == "prod":
        picked = x.to(want).prod(dim=-1)
    else:
        raise SpyreError(f"no reference evaluation for the reduction {kind}")
    return picked.to(want).reshape(kept), dtype


# ---- matmul and attention ------------------------------------------------------------------

def _view(memory: Memory, view) -> torch.Tensor:
    name, off, sizes, strides = view
    place = memory[name]
    return place.flat.as_strided(tuple(sizes), tuple(strides), place.start + off)


def _body(ops, load, on_store) -> None:
    """Evaluate a fused body (an epilogue's or a prologue's): `load(op)` gives a load's
    value and dtype, `on_store(op, value)` takes each stored value."""
    values: dict[str, tuple[torch.Tensor, str]] = {}
    for op in ops:
        name = op.op
        if name == "store":
            on_store(op, values[op.args[0]][0])
        elif name in ("load", "product"):
            values[op.id] = load(op)
        elif name == "constant":
            values[op.id] = (_constant(op, 3), _dtype(op, [], {}))
        elif name == "to_dtype":
            values[op.id] = (_to_dtype(values[op.args[0]][0], op.dtype), _computed(op, values, {}))
        else:
            dtype = _computed(op, values, {})
            values[op.id] = (_elementwise(name, dtype, [values[a][0] for a in op.args]), dtype)


def _operand_a(k: MatmulKernel, memory: Memory) -> torch.Tensor:
    """A as the matmul multiplies it: read, or made by its prologue."""
    pro = k.prologue
    if pro is None:
        return _view(memory, k.a)
    _, _, sizes, _ = k.a
    made = []

    def load(op):
        dtype = pro.input_dtypes[op.attrs["input"]]
        return _view(memory, pro.inputs[op.attrs["input"]]).to(_TORCH[compute_type(dtype)]), dtype

    _body(pro.ops, load, lambda op, value: made.append(value.expand(tuple(sizes)).to(torch_dtype(k.in_dtype))))
    return made[0]


def _matmul(k: MatmulKernel, memory: Memory) -> None:
    a = _operand_a(k, memory).to(torch.float32)
    for b, out in ((k.b, k.out), *k.parts):  # a grouped matmul's parts: the same A by each B
        acc = torch.matmul(a, _view(memory, b).to(torch.float32))
        if k.bias is not None:
            acc = acc + _view(memory, k.bias).to(torch.float32)
        product = acc.to(torch_dtype(k.out_dtype))
        if k.epilogue is None:
            _view(memory, out).copy_(product)
        else:  # (a matmul with an epilogue has no parts: construction refuses both)
            _epilogue(k.epilogue, product, memory)


def _epilogue(ep, product: torch.Tensor, memory: Memory) -> None:
    if ep.slices:
        _sliced_epilogue(ep, product, memory)
        return

    def load(op):
        if op.op == "product":
            return product.to(torch.float32), op.dtype
        dtype = ep.input_dtypes[op.attrs["input"]]
        return _view(memory, ep.inputs[op.attrs["input"]]).to(_TORCH[compute_type(dtype)]), dtype

    def store(op, value):
        out = _view(memory, ep.outputs[op.attrs["output"]])
        out.copy_(value.expand(out.shape).to(out.dtype))

    _body(ep.ops, load, store)


def _sliced_epilogue(ep, product: torch.Tensor, memory: Memory) -> None:
    """A sliced epilogue: each slice's body on the columns of that slice of every period."""
    cols = torch.arange(product.shape[-1])
    for i, body in enumerate(ep.slices):
        idx = cols[cols % ep.period // ep.slice_cols == i]

        def load(op, idx=idx):
            if op.op == "product":
                return product[..., idx + op.attrs.get("shift", 0)].to(torch.float32), op.dtype
            n = op.attrs["input"]
            dtype = ep.input_dtypes[n]
            view = _view(memory, ep.inputs[n])
            at = idx % ep.slice_cols + op.attrs.get("at", 0) if n in ep.periodic else idx
            return view[..., at].to(_TORCH[compute_type(dtype)]), dtype

        def store(op, value, idx=idx):
            out = _view(memory, ep.outputs[op.attrs["output"]])
            out[..., idx] = value.expand(*out.shape[:-1], len(idx)).to(out.dtype)

        _body(body, load, store)


def _attention(k: AttentionKernel, memory: Memory) -> None:
    q, key, v = (_view(memory, x).to(torch.float32) for x in (k.q, k.k, k.v))
    if k.page:  # (pages, kv_heads, page, dim) through the table: (batch, kv_heads, kv_len, dim)
        table = _view(memory, k.block_table).to(torch.int64)
        key, v = (x[table].permute(0, 2, 1, 3, 4).flatten(2, 3) for x in (key, v))
    heads, kv_heads = q.shape[1], key.shape[1]
    if kv_heads != heads:  # grouped-query attention: query head h reads kv head h // group
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(q, key.transpose(-1, -2)) * k.scale
    if k.mask is not None:
        mask = _view(memory, k.mask)
        scores = scores.masked_fill(~mask.bool(), -math.inf) if k.mask_dtype == "bool" else \
            scores + mask.to(torch.float32)
    if k.causal:
        q_len, kv_len = scores.shape[-2:]
        keep = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + k.q_offset
        scores = scores.masked_fill(~keep, -math.inf)
    out = _view(memory, k.out)
    out.copy_(torch.matmul(torch.softmax(scores, dim=-1), v).to(out.dtype))


def _collective(k: CollectiveKernel, memory: Memory) -> None:
    """A collective between cards, on host tensors: the functional collective of its group
    (whose process group serves host tensors too)."""
    import torch.distributed._functional_collectives as funcol

    x = _view(memory, k.inp).contiguous()
    if k.collective == "all_reduce":
        y = funcol.all_reduce(x, k.op, k.group)
    elif k.collective == "all_gather":
        y = funcol.all_gather_tensor(x, 0, k.group)
    elif k.collective == "reduce_scatter":
        y = funcol.reduce_scatter_tensor(x, k.op, 0, k.group)
    elif k.collective == "broadcast":
        y = funcol.broadcast(x, k.root, k.group)
    else:
        raise SpyreError(f"no reference evaluation for the collective {k.collective!r}")
    _view(memory, k.out).copy_(funcol.wait_tensor(y))
