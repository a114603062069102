"""Which buffers a step's items read, write and touch, named as the buffers they finally
are (through the step's aliases: a compile region's input is an alias of its caller's
view): what the fusion passes check before they move work past other work."""

from __future__ import annotations

from spyre_rt.ir import LoopKernel, MatmulKernel, StepDesc, resolve_alias


def base(step: StepDesc, name: str) -> str:
    """The buffer `name` finally is."""
    return resolve_alias(step.aliases, name)[0]


def resolve(step: StepDesc, name: str, element: int) -> tuple[str, int]:
    """(buffer, element) that element `element` of `name` is."""
    return resolve_alias(step.aliases, name, element)


def touches(step: StepDesc, kernels: dict, item) -> set[str]:
    """The buffers a sequence item reads or writes."""
    kind, x = item
    if kind == "run":
        return {base(step, b.name) for b in kernels[x].buffers}
    if kind == "cpu":
        return {base(step, n) for n in x.buffer_names()}
    src, _, out = x
    return {base(step, src), base(step, out)}


def writes(step: StepDesc, kernels: dict, item) -> set[str]:
    """The buffers a sequence item writes (everything it touches where that is not known)."""
    kind, x = item
    if kind == "run":
        k = kernels[x]
        if isinstance(k, LoopKernel):
            return {base(step, o.access.buf) for o in k.ops if o.op == "store"}
        if isinstance(k, MatmulKernel):
            views = k.epilogue.outputs if k.epilogue is not None else k.outs()
            return {base(step, v[0]) for v in views}
        if getattr(k, "kind", "") == "attention":
            return {base(step, k.out[0])}
    if kind == "cpu":  # its results and the arguments its schema marks written
        return {base(step, n) for n in x.written_names()}
    return touches(step, kernels, item)  # everything it touches, to be safe
