"""Construction of byte copies between device buffers.

The card has no DRAM-to-DRAM DMA: a copy streams through the cores' scratchpads. Each
range is cut into chunks, dealt round-robin to the cores; a core double-buffers, so the
load of its chunk g waits only for the store of chunk g-2 (which used the same scratchpad
slot) and loads overlap stores. Python decides the slots; the native builder
(``spy_build_copy``, native/construct.c) makes the commands and encodes them.
"""

from __future__ import annotations

from typing import NamedTuple

from ..native import ffi, lib
from ..program import JOB_HEADER, built_block
from .context import BuildContext

CHUNK_MAX = 256 << 10  # bytes per chunk: two slots stay well inside a 2 MiB scratchpad


class Copy(NamedTuple):
    """``nbytes`` from byte ``src_off`` of buffer ``src`` to byte ``dst_off`` of ``dst``."""

    src: str
    src_off: int
    dst: str
    dst_off: int
    nbytes: int


def build(ctx: BuildContext, copies: list[Copy]) -> None:
    """All chunks of `copies` as load/store pairs: the context's program, built natively
    (``spy_build_copy``) from the copies and the slots of their buffers."""
    live = [c for c in copies if c.nbytes > 0]
    ranges = ffi.new("spy_copy_range[]", max(1, len(live)))
    for r, c in zip(ranges, live, strict=False):
        r.src_slot, r.dst_slot = ctx.slot(c.src), ctx.slot(c.dst)
        r.src_off, r.dst_off, r.nbytes = c.src_off, c.dst_off, c.nbytes
    extents = ffi.new("uint64_t[]", [extent for _, extent in ctx.program.slots] or [0])
    t = ctx.target
    rec = ffi.new("spy_copy_record *", {"num_cores": t.num_cores, "stick_bytes": t.stick_bytes,
                                        "chunk_max": CHUNK_MAX, "scratchpad_bytes": t.scratchpad_bytes,
                                        "nslots": len(ctx.program.slots), "nranges": len(live),
                                        "slot_extent": extents, "ranges": ranges})
    ctx.block = built_block(lib.spy_build_copy, rec, "building a copy kernel")
    chunks = int(ctx.block[:JOB_HEADER.itemsize].view(JOB_HEADER)["ncmds"][0]) // 2
    if chunks:
        ctx.scratchpad_peak = 2 * CHUNK_MAX if chunks > t.num_cores else CHUNK_MAX

