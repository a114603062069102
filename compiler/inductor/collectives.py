"""Functional collectives of a graph as collectives of the card's step.

Inductor lowers ``_c10d_functional`` ops to extern nodes (``ir._CollectiveKernel``): an
in-place ``all_reduce_`` or ``broadcast_`` of a buffer, an out-of-place
``all_gather_into_tensor`` or ``reduce_scatter_tensor`` into a buffer of its own, each
followed by a ``wait_tensor``. A collective of card tensors in a ``spyreccl`` group becomes
a :class:`~spyre_rt.ir.CollectiveKernel`, a job of the step's plan; its wait is no work
(the plan runs its jobs in order, the collective complete before the next). Any other
collective (another group's, a coalesced or an all-to-all one) stays an op the step runs on
the CPU, through the group's eager call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._inductor import ir

from spyre_rt.ir import CollectiveKernel

from .record import (
    buffer_info,
    computing_origins,
    dtype_name,
    fx_origins,
    module_of,
    on_cpu,
    stored_buffer,
    stored_view,
    view_of,
)

_C10D = "_c10d_functional"
# op name -> (the collective, whether it writes its input in place)
_IN_PLAN = {"all_reduce_": ("all_reduce", True), "broadcast_": ("broadcast", True),
            "all_gather_into_tensor": ("all_gather", False), "reduce_scatter_tensor": ("reduce_scatter", False)}


def _op_name(node) -> tuple[str, str]:
    op = getattr(node, "op_overload", None)
    if not isinstance(op, torch._ops.OpOverload):
        return "", ""
    return op.namespace, op._opname


def is_wait(node) -> bool:
    """A ``wait_tensor`` of a card collective: no work in a step whose collectives complete
    in order."""
    return isinstance(node, ir._WaitKernel) and _op_name(node) == (_C10D, "wait_tensor") and not on_cpu(node)


def describe(node, name: str) -> tuple[CollectiveKernel, list] | None:
    """The collective of an extern node and the buffers it makes, or None when the step runs
    it as a CPU op."""
    namespace, opname = _op_name(node)
    if not isinstance(node, ir._CollectiveKernel) or namespace != _C10D or opname not in _IN_PLAN:
        return None
    if on_cpu(node) or len(node.inputs) != 1:
        return None
    from .. import options

    if computing_origins([node]) & set(options.cpu_nodes):  # refused for the ring: a compile again put it here
        return None
    collective, in_place = _IN_PLAN[opname]
    args = list(node.constant_args)
    group = args[-1]
    try:
        pg = dist.distributed_c10d._resolve_process_group(group)
    except (ValueError, RuntimeError, KeyError):
        return None
    if getattr(pg, "ring", None) is None:  # not a spyreccl group: its eager call
        return None
    inp = node.inputs[0]
    made = []
    if in_place:
        out_view = view_of(inp)
    else:
        out = buffer_info(node.get_name())
        made.append(stored_buffer(out))
        out_view = (out.name, out.offset, out.sizes, out.strides)   # stored once, below
    op = args[0] if collective in ("all_reduce", "reduce_scatter") else "sum"
    root = int(args[0]) if collective == "broadcast" else 0
    if collective == "broadcast":  # broadcast_(input, src, group): src is a global rank
        root = dist.get_group_rank(pg, root) if pg is not dist.group.WORLD else root
    kernel = CollectiveKernel(
        name=name, collective=collective, group=str(group), ranks=pg.size(), inp=stored_view(view_of(inp)),
        out=stored_view(out_view), dtype=dtype_name(inp.get_dtype()), op=str(op), root=root,
        buffers=tuple(stored_buffer(buffer_info(n)) for n in {view_of(inp)[0], out_view[0]}),
        origins=(f"{_C10D}.{opname}",), module=module_of(fx_origins([node])))
    return kernel, made

