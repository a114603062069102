"""Matmul construction: C[b] = A[b] @ B[b] (+ bias), over all the cores, operands shared
over the ring.

The cores form groups of ``pk x pm x pn`` grids (:mod:`.tiling`). Per wave a group
computes one block of the output: each core an M x N tile over one K slice. A chunk of A
is loaded from DRAM once per grid row and forwarded over the ring to the row's other
cores, a chunk of B once per grid column; chunks stream through ``nbuf`` operand buffers
per core (the loads of the next chunks overlap the matmul of this one). Partial sums of
split-K are added over the ring; the SFU epilogue adds the bias and rounds into a staging
tile, which is stored. Operands whose K dimension is not the contiguous one are read
transposed in place (a weight used as ``W.t()``), and the matmul command says so.

The tiling comes from a cost model over the profile's figures, under the scratchpad
capacity (checked again by the card when the program is committed); :mod:`.schedule` says
which core does what, :mod:`.commands` makes the commands.
"""

from __future__ import annotations

import dataclasses

from ... import dtypes
from ..context import BuildContext, Refused
from . import commands
from .spec import ITEMSIZE, MatmulSpec, Problem, View
from .tiling import Tiling, choose

__all__ = ["ITEMSIZE", "MatmulSpec", "Problem", "Tiling", "View", "build", "build_kernel", "choose"]


def build(ctx: BuildContext, spec: MatmulSpec, tiling: Tiling | None = None) -> Tiling:
    """Build the matmul into the context's program; returns its tiling (pass it back to
    build the same matmul again on the same target without choosing again)."""
    if spec.alpha != 1 or spec.beta != 1:
        raise NotImplementedError("matmul alpha/beta other than 1 are lowered to pointwise ops")
    tiling = tiling or choose(ctx.target, Problem.of(spec))
    commands.build(ctx, spec, tiling)
    return tiling


def build_kernel(ctx: BuildContext, k, tiling: Tiling | None = None) -> Tiling:
    """Build a :class:`~spyre_rt.kernels.MatmulKernel` (views relative to their buffers'
    starts) into the context's program; returns its tiling."""

    def view(v) -> View:
        name, off, sizes, strides = v
        return View(name, off + ctx.offset(name), tuple(sizes), tuple(strides))

    for dt in (k.in_dtype, k.out_dtype):
        if dt not in dtypes.MATMUL:
            raise Refused(f"matmul in {dt}")
    ep = k.epilogue
    if ep is not None:
        ep = dataclasses.replace(ep, inputs=tuple(view(v) for v in ep.inputs),
                                 outputs=tuple(view(v) for v in ep.outputs))
    spec = MatmulSpec(view(k.a), view(k.b), view(k.out), dtypes.CODE[k.in_dtype], dtypes.CODE[k.out_dtype],
                      bias=view(k.bias) if k.bias else None, bias_dtype=dtypes.CODE.get(k.bias_dtype, 0),
                      epilogue=ep)
    return build(ctx, spec, tiling)
