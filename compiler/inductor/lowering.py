"""Lowerings and decompositions for the card.

Matmuls become :class:`SpyreMatmul` extern nodes that the wrapper turns into matmul kernels
(an ``addmm`` whose bias broadcasts over rows keeps the bias as the matmul's epilogue).
Inductor's lowering table is global, so every lowering here hands inputs on other devices
back to the original one.
"""

from __future__ import annotations

import operator

import torch
from torch._decomp import get_decompositions
from torch._inductor import ir
from torch._inductor import lowering as L
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.virtualized import V
from torch.utils._sympy.symbol import SymT, free_symbol_is_type

from spyre_rt import dtypes
from spyre_rt.construct.loops import CARD_OPS
from spyre_rt.ir import MatmulKernel

from ..describe import ADAPTERS
from ..errors import compile_error
from . import attention
from .grouped import grouped_decompositions
from .ranking import ranking_decompositions
from .record import (
    buffer_info,
    dtype_name,
    fx_origins,
    kept_apart,
    module_of,
    node_key,
    node_origins,
    on_cpu,
    stored_buffer,
    stored_view,
    view_of,
)

aten = torch.ops.aten
prims = torch.ops.prims


class SpyreMatmul(ir.ExternKernelOut):
    """``out = a @ b (+ bias)``: a matmul kernel of the card (not a CPU extern)."""

    def spyre_kernel(self, name: str) -> MatmulKernel:
        """Its description: views in logical elements of their buffers, batched."""
        a, b = view_of(self.inputs[0]), view_of(self.inputs[1])
        out = buffer_info(self.get_name())
        nd = len(out.sizes)
        bias = _batched(view_of(self.inputs[2]), 2) if len(self.inputs) > 2 else None
        if bias is not None:
            bname, off, sizes, strides = bias
            # (1, n) bias over (batch, m, n): broadcast over batch and rows
            bias = (bname, off, (1, 1, sizes[-1]), (0, 0, strides[-1]))
        bufs = {v[0]: buffer_info(v[0]) for v in (a, b, bias) if v is not None}
        bufs[out.name] = out
        out_view = (out.name, out.offset, out.sizes, out.strides)
        if nd == 2:
            a, b, out_view = _batched(a, 2), _batched(b, 2), _batched(out_view, 2)
        return MatmulKernel(
            name=name, a=stored_view(a), b=stored_view(b), out=stored_view(out_view),
            in_dtype=dtype_name(self.inputs[0].get_dtype()), out_dtype=out.dtype,
            bias=stored_view(bias) if bias else None,
            bias_dtype=dtype_name(self.inputs[2].get_dtype()) if bias else "",
            buffers=tuple(stored_buffer(b) for b in bufs.values()), origins=node_origins(self),
            module=module_of([o for o in fx_origins([self]) if "mm" in str(o.target)] or fx_origins([self])),
        )


def _batched(view, nd: int):
    name, off, sizes, strides = view
    if len(sizes) == nd:
        return (name, off, (1, *sizes), (0, *strides))
    return view


_original: dict = {}
_installed = False


def _on_spyre(*xs) -> bool:
    """Whether any of the arguments, or of the tensors in a list argument (cat's, stack's,
    index_put's indices), is on the card."""
    for x in xs:
        if isinstance(x, (list, tuple)):
            if _on_spyre(*x):
                return True
            continue
        try:
            d = x.get_device()
        except Exception:
            continue
        if d is not None and d.type == "spyre":
            return True
    return False


def _static(expr) -> bool:
    return not getattr(expr, "free_symbols", None)


def _known(expr, n: int) -> bool:
    """The size is `n` whatever the size symbols are."""
    return V.graph.sizevars.statically_known_equals(expr, n)


def _matmul_operand(x):
    """Realised, with one of its two inner dimensions contiguous (else copied so), its
    layout fixed: a flexible layout seen here could be changed afterwards (by a later
    consumer), leaving the kernel an operand with neither inner dimension contiguous."""
    x = ir.ExternKernel.realize_input(x)
    if ir.is_storage_and_layout(x) and isinstance(x.get_layout(), ir.FlexibleLayout):
        ir.as_storage_and_layout(x, freeze=True)
    size, stride = x.get_size(), x.get_stride()
    ok = any(_known(size[d], 1) or _known(stride[d], 1) for d in (-1, -2))
    return x if ok else ir.ExternKernel.require_contiguous(x)


def _matmul(a, b, bias=None, out_dtype=None):
    *batch, m, k = a.get_size()
    size = [*batch, m, b.get_size()[-1]]
    out_dtype = out_dtype or a.get_dtype()
    if any(_known(s, 0) for s in size):  # an empty result: nothing to compute
        return L.full(size, 0, dtype=out_dtype, device=a.get_device())
    a, b = _matmul_operand(a), _matmul_operand(b)
    layout = ir.FixedLayout(a.get_device(), out_dtype, size)
    inputs = [a, b] + ([ir.ExternKernel.realize_input(bias)] if bias is not None else [])
    node = SpyreMatmul(layout, inputs, python_kernel_name="spyre_rt.matmul")
    return ir.TensorBox.create(node)


MAX_DEPTHWISE_TAPS = 16  # a depthwise conv1d's kernel length the card computes as shifted slices


def _depthwise_1d(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups) -> bool:
    """A 1-D convolution of each channel with its own short kernel, stride and dilation 1."""
    w, xs = weight.get_size(), x.get_size()
    return (len(w) == 3 and len(xs) == 3 and not transposed and list(stride) == [1] and list(dilation) == [1]
            and len(padding) == 1 and _static(w[0]) and _static(w[2]) and _known(w[1], 1)
            and _static(xs[1]) and int(xs[1]) == int(w[0]) == groups and int(w[2]) <= MAX_DEPTHWISE_TAPS
            and x.get_dtype().is_floating_point and x.get_dtype() == weight.get_dtype())


def _arrays_take(*operands) -> bool:
    """The systolic arrays multiply these dtypes (others, int8 say, run on the CPU)."""
    return all(dtype_name(x.get_dtype()) in dtypes.MATMUL for x in operands)


def _arrays_give(out_dtype, *operands) -> bool:
    """The arrays multiply the operands and store the product in `out_dtype` (they
    accumulate in fp32: ``mm(a16, b16, out_dtype=float32)`` keeps the sums unrounded)."""
    return _arrays_take(*operands) and dtype_name(out_dtype) in dtypes.MATMUL


def _bias_broadcasts_over_rows(bias, n) -> bool:
    size = bias.get_size()
    return V.graph.sizevars.statically_known_equals(size[-1], n) and all(_known(s, 1) for s in size[:-1])


# Operations of Inductor's ops handler a lowering may leave in a loop body besides the ones
# construction emits (the recorder turns these into those).
_BOOKKEEPING = frozenset({"index_expr", "indirect_indexing", "masked", "store_reduction", "check_bounds",
                          "device_assert_async"})


def card_computes() -> frozenset[str]:
    """The ops-handler operations a loop kernel on the card may use: construction's own and
    those an adapter rewrites into them."""
    return CARD_OPS | frozenset(ADAPTERS) | _BOOKKEEPING


def missing_operations(result, args=()) -> set[str]:
    """The operations of a lowering's result (its loop bodies) the card cannot compute, and
    the dtypes among its tensors that the card does not compute in."""
    allowed = card_computes()
    out: set[str] = set()
    boxes = result if isinstance(result, (list, tuple)) else [result]
    for t in [*boxes, *args]:
        dtype = getattr(t, "get_dtype", None)
        name = dtype_name(dtype()) if callable(dtype) and isinstance(t, ir.IRNode) else None
        if name is not None and name not in dtypes.CODE:
            out.add(name)
    for box in boxes:
        data = getattr(box, "data", None)
        while isinstance(data, (ir.StorageBox, ir.ComputedBuffer)):
            data = data.data
        if isinstance(data, ir.Loops):
            out |= set(data.inner_fn_opcount().used_ops) - allowed
    return out


def _checked(op, lowering):
    """A lowering whose result on the card is checked against what the card computes: an
    operation it lacks makes the op a CPU fallback kernel instead (the fusion forms around
    it), or, with CPU fallback off, a compile error naming the op and the model line."""
    handler = L.fallback_handler(op, add_to_fallback_set=False)

    def checked(*args, **kwargs):
        node = V.graph.current_node
        from .. import options

        if node is not None and node_key(node) in options.cpu_nodes and _on_spyre(*args, *kwargs.values()):
            return handler(*args, **kwargs)  # a kernel holding it could not be built: the CPU runs it
        made = len(V.graph.operations)
        result = lowering(*args, **kwargs)
        if node is not None and node_key(node) in options.realize_nodes and isinstance(result, ir.TensorBox):
            result.realize()  # a buffer of its own, read by the kernels that fused it before
        elif node is not None and isinstance(result, ir.TensorBox) and _on_spyre(*args) \
                and _computed_apart(op, node, args):
            result.realize()  # computed once, not again by each of its readers
            kept_apart(V.graph).add(node_key(node))
        if not _on_spyre(*args, *kwargs.values()):
            if options.compiler_version and not op.is_view and on_cpu(result):
                # Work on a CPU tensor (a 0-d tensor a model passes, say) inside a graph
                # compiled for the card: a step has no C++ kernels, so aten runs it.
                return handler(*args, **kwargs)
            return result
        if _unrunnable_externs(V.graph.operations[made:]):
            # An extern kernel that is a Python function of Inductor's, not a torch op
            # (``_weight_int8pack_mm``'s): the step runs the op itself on the CPU instead.
            return handler(*args, **kwargs)
        missing = missing_operations(result, args)
        if not missing:
            return result
        if not options.cpu_fallback:
            raise compile_error(f"operation {', '.join(sorted(missing))} has no card kernel or adapter and "
                                "CPU fallback is off", [V.graph.current_node])
        return handler(*args, **kwargs)

    return checked


def _computed_apart(op, node: torch.fx.Node, args) -> bool:
    """Whether the lowering computes `node`'s value (the result of `op` on the card) into a
    buffer of its own, kept out of its readers' kernels: a gather whose readers broadcast
    its rows (:func:`rebroadcast`), gathered once, not again for every element that reads
    it; a residual sum (:func:`residual_sum`), computed once in the matmul's epilogue."""
    from .. import options

    if op in _GATHERS:
        return rebroadcast(node)
    if op in _RESIDUAL_SUMS:
        return (node.target is op and options.fuse_residuals and options.fuse_epilogues and residual_sum(node)
                and all(_reads_plainly(a) for a in args[:_RESIDUAL_SUMS[op]]))
    return False


_GATHERS = (aten.index_select.default, aten.embedding.default, aten.index.Tensor)
_PASS_THROUGH = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
                 aten.squeeze.dim, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
                 aten.expand.default, prims.convert_element_type.default, operator.getitem)
# a gather whose readers use each gathered element this many times or more is computed apart
REBROADCAST = 4


def rebroadcast(node: torch.fx.Node) -> bool:
    """The rows `node` gathers are read, past views, splits and casts, by an op of at least
    REBROADCAST times as many elements (the cos and sin rows of a rotary embedding, gathered
    by position and read by every head): fused into it, the gather would fetch each row once
    per element that reads it, in runs of a row."""
    gathered = _numel(node)
    if gathered is None:
        return False
    todo, seen = list(node.users), set()
    while todo:
        user = todo.pop()
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        if user.target in _PASS_THROUGH:
            todo.extend(user.users)
            continue
        reader = _numel(user)
        if reader is not None and V.graph.sizevars.statically_known_geq(reader, REBROADCAST * gathered):
            return True
    return False


_MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
_SCALINGS = (aten.mul.Tensor, aten.div.Tensor)
# the ops that may add a residual to a matmul's product, and how many of their leading
# arguments are the terms an epilogue would load (an addmm's matmul is its own)
_RESIDUAL_SUMS = {aten.add.Tensor: 2, aten.addmm.default: 1}
# the smallest sum realized: the read a reader saves must outweigh the epilogue the matmul
# gains (a tile program and its loads at the end of a wave). On Granite 3.3 8B's decode step
# a sum of 64 KiB (batch 8) cost 2.5 µs a layer realized, one of 256 KiB (batch 32) saved 5
RESIDUAL_MIN_BYTES = 1 << 18


def residual_sum(node: torch.fx.Node) -> bool:
    """`node` adds a matmul's product (past views, casts and scalings by a number, none of
    them read by anything else) to a tensor of the sum's size, and more than one op reads
    the sum: a residual stream (``h + attn(h) * m``, read by the next norm and the next
    residual add; an ``addmm`` whose input is such a tensor) of RESIDUAL_MIN_BYTES or more.
    Inductor would inline the add into each reader, which then loads both terms; realized,
    the add is the matmul's epilogue (``compiler/fusion.py``) and each reader loads the sum
    alone."""
    size = _numel(node)
    value = node.meta.get("val")
    if len(node.users) < 2 or size is None or not V.graph.sizevars.statically_known_geq(
            size * value.element_size(), RESIDUAL_MIN_BYTES):
        return False
    if node.target is aten.addmm.default:
        return isinstance(node.args[0], torch.fx.Node) and _numel(node.args[0]) == size
    terms = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
    if len(terms) != 2 or any(_numel(t) != size for t in terms):
        return False  # a broadcast term (a bias, a scalar) is not a residual
    return any(_private_product(t) for t in terms)


def _reads_plainly(x) -> bool:
    """`x` (a lowered term) is a buffer, or computed from buffers at affine indices: an
    epilogue can load what it reads (a term that gathers, a token embedding's rows, would
    keep the realized sum a kernel of its own)."""
    if not isinstance(x, ir.IRNode):
        return False
    if ir.is_storage_and_layout(x):
        return True
    try:
        reads = x.get_reads()
    except NotImplementedError:
        return False
    # an index loaded from memory shows as a tmp (or indirect) symbol in the read's index
    return not any(free_symbol_is_type(dep.index, (SymT.TMP, SymT.INDIRECT)) for dep in reads if hasattr(dep, "index"))


def _private_product(x: torch.fx.Node) -> bool:
    """`x` is a matmul's product, past views, casts and scalings by a number, and each
    node on the way is read once."""
    while len(x.users) == 1:
        if x.target in _MATMULS:
            return True
        if x.target in _PASS_THROUGH or (x.target in _SCALINGS and not isinstance(x.args[1], torch.fx.Node)):
            x = x.args[0]
            if not isinstance(x, torch.fx.Node):
                return False
            continue
        return False
    return False


def _numel(node: torch.fx.Node):
    """The elements of the node's value: an int, or the sympy expression of a symbolic count."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    n = value.numel()
    return n.node.expr if isinstance(n, torch.SymInt) else n


def _unrunnable_externs(operations) -> list:
    """The extern nodes among `operations` that neither the card runs (a node of ours, with
    ``spyre_kernel``) nor a CPU op can call (they name no torch op)."""
    return [op for op in operations if isinstance(op, (ir.ExternKernelOut, ir.ExternKernelAlloc))
            and not isinstance(op, (ir.FallbackKernel, ir.DeviceCopy)) and not hasattr(op, "spyre_kernel")
            and not isinstance(getattr(op, "op_overload", None), torch._ops.OpOverload)]


def _install_card_check() -> None:
    for op, lowering in list(L.lowerings.items()):
        if isinstance(op, torch._ops.OpOverload) and op.namespace in ("aten", "prims"):
            L.lowerings[op] = _checked(op, lowering)


def _install_region_writes() -> None:
    """A compile region's call (``invoke_subgraph``) on the card declares the operands its
    region writes (a KV cache, a clone AOT made of one): Inductor's own call declares none,
    and its scheduler would then order a read of such an operand (the copy back into the
    graph input) before the call."""
    hop = torch.ops.higher_order.invoke_subgraph
    original = L.lowerings[hop]

    def invoke_subgraph(subgraph_fn, identifier, *operands):
        result = original(subgraph_fn, identifier, *operands)
        call = next(op for op in reversed(V.graph.operations) if isinstance(op, ir.InvokeSubgraph))
        region = subgraph_fn.graph
        written = [i for i, name in enumerate(region.graph_input_names) if name in region.mutated_buffers]
        for i in written:
            operand = call.inputs[i]
            if isinstance(operand, ir.ReinterpretView):
                operand = operand.unwrap_view()
            if not _on_spyre(operand):
                continue
            if operand.get_name() not in V.graph.graph_inputs:
                # AOT made a copy for the region to write and copies it back after the
                # call; the copy back is not ordered after the call (wrong results seen
                # with Gemma 2's decode step), so refuse rather than compute wrongly
                err = compile_error("a compile region that writes a copy of its caller's tensor "
                                    f"({operand.get_name()}) is not supported on spyre", [])
                err.inline_regions = True  # the backend compiles the graph again with its regions inlined
                raise err
            ir.MutationOutput(ir.NoneLayout(device=operand.get_device()), operand, call)
        return result

    L.lowerings[hop] = invoke_subgraph


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    _install_cpu_ops()
    _install_region_writes()
    cpu_matmul = {}
    for op in (aten.mm.default, aten.bmm.default, aten.addmm.default):
        _original[op] = L.lowerings[op]
        cpu_matmul[op] = L.fallback_handler(op, add_to_fallback_set=False)

    @L.register_lowering(aten.mm.default, type_promotion_kind=None)
    def mm(a, b, out_dtype=None, *, layout=None):
        if not _on_spyre(a, b) or (out_dtype is not None and not _arrays_give(out_dtype, a, b)):
            return _original[aten.mm.default](a, b, out_dtype, layout=layout)
        if not _arrays_take(a, b):
            return cpu_matmul[aten.mm.default](a, b)
        return _matmul(a, b, out_dtype=out_dtype)

    @L.register_lowering(aten.bmm.default, type_promotion_kind=None)
    def bmm(a, b, out_dtype=None, *, layout=None):
        if not _on_spyre(a, b) or (out_dtype is not None and not _arrays_give(out_dtype, a, b)):
            return _original[aten.bmm.default](a, b, out_dtype, layout=layout)
        if not _arrays_take(a, b):
            return cpu_matmul[aten.bmm.default](a, b)
        return _matmul(a, b, out_dtype=out_dtype)

    for op, same in ((aten.mm.dtype, aten.mm.default), (aten.bmm.dtype, aten.bmm.default)):
        _original[op] = L.lowerings[op]

        def matmul_to(a, b, out_dtype, *, layout=None, _op=op, _same=same):
            """A product stored in another dtype than its operands' (fp16 operands, an fp32
            product, the only other kind torch allows): the arrays accumulate in fp32 and
            store it so. The CPU has no kernel for these overloads."""
            if not _on_spyre(a, b):
                return _original[_op](a, b, out_dtype, layout=layout)
            if out_dtype == a.get_dtype():
                return L.lowerings[_same](a, b)
            return _matmul(a, b, out_dtype=out_dtype)

        L.lowerings[op] = matmul_to

    @L.register_lowering(aten.addmm.default, type_promotion_kind=None)
    def addmm(inp, a, b, *, beta=1, alpha=1, layout=None):
        if not _on_spyre(a, b):
            return _original[aten.addmm.default](inp, a, b, beta=beta, alpha=alpha, layout=layout)
        if not _arrays_take(a, b):
            return cpu_matmul[aten.addmm.default](inp, a, b, beta=beta, alpha=alpha)
        n = b.get_size()[-1]
        if alpha == 1 and beta == 1 and _bias_broadcasts_over_rows(inp, n):
            return _matmul(a, b, L.lowerings[aten.view.default](inp, [1, n]))
        out = _matmul(a, b)
        if alpha != 1:
            out = L.lowerings[aten.mul.Tensor](out, alpha)
        scaled = inp if beta == 1 else L.lowerings[aten.mul.Tensor](inp, beta)
        return L.lowerings[aten.add.Tensor](out, scaled)

    _original[aten.convolution.default] = L.lowerings[aten.convolution.default]

    @L.register_lowering(aten.convolution.default, type_promotion_kind=None)
    def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
        """A depthwise 1-D convolution with a short kernel (Mamba's causal conv1d) as
        shifted slices of the padded input times a column of the weight each, summed: one
        fused element-wise kernel on the card. Other convolutions are the extern kernel,
        which runs on the CPU inside the step."""
        args = (x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
        if not (_on_spyre(x, weight) and _depthwise_1d(*args)):
            return _original[aten.convolution.default](*args)
        k, p = int(weight.get_size()[-1]), int(padding[0])
        if p:
            x = L.lowerings[aten.constant_pad_nd.default](x, [p, p], 0.0)
        length = x.get_size()[-1] - (k - 1)
        out = None
        for i in range(k):
            term = L.lowerings[aten.mul.Tensor](L.lowerings[aten.slice.Tensor](x, 2, i, i + length),
                                                L.lowerings[aten.select.int](weight, 2, i))  # (C, 1)
            out = term if out is None else L.lowerings[aten.add.Tensor](out, term)
        if bias is not None:
            out = L.lowerings[aten.add.Tensor](out, L.lowerings[aten.unsqueeze.default](bias, -1))
        return out

    roll_elsewhere = L.fallback_handler(aten.roll.default, add_to_fallback_set=False)

    @L.register_lowering(aten.roll.default, type_promotion_kind=None)
    def roll(x, shifts, dims=()):
        """Two slices put back together (affine loads). Inductor's decomposition indexes
        modulo the size, which the card's DMA cannot follow (see decompositions())."""
        sizes = x.get_size()
        if not _on_spyre(x) or not dims or not all(_static(sizes[d]) for d in dims):
            return roll_elsewhere(x, shifts, dims)
        for shift, dim in zip(shifts, dims, strict=True):
            n = int(sizes[dim])
            s = shift % n if n else 0
            if s:
                parts = [L.lowerings[aten.slice.Tensor](x, dim, n - s, n), L.lowerings[aten.slice.Tensor](x, dim, 0, n - s)]
                x = L.lowerings[aten.cat.default](parts, dim)
        return x

    attention.install()
    _install_card_check()  # last: it wraps the lowerings above too


# Ops whose kernels the card cannot express: an element-wise gather or an accumulating
# scatter needs an address per element; they run on the CPU inside the compiled step.
_ON_CPU = ("gather", "scatter", "scatter_add", "scatter_reduce", "index_add", "index_reduce")


def _install_cpu_ops() -> None:
    for name in _ON_CPU:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if op not in L.lowerings:
                continue
            original = L.lowerings[op]
            handler = L.fallback_handler(op, add_to_fallback_set=False)

            def lowering(*args, _original=original, _handler=handler, **kwargs):
                if _on_spyre(*args, *kwargs.values()):
                    return _handler(*args, **kwargs)
                return _original(*args, **kwargs)

            L.lowerings[op] = lowering
    for op in (aten.index_put.default, aten.index_put_.default):
        original = L.lowerings[op]
        handler = L.fallback_handler(op, add_to_fallback_set=False)

        def index_put(x, indices, values, accumulate=False, _original=original, _handler=handler):
            if accumulate and _on_spyre(x, values):
                return _handler(x, indices, values, accumulate)
            return _original(x, indices, values, accumulate)

        L.lowerings[op] = index_put


def decompositions() -> dict:
    """Inductor's decomposition table, plus ours (compile_fx takes the whole table)."""
    table = dict(select_decomp_table())
    table.pop(aten.roll.default, None)  # lowered as two slices (see install)
    # baddbmm = beta * input + alpha * bmm: the bmm becomes a matmul kernel, the rest fuses
    table.update(get_decompositions([aten.baddbmm.default]))
    table.update(grouped_decompositions())  # experts: every expert's product, then a select
    table.update(ranking_decompositions())  # sorts, top-k, histograms, cumsums of short rows
    return table


def decomposition_table() -> dict:
    """Module-level and picklable by name: Inductor's FX graph cache keys on it."""
    return decompositions()

