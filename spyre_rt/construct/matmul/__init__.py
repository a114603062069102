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

Python decides, C builds. The tiling comes from a cost model over the profile's figures,
under the scratchpad capacity (checked again by the card when the program is committed);
:mod:`.record` makes every decision of a kernel once (tiles, scratchpad regions, slots,
views, the per-tile SFU program) into one native record, and each build is one call of
the native builder (``spy_build_matmul``, native/build_matmul.c), which derives who does
what and makes the commands, dependencies, DMA patterns and programs.
"""

from __future__ import annotations

import dataclasses

from ... import dtypes
from ..context import BuildContext, Refused
from .record import MatmulRecord, decide
from .spec import ITEMSIZE, MatmulSpec, Problem, View
from .tiling import Tiling, choose

__all__ = ["ITEMSIZE", "MatmulRecord", "MatmulSpec", "Problem", "Tiling", "View", "build", "build_kernel", "choose",
           "spec_of"]


def build(ctx: BuildContext, spec: MatmulSpec, previous: MatmulRecord | Tiling | None = None) -> MatmulRecord:
    """Build the matmul into the context's program; returns its decision record (pass it
    back to build the same matmul again on the same target without deciding again; a
    tiling passed instead is used in place of the cost model's choice)."""
    if isinstance(previous, MatmulRecord):
        if (previous.spec is spec or previous.spec == spec) and previous.fits(ctx):
            previous.build(ctx)
            return previous
        previous = previous.tiling
    rec = decide(ctx, spec, previous)
    rec.build(ctx)
    return rec


def spec_of(k, offset=lambda name: 0) -> MatmulSpec:
    """The spec of a :class:`~spyre_rt.ir.MatmulKernel`, each view moved by `offset(buffer)`
    (a context's buffer offsets; none for a kernel's shape alone, as the passes that ask
    whether a fused kernel can be built want it)."""
    def view(v) -> View:
        name, off, sizes, strides = v
        return View(name, off + offset(name), tuple(sizes), tuple(strides))

    ep, pro = k.epilogue, k.prologue
    if ep is not None:
        ep = dataclasses.replace(ep, inputs=tuple(view(v) for v in ep.inputs),
                                 outputs=tuple(view(v) for v in ep.outputs))
    if pro is not None:
        pro = dataclasses.replace(pro, inputs=tuple(view(v) for v in pro.inputs))
    return MatmulSpec(view(k.a), view(k.b), view(k.out), dtypes.CODE[k.in_dtype], dtypes.CODE[k.out_dtype],
                      bias=view(k.bias) if k.bias else None, bias_dtype=dtypes.CODE.get(k.bias_dtype, 0),
                      epilogue=ep, prologue=pro, parts=tuple((view(b), view(o)) for b, o in k.parts))


def build_kernel(ctx: BuildContext, k, previous: MatmulRecord | Tiling | None = None) -> MatmulRecord:
    """Build a :class:`~spyre_rt.ir.MatmulKernel` (views relative to their buffers'
    starts) into the context's program; returns its decision record. A launch passes back
    the record of the kernel's first build: its construction is then one native call."""
    if isinstance(previous, MatmulRecord):
        if previous.kernel is k and previous.fits(ctx):
            previous.build(ctx)
            return previous
        previous = previous.tiling

    for dt in (k.in_dtype, k.out_dtype):
        if dt not in dtypes.MATMUL:
            raise Refused(f"matmul in {dt}")
    rec = decide(ctx, spec_of(k, ctx.offset), previous)
    rec.kernel = k
    rec.build(ctx)
    return rec
