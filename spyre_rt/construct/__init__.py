"""Construction: kernel descriptions to validated job programs for the card.

This is the work the dispatch modes move: ``construct`` runs it on every launch,
``prebuilt`` once, when the graph plan is built. The compiler decides what a kernel
computes (a plain-data description, :mod:`spyre_rt.ir`); construction decides how the
card runs it (tiles over the cores, scratchpad regions, DMA patterns, commands).

A kernel kind is a description type with a ``kind`` and a builder registered here: a
function ``(context, kernel, decided or None) -> decided`` that fills the context's program
and returns what it decided (the kernel's whole decision record: tiles, schedules,
scratchpad regions, access patterns, and the record the native builder takes), which a
later build of the same kernel on the same target takes back instead of deciding again:
Python decides once, C builds at every launch. A builder that cannot build a kernel for
the target raises :class:`Refused` (a limitation, not a bug): its ops then run on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

from . import attention, loops, matmul
from .context import BuildContext, Refused

__all__ = ["BUILDERS", "BuildContext", "Refused", "build"]

BUILDERS: dict[str, Callable] = {
    "loop": loops.build,
    "matmul": matmul.build_kernel,
    "attention": attention.build,
}


def build(ctx: BuildContext, kernel, decided=None):
    """Construct `kernel` into the context's program; returns its decisions."""
    builder = BUILDERS.get(getattr(kernel, "kind", None))
    if builder is None:
        raise TypeError(f"no builder for a {type(kernel).__name__} (kind {getattr(kernel, 'kind', None)!r})")
    return builder(ctx, kernel, decided)
