"""Recording Inductor's fused loop nodes as plain data (the adapter's half of describe).

Each SchedulerNode's LoopBody runs under a recording ops handler, which yields an SSA list
of its operations with sympy index expressions; with the sizes of its loops and the
buffers it touches, that is a :class:`~spyre_rt.compiler.describe.RecordedKernel`. Sizes
and indices may hold size symbols (``s0``) when the graph has dynamic shapes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import sympy
import torch
from torch._inductor.ops_handler import DefaultHandler
from torch._inductor.virtualized import V

from spyre_rt.ir import Buffer

from ..describe import NotSupported, RecordedKernel, RecordedNode, loop_symbols, text


def dtype_name(d) -> str:
    return str(d).removeprefix("torch.") if isinstance(d, torch.dtype) else str(d)


def size(x):
    """An int, or the sympy expression of a symbolic size."""
    if isinstance(x, int):
        return x
    x = sympy.sympify(x)
    return int(x) if x.is_Integer else x


class _Recorder(DefaultHandler):
    """An ops handler that records a LoopBody as SSA operations."""

    def __init__(self, prefix: str, real_name: Callable[[str], str]):
        self.prefix = prefix
        self.real_name = real_name
        self.ops: list[dict] = []
        self.nind = 0
        self.mask_stack: list[str] = []
        self.indirect: dict[str, tuple[str, object, bool]] = {}  # symbol -> (value, size, wrap_neg)

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
        return self._add({"op": "load", "buf": self.real_name(name), "index": self._affine_in_indirect(index)})

    def store(self, name, index, value, mode=None):
        if mode not in (None,):
            raise NotSupported(f"store with mode {mode!r} (accumulating scatter)")
        self._add({"op": "store", "buf": self.real_name(name), "index": self._affine_in_indirect(index),
                   "args": [value]})

    def _affine_in_indirect(self, index):
        """`index` with each ``x // d`` and ``(x // d) % m`` of an indirect index x (a gather
        of the rows at ``perm // top_k``, say) replaced by an indirect index of its own that
        the card computes from x's value: kernels address memory affinely in their
        indirect indices."""
        if not self.indirect or not isinstance(index, sympy.Expr):
            return index
        swap = {}
        for node in sympy.preorder_traversal(index):
            name = type(node).__name__
            if name not in ("FloorDiv", "CleanDiv", "ModularIndexing") or node in swap:
                continue
            x, d = node.args[0], node.args[1]
            if not (isinstance(x, sympy.Symbol) and x.name in self.indirect and d.is_Integer and int(d) > 0):
                continue
            m = node.args[2] if name == "ModularIndexing" else None
            if m is not None and not (m.is_Integer and int(m) > 0):
                continue
            value, bound, wrap_neg = self.indirect[x.name]
            if wrap_neg:  # the index x stands for: a negative value counts from the end
                wrapped = self._add({"op": "add", "args": [value, self.constant(bound, torch.int64)]})
                negative = self._add({"op": "lt", "args": [value, self.constant(0, torch.int64)]})
                value = self._add({"op": "where", "args": [negative, wrapped, value]})
            value = self._add({"op": "floordiv", "args": [value, self.constant(int(d), torch.int64)]})
            if m is not None:
                value = self._add({"op": "mod", "args": [value, self.constant(int(m), torch.int64)]})
                new_bound = int(m)
            else:
                new_bound = size(sympy.ceiling(sympy.sympify(bound) / int(d)))
            swap[node] = self.indirect_indexing(value, new_bound, wrap_neg=False)
        return index.xreplace(swap) if swap else index

    def store_reduction(self, name, index, value):
        self._add({"op": "store", "buf": self.real_name(name), "index": index, "args": [value]})

    def reduction(self, dtype, src_dtype, reduction_type, value):
        if reduction_type == "welford_reduce":
            # mean and m2 over the row, computed exactly from the row in the scratchpad
            mean = self._add({"op": "reduction", "args": [value], "kind": "mean", "dtype": dtype_name(dtype)})
            m2 = self._add({"op": "reduction", "args": [value, mean], "kind": "m2", "dtype": dtype_name(dtype)})
            count = self._add({"op": "reduction", "args": [value], "kind": "count", "dtype": dtype_name(dtype)})
            return mean, m2, count
        if reduction_type not in ("sum", "max", "min", "prod", "any", "argmax", "argmin"):
            raise NotSupported(f"reduction {reduction_type}")
        return self._add({"op": "reduction", "args": [value], "kind": reduction_type, "dtype": dtype_name(dtype)})

    def constant(self, value, dtype):
        return self._add({"op": "constant", "value": value, "dtype": dtype_name(dtype)})

    def index_expr(self, expr, dtype):
        """An index as a value. Kernels address memory with affine indices only, so the
        functions Inductor leaves in a value's index (``Abs(i - j)`` of a local attention
        window or a relative position, ``Min``, ``Max``) become the card's own operations
        on affine parts."""
        expr = sympy.sympify(expr)
        op = _INDEX_FUNCTIONS.get(type(expr).__name__)
        if op is None and isinstance(expr, (sympy.Add, sympy.Mul)) and _has_index_function(expr):
            op = "add" if isinstance(expr, sympy.Add) else "mul"
        if op is None:
            return self._add({"op": "index", "index": expr, "dtype": dtype_name(dtype)})
        args = [self.index_expr(a, dtype) for a in expr.args]
        if op == "abs":
            return self._add({"op": "abs", "args": args})
        return functools.reduce(lambda a, b: self._add({"op": op, "args": [a, b]}), args)

    def indirect_indexing(self, x, size_, check=True, wrap_neg=True):
        sym = sympy.Symbol(f"{self.prefix}ind{self.nind}", integer=True)
        self.nind += 1
        self._add({"op": "indirect", "args": [x], "size": size(size_), "wrap_neg": bool(wrap_neg),
                   "symbol": sym.name})
        self.indirect[sym.name] = (x, size(size_), bool(wrap_neg))
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

    def check_bounds(self, expr, size_, lower, upper):
        return None

    def device_assert_async(self, cond, msg):
        return None


# Functions in a value's index, by name (sympy's and torch's classes), and the card
# operation of each
_INDEX_FUNCTIONS = {"Abs": "abs", "Min": "minimum", "Max": "maximum"}


def _has_index_function(expr: sympy.Basic) -> bool:
    return any(type(e).__name__ in _INDEX_FUNCTIONS for e in sympy.preorder_traversal(expr))


def _record_node(snode, prefix: str, real_name) -> RecordedNode:
    sizes, rsizes = snode._sizes
    sizes, rsizes = [size(s) for s in sizes], [size(s) for s in rsizes]
    syms = loop_symbols(prefix, len(sizes) + len(rsizes))
    rec = _Recorder(prefix, real_name)
    with V.set_ops_handler(rec):
        snode._body(syms[: len(sizes)], syms[len(sizes):])
    return RecordedNode(tuple(sizes), tuple(rsizes), tuple(rec.ops))


def record_kernel(name: str, snodes, numel, rnumel, local: set[str], real_name: Callable[[str], str]) -> RecordedKernel:
    """A fused group of SchedulerNodes as a RecordedKernel (expressions as sympy)."""
    nodes = tuple(_record_node(sn, f"n{k}_", real_name) for k, sn in enumerate(snodes))
    buffers = {}
    for node in nodes:
        for op in node.ops:
            if "buf" in op and op["buf"] not in buffers:
                try:
                    buffers[op["buf"]] = buffer_info(op["buf"])
                except NotSupported:
                    if op["buf"] not in local:
                        raise
    return RecordedKernel(name, nodes, size(numel), size(rnumel), tuple(sorted(local)), buffers,
                          tuple(sorted(origins(snodes))), module_of(fx_origins(snodes)))


def buffer_info(name: str) -> Buffer:
    """The dtype and geometry Inductor gave a buffer or graph input (sizes may be sympy)."""
    buf = V.graph.get_buffer(name)
    if buf is None and name in V.graph.graph_inputs:
        buf = V.graph.graph_inputs[name]
    if buf is None or not hasattr(buf, "get_layout"):
        raise NotSupported(f"unknown buffer {name}")
    layout = buf.get_layout()
    return Buffer(name, dtype_name(buf.get_dtype()), tuple(size(s) for s in layout.size),
                  tuple(size(s) for s in layout.stride), size(layout.offset))


def origins(snodes) -> set[str]:
    out = set()
    for sn in snodes:
        for o in getattr(sn.node, "origins", ()):
            if getattr(o, "op", "") == "call_function":
                out.add(str(o.target))
    return out


def hints(*exprs) -> dict[str, int]:
    """Inductor's example values of the size symbols in `exprs` (any nesting of sizes,
    buffers and recorded kernels): to check at compile time what a dynamic graph will be
    like at its first call."""
    out = {}
    for s in _free_symbols(exprs):
        if not _RECORDER_SYMBOL.match(s.name):  # a size symbol, not a loop variable
            out[s.name] = int(V.graph.sizevars.optimization_hint(s, fallback=8192))
    return out


_RECORDER_SYMBOL = re.compile(r"n\d+_(v|ind)\d+$")


def _free_symbols(x) -> set:
    if isinstance(x, sympy.Basic):
        return set(x.free_symbols)
    if isinstance(x, (list, tuple, set)):
        return set().union(*[_free_symbols(v) for v in x]) if x else set()
    if isinstance(x, dict):
        return _free_symbols(list(x.values()))
    if hasattr(x, "__dataclass_fields__"):
        return _free_symbols([getattr(x, f) for f in x.__dataclass_fields__])
    return set()


def view_of(x) -> tuple:
    """(underlying buffer, offset, sizes, strides) of an extern kernel's input or output."""
    from torch._inductor import ir

    if isinstance(x, ir.ReinterpretView):
        layout = x.layout
        return (x.data.get_name(), size(layout.offset), tuple(size(s) for s in layout.size),
                tuple(size(s) for s in layout.stride))
    b = buffer_info(x.get_name())
    return (b.name, b.offset, b.sizes, b.strides)


def on_cpu(x) -> bool:
    """An IR node, or every node of a sequence, on the CPU device (work on CPU tensors that
    the graph was given or made, as eager does it)."""
    nodes = x if isinstance(x, (list, tuple)) else [x]
    devices = set()
    for n in nodes:
        try:
            devices.add(n.get_device().type)
        except Exception:
            return False
    return devices == {"cpu"}


def node_origins(node) -> tuple[str, ...]:
    return tuple(sorted(str(o.target) for o in getattr(node, "origins", ()) if o.op == "call_function"))


def stored_view(view) -> tuple:
    """A view for a description: sizes that are expressions become Sym text."""
    name, off, sizes, strides = view
    return (name, text(off), tuple(text(s) for s in sizes), tuple(text(s) for s in strides))


def stored_buffer(b: Buffer) -> Buffer:
    return Buffer(b.name, b.dtype, tuple(text(s) for s in b.sizes), tuple(text(s) for s in b.strides), text(b.offset))


# Ops that only rearrange how a tensor is seen: running them on the CPU would change nothing
# about what the card can compute.
_VIEWS = {"view", "_unsafe_view", "reshape", "permute", "expand", "unsqueeze", "squeeze", "slice", "select",
          "t", "transpose", "alias", "as_strided", "clone", "_to_copy", "convert_element_type"}


def node_key(node) -> str:
    """An FX node's name qualified by the graph being lowered: a compile region's graph
    names its nodes as the outer graph does (``div``, ``mm_1``), so a node the backend
    runs on the CPU or realizes apart (``options.cpu_nodes``, ``realize_nodes``) must
    not stand for the region's node of the same name."""
    graph = getattr(V.graph, "name", None)
    return f"{graph}/{node.name}" if graph else node.name


def kept_apart(graph) -> set[str]:
    """The nodes of the graph being lowered that the lowering realized for a reason of its
    own (a gather ``lowering.rebroadcast`` computes once, a residual sum
    ``lowering.residual_sum`` computes in a matmul's epilogue), kept out of their readers'
    kernels (``SpyreScheduling.can_fuse_vertical``) as the nodes of the backend's
    ``options.realize_nodes`` are."""
    if not hasattr(graph, "spyre_kept_apart"):
        graph.spyre_kept_apart = set()
    return graph.spyre_kept_apart


def computing_origins(snodes) -> set[str]:
    """The FX nodes a fused group (scheduler nodes) or an IR node computes (its view ops
    left out), by :func:`node_key`."""
    out = set()
    for sn in snodes:
        for o in getattr(getattr(sn, "node", sn), "origins", ()):
            if getattr(o, "op", "") == "call_function" and getattr(o.target, "_opname", str(o.target)) not in _VIEWS:
                out.add(node_key(o))
    return out


# FX ops whose reads go through an index tensor: where an indirect access comes from
_INDEXING = {"index", "_unsafe_index", "index_select", "gather", "embedding", "take", "index_put", "_unsafe_index_put",
             "index_put_", "scatter", "scatter_"}


def indexing_origins(snodes) -> set[str]:
    """The FX nodes among what a fused group computes that index by a tensor, by :func:`node_key`."""
    out = set()
    for sn in snodes:
        for o in getattr(getattr(sn, "node", sn), "origins", ()):
            if getattr(o, "op", "") == "call_function" and getattr(o.target, "_opname", "") in _INDEXING:
                out.add(node_key(o))
    return out


def module_of(fx_nodes) -> str:
    """The module path (``model.layers.3.mlp.up_proj``) of the module a kernel's work ends
    in, read from Dynamo's nn_module_stack: that of its last FX node (in graph order) in the
    graph most of its nodes come from. Not the one most nodes share: a kernel that
    recomputes what it reads (a rotary table, an embedding) holds more nodes of those."""
    nodes = [n for n in fx_nodes if (getattr(n, "meta", None) or {}).get("nn_module_stack")]
    if not nodes:
        return ""
    graphs: dict[int, list] = {}
    for n in nodes:
        graphs.setdefault(id(n.graph), []).append(n)
    mine = max(graphs.values(), key=len)
    order = _graph_order(mine[0].graph)
    last = max(mine, key=lambda n: order.get(n, -1))
    return _module_path(list(last.meta["nn_module_stack"].values())[-1][0])


_ORDERS: dict[int, tuple] = {}  # id(graph) -> (graph, its node count, {node: position})


def _graph_order(graph) -> dict:
    """Each node's position in `graph` (kept for the few graphs a compile lowers)."""
    key = id(graph)
    got = _ORDERS.get(key)
    if got is None or got[0] is not graph or got[1] != len(graph.nodes):
        if len(_ORDERS) > 64:
            _ORDERS.clear()
        got = _ORDERS[key] = (graph, len(graph.nodes), {n: i for i, n in enumerate(graph.nodes)})
    return got[2]


# The roots Dynamo names a module by: the frame's local or global it was reached from
# (``L['self']``, ``G['model']``), and the closure cells of a function that captured it.
_ROOT = re.compile(r"^(?:[LG]\['[^']*'\]\.?)?(?:__closure__\[\d+\]\.cell_contents\.?)*")


def _module_path(qualified: str) -> str:
    """``L['self'].model.layers[3].mlp`` -> ``model.layers.3.mlp``; the same from a global
    (``G['m'].model...``) or a closure's cell (``L['fn'].__closure__[2].cell_contents.model...``)."""
    path = _ROOT.sub("", qualified)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.strip(".")


def fx_origins(nodes) -> list:
    """The FX nodes an IR node (or scheduler nodes) came from."""
    out = []
    for n in nodes:
        node = getattr(n, "node", n)
        out.extend(o for o in getattr(node, "origins", ()) if getattr(o, "op", "") == "call_function")
    return out
