"""Inductor wrapper codegen for the card: a step description instead of Python launches.

Inductor's memory planning runs as usual; afterwards the planned wrapper lines are read as
data and turned into a :class:`~spyre_rt.kernels.StepDesc` (inputs, outputs,
intermediate buffers, kernels and the ordered sequence of kernel runs and CPU ops). The
generated module embeds that description as JSON and its ``call`` runs it with the
spyre runtime, so Inductor's FX graph cache can reload it with none of our hooks running.
"""

from __future__ import annotations

import dataclasses

import sympy
import torch
from torch._inductor import ir
from torch._inductor.codegen import wrapper as W
from torch._inductor.utils import LineContext, ValueWithLineMap
from torch._inductor.virtualized import V

from spyre_rt.kernels import Buffer, CpuOp, LoopKernel, MatmulKernel, StepDesc, to_json

from ..describe import buffer_info, copy_kernel, dtype_name
from ..errors import compile_error, source_of
from .lowering import SpyreMatmul


def _view(x) -> tuple[str, int, tuple[int, ...], tuple[int, ...]]:
    """(underlying buffer, offset, sizes, strides) of an extern kernel's input."""
    if isinstance(x, ir.ReinterpretView):
        layout = x.layout
        return (x.data.get_name(), int(layout.offset), tuple(int(s) for s in layout.size),
                tuple(int(s) for s in layout.stride))
    b = buffer_info(x.get_name())
    return (b.name, b.offset, b.sizes, b.strides)


def _batched(view, nd: int):
    name, off, sizes, strides = view
    if len(sizes) == nd:
        return (name, off, (1, *sizes), (0, *strides))
    return view


@dataclasses.dataclass
class DeviceCopyLine(W.WrapperLine):
    """A copy of a buffer into another inside the step (Inductor's DeviceCopy: a CPU input
    used on the card). The step runs it as a copy kernel on the card: by then every input
    is on the card."""

    src: str
    dst: str

    def codegen(self, code) -> None:
        code.writeline(f"{self.dst}.copy_({self.src})")


# Wrapper lines that only render the reference Python or free what the plan never allocates.
_NO_WORK = (W.CommentLine, LineContext, W.KernelDefinitionLine, W.FreeLine, W.FreeIfNotReusedLine, W.NullLine,
            W.EnterDeviceContextManagerLine, W.ExitDeviceContextManagerLine, W.AssertSizeStrideLine)


class SpyreWrapperCodegen(W.PythonWrapperCodegen):
    @staticmethod
    def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
        # the base class's create() returns a PythonWrapperCodegen, whatever the subclass
        if is_subgraph:
            raise compile_error("subgraphs (control flow) are not supported on spyre", [])
        return SpyreWrapperCodegen()

    def __init__(self):
        super().__init__()
        self.spyre_kernels: dict = {}

    def define_spyre_kernel(self, kernel) -> None:
        self.spyre_kernels[kernel.name] = kernel
        self.define_kernel(kernel.name, "None  # a spyre kernel description", gpu=False)

    def codegen_device_copy(self, src, dst, non_blocking) -> None:
        self.writeline(DeviceCopyLine(str(src), str(dst)))

    def _device_copy(self, line: DeviceCopyLine) -> LoopKernel:
        for name in (line.src, line.dst):
            if V.graph.get_buffer(name) is None and name not in V.graph.graph_inputs:
                raise compile_error(f"a device copy of {name} (only whole buffers are copied)", [])
        kernel = copy_kernel(f"k{len(self.spyre_kernels)}", buffer_info(line.src), buffer_info(line.dst))
        self.spyre_kernels[kernel.name] = kernel
        return kernel

    def _generate_kernel_call_helper(self, kernel_name, call_args, **kwargs):
        # only renders the reference Python, which is never run
        self.writeline(self.wrap_kernel_call(kernel_name, call_args))

    # -- the step -----------------------------------------------------------------------

    def _matmul(self, node: SpyreMatmul) -> MatmulKernel:
        a, b = _view(node.inputs[0]), _view(node.inputs[1])
        out = buffer_info(node.get_name())
        nd = len(out.sizes)
        bias = _batched(_view(node.inputs[2]), 2) if len(node.inputs) > 2 else None
        if bias is not None:
            name, off, sizes, strides = bias
            # (1, n) bias over (batch, m, n): broadcast over batch and rows
            bias = (name, off, (1, 1, sizes[-1]), (0, 0, strides[-1]))
        bufs = {}
        for v in (a, b, bias):
            if v is not None:
                bufs[v[0]] = buffer_info(v[0])
        bufs[out.name] = out
        name = f"k{len(self.spyre_kernels)}"
        k = MatmulKernel(
            name=name, a=_batched(a, 2) if nd == 2 else a, b=_batched(b, 2) if nd == 2 else b,
            out=_batched((out.name, out.offset, out.sizes, out.strides), 2) if nd == 2 else
            (out.name, out.offset, out.sizes, out.strides),
            in_dtype=dtype_name(node.inputs[0].get_dtype()), out_dtype=out.dtype,
            bias=bias, bias_dtype=dtype_name(node.inputs[2].get_dtype()) if bias else "",
            buffers=tuple(bufs.values()), origins=tuple(sorted(str(o.target) for o in node.origins
                                                               if o.op == "call_function")),
        )
        self.spyre_kernels[name] = k
        return k

    def _fallback(self, node) -> CpuOp:
        from .. import options

        op = getattr(node, "op_overload", None)
        if op is None or not isinstance(node, ir.FallbackKernel):
            raise compile_error(f"extern kernel {getattr(node, 'python_kernel_name', node)}", [node])
        if not options.cpu_fallback:
            raise compile_error(f"{op} has no kernel on the card and CPU fallback is off", [node])

        class Ref:
            def __init__(self, x):
                self.x = x

        args, kwargs = node.unflatten_args([Ref(x) for x in node.inputs], node.constant_args)

        def enc(a):
            if isinstance(a, Ref):
                return {"buf": _view(a.x)}
            if isinstance(a, (list, tuple)):
                return [enc(x) for x in a]
            if isinstance(a, torch.dtype):
                return {"dtype": dtype_name(a)}
            if isinstance(a, torch.device):
                return {"device": a.type}
            if isinstance(a, sympy.Basic):
                return int(a)
            if isinstance(a, (int, float, bool, str)) or a is None:
                return a
            raise compile_error(f"CPU fallback argument {a!r}", [node])

        outputs = []
        if not isinstance(node.layout, ir.MultiOutputLayout):
            outputs = [buffer_info(node.get_name())]
        return CpuOp(
            name=node.get_name(), op=str(op), args=tuple(enc(list(args))),
            kwargs={k: enc(v) for k, v in {**kwargs, **(node.kwargs or {})}.items()},
            outputs=tuple(outputs), mutated=tuple(node.mutation_names), source=source_of([node]),
        )

    def build_step(self) -> StepDesc:
        g = V.graph
        seq: list = []
        buffers: dict[str, Buffer] = {}
        aliases: dict[str, tuple] = {}
        multi: dict[str, list] = {}
        for line in self.lines:
            if isinstance(line, W.KernelCallLine):
                seq.append(("run", line.kernel_name))
            elif isinstance(line, W.ExternKernelOutLine):
                node = line.node
                if not isinstance(node, SpyreMatmul):
                    raise compile_error(f"extern kernel {node.python_kernel_name}", [node])
                seq.append(("run", self._matmul(node).name))
            elif isinstance(line, W.ExternKernelAllocLine):
                op = self._fallback(line.node)
                seq.append(("cpu", op))
                for o in op.outputs:
                    buffers[o.name] = o
                if isinstance(line.node.layout, ir.MultiOutputLayout):
                    multi[line.node.get_name()] = []
            elif isinstance(line, W.MultiOutputLine):
                out = buffer_info(line.result_name)
                buffers[out.name] = out
                index = [i for _, i in line.indices]
                seq.append(("pick", (line.arg_name, tuple(index), out.name)))
            elif isinstance(line, W.AllocateLine):
                b = buffer_info(line.node.get_name())
                buffers[b.name] = b
            elif isinstance(line, W.ReuseLine):
                b = buffer_info(line.reused_as.get_name())
                buffers[b.name] = b
            elif isinstance(line, W.ReinterpretLine):
                lay = line.layout
                aliases[line.reused_as.get_name()] = (line.node.get_name(), int(lay.offset),
                                                      tuple(int(s) for s in lay.size),
                                                      tuple(int(s) for s in lay.stride))
            elif isinstance(line, DeviceCopyLine):
                seq.append(("run", self._device_copy(line).name))
            elif isinstance(line, (W.IndexPutFallbackLine, W.ScatterFallbackLine)):
                raise compile_error("an index_put/scatter fallback", [line.node])
            elif isinstance(line, W.UnbackedSymbolDefsLine) and not line.unbacked_bindings:
                continue  # written after every extern kernel; this one defines no symbol
            elif not isinstance(line, _NO_WORK):
                # A line kind this step description does not know would be work left undone
                # (a device copy once was, and its buffer held garbage): refuse it.
                raise compile_error(f"a wrapper line of kind {type(line).__name__} ({str(line)[:120]})", [])
        inputs = []
        for name in g.graph_input_names:
            inp = g.graph_inputs[name]
            if isinstance(inp, sympy.Basic) or not hasattr(inp, "get_layout"):
                raise compile_error(f"graph input {name} is a symbolic size; compile with dynamic=False", [])
            b = buffer_info(name)
            inputs.append((b, name in g.mutated_inputs))
        outputs = []
        for out in g.graph_outputs:
            while isinstance(out, (ir.TensorBox, ir.StorageBox)) and isinstance(out.data, ir.IRNode):
                if isinstance(out.data, ir.ReinterpretView) or isinstance(out, ir.TensorBox):
                    out = out.data
                else:
                    break
            if isinstance(out, ir.ReinterpretView):
                outputs.append(_view(out))
            elif isinstance(out, (ir.ShapeAsConstantBuffer,)) or not hasattr(out, "get_name"):
                raise compile_error("graph outputs that are sizes or Python values", [])
            else:
                b = buffer_info(out.get_name())
                outputs.append((b.name, b.offset, b.sizes, b.strides))
        constants = {}
        for name, t in g.constants.items():
            constants[name] = Buffer(name, dtype_name(t.dtype), tuple(t.shape), tuple(t.stride()), 0)
        from .. import backend, options
        from ..version import compiler_version

        return StepDesc(
            inputs=tuple(inputs), outputs=tuple(outputs), buffers=buffers, aliases=aliases,
            constants=constants, kernels=dict(self.spyre_kernels), sequence=tuple(seq),
            options={"dispatch": options.dispatch, "cpu_fallback": options.cpu_fallback,
                     "compute_dtype": options.compute_dtype, "compiler_version": compiler_version()},
            static_inputs=backend.static_inputs(),
        )

    def _generate(self, is_inference):
        py, kernel_decls = super()._generate(is_inference)
        step = self.build_step()
        src = (
            "# spyre_rt: a compiled step (generated; the description is plain data)\n"
            "from spyre_rt.executor import load_step\n"
            f"_step = load_step({to_json(step)!r})\n"
            "def call(args):\n"
            "    # constants are attached to this module after it is loaded\n"
            "    return _step(args, globals())\n"
        )
        return ValueWithLineMap(src, []), kernel_decls
