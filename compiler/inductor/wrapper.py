"""Inductor wrapper codegen for the card: a step description instead of Python launches.

Inductor's scheduler hands each fused group to :class:`~.scheduling.SpyreScheduling`
(recorded as a kernel description) and each extern kernel to this wrapper; the wrapper's
lines are data (kernel calls, extern kernels, CPU fallbacks, device copies, allocations
and views), and after Inductor's own passes over them they are read, in order, into a
:class:`~spyre_rt.ir.StepDesc`. Nothing is rendered: the generated module only embeds
that description as JSON and runs it, so Inductor's FX graph cache can reload it with
none of our hooks running. A line kind the step does not know is a compile error.

With dynamic shapes, sizes in the description are expressions of size symbols and the
fused groups stay recorded (:mod:`spyre_rt.compiler.specialize` makes a concrete step per
distinct size at its first call).
"""

from __future__ import annotations

import dataclasses
import re

import sympy
import torch
from torch._dynamo.utils import dynamo_timed
from torch._inductor import ir
from torch._inductor.codegen import wrapper as W
from torch._inductor.utils import LineContext, ValueWithLineMap
from torch._inductor.virtualized import V

from spyre_rt import dtypes
from spyre_rt.ir import TORCH_CONSTANT_NAMES, Buffer, CpuOp, StepDesc, to_json

from ..describe import NotSupported, RecordedKernel, Sym, copy_kernel, text
from ..errors import compile_error, source_of
from ..fusion import fuse_kernels
from ..prebuild import prebuild
from ..regions import Inlined, inline
from . import STATIC_INPUTS, collectives
from .record import (
    buffer_info,
    computing_origins,
    dtype_name,
    fx_origins,
    indexing_origins,
    module_of,
    on_cpu,
    stored_buffer,
    stored_view,
    view_of,
)


@dataclasses.dataclass
class DeviceCopyLine(W.WrapperLine):
    """A copy of a buffer into another inside the step (Inductor's DeviceCopy: a CPU input
    used on the card). The step runs it as a copy kernel on the card: by then every input
    is on the card."""

    src: str
    dst: str

    def codegen(self, code) -> None:
        code.writeline(f"{self.dst}.copy_({self.src})")


def _rerooted(kernel, root: str, module: str):
    """`kernel` of a region first called from module `root`, as the call from `module`
    runs it: a path under `root` moved under `module` (``model.layers.0.mlp.up_proj`` in the
    call from ``model.layers.7``: ``model.layers.7.mlp.up_proj``)."""
    path = getattr(kernel, "module", "")
    if not (root and module and root != module and path) or not (path == root or path.startswith(root + ".")):
        return kernel
    return dataclasses.replace(kernel, module=module + path[len(root):])


@dataclasses.dataclass
class RegionCallLine(W.WrapperLine):
    """A call of a compile region (``invoke_subgraph``): the region's step, described once,
    and the caller's views it is called with. The step inlines a copy of its kernels."""

    name: str
    step: StepDesc
    operands: tuple
    module: str = ""  # the module path the call is made from (the layer it computes)

    def codegen(self, code) -> None:
        code.writeline(f"{self.name} = <compile region of {len(self.step.kernels)} kernels>")


# Lines of extern nodes: a kernel of the card (a node with ``spyre_kernel``) or an op the
# step runs on the CPU. Inductor writes one of these for every extern node it makes.
_EXTERN_LINES = (W.ExternKernelOutLine, W.ExternKernelAllocLine, W.ExternKernelMultiOutLine,
                 W.ScatterFallbackLine, W.IndexPutFallbackLine)
TORCH_CONSTANTS = frozenset(TORCH_CONSTANT_NAMES)

# Wrapper lines that only render the reference Python or free what the plan never allocates.
_NO_WORK = (W.CommentLine, LineContext, W.KernelDefinitionLine, W.FreeLine, W.FreeIfNotReusedLine, W.NullLine,
            W.EnterDeviceContextManagerLine, W.ExitDeviceContextManagerLine, W.AssertSizeStrideLine)


class SpyreWrapperCodegen(W.PythonWrapperCodegen):
    @staticmethod
    def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
        # the base class's create() returns a PythonWrapperCodegen, whatever the subclass;
        # a subgraph's wrapper is a compile region's (control flow has no lowering here)
        return SpyreWrapperCodegen(region=is_subgraph)

    def __init__(self, region: bool = False):
        super().__init__()
        self.region = region
        self.region_step: StepDesc | None = None  # a region's step, once generated
        self._regions: dict[str, tuple] = {}  # region graph -> (its step, its wrapper, its first call's module)
        self._region_writes: set[str] = set()  # the caller's buffers region calls write
        self._inlined_kernels: set[str] = set()  # kernels of region calls of fixed sizes
        self.spyre_kernels: dict = {}
        # (extern node, index path of a result) -> the view of the argument it returns
        self._returned_args: dict[tuple[str, tuple], tuple] = {}
        # per kernel: the FX nodes it computes (what the backend runs on the CPU when its
        # construction is refused) and the op and model line it came from
        self.kernel_nodes: dict[str, set[str]] = {}
        self.kernel_indexing: dict[str, set[str]] = {}  # of those, the ops that index by a tensor
        self.kernel_sources: dict[str, str] = {}

    def new_kernel_name(self) -> str:
        return f"k{len(self.spyre_kernels)}"

    def define_spyre_kernel(self, kernel, nodes=()) -> None:
        self.spyre_kernels[kernel.name] = kernel
        self._remember(kernel.name, nodes)
        self.define_kernel(kernel.name, "None  # a spyre kernel description", gpu=False)

    def _remember(self, name: str, nodes) -> None:
        self.kernel_nodes[name] = computing_origins(nodes)
        self.kernel_indexing[name] = indexing_origins(nodes)
        self.kernel_sources[name] = source_of(nodes) if nodes else ""

    def codegen_invoke_subgraph(self, invoke_subgraph) -> None:
        """A call of a compile region: its step described at its first call, then reused."""
        from torch._dynamo.utils import counters

        sub = invoke_subgraph.subgraph
        module = module_of(fx_origins([invoke_subgraph]))
        found = self._regions.get(sub.graph.name)
        if found is None:
            with V.set_graph_handler(sub.graph):
                sub.graph.codegen()
            found = self._regions[sub.graph.name] = (sub.graph.wrapper_code.region_step, sub.graph.wrapper_code,
                                                     module)
            counters["spyre_rt"]["regions_compiled"] += 1
        counters["spyre_rt"]["region_calls"] += 1
        operands = tuple(("int", text(x.expr)) if isinstance(x, ir.ShapeAsConstantBuffer) else view_of(x)
                         for x in invoke_subgraph.inputs)
        self.writeline(RegionCallLine(invoke_subgraph.get_name(), found[0], operands, module))

    def _inline_region(self, line: RegionCallLine, placed: dict) -> Inlined:
        region = inline(line.step, line.name, [v if v[0] == "int" else stored_view(_placed_view(v, placed))
                                               for v in line.operands])
        wrapper, root = self._regions_by_step(line.step)
        for k, new in region.kernel_names.items():
            # the region's kernels were described at its first call: name each call's own layer
            self.spyre_kernels[new] = region.kernels[new] = _rerooted(region.kernels[new], root, line.module)
            if not line.step.symbols:  # a region of dynamic sizes is specialized with its caller
                self._inlined_kernels.add(new)
            self.kernel_nodes[new] = wrapper.kernel_nodes.get(k, set())
            self.kernel_indexing[new] = wrapper.kernel_indexing.get(k, set())
            self.kernel_sources[new] = region.sources.get(new, "")
        for i, out in enumerate(region.outputs):
            if isinstance(out, tuple):  # the MultiOutput lines read the call's results
                self._returned_args[(line.name, (i,))] = out
        self._region_writes |= region.mutated
        return region

    def _regions_by_step(self, step):
        return next((w, root) for s, w, root in self._regions.values() if s is step)

    def codegen_device_copy(self, src, dst, non_blocking) -> None:
        self.writeline(DeviceCopyLine(str(src), str(dst)))

    def _generate_kernel_call_helper(self, kernel_name, call_args, **kwargs):
        # kernel calls are read from the lines as data; nothing is rendered
        self.writeline(self.wrap_kernel_call(kernel_name, call_args))

    # -- extern kernels -----------------------------------------------------------------

    def _card_kernel(self, node):
        """The description of an extern node the card runs itself (a node class of the
        lowering that knows its description: see ``spyre_kernel``)."""
        kernel = node.spyre_kernel(self.new_kernel_name())
        self.spyre_kernels[kernel.name] = kernel
        self._remember(kernel.name, [node])
        return kernel

    def _device_copy(self, line: DeviceCopyLine):
        for name in (line.src, line.dst):
            if V.graph.get_buffer(name) is None and name not in V.graph.graph_inputs:
                raise compile_error(f"a device copy of {name} (only whole buffers are copied)", [])
        src, dst = buffer_info(line.src), buffer_info(line.dst)
        if any(not isinstance(s, int) for s in src.sizes + src.strides + dst.sizes + dst.strides):
            raise compile_error(f"a device copy of {line.src} with dynamic sizes", [])
        kernel = copy_kernel(self.new_kernel_name(), src, dst)
        self.spyre_kernels[kernel.name] = kernel
        return kernel

    def _cpu_op(self, node) -> CpuOp:
        """An extern node the card does not run, as an op the step runs on the CPU: called
        as Inductor's own wrapper would call it, with every argument its schema marks as
        written copied back to the card (see :mod:`spyre_rt.executor.cpu_ops`)."""
        from .. import options

        op = getattr(node, "op_overload", None)
        kernel = getattr(node, "python_kernel_name", None) or type(node).__name__
        if not isinstance(op, torch._ops.OpOverload):
            raise compile_error(f"extern kernel {kernel} names no torch op to run it with on the CPU", [node])
        host = on_cpu(node)
        if not options.cpu_fallback and not host:
            raise compile_error(f"{op} has no kernel on the card and CPU fallback is off", [node])
        args, kwargs = _call_args(node)
        schema = op._schema
        written: dict[int, bool] = {}  # id of a written _Ref -> whether it is an out= argument
        try:
            bound = list(torch._library.utils.zip_schema(schema, args, kwargs))
        except AssertionError as e:
            raise compile_error(f"extern kernel {kernel}: its arguments do not fit {schema} ({e})", [node]) from None
        for info, arg in bound:
            if info.alias_info is not None and info.alias_info.is_write:
                for ref in _refs_in(arg):
                    written[id(ref)] = written.get(id(ref), True) and info.is_out
        self._note_returned_args(node, schema, bound)

        def enc(a):
            if isinstance(a, ir.IRNode):
                a = _Ref(a)
            if isinstance(a, _Ref):
                return _tensor_arg(a, written, node)
            if isinstance(a, (list, tuple)):
                return [enc(x) for x in a]
            if isinstance(a, torch.dtype):
                return {"dtype": dtype_name(a)}
            if isinstance(a, torch.device):
                return {"device": a.type}
            if isinstance(a, (torch.layout, torch.memory_format)):  # torch.strided, torch.contiguous_format
                name = str(a).removeprefix("torch.")
                if name not in TORCH_CONSTANTS:
                    raise compile_error(f"CPU op argument {a} (the step names {', '.join(TORCH_CONSTANTS)})", [node])
                return {"torch": name}
            if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                a = a.node.expr
            if isinstance(a, sympy.Basic):
                return _scalar(a, node)
            if isinstance(a, (int, float, bool, str)) or a is None:
                return a
            raise compile_error(f"CPU op argument {a!r} of type {type(a).__name__}", [node])

        outputs = []
        if isinstance(node.layout, ir.Layout) and not isinstance(node, ir.ExternKernelOut):
            outputs = [stored_buffer(buffer_info(node.get_name()))]  # the op's result is this buffer
        cpu_op = CpuOp(name=node.get_name(), op=str(op), args=tuple(enc(list(args))),
                       kwargs={k: enc(v) for k, v in kwargs.items()}, outputs=tuple(outputs), mutated=(),
                       source=source_of([node]), host=host)
        written_bufs = sorted({ref["buf"][0] for ref in cpu_op.tensor_args() if ref.get("write")})
        return dataclasses.replace(cpu_op, mutated=tuple(written_bufs))

    def _note_returned_args(self, node, schema, bound) -> None:
        """Results that are an argument the op wrote (``index_add_`` returns ``self``, an
        ``out=`` variant its ``out``): their buffers are that argument's view, not copies."""
        returns = schema.returns
        for i, r in enumerate(returns):
            if r.alias_info is None or not r.alias_info.is_write:
                continue
            for info, arg in bound:
                same = info.alias_info is not None and info.alias_info.is_write \
                    and set(info.alias_info.after_set) & set(r.alias_info.after_set)
                if same and isinstance(arg, _Ref):
                    self._returned_args[(node.get_name(), () if len(returns) == 1 else (i,))] = view_of(arg.node)
                    break

    def _index_put_fallback(self, line) -> CpuOp:
        """Inductor's index_put fallback (boolean indices, say): ``x.index_put_`` on the CPU,
        writing x back."""
        from .. import options

        node = line.node
        if not options.cpu_fallback:
            raise compile_error("index_put with these indices has no kernel on the card and CPU fallback is off",
                                [node])
        x, values = node.inputs[:2]

        def ref(t, write=False):
            arg = {"buf": stored_view(view_of(t)), "as": dtype_name(t.get_dtype())}
            return {**arg, "write": True} if write else arg

        return CpuOp(name=node.get_name(), op="aten.index_put_.default",
                     args=(ref(x, write=True), [None if i is None else ref(i) for i in line.indices], ref(values),
                           *node.constant_args),
                     kwargs={}, outputs=(), mutated=(x.get_name(),), source=source_of([node]), host=on_cpu(node))

    # -- the step -----------------------------------------------------------------------

    def build_step(self) -> StepDesc:
        g = V.graph
        seq: list = []
        buffers: dict[str, Buffer] = {}
        aliases: dict[str, tuple] = {}
        read_back: list = []  # values read back from the card (.item()): DynamicScalar nodes
        placed: dict[str, tuple] = {}  # an aliased buffer: (the buffer it finally lives in, offset)
        for line in self.lines:
            if isinstance(line, W.KernelCallLine):
                seq.append(("run", line.kernel_name))
            elif isinstance(line, _EXTERN_LINES):
                node = line.node
                if hasattr(node, "spyre_kernel"):  # the card runs it
                    seq.append(("run", self._card_kernel(node).name))
                    continue
                if collectives.is_wait(node):  # the plan's collectives complete in order
                    continue
                described = collectives.describe(node, self.new_kernel_name())
                if described is not None:  # a job of the plan between the cards
                    kernel, made = described
                    self.spyre_kernels[kernel.name] = kernel
                    self._remember(kernel.name, [node])
                    buffers.update((b.name, b) for b in made)
                    seq.append(("run", kernel.name))
                    continue
                op = self._cpu_op(node)
                seq.append(("cpu", op))
                for o in op.outputs:
                    buffers[o.name] = o
            elif isinstance(line, W.IndexPutFallbackLine):
                seq.append(("cpu", self._index_put_fallback(line)))
            elif isinstance(line, W.MultiOutputLine):
                index = tuple(i for _, i in line.indices)
                written = self._returned_args.get((line.arg_name, index))
                if written is not None:  # the op returned an argument it wrote: that view
                    name, off, sizes, strides = written
                    if name in placed:
                        name, outer = placed[name]
                        off = outer + off
                    placed[line.result_name] = (name, off)
                    aliases[line.result_name] = stored_view((name, off, sizes, strides))
                    continue
                out = stored_buffer(buffer_info(line.result_name))
                buffers[out.name] = out
                seq.append(("pick", (line.arg_name, index, out.name)))
            elif isinstance(line, DeviceCopyLine):
                seq.append(("run", self._device_copy(line).name))
            elif isinstance(line, RegionCallLine):
                region = self._inline_region(line, placed)
                seq.extend(region.sequence)
                buffers.update(region.buffers)
                aliases.update(region.aliases)
            elif isinstance(line, W.AllocateLine):
                b = stored_buffer(buffer_info(line.node.get_name()))
                buffers[b.name] = b
            elif isinstance(line, W.ReuseLine):
                b = stored_buffer(buffer_info(line.reused_as.get_name()))
                buffers[b.name] = b
            elif isinstance(line, W.ReinterpretLine):
                # The buffer lives in a view of another (a cat's input computed in place in its
                # slice of the result). The view's offset is relative to the buffer it views,
                # which may itself live in a view (a cat inside a cat): Inductor adds the two
                # at run time, here they are added once.
                name, off, sizes, strides = view_of(line.layout.view)
                if name in placed:
                    name, outer = placed[name]
                    off = outer + off
                placed[line.reused_as.get_name()] = (name, off)
                aliases[line.reused_as.get_name()] = stored_view((name, off, sizes, strides))
            elif isinstance(line, W.UnbackedSymbolDefsLine) and not line.unbacked_bindings:
                continue  # written after every extern kernel; this one defines no symbol
            elif isinstance(line, W.DynamicScalarLine):
                read_back.append(line.node)  # checked below: nothing may depend on it
            elif not isinstance(line, _NO_WORK):
                # A line kind this step description does not know would be work left undone
                # (a device copy once was, and its buffer held garbage): refuse it.
                raise compile_error(f"a wrapper line of kind {type(line).__name__} ({str(line)[:120]})", [])
        inputs, symbols = self._inputs()
        for b in [*buffers.values(), *(b for b, _ in inputs)]:
            if b.dtype not in dtypes.BY_NAME:
                raise compile_error(f"{b.name} holds {b.dtype}, which spyre tensors cannot hold "
                                    f"(they hold {', '.join(dtypes.BY_NAME)})", _origin_of(b.name))
        step = StepDesc(
            inputs=tuple(inputs), outputs=tuple(self._outputs()), buffers=buffers, aliases=aliases,
            constants={name: Buffer(name, dtype_name(t.dtype), tuple(t.shape), tuple(t.stride()), 0)
                       for name, t in g.constants.items()},
            kernels=dict(self.spyre_kernels), sequence=tuple(seq), options=self._options(),
            static_inputs=tuple(g.module.meta.get(STATIC_INPUTS, ())), symbols=tuple(symbols),
            host_outputs=self._host_outputs(),
            sources={k: v for k, v in self.kernel_sources.items() if v and k in self.spyre_kernels},
        )
        _check_unused(read_back, step)
        if not self._symbolic(step):  # a symbolic step's are fused once its sizes are known
            step = fuse_kernels(step)
        return step

    def _symbolic(self, step: StepDesc) -> bool:
        """Whether sizes in `step` are expressions of size symbols, or the step is called with
        a size among its tensors (a graph input Dynamo made a symbol of, which no kernel of
        this step may read: the call must still take it out). The walk skips the kernels
        inlined from regions of fixed sizes."""
        if any(kind == "int" for _, kind, _, _ in step.symbols):
            return True
        inlined = self._inlined_kernels
        return _is_symbolic(dataclasses.replace(
            step, kernels={k: v for k, v in step.kernels.items() if k not in inlined}))

    def _inputs(self) -> tuple[list, list]:
        """The tensor inputs (and whether the step mutates them), and where each size symbol
        comes from at a call: an int argument, or a size or stride of a tensor argument."""
        g = V.graph
        inputs, symbols, bound = [], [], set()
        position = -1
        for name in g.graph_input_names:
            inp = g.graph_inputs[name]
            if isinstance(inp, ir.TorchBindObject):  # an opaque object (a device mesh): dropped by call()
                continue
            position += 1
            if isinstance(inp, sympy.Basic):
                if not isinstance(inp, sympy.Symbol):
                    raise compile_error(f"graph input {name} is a size expression ({inp})", [])
                symbols.append((inp.name, "int", position, 0))
                bound.add(inp.name)
                continue
            if not hasattr(inp, "get_layout"):
                raise compile_error(f"graph input {name} of kind {type(inp).__name__}", [])
            b = buffer_info(name)
            for kind, values in (("size", b.sizes), ("stride", b.strides)):
                for dim, v in enumerate(values):
                    if isinstance(v, sympy.Symbol) and v.name not in bound:
                        symbols.append((v.name, kind, position, dim))
                        bound.add(v.name)
            inputs.append((stored_buffer(b), name in g.mutated_inputs or name in self._region_writes))
        return inputs, symbols

    def _outputs(self) -> list:
        outputs = []
        for out in V.graph.graph_outputs:
            while isinstance(out, (ir.TensorBox, ir.StorageBox)) and isinstance(out.data, ir.IRNode):
                if isinstance(out.data, ir.ReinterpretView) or isinstance(out, ir.TensorBox):
                    out = out.data
                else:
                    break
            if isinstance(out, ir.ShapeAsConstantBuffer):  # a size the graph returns
                outputs.append({"int": text(out.expr)})
                continue
            if isinstance(out, ir.NoneAsConstantBuffer):  # no gradient for an input, say
                outputs.append({"none": True})
                continue
            if not hasattr(out, "get_name"):
                raise compile_error(f"a graph output of kind {type(out).__name__}", [])
            outputs.append(stored_view(view_of(out)))
        return outputs

    def _host_outputs(self) -> tuple[int, ...]:
        """The outputs on the CPU device (work on CPU tensors the graph was given): the step
        computes them like the rest and returns them as CPU tensors, as eager does."""
        def device(out):
            try:
                return out.get_device()
            except Exception:
                return None

        return tuple(i for i, out in enumerate(V.graph.graph_outputs)
                     if getattr(device(out), "type", None) == "cpu")

    def _options(self) -> dict:
        from .. import options
        from ..version import compiler_version

        return {"dispatch": options.dispatch, "cpu_fallback": options.cpu_fallback,
                "compute_dtype": options.compute_dtype, "fuse_epilogues": options.fuse_epilogues,
                "slice_epilogues": options.slice_epilogues,
                "fuse_prologues": options.fuse_prologues, "group_matmuls": options.group_matmuls,
                "bound_causal_masks": options.bound_causal_masks,
                "compiler_version": compiler_version()}

    def _generate(self, is_inference):
        self.run_wrapper_ir_passes(is_inference)  # Inductor's own passes (memory planning)
        with dynamo_timed("spyre.describe"):
            step = self.build_step()
        if self.region:  # the calling step inlines it (see codegen_invoke_subgraph)
            self.region_step = step
            return ValueWithLineMap("", []), ValueWithLineMap("", [])
        symbolic = self._symbolic(step)
        loader = "spyre_rt.compiler.specialize" if symbolic else "spyre_rt.executor"
        text = to_json(step)
        from .. import options

        settings = dict(options.step_settings)  # what the step's calls read: its plan cache, its tracing
        # every kernel constructed now: what construction refuses is a compile-time event
        with dynamo_timed("spyre.plan_build"):
            prebuild(step, text, settings, self.kernel_nodes, symbolic, self.kernel_indexing)
        opaque = _opaque_inputs()
        src = (
            "# spyre_rt: a compiled step (generated; the description is plain data)\n"
            f"from {loader} import load_step\n"
            f"_step = load_step({text!r}, {settings!r})\n"
            "def call(args):\n"
            + (f"    args[:] = [a for i, a in enumerate(args) if i not in {opaque!r}]  # opaque objects\n"
               if opaque else "")
            + "    # constants are attached to this module after it is loaded\n"
            "    return _step(args, globals())\n"
        )
        return ValueWithLineMap(src, []), ValueWithLineMap("", [])


def _opaque_inputs() -> frozenset[int]:
    """Positions of the graph's inputs that are opaque objects (the device mesh DTensor
    parameters carry): the step reads none of them."""
    g = V.graph
    return frozenset(i for i, name in enumerate(g.graph_input_names) if isinstance(g.graph_inputs[name],
                                                                                 ir.TorchBindObject))


def _placed_view(view: tuple, placed: dict) -> tuple:
    """A view of a buffer that lives in a view of another, as a view of that other."""
    name, off, sizes, strides = view
    if name in placed:
        name, outer = placed[name]
        off = outer + off
    return (name, off, sizes, strides)


# ---- an extern node's call, as Inductor's Python wrapper makes it ------------------------


class _Ref:
    """A tensor argument of an extern node's call (an IR node), while the call is put
    together: one object per argument, so written arguments are told apart by identity."""

    def __init__(self, node):
        self.node = node


def _call_args(node) -> tuple[tuple, dict]:
    """The positional and keyword arguments the extern node's op is called with."""
    refs = [_Ref(x) for x in node.inputs]
    if isinstance(node, ir.ScatterFallback):  # scatter_(x, dim, index, src[, reduce=])
        x, index, *src = refs
        names = {a.name for a in node.op_overload._schema.arguments}
        kwargs = {k: v for k, v in node.kwargs.items() if k in names and v is not None}
        return (x, node.constant_args[0], index, src[0] if node.src_is_tensor else node.constant_args[1]), kwargs
    if isinstance(node, ir.IndexPutFallback):  # index_put_(x, indices, values, accumulate)
        x, values, *given = refs
        it = iter(given)
        indices = [next(it) if i is not None else None for i in node.indices]
        return (x, indices, values, node.constant_args[0]), {}
    if hasattr(node, "unflatten_args"):  # a FallbackKernel: the op's own arguments
        args, kwargs = node.unflatten_args(refs, node.constant_args)
        kwargs = {**(node.kwargs or {}), **kwargs}
        if isinstance(node, ir.ExternKernelMultiOut):
            kwargs.update((name, _Ref(out)) for name, out in zip(node.out_arg_names, node.out_variant_output_nodes,
                                                                 strict=True))
        return tuple(args), kwargs
    kwargs = dict(node.kwargs or {})
    if isinstance(node, ir.ExternKernelOut):  # an out= variant writing the node's buffer
        kwargs["out"] = _Ref(node.output_view or node)
    return (*refs, *node.constant_args), kwargs


def _refs_in(arg) -> list[_Ref]:
    if isinstance(arg, _Ref):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [r for a in arg for r in _refs_in(a)]
    return []


def _tensor_arg(ref: _Ref, written: dict[int, bool], node):
    """A tensor argument for the description: the view it is, the dtype it is read as,
    and whether the op writes it (and only writes it: an out= argument)."""
    x = ref.node
    if isinstance(x, ir.NoneAsConstantBuffer):
        return None
    if isinstance(x, ir.ShapeAsConstantBuffer):
        return _scalar(x.expr, node)
    try:
        arg = {"buf": stored_view(view_of(x)), "as": dtype_name(x.get_dtype())}
    except NotSupported as e:
        raise compile_error(f"CPU op argument {type(x).__name__} ({e})", [node]) from None
    if id(ref) in written:
        arg["write"] = True
        if written[id(ref)]:
            arg["out"] = True
    return arg


def _scalar(x: sympy.Basic, node):
    """A scalar argument that sympy holds (a SymInt's expression, say): an int, float or
    bool when it is known, else size-symbol text evaluated when the step's sizes are."""
    if isinstance(x, (sympy.logic.boolalg.BooleanTrue, sympy.logic.boolalg.BooleanFalse)):
        return bool(x)
    if not x.free_symbols:
        return int(x) if x.is_integer else float(x)
    if x.is_integer:
        return text(x)
    raise compile_error(f"CPU op argument {x}: only integer sizes may depend on size symbols", [node])


def _origin_of(name: str) -> list:
    """The IR node of a buffer (for an error that names the op it came from)."""
    node = V.graph.get_buffer(name)
    return [node] if node is not None else []


def _check_unused(read_back: list, step: StepDesc) -> None:
    """A value read back from the card (``u0 = x.item()``) that no size, kernel or output
    of the step depends on is not read at all: a step's sizes are fixed when its plan is
    built. (OPT reads its cache's length so, for a mask its positions then do not use.)"""
    used = [node for node in read_back if _mentions(step, node.sym.name)]
    if used:
        names = ", ".join(node.sym.name for node in used)
        raise compile_error(f"sizes that depend on a value read back from the card ({names} = tensor.item())", used)


def _mentions(x, name: str) -> bool:
    if isinstance(x, Sym):
        return name in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", x.text)
    if isinstance(x, sympy.Basic):
        return any(s.name == name for s in x.free_symbols)
    if isinstance(x, (list, tuple)):
        return any(_mentions(v, name) for v in x)
    if isinstance(x, dict):
        return any(_mentions(v, name) for v in x.values())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return any(_mentions(getattr(x, f.name), name) for f in dataclasses.fields(x))
    return False


def _is_symbolic(x) -> bool:
    if isinstance(x, (Sym, RecordedKernel)):
        return True
    if isinstance(x, (list, tuple)):
        return any(_is_symbolic(v) for v in x)
    if isinstance(x, dict):
        return any(_is_symbolic(v) for v in x.values())
    if dataclasses.is_dataclass(x):
        return any(_is_symbolic(getattr(x, f.name)) for f in dataclasses.fields(x))
    return False
