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

A region of dynamic sizes (the graph Dynamo compiles again at a second prompt length) keeps
its sizes as expressions of its size symbols and its kernels recorded; each call's copy is
written in the caller's sizes, and the caller's step describes them with its own kernels
for each distinct size at its first call (:mod:`spyre_rt.compiler.specialize`).
"""

from __future__ import annotations

import dataclasses

import sympy

from spyre_rt.ir import StepDesc

from .describe import Sym, parse, text
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
    """The kernels of `step` for its call `call` with the caller's `operands`, one per input
    of the region in order: a view for a tensor, ``("int", size)`` for a size."""
    if step.constants:
        raise _refused("a compile region with constants of its own is not supported on spyre")
    views, sizes = _bound(step, operands)
    names = {b.name: f"{call}_{b.name}" for b, _ in step.inputs}
    names.update((n, f"{call}_{n}") for n in (*step.buffers, *step.aliases, *step.kernels))
    names.update((op.name, f"{call}_{op.name}") for kind, op in step.sequence if kind == "cpu")
    # a fused matmul still names its product, a buffer the fusion took out of the step's
    names.update((k.out[0], f"{call}_{k.out[0]}") for k in step.kernels.values()
                 if getattr(k, "epilogue", None) is not None and k.out[0] not in names)
    kernels, buffers, aliases, sequence, outputs = _rename(
        (step.kernels, step.buffers, dict(step.aliases), tuple(step.sequence), tuple(step.outputs)), names,
        _Sizes(sizes) if sizes else None)
    for (b, _), view in zip(step.inputs, views, strict=True):
        aliases[names[b.name]] = tuple(view)
    mutated = {view[0] for (b, written), view in zip(step.inputs, views, strict=True) if written}
    return Inlined(kernels=kernels, sequence=list(sequence), buffers=buffers, aliases=aliases,
                   outputs=list(outputs), mutated=mutated,
                   sources={names[k]: v for k, v in step.sources.items() if k in names},
                   kernel_names={k: names[k] for k in step.kernels})


def _bound(step: StepDesc, operands: list) -> tuple[list, dict]:
    """The caller's views for the region's tensor inputs, and the caller's size for each size
    symbol of the region that is not the caller's own. A region of dynamic sizes keeps its
    sizes as expressions of its symbols (Dynamo gives each size a region takes a symbol of
    its own, though every layer takes the caller's ``s0``); its copy in the caller is
    written in the caller's. A symbol given two different sizes in one call is refused."""
    ints = {position for _, kind, position, _ in step.symbols if kind == "int"}
    if any((i in ints) != (op[0] == "int") for i, op in enumerate(operands)):
        raise CompileFailed("a compile region's sizes and tensors called in another order")
    views = [op for i, op in enumerate(operands) if i not in ints]
    if len(views) != len(step.inputs):
        raise CompileFailed(f"a compile region of {len(step.inputs)} inputs called with {len(views)}")
    given: dict = {}
    for name, kind, position, dim in step.symbols:
        op = operands[position]
        size = op[1] if kind == "int" else op[2 if kind == "size" else 3][dim]
        if given.setdefault(name, size) != size:
            raise _refused(f"a compile region's size {name} called as both {given[name]} and {size}")
    return views, {name: size for name, size in given.items() if size != Sym(name)}


def _refused(why: str) -> CompileFailed:
    err = CompileFailed(why)
    err.inline_regions = True  # the backend compiles the graph again with its regions inlined
    return err


class _Sizes:
    """The caller's sizes for a region's own size symbols: expressions rewritten in them
    (each distinct one once: the kernels of a layer repeat a few)."""

    def __init__(self, sizes: dict):
        self.by_name = {name: parse(v.text) if isinstance(v, Sym) else sympy.Integer(v) for name, v in sizes.items()}
        self.done: dict = {}

    def __call__(self, x):
        if x not in self.done:
            e = parse(x.text) if isinstance(x, Sym) else x
            e = e.xreplace({s: self.by_name[s.name] for s in e.free_symbols if s.name in self.by_name})
            self.done[x] = text(e) if isinstance(x, Sym) else e
        return self.done[x]


def _rename(obj, names: dict[str, str], sizes: _Sizes | None = None):
    """`obj` with every buffer, alias and kernel name in it renamed and, with `sizes`, every
    size expression (stored Sym text, or sympy in a recorded kernel's loops and indices)
    written in the caller's sizes (descriptions rebuilt, plain data: a call's copy shares
    nothing that changes with the region's)."""
    if isinstance(obj, str):
        return names.get(obj, obj)
    if isinstance(obj, (Sym, sympy.Basic)):
        return sizes(obj) if sizes else obj
    if isinstance(obj, tuple):
        return tuple(_rename(x, names, sizes) for x in obj)
    if isinstance(obj, list):
        return [_rename(x, names, sizes) for x in obj]
    if isinstance(obj, dict):
        return {names.get(k, k) if k not in _NOT_NAMES else k: (v if k in _NOT_NAMES else _rename(v, names, sizes))
                for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: (v if f.name in _NOT_NAMES else _rename(v, names, sizes))
                            for f in dataclasses.fields(obj) for v in (getattr(obj, f.name),)})
    return obj
