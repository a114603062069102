"""A plan build constructs each distinct kernel once.

A decoder's layers are the same kernels many times over, on buffers of other names: the
same description once its buffer names are numbered in order, on buffers of the same stick
layouts and offsets. Construction turns such kernels into the same program; only the
relocations (where each slot's buffer lives) differ, and those are the plan's, not the
program's. So a plan build keys each kernel by its form (:func:`form`) and constructs the
first of each form only; the others take its program, with their own buffers bound to its
slots.

Only a plan build does this. The construct modes build each kernel at each launch, which is
the work they measure.
"""

from __future__ import annotations

import dataclasses
import functools

from .. import job_facts
from ..ir import field_names
from .stats import stats

# Fields that name or document a kernel and never change its program: its own name, the
# aten ops and module it came from, the loop kernel an epilogue was.
_NOT_PROGRAM = frozenset({"name", "origins", "module", "fused"})


@functools.cache
def _program_fields(cls: type) -> tuple[str, ...]:
    return tuple(n for n in field_names(cls) if n not in _NOT_PROGRAM)


def form(kernel, layouts: dict, offsets: dict) -> tuple[tuple, list[str]]:
    """What a kernel's program depends on, with its buffers numbered in the order the
    description names them; and those buffer names, in that order."""
    numbers: dict[str, int] = {}
    for b in kernel.buffers:
        numbers.setdefault(b.name, len(numbers))
    # A matmul with an epilogue names its product without storing it (its views leave it
    # out): numbered too, so layers whose products are named apart are one form.
    out = getattr(kernel, "out", None)
    for view in (*kernel.views(), *([out] if out is not None else ())):
        numbers.setdefault(view[0], len(numbers))
    geometry = tuple((tuple(layouts[n]) if n in layouts else None, offsets.get(n, 0)) for n in numbers)
    return (type(kernel).__name__, _numbered(kernel, numbers), geometry), list(numbers)


def _numbered(x, numbers: dict[str, int]):
    t = type(x)
    if t is int or t is float or t is bool or x is None:  # most of a description: sizes, strides, offsets
        return x
    if isinstance(x, str):
        n = numbers.get(x)
        return x if n is None else ("#", n)
    if isinstance(x, (tuple, list)):
        return tuple([_numbered(v, numbers) for v in x])
    if isinstance(x, dict):
        return tuple(sorted((k, _numbered(v, numbers)) for k, v in x.items()))
    if dataclasses.is_dataclass(x):
        return (t.__name__, *[_numbered(getattr(x, n), numbers) for n in _program_fields(t)])
    return x


class DistinctBuilds:
    """The programs one plan build made, by form."""

    def __init__(self, exe):
        self.exe = exe
        self._made: dict[tuple, tuple] = {}  # form -> (program, its slots as buffer numbers, kernel)

    def build(self, name: str):
        """The program of kernel `name` and the buffers its slots bind, built if no kernel
        of its form was."""
        exe = self.exe
        kernel = exe.kernels.get(name)  # the step's and the row saves'
        if kernel is None or kernel.kind == "collective":  # the snapshot copies; a ring's job (its own tag)
            return exe.build(name)
        key, names = form(kernel, exe.bindings.layouts, exe.bindings.offsets)
        made = self._made.get(key)
        if made is None:
            blob, bufs = exe.build(name)
            number = {n: i for i, n in enumerate(names)}
            if all(b in number for b in bufs):
                self._made[key] = (blob, [number[b] for b in bufs], name)
            return blob, bufs
        blob, slots, first = made
        stats["kernels_reused"] += 1
        info = job_facts.lookup(exe.job_name(first))
        if info is not None:  # what it computes is the first one's, from its own module
            job_facts.register(exe.job_name(name), {**info, "module": getattr(kernel, "module", "")})
        return blob, [names[i] for i in slots]
