"""Epilogue fusion: a pointwise loop kernel that reads a matmul's product, where nothing
else reads it, becomes the matmul's epilogue (:class:`~spyre_rt.ir.Epilogue`).

The matmul then computes the loop kernel's body on each output tile while the tile is in
its scratchpad, loading the body's other operands tile by tile, and stores what the loop
kernel stored: the product never goes to DRAM and back (SiLU(gate) * up, a residual add,
a scaling). The values are the same: the body starts from the product rounded to the
matmul's output dtype, as the loop kernel loaded it, and computes as the loop kernel's
construction does.

A fusion moves the loop kernel's work back to the matmul's place in the step, so nothing
in between may write what it reads or touch what it writes. The loop kernel's iteration
space must be the product's elements: its canonical variables are regrouped (split where
one spans two dimensions) into the product's (batch, M, N), and every access it makes
must then be a (batch, M, N) view with the columns contiguous (or broadcast over rows).
"""

from __future__ import annotations

import dataclasses

from spyre_rt.construct.sfu import BINARY, COMPARE, UNARY
from spyre_rt.cost import CostModel
from spyre_rt.ir import Epilogue, LoopKernel, MatmulKernel, Op, StepDesc

from .step_buffers import base, touches, writes

# what an epilogue computes: the elementwise operations of loop construction's SFU stages
COMPUTES = frozenset({"constant", "to_dtype", "where", "relu", "square", "exp2"}) | frozenset(UNARY) \
    | frozenset(BINARY) | frozenset(COMPARE)


def fuse_kernels(step: StepDesc) -> StepDesc:
    """The step's fusions its options turn on: epilogues, then prologues (an epilogue can
    make a matmul's A, so that the kernel after it is a norm the next matmuls take in), then
    groups of matmuls of one A (their prologues made alike by then); and the attentions
    whose masks the step proves causal up to a bound skip the blocks past it."""
    if step.options.get("fuse_epilogues"):
        step = fuse_epilogues(step, sliced=step.options.get("slice_epilogues", True))
    if step.options.get("fuse_prologues"):
        from .prologue import fuse_prologues

        step = fuse_prologues(step)
    if step.options.get("group_matmuls"):
        from .grouping import group_matmuls

        step = group_matmuls(step)
    if step.options.get("bound_causal_masks"):
        from .causal import bound_causal_masks

        step = bound_causal_masks(step)
    return step


def fuse_epilogues(step: StepDesc, target: CostModel | None = None, sliced: bool = True) -> StepDesc:
    """The step with every pointwise loop kernel that can be a matmul's epilogue folded
    into it (kernels named as before; the loop kernels and the products' buffers gone).
    `target`: the card the step runs on (the current card set's by default), whose
    scratchpad must hold the epilogue beside the matmul's own tiling. With `sliced`, also
    kernels whose work depends on where a column lies in a period (a rotary embedding on a
    projection's heads), as epilogues in column slices (:mod:`.slicing`)."""
    target = card_target(target)
    kernels = dict(step.kernels)
    seq = list(step.sequence)
    buffers = dict(step.buffers)
    i = 0
    while i < len(seq):
        kind, name = seq[i]
        if kind == "run" and isinstance(kernels.get(name), LoopKernel):
            found = _fusion(step, kernels, seq, i, sliced)
            tiling = None if found is None else exact_tiling_of(found[1], target)
            if tiling is not None and _pays(found[1], target, tiling):
                j, fused = found
                product = kernels[seq[j][1]].out[0]
                kernels[fused.name] = fused
                del kernels[name]
                del seq[i]
                buffers.pop(product, None)
                continue
        i += 1
    if len(seq) == len(step.sequence):
        return step
    return dataclasses.replace(step, kernels=kernels, sequence=tuple(seq), buffers=buffers)


def _pays(m: MatmulKernel, target: CostModel, tiling) -> bool:
    """Whether a sliced epilogue keeps the matmul's own tiling, and its per-tile program (each
    slice's body, once per slice of a tile) stays within the card's (SPY_MM_MAX_PROGRAM: a
    decode step's one-row tiles are wide, 1,024 columns of 32 slices). Its tiles must be alike and
    whole periods, and its periodic tables take room: where that makes another tiling (fewer
    operand buffers at a prefill of 8,192 rows), the cost model's margin is smaller than its
    error (Granite 8B's q projection with its rotation took as long fused as apart, measured),
    so the kernels stay apart. A plain epilogue always pays: it takes the matmul's own tiling
    or one with its K chunks, at about its cost. `tiling`: the fused matmul's exact tiling."""
    if m.epilogue is None or not m.epilogue.slices:
        return True
    from spyre_rt.construct.matmul import Problem, epilogue, spec_of
    from spyre_rt.construct.matmul.record import _cuts
    from spyre_rt.construct.matmul.tiling import choose
    from spyre_rt.native import lib

    fused = spec_of(m)
    if tiling != choose(target, Problem.of(dataclasses.replace(fused, epilogue=None))):
        return False
    p, bodies = Problem.of(fused), epilogue.plan(fused.epilogue).slices
    tn = int(_cuts(target, fused, p, tiling)[1].max())
    instrs = sum(bodies[q % len(bodies)].instrs for q in range(tn // fused.epilogue.slice_cols))
    return instrs + (p.k == 0) + (fused.bias is not None) <= lib.SPY_MM_MAX_PROGRAM


def card_target(target: CostModel | None) -> CostModel:
    """`target`, or the cost model of the current card set's card (the passes' default)."""
    if target is not None:
        return target
    from spyre_rt import card

    return CostModel.of_figures(card.card_set().profile)


def exact_tiling_of(m: MatmulKernel, target: CostModel):
    """The tiling the fused matmul `m` is cut in when it is the matmul's alone (its fused
    work fits beside that tiling in the target's scratchpad), so that its values are the
    unfused kernels' bit for bit; None otherwise: the fusion passes fuse only then."""
    from spyre_rt.construct.context import ScratchpadOverflow
    from spyre_rt.construct.matmul import spec_of
    from spyre_rt.construct.matmul.record import exact_tiling

    try:
        return exact_tiling(target, spec_of(m))
    except ScratchpadOverflow:
        return None


def keeps_its_bits(m: MatmulKernel, target: CostModel) -> bool:
    """Whether the fused matmul `m` keeps the unfused kernels' bits (:func:`exact_tiling_of`)."""
    return exact_tiling_of(m, target) is not None


def _fusion(step: StepDesc, kernels: dict, seq: list, i: int, sliced: bool = True) -> tuple[int, MatmulKernel] | None:
    """(position of the matmul, the matmul with the loop kernel at `i` as its epilogue),
    or None when the loop kernel cannot be one."""
    k: LoopKernel = kernels[seq[i][1]]
    simple = _fusable(k, sliced=False)
    if k.reduce or k.shape != "pointwise" or not (simple or (sliced and _fusable(k, sliced=True))):
        return None
    loaded = {base(step, o.access.buf) for o in k.ops if o.op == "load"}
    stored = {base(step, o.access.buf) for o in k.ops if o.op == "store"}
    if loaded & stored:
        return None
    # the latest matmul before it whose product it reads
    for j in range(i - 1, -1, -1):
        kind, x = seq[j]
        mm = kernels.get(x) if kind == "run" else None
        if isinstance(mm, MatmulKernel) and mm.epilogue is None and not mm.parts and base(step, mm.out[0]) in loaded:
            break
    else:
        return None
    product = mm.out[0]
    if not _private(step, kernels, seq, product, (i, j)):
        return None
    if stored & {base(step, v[0]) for v in (mm.a, mm.b, mm.bias) if v is not None}:
        return None
    for t in range(j + 1, i):  # the loop kernel's work moves back to the matmul's place
        if writes(step, kernels, seq[t]) & loaded or touches(step, kernels, seq[t]) & stored:
            return None
    epilogue = _epilogue(k, mm) if simple else None
    if epilogue is None and sliced:
        epilogue = _sliced(k, mm)
    if epilogue is None:
        return None
    bufs = {b.name: b for b in (*mm.buffers, *k.buffers) if b.name != product}
    return j, dataclasses.replace(mm, epilogue=epilogue, buffers=tuple(bufs.values()),
                                  origins=tuple(sorted({*mm.origins, *k.origins})))


def _fusable(k: LoopKernel, sliced: bool) -> bool:
    """Loads and stores at plain addresses and elementwise work: what an epilogue computes.
    `sliced`: also masked loads and column indices, what a sliced epilogue may decide
    (:mod:`.slicing`)."""
    for op in k.ops:
        if op.op in ("load", "store"):
            if op.access.ind or not op.access.buf or (op.access.domain and (op.op == "store" or not sliced)):
                return False
        elif op.op not in COMPUTES and not (sliced and op.op == "index"):
            return False
    return True


def _anchor(k: LoopKernel, mm: MatmulKernel) -> Op | None:
    """The loop kernel's load of the product at the product's own elements, unmasked."""
    return next((o for o in k.ops if o.op == "load" and o.access.buf == mm.out[0] and not o.access.domain
                 and o.access.const == mm.out[1]), None)


def _anchored(k: LoopKernel, mm: MatmulKernel) -> tuple[Op, list] | None:
    """The anchor (:func:`_anchor`) and the loop kernel's variables as the product's
    dimensions, seen from its access (:func:`_parts`), when they cover every variable the
    kernel loops over."""
    anchor = _anchor(k, mm)
    if anchor is None:
        return None
    parts = _parts(k, anchor.access.coeffs, mm.out)
    if parts is None or any(n > 1 and v not in {p[0] for p in parts} for v, n in enumerate(k.sizes)):
        return None
    return anchor, parts


def _sliced(k: LoopKernel, mm: MatmulKernel) -> Epilogue | None:
    from .slicing import sliced_epilogue

    anchored = _anchored(k, mm)
    return None if anchored is None else sliced_epilogue(k, mm, *anchored, COMPUTES)


def _private(step: StepDesc, kernels: dict, seq: list, product: str, users: tuple[int, int]) -> bool:
    """Nothing but the matmul and the loop kernel ever sees the product's buffer."""
    if product not in step.buffers or product in step.aliases:
        return False
    if any(v[0] == product for v in step.aliases.values()):
        return False
    if any(isinstance(o, (tuple, list)) and o and o[0] == product for o in step.outputs):
        return False
    return not any(product in touches(step, kernels, item) for t, item in enumerate(seq) if t not in users)


# ---- the loop kernel over the product's elements --------------------------------------------

def _parts(k: LoopKernel, coeffs, out) -> list[tuple[int, int, int, int, int]] | None:
    """The loop kernel's variables regrouped into the product's dimensions: parts
    (variable, weight of the part in the variable, size, dimension, weight of the part in
    the dimension), when the product's load visits each of its elements once."""
    _, _, osz, ost = out
    dims = [d for d in (2, 1, 0) if osz[d] > 1]
    loop_vars = sorted((coeffs[v], v, n) for v, n in enumerate(k.sizes) if n > 1)
    parts = []
    di, pos = 0, 1
    for c, v, n in loop_vars:
        w = 1
        while n > 1:
            if di >= len(dims):
                return None
            d = dims[di]
            if c * w != ost[d] * pos:
                return None
            rem = osz[d] // pos
            if n <= rem:
                if rem % n:
                    return None
                take = n
            elif n % rem:
                return None
            else:
                take = rem
            parts.append((v, w, take, d, pos))
            w, n, pos = w * take, n // take, pos * take
            if pos == osz[d]:
                di, pos = di + 1, 1
    return parts if di == len(dims) else None


def _view(acc, parts, out) -> tuple | None:
    """The access as a view over (batch, M, N), or None if it is not affine in them."""
    _, _, osz, _ = out
    strides = [0, 0, 0]
    for v, w, _, d, pos in sorted(parts, key=lambda p: p[4]):
        s = acc.coeffs[v] * w
        if pos == 1:
            strides[d] = s
        elif s != strides[d] * pos:
            return None
    return (acc.buf, acc.const, tuple(osz), tuple(strides))


def _epilogue(k: LoopKernel, mm: MatmulKernel) -> Epilogue | None:
    product = mm.out[0]
    anchored = _anchored(k, mm)
    if anchored is None:
        return None
    anchor, parts = anchored
    _, _, (nb, nm, nn), _ = mm.out
    dtype = {b.name: b.dtype for b in k.buffers}
    inputs, input_dtypes, outputs, output_dtypes, ops = [], [], [], [], []
    for op in k.ops:
        if op.op not in ("load", "store"):
            ops.append(dataclasses.replace(op, access=None))
            continue
        view = _view(op.access, parts, mm.out)
        if view is None:
            return None
        _, _, _, (sb, sm, sn) = view
        if nn > 1 and sn != 1:
            return None  # the columns are contiguous in every tile the epilogue moves
        if op.op == "load" and op.access.buf == product:
            if view != tuple(mm.out[:2]) + (tuple(mm.out[2]), tuple(
                    s if n > 1 else 0 for s, n in zip(mm.out[3], mm.out[2], strict=True))):
                return None
            ops.append(Op(op.id, "product", dtype=mm.out_dtype))
        elif op.op == "load":
            if (nb > 1 and sb == 0) or (nn == 1 and nm > 1 and sm == 0):
                return None  # broadcast over batches, or along a single column
            if view not in inputs:
                inputs.append(view)
                input_dtypes.append(dtype[op.access.buf])
            ops.append(Op(op.id, "load", dtype=dtype[op.access.buf], attrs={"input": inputs.index(view)}))
        else:
            if (nb > 1 and sb == 0) or (nm > 1 and sm == 0) or view in outputs:
                return None  # a store must write each element once
            outputs.append(view)
            output_dtypes.append(dtype[op.access.buf])
            ops.append(Op(op.id, "store", op.args, dtype[op.access.buf], attrs={"output": len(outputs) - 1}))
    if not outputs:
        return None
    return Epilogue(tuple(ops), tuple(inputs), tuple(input_dtypes), tuple(outputs), tuple(output_dtypes), k.name)
