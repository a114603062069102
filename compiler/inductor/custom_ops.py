"""Custom ops in a graph handed to the backend.

The compiler traces a graph with fake tensors (AOT, then Inductor's fallback kernels) to
learn the sizes, strides and dtypes of every op's results; a custom op (``torch.library``)
tells them through its fake implementation. A graph that holds one without it is refused
before tracing starts, naming the op, the model line and what to register, instead of a
traceback from the middle of AOT.
"""

from __future__ import annotations

import torch

from ..errors import compile_error


def check_fake_kernels(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        op = node.target
        if isinstance(op, torch._ops.OpOverloadPacket):  # a graph traced without Dynamo names packets
            op = getattr(op, "default", None)
        if not isinstance(op, torch._ops.OpOverload) or torch._library.utils.is_builtin(op):
            continue
        if not torch._library.utils.has_fake_kernel(op):
            raise compile_error(f"the custom op {op._name} has no fake (meta) implementation, which the compiler "
                                f"needs for the sizes of its results; {_how_to_register(op)}", [node])


def _how_to_register(op: torch._ops.OpOverload) -> str:
    opdef = torch._library.custom_ops._maybe_get_opdef(op._name)
    generic = f'torch.library.register_fake("{op._name}")'
    if opdef is not None:
        return f"register one with @{opdef._init_fn.__name__}.register_fake (or {generic})"
    return f"register one with @{generic}"
