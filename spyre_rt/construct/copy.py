"""Construction of byte copies between device buffers.

The card has no DRAM-to-DRAM DMA: a copy streams through the cores' scratchpads. Each
range is cut into chunks, dealt round-robin to the cores; a core double-buffers, so the
load of its chunk g waits only for the store of chunk g-2 (which used the same scratchpad
slot) and loads overlap stores. Python decides the slots; the native builder
(``spy_build_copy``, native/construct.c) makes the commands and encodes them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..native import ffi, lib
from ..program import CMD_DMA, JOB_HEADER, OP_LOAD, OP_STORE, built_block
from .context import BuildContext, round_up

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


def build_numpy(ctx: BuildContext, copies: list[Copy]) -> None:
    """All chunks of `copies` as load/store pairs into the context's program."""
    cores = ctx.target.num_cores
    src_slot, dst_slot, src_off, dst_off, size = [], [], [], [], []
    for c in copies:
        if c.nbytes <= 0:
            continue
        chunk = min(CHUNK_MAX, round_up(-(-c.nbytes // cores), ctx.target.stick_bytes))
        starts = np.arange(0, c.nbytes, chunk, dtype=np.int64)
        src_slot.append(np.full(starts.size, ctx.slot(c.src)))
        dst_slot.append(np.full(starts.size, ctx.slot(c.dst)))
        src_off.append(c.src_off + starts)
        dst_off.append(c.dst_off + starts)
        size.append(np.minimum(chunk, c.nbytes - starts))
    if not size:
        return
    src_slot, dst_slot, src_off, dst_off, size = (np.concatenate(a) for a in
                                                  (src_slot, dst_slot, src_off, dst_off, size))
    n = size.size
    core = np.arange(n) % cores
    seq = np.arange(n) // cores  # the chunk's position on its core
    lx = (seq % 2) * CHUNK_MAX
    # commands: load of chunk i at 2i, its store at 2i + 1
    cmds = np.zeros(2 * n, dtype=CMD_DMA)
    load, store = cmds[0::2], cmds[1::2]
    load["op"], store["op"] = OP_LOAD, OP_STORE
    load["core"] = store["core"] = core
    load["src_slot"], load["src_off"], load["dst_off"] = src_slot, src_off, lx
    store["dst_slot"], store["src_off"], store["dst_off"] = dst_slot, lx, dst_off
    load["run_bytes"] = store["run_bytes"] = size
    # a store waits for its load; a load waits for the store two chunks back on its core
    waits = np.flatnonzero(seq >= 2)
    ndeps = np.zeros(2 * n, dtype=np.int64)
    ndeps[1::2] = 1
    ndeps[2 * waits] = 1
    deps = np.zeros(int(ndeps.sum()), dtype=np.int64)
    begin = np.cumsum(ndeps) - ndeps
    deps[begin[1::2]] = 2 * np.arange(n)
    deps[begin[2 * waits]] = 2 * (waits - 2 * cores) + 1
    cmds["ndeps"] = ndeps
    cmds["dep_begin"] = begin
    ctx.program.add(cmds, deps.astype(np.uint32))
    ctx.scratchpad_peak = 2 * CHUNK_MAX if n > cores else CHUNK_MAX
