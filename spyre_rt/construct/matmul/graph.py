"""A job graph made of whole arrays of commands at a time.

Commands are added in blocks, each command with a *program-order key*; dependencies are
added between groups of commands, also as arrays. An engine runs its commands in program
order, so the keys decide what may wait behind what. :meth:`CommandGraph.encode` hands
the blocks to the native builder (``spy_build_graph``), which sorts the commands by key
(stably), renumbers the dependencies and encodes the program.
"""

from __future__ import annotations

import numpy as np

from ...native import ffi, lib
from ...program import CMD, DESC, INSTR, SLOT, ProgramBuilder, built_block


class Ops:
    """Operations that are runs of commands in a graph: op ``x`` is commands
    ``[first[x], first[x] + count[x])``; no `count` means one command each (the common
    case, kept without an array of ones)."""

    __slots__ = ("first", "count")

    def __init__(self, first: np.ndarray, count: np.ndarray | None = None):
        self.first = first
        self.count = count

    def __getitem__(self, sel) -> Ops:
        return Ops(self.first[sel], None if self.count is None else self.count[sel])

    def __len__(self) -> int:
        return self.first.size

    def counts(self) -> np.ndarray:
        return np.ones_like(self.first) if self.count is None else self.count

    def with_runs(self, at: np.ndarray, first: np.ndarray, count: np.ndarray | int) -> Ops:
        """A copy in which the ops at `at` are the runs (`first`, `count`)."""
        counts = self.counts().copy()
        firsts = self.first.copy()
        firsts[at], counts[at] = first, count
        return Ops(firsts, None if (counts == 1).all() else counts)


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of each distinct row's first occurrence, in sorted row order; the distinct
    row of each row) of a 2-D array of non-negative integers. The columns are packed into
    one integer key where they fit (a one-dimensional unique is many times faster)."""
    a = np.asarray(a, dtype=np.int64)
    if not len(a) or (a == a[0]).all():  # the common case: every row alike
        return np.zeros(min(len(a), 1), dtype=np.int64), np.zeros(len(a), dtype=np.int64)
    radix = a.max(axis=0) + 1
    if a.size and float(np.prod(radix.astype(float))) < 2.0**62:
        key = a @ np.concatenate([np.cumprod(radix[::-1])[::-1][1:], [1]])
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    else:
        _, first, inverse = np.unique(a, axis=0, return_index=True, return_inverse=True)
    return first, inverse.ravel()


def _bytes(arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """Records of `dtype` from several arrays, concatenated as bytes."""
    if not arrays:
        return np.zeros(0, dtype=np.uint8)
    return np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in arrays])


class CommandGraph:
    def __init__(self) -> None:
        self._blocks: list[np.ndarray] = []
        self._keys: list[np.ndarray] = []
        self._after: list[np.ndarray] = []
        self._before: list[np.ndarray] = []
        self.size = 0

    def add(self, cmds: np.ndarray, key, first: np.ndarray | None = None,
            count: np.ndarray | None = None) -> Ops:
        """Append commands; `key` per command (or per op, with `first`/`count` giving the
        runs of commands that form each op). Returns the ops."""
        base, n = self.size, len(cmds)
        self._blocks.append(cmds.view(CMD))  # one storage dtype, whatever variant filled it
        self.size += n
        if first is None or len(first) == n:  # one command per op
            self._keys.append(key if np.ndim(key) else np.full(n, key, dtype=np.int64))
            return Ops(np.arange(base, base + n))
        self._keys.append(np.repeat(key, count))
        return Ops(first + base, count)

    def depend(self, after: Ops, before: Ops, keep: np.ndarray | None = None) -> None:
        """Every command of op ``after[x]`` waits for every command of ``before[x]``
        (pairs where `keep` is false are skipped)."""
        if after.count is None and before.count is None:  # one command each: no expansion
            self._after.append(after.first if keep is None else after.first[keep])
            self._before.append(before.first if keep is None else before.first[keep])
            return
        if keep is not None:
            after, before = after[keep], before[keep]
        a_count, b_count = after.counts(), before.counts()
        pairs = a_count * b_count
        x = np.repeat(np.arange(len(after)), pairs)
        k = np.arange(pairs.sum()) - np.repeat(np.cumsum(pairs) - pairs, pairs)
        self._after.append(after.first[x] + k // b_count[x])
        self._before.append(before.first[x] + k % b_count[x])

    def encode(self, program: ProgramBuilder) -> np.ndarray:
        """The whole program block: `program`'s slots, SFU instructions and descriptors
        (it holds no commands) with the graph's commands in key order, built natively
        (``spy_build_graph``, native/construct.c)."""
        if program.ncmds:
            raise ValueError("a command graph encodes a program of its commands only")
        # records moved as bytes (a structured concatenate goes field by field)
        cmds = _bytes(self._blocks, CMD)
        keys = np.concatenate(self._keys).astype(np.int64, copy=False) if self._keys else np.zeros(0, np.int64)
        pairs = [np.concatenate(p).astype(np.int64, copy=False) if p else np.zeros(0, np.int64)
                 for p in (self._after, self._before)]
        slots = np.array([(kind, 0, extent) for kind, extent in program.slots], dtype=SLOT)
        instrs, descs = _bytes(program._instrs, INSTR), _bytes(program._descs, DESC)
        rec = ffi.new("spy_graph_record *", {
            "nslots": slots.size, "ninstrs": instrs.size // INSTR.itemsize, "ndescs": descs.size // DESC.itemsize,
            "ncmds": cmds.size // CMD.itemsize, "npairs": pairs[0].size})
        keep = []
        for name, ctype, a in (("slots", "spy_slot *", slots), ("cmds", "spy_cmd *", cmds), ("keys", "int64_t *", keys),
                               ("after", "int64_t *", pairs[0]), ("before", "int64_t *", pairs[1]),
                               ("instrs", "spy_instr *", instrs), ("descs", "spy_desc *", descs)):
            if a.size:
                keep.append(ffi.from_buffer(a))
                setattr(rec, name, ffi.cast(ctype, keep[-1]))
        return built_block(lib.spy_build_graph, rec, "building a command graph")
