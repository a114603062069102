"""Construction of loop kernels: pointwise, reductions, gathers and scatters.

A build runs in rooms of one concept each:

* :mod:`.analysis` — the values of the kernel's body: what each varies along (tile, row,
  column or scalar), its storage type and the SFU stage that computes it;
* :mod:`.tiling` — the tiles: the block variable, rows per tile, the tiles and their cores;
* :mod:`.scratchpad` — the scratchpad layout for tiles of that many rows;
* :mod:`.stages` — the SFU programs of a tile (its stages and its prologue);
* :mod:`.commands` — the DMA, gather and SFU commands of one tile, recorded as a template;
* :mod:`.replication` — every tile's commands from the templates of a few.

Analysis and tiling depend only on the kernel and the target: :func:`build` makes them at
a kernel's first construction and returns them, and every later construction takes them
back. The rest is the work of every construction.
"""

from __future__ import annotations

from ...kernels import LoopKernel
from ..context import BuildContext, ScratchpadOverflow
from ...native import lib
from ...program import built_block
from .analysis import CARD_OPS, LOGICAL, Unsupported, analyse
from .record import LoopRecord, decide
from .replication import replicate
from .scratchpad import lay_out
from .tiling import Tiling, choose_tiling

__all__ = ["CARD_OPS", "LOGICAL", "Tiling", "Unsupported", "build", "check_kernel", "memo"]


def check_kernel(k: LoopKernel) -> None:
    """Raise Unsupported if construction could not express this kernel (compile time)."""
    analyse(k)


def memo() -> dict:
    """A construction memo (tile classes, stage programs, DMA patterns): each key holds
    everything its value depends on, so a build that never hits one (tests swap this for
    such a dict) makes the same commands tile by tile."""
    return {}


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


def build_numpy(ctx: BuildContext, k: LoopKernel, tiling: Tiling | None = None) -> Tiling:
    """All tiles' commands, in per-core order, with their dependencies; returns the tiling
    (pass it back to build the same kernel on the same target again without re-deciding it)."""
    if tiling is None:
        tiling = choose_tiling(analyse(k), ctx.target)
    layout = lay_out(tiling.analysis, tiling.rows_per_tile, tiling.scratch_needs, ctx.target.stick_bytes)
    if layout.peak > ctx.target.scratchpad_bytes:
        raise ScratchpadOverflow(f"kernel {k.name} needs {layout.peak} bytes of scratchpad")
    replicate(ctx, tiling, layout, memo)
    ctx.scratchpad_peak = layout.peak
    return tiling
