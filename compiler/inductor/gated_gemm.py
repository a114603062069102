"""A merged gate-and-up GEMM as two GEMMs, so that the gated activation is an epilogue.

vLLM's models compute an MLP's gate and up projections as one GEMM over their weights
stacked (``MergedColumnParallelLinear``) and then ``SiluAndMul``: ``silu(y[:, :d]) *
y[:, d:]``. The activation reads the product at two column offsets, which no matmul
epilogue can (an epilogue works on the product's own elements, tile by tile), so it runs
as a kernel of its own: the product (tokens x 2d) is written to DRAM, read back and the
result written, a quarter of a prefill layer's DRAM traffic.

:class:`SplitGatedGEMM` (a post-grad pass over the aten graph) makes a GEMM whose product
is read only as its two halves of columns two GEMMs over the halves of the weight (views of
it, no copy): each output element is the same dot product. The activation then reads two
products element for element, as it does for Hugging Face's separate gate and up
projections, and epilogue fusion (:mod:`spyre_rt.compiler.fusion`) makes it the second
GEMM's epilogue. Turned off by the backend option ``split_gated_gemms=False``.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten

_TRANSPOSES = (aten.permute.default, aten.t.default)
_END = 2**63 - 1  # a slice to the end, as the graph spells it


class SplitGatedGEMM(CustomGraphPass):
    """``mm(x, W.t())`` read only as ``[..., :d]`` and ``[..., d:]`` (slices, or a split in
    two, of the product or of it reshaped) becomes ``mm(x, W[:d].t())`` and
    ``mm(x, W[d:].t())``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        from .. import options

        if not options.split_gated_gemms:
            return
        for mm in list(graph.find_nodes(op="call_function", target=aten.mm.default)):
            found = halves(mm)
            if found is not None:
                _split(graph, mm, found)
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        from ..version import compiler_version

        return compiler_version()


_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


class Halves(NamedTuple):
    """A GEMM's product read only as its two halves of columns."""

    weight: torch.fx.Node          # W, (2d, k)
    d: int
    shape: list | None             # the product reshaped to this (its last dim kept), or None
    readers: list[tuple[torch.fx.Node, int]]  # each reader of a half, and which (0, 1)


def halves(mm: torch.fx.Node) -> Halves | None:
    """The halves of `mm` = ``mm(x, W.t())``, W a (2d, k) tensor, when every reader of its
    product (or of the product reshaped with its columns kept) is a slice of its columns
    ``[:d]`` or ``[d:]``, or a split of them in two (both halves read); else None."""
    wt = mm.args[1]
    if not _is_call(wt, _TRANSPOSES) or (wt.target is aten.permute.default and list(wt.args[1]) != [1, 0]):
        return None
    value = mm.meta.get("val")
    n = value.shape[1] if value is not None and value.dim() == 2 else None
    if not isinstance(n, int) or n < 2 or n % 2:
        return None
    d, product, shape = n // 2, mm, None
    users = list(mm.users)
    if len(users) == 1 and _is_call(users[0], _RESHAPES):
        shaped = users[0].meta.get("val")
        if shaped is None or shaped.dim() < 1 or shaped.shape[-1] != n:
            return None
        product, shape = users[0], list(users[0].args[1])
    last = product.meta["val"].dim() - 1
    readers: list[tuple[torch.fx.Node, int]] = []
    for user in product.users:
        found = _read_halves(user, last, d, n)
        if found is None:
            return None
        readers += found
    if {half for _, half in readers} != {0, 1} or not _gated(readers):
        return None
    return Halves(wt.args[0], d, shape, readers)


def _gated(readers: list[tuple[torch.fx.Node, int]], depth: int = 8) -> bool:
    """The second half meets the first (an activation of it, within `depth` ops) in one op:
    the gate's product, which the split lets fuse as an epilogue. Halves read apart (the
    projections of a Mamba block's input, say) stay one GEMM: split, each would be a GEMM of
    its own with nothing to fuse."""
    seen: set[torch.fx.Node] = set()
    frontier = [r for r, half in readers if half == 0]
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u.op == "call_function" and u not in seen]
        seen.update(frontier)
    return any(u in seen for r, half in readers if half == 1 for u in r.users)


def _read_halves(user: torch.fx.Node, last: int, d: int, n: int) -> list[tuple[torch.fx.Node, int]] | None:
    """(node, half) of what `user` reads: a slice of one half, or a split's items."""
    if user.kwargs:
        return None
    if _is_call(user, (aten.slice.Tensor,)):
        dim, start, end, step = (list(user.args[1:]) + [0, 0, None, 1][len(user.args) - 1:])[:4]
        if dim not in (last, -1) or step != 1:
            return None
        end = n if end is None or end >= n else end
        return [(user, {(0, d): 0, (d, n): 1}[(start, end)])] if (start, end) in ((0, d), (d, n)) else None
    if _is_call(user, (aten.split.Tensor, aten.split_with_sizes.default)):
        sizes, dim = user.args[1], user.args[2] if len(user.args) > 2 else 0
        if dim not in (last, -1) or not (sizes == d if isinstance(sizes, int) else list(sizes) == [d, d]):
            return None
        items = list(user.users)
        if not all(i.target is operator.getitem and i.args[1] in (0, 1) for i in items):
            return None
        return [(i, i.args[1]) for i in items]
    return None


def _split(graph: torch.fx.Graph, mm: torch.fx.Node, found: Halves) -> None:
    x, d = mm.args[0], found.d
    with graph.inserting_before(mm):
        products = []
        for start, end in ((0, d), (d, _END)):
            half = _call(graph, mm, aten.slice.Tensor, found.weight, 0, start, end)
            product = _call(graph, mm, aten.mm.default, x, _call(graph, mm, aten.permute.default, half, [1, 0]))
            if found.shape is not None:
                product = _call(graph, mm, aten.reshape.default, product, [*found.shape[:-1], d])
            products.append(product)
    for reader, half in found.readers:
        reader.replace_all_uses_with(products[half])
        graph.erase_node(reader)


def _call(graph: torch.fx.Graph, like: torch.fx.Node, target, *args) -> torch.fx.Node:
    """A new node with the origins of `like` (the module and source it came from, for the
    profiler) and its fake value, computed from its arguments' (what lowering reads)."""
    node = graph.call_function(target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    vals = torch.fx.node.map_arg(args, lambda a: a.meta["val"])  # nested too: a shape's symbolic sizes
    node.meta["val"] = target(*vals)
    return node


def _is_call(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets
