"""A region's step inlined into the step that calls it.

A region is a subgraph Inductor compiled once for every call of it
(``torch.compiler.nested_compile_region``: one decoder layer, called for every layer). Its
kernels are described once; each call puts a copy of them into the calling step under names
of its own, so the step is still one sequence of kernels, one memory plan and one plan
launch per call. Pure: plain data in, plain data out.

Each buffer, alias and kernel of the region is renamed ``{call}_{name}``; each input of the
region becomes an alias of the caller's view it was called with (Inductor gives a region's
operands the strides of its inputs, so the region's accesses address the caller's
storage as they are).
"""

from __future__ import annotations

import dataclasses

from spyre_rt.ir import StepDesc

from .errors import CompileFailed

# Fields of a description whose strings are never buffer or kernel names (and JSON's tag).
_NOT_NAMES = frozenset({"__type__", "origins", "source", "module", "op", "dtype", "dtypes", "id", "args_of"})


@dataclasses.dataclass
class Inlined:
    """One call of a region, renamed: what the caller adds to its step."""

    kernels: dict
    sequence: list
    buffers: dict
    aliases: dict           # the region's own aliases and its inputs bound to the caller's views
    outputs: list           # the call's results: views of the caller's names
    mutated: set[str]       # the caller's views (by buffer) the call writes
    sources: dict[str, str]
    kernel_names: dict[str, str]  # region kernel -> its name in this call


def inline(step: StepDesc, call: str, operands: list) -> Inlined:
    """The kernels of `step` for its call `call` with the caller's views `operands` (one per
    input of the region, in order)."""
    if step.symbols or step.constants:
        err = CompileFailed("a compile region with dynamic sizes or constants of its own is not supported on spyre")
        err.inline_regions = True  # the backend compiles the graph again with its regions inlined
        raise err
    if len(operands) != len(step.inputs):
        raise CompileFailed(f"a compile region of {len(step.inputs)} inputs called with {len(operands)}")
    names = {b.name: f"{call}_{b.name}" for b, _ in step.inputs}
    names.update((n, f"{call}_{n}") for n in (*step.buffers, *step.aliases, *step.kernels))
    names.update((op.name, f"{call}_{op.name}") for kind, op in step.sequence if kind == "cpu")
    # a fused matmul still names its product, a buffer the fusion took out of the step's
    names.update((k.out[0], f"{call}_{k.out[0]}") for k in step.kernels.values()
                 if getattr(k, "epilogue", None) is not None and k.out[0] not in names)
    kernels, buffers, aliases, sequence, outputs = _rename(
        (step.kernels, step.buffers, dict(step.aliases), tuple(step.sequence), tuple(step.outputs)), names)
    for (b, _), view in zip(step.inputs, operands, strict=True):
        aliases[names[b.name]] = tuple(view)
    mutated = {view[0] for (b, written), view in zip(step.inputs, operands, strict=True) if written}
    return Inlined(kernels=kernels, sequence=list(sequence), buffers=buffers, aliases=aliases,
                   outputs=list(outputs), mutated=mutated,
                   sources={names[k]: v for k, v in step.sources.items() if k in names},
                   kernel_names={k: names[k] for k in step.kernels})


def _rename(obj, names: dict[str, str]):
    """`obj` with every buffer, alias and kernel name in it renamed (descriptions rebuilt,
    plain data: a call's copy shares nothing that changes with the region's)."""
    if isinstance(obj, str):
        return names.get(obj, obj)
    if isinstance(obj, tuple):
        return tuple(_rename(x, names) for x in obj)
    if isinstance(obj, list):
        return [_rename(x, names) for x in obj]
    if isinstance(obj, dict):
        return {names.get(k, k) if k not in _NOT_NAMES else k: (v if k in _NOT_NAMES else _rename(v, names))
                for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: (v if f.name in _NOT_NAMES else _rename(v, names))
                            for f in dataclasses.fields(obj) for v in (getattr(obj, f.name),)})
    return obj
