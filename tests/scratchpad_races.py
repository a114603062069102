"""A race detector for the scratchpads of a program block.

The simulator applies a command's effects when it starts, in timeline order, so a missing
dependency can go unseen in functional results when the timeline happens to order two
accesses right. This checker does not run the program: it takes happens-before to be the
dependencies plus each engine's program order (``spy_engine_of`` in native/program.c) and
requires that every two accesses to the same scratchpad bytes, one of them a write, are
ordered by it. Accesses are byte ranges (a tile's bounding range); ranges are cut into
the elementary intervals their ends make, per core.

A plain module, not a conftest: test modules import it by name.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from spyre_rt.native import lib
from spyre_rt.program import (
    CMD,
    CMD_MM,
    CMD_RING,
    CMD_SFU,
    DESC,
    DMA_DESCS,
    INSTR,
    JOB_HEADER,
    MM_ACCUMULATE,
    MM_TRANS_A,
    MM_TRANS_B,
    OP_LOAD,
    OP_MATMUL,
    OP_RING,
    OP_SFU,
    OP_STORE,
    OPND_COL,
    OPND_ROW,
    OPND_SCALAR,
    OPND_TILE,
    SLOT,
)

ENGINE = {OP_LOAD: 0, lib.SPY_OP_GATHER: 0, OP_STORE: 1, lib.SPY_OP_SCATTER: 1, OP_MATMUL: 2, OP_SFU: 3}
RING_ENGINE, ENGINES_PER_CORE = 4, 5
ITEM = {lib.SPY_DT_F32: 4, lib.SPY_DT_F16: 2, lib.SPY_DT_BF16: 2, lib.SPY_DT_I64: 8, lib.SPY_DT_I32: 4,
        lib.SPY_DT_I8: 1, lib.SPY_DT_U8: 1, lib.SPY_DT_BOOL: 1}


def decode(blob: np.ndarray):
    """(commands, dependencies, instructions, descriptors) of a program block."""
    hdr = blob[: JOB_HEADER.itemsize].view(JOB_HEADER)[0]
    off = JOB_HEADER.itemsize + int(hdr["nslots"]) * SLOT.itemsize
    ncmds, ndeps = int(hdr["ncmds"]), int(hdr["ndeps"])
    cmds = blob[off: off + ncmds * CMD.itemsize].view(CMD)
    off += ncmds * CMD.itemsize
    deps = blob[off: off + ndeps * 4].view(np.uint32)
    off += (ndeps * 4 + 7) & ~7
    instrs = blob[off: off + int(hdr["ninstrs"]) * INSTR.itemsize].view(INSTR)
    off += int(hdr["ninstrs"]) * INSTR.itemsize
    descs = blob[off: off + int(hdr["ndescs"]) * DESC.itemsize].view(DESC)
    return cmds, deps, instrs, descs


def _dma_lx(c, descs) -> list[tuple[int, int]]:
    """Scratchpad ranges a DRAM <-> scratchpad DMA touches."""
    load = c["op"] == OP_LOAD
    if c["flags"] & DMA_DESCS:
        ds = descs[int(c["src_off"]): int(c["src_off"]) + int(c["desc_count"])]
        lx = ds["dst_off"] if load else ds["src_off"]
        return [(int(o), int(o) + int(n)) for o, n in zip(lx, ds["bytes"], strict=True)]
    start = int(c["dst_off"] if load else c["src_off"])
    strides = c["dst_stride"] if load else c["src_stride"]
    span = int(c["run_bytes"]) + sum(int(c["count"][d] - 1) * int(strides[d]) for d in range(int(c["ndims"])))
    return [(start, start + span)]


def _tile(off, rows, cols, pitch, e) -> tuple[int, int]:
    return int(off), int(off) + ((int(rows) - 1) * int(pitch) + int(cols)) * e


def _operand(o, rows, cols) -> tuple[int, int] | None:
    e, kind = ITEM[int(o["dtype"])], int(o["kind"])
    if kind == OPND_TILE:
        return _tile(o["v"], rows, cols, o["pitch"], e)
    if kind == OPND_ROW:
        return _tile(o["v"], rows, 1, o["pitch"], e)
    if kind == OPND_COL:
        return int(o["v"]), int(o["v"]) + int(cols) * e
    if kind == OPND_SCALAR:
        return int(o["v"]), int(o["v"]) + e
    return None


def accesses(cmds, instrs, descs) -> list[tuple[int, int, int, int, bool]]:
    """(command, core, lo, hi, writes) of every scratchpad access."""
    out = []
    for i, c in enumerate(cmds):
        op, core = int(c["op"]), int(c["core"])
        if op in (OP_LOAD, OP_STORE):
            out += [(i, core, lo, hi, op == OP_LOAD) for lo, hi in _dma_lx(c, descs)]
        elif op == OP_MATMUL:
            m = c.view(CMD_MM)
            flags, ea, eb = int(c["flags"]), ITEM[int(m["a_dtype"])], ITEM[int(m["b_dtype"])]
            ta, tb = flags & MM_TRANS_A, flags & MM_TRANS_B
            a = _tile(m["a_off"], m["k"] if ta else m["m"], m["m"] if ta else m["k"], m["lda"], ea)
            b = _tile(m["b_off"], m["n"] if tb else m["k"], m["k"] if tb else m["n"], m["ldb"], eb)
            acc = _tile(m["c_off"], m["m"], m["n"], m["ldc"], 4)
            out += [(i, core, *a, False), (i, core, *b, False), (i, core, *acc, True)]
            if flags & MM_ACCUMULATE:
                out.append((i, core, *acc, False))
        elif op == OP_SFU:
            s = c.view(CMD_SFU)
            for ins in instrs[int(s["instr_begin"]): int(s["instr_begin"]) + int(s["ninstrs"])]:
                for src in ins["src"]:
                    r = _operand(src, ins["rows"], ins["cols"])
                    if r:
                        out.append((i, core, *r, False))
                out.append((i, core, *_operand(ins["dst"], ins["rows"], ins["cols"]), True))
        elif op == OP_RING:
            r = c.view(CMD_RING)
            n = int(r["bytes"])
            out.append((i, core, int(r["ring_src"]), int(r["ring_src"]) + n, False))
            out.append((i, int(r["dst_core"]), int(r["ring_dst"]), int(r["ring_dst"]) + n, True))
    return out


def _engine(c) -> int:
    op = int(c["op"])
    return int(c["core"]) * ENGINES_PER_CORE + ENGINE.get(op, RING_ENGINE)


def _clocks(cmds, deps):
    """A topological order, and vector clocks over the engines: command b happens after a
    iff clock[b][engine(a)] >= seq(a) (seq counts from 1 on each engine)."""
    n = len(cmds)
    engine = np.array([_engine(c) for c in cmds])
    nengines = int(engine.max(initial=0)) + 1
    seq = np.zeros(n, dtype=np.int64)
    prev_on = np.full(n, -1)
    last = {}
    for i in range(n):
        e = int(engine[i])
        seq[i] = seq[last[e]] + 1 if e in last else 1
        prev_on[i] = last.get(e, -1)
        last[e] = i
    preds = [list(deps[int(c["dep_begin"]): int(c["dep_begin"]) + int(c["ndeps"])]) for c in cmds]
    for i in range(n):
        if prev_on[i] >= 0:
            preds[i].append(prev_on[i])
    succ = defaultdict(list)
    indeg = np.zeros(n, dtype=np.int64)
    for i, ps in enumerate(preds):
        for p in ps:
            succ[int(p)].append(i)
            indeg[i] += 1
    order = [i for i in range(n) if indeg[i] == 0]
    clock = np.zeros((n, nengines), dtype=np.int64)
    for i in order:  # grows while iterating: Kahn's algorithm
        if preds[i]:
            clock[i] = clock[np.array(preds[i], dtype=np.int64)].max(axis=0)
        clock[i, engine[i]] = seq[i]
        for s in succ[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                order.append(s)
    assert len(order) == n, "the program has a cycle"
    return order, clock, engine, seq


def races(blob: np.ndarray, limit: int = 10) -> list[str]:
    """Unordered conflicting scratchpad accesses of a program block (empty: none)."""
    cmds, deps, instrs, descs = decode(blob)
    order, clock, engine, seq = _clocks(cmds, deps)
    position = np.empty(len(cmds), dtype=np.int64)
    position[np.array(order, dtype=np.int64)] = np.arange(len(order))

    def after(a: int, b: int) -> bool:
        return a == b or clock[b, engine[a]] >= seq[a]

    by_core = defaultdict(list)
    for acc in accesses(cmds, instrs, descs):
        by_core[acc[1]].append(acc)
    found = []
    for core, accs in by_core.items():
        cuts = np.unique([x for a in accs for x in (a[2], a[3])])
        cells = defaultdict(list)  # elementary interval -> accesses, in topological order
        for a in sorted(accs, key=lambda a: (position[a[0]], not a[4])):
            for cell in range(np.searchsorted(cuts, a[2]), np.searchsorted(cuts, a[3])):
                cells[cell].append(a)
        for cell, accs_ in cells.items():
            writer, readers = None, []
            for cmd, _, _, _, writes in accs_:
                if writer is not None and not after(writer, cmd):
                    found.append(f"core {core} bytes {cuts[cell]}..: command {cmd} ({'write' if writes else 'read'}) "
                                 f"is not ordered after write {writer}")
                if writes:
                    found += [f"core {core} bytes {cuts[cell]}..: write {cmd} is not ordered after read {r}"
                              for r in readers if not after(r, cmd)]
                    writer, readers = cmd, []
                else:
                    readers.append(cmd)
                if len(found) >= limit:
                    return found
    return found
