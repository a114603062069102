"""Construction of loop kernels: pointwise, reductions, gathers and scatters.

Python decides, once per kernel, in rooms of one concept each:

* :mod:`.analysis` — the values of the kernel's body: what each varies along (tile, row,
  column or scalar), its storage type and the SFU stage that computes it;
* :mod:`.tiling` — the tiles: the block variable, rows per tile, the tiles and their cores;
* :mod:`.scratchpad` — the scratchpad layout for tiles of that many rows;
* :mod:`.reuse` — the loads a tile copies from its own scratchpad instead of fetching
  (broadcast rows, shifted views of another load);
* :mod:`.stages` — the SFU stage programs, for any tile of a parity;
* :mod:`.record` — all of it as the native builder's decision record.

C builds, at every construction (``spy_build_loop``, native/build_loop.c): every tile's
boxes, DMA patterns and descriptor lists, gathers, SFU instructions and prologue, the
dependencies between tiles, the encoded block. :func:`build` makes the record at a
kernel's first construction and returns it; every later construction hands it back.
"""

from __future__ import annotations

from ...ir import LoopKernel
from ...native import lib
from ...program import built_block
from ..context import BuildContext
from .analysis import CARD_OPS, LOGICAL, Unsupported, analyse
from .record import LoopRecord, decide

__all__ = ["CARD_OPS", "LOGICAL", "LoopRecord", "Unsupported", "build", "check_kernel"]


def check_kernel(k: LoopKernel) -> None:
    """Raise Unsupported if construction could not express this kernel (compile time)."""
    analyse(k)


def build(ctx: BuildContext, k: LoopKernel, decided: LoopRecord | None = None) -> LoopRecord:
    """The kernel's program, built natively from its decision record (made here at the first
    build); returns the record: pass it back to build the same kernel on the same target and
    buffers again without deciding anything."""
    if decided is None:
        decided = decide(ctx, k)
    ctx.block = built_block(lib.spy_build_loop, decided.record, "building a loop kernel")
    ctx.slot_of = dict(decided.slot_of)
    ctx.scratchpad_peak = decided.layout.peak
    return decided
