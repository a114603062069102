"""A job graph made of whole arrays of commands at a time.

Commands are added in blocks, each command with a *program-order key*; dependencies are
added between groups of commands, also as arrays. An engine runs its commands in program
order, so the keys decide what may wait behind what. :meth:`CommandGraph.commit` sorts
the commands by key (stably), renumbers the dependencies and appends the block to the
program.
"""

from __future__ import annotations

import numpy as np

from ...program import CMD, ProgramBuilder


class Ops:
    """Operations that are runs of commands in a graph: op ``x`` is commands
    ``[first[x], first[x] + count[x])``."""

    __slots__ = ("first", "count")

    def __init__(self, first: np.ndarray, count: np.ndarray | None = None):
        self.first = np.asarray(first, dtype=np.int64)
        self.count = np.ones_like(self.first) if count is None else np.asarray(count, dtype=np.int64)

    def __getitem__(self, sel) -> Ops:
        return Ops(self.first[sel], self.count[sel])

    def __len__(self) -> int:
        return self.first.size


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of each distinct row's first occurrence, in sorted row order; the distinct
    row of each row) of a 2-D array of non-negative integers. The columns are packed into
    one integer key where they fit (a one-dimensional unique is many times faster)."""
    a = np.asarray(a, dtype=np.int64)
    radix = a.max(axis=0, initial=0) + 1
    if a.size and float(np.prod(radix.astype(float))) < 2.0**62:
        key = a @ np.concatenate([np.cumprod(radix[::-1])[::-1][1:], [1]])
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    else:
        _, first, inverse = np.unique(a, axis=0, return_index=True, return_inverse=True)
    return first, inverse.ravel()


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
        base = self.size
        self._blocks.append(cmds.view(CMD))  # one storage dtype, whatever variant filled it
        if first is None:
            first = np.arange(len(cmds))
        ops = Ops(first + base, count)
        keys = np.broadcast_to(np.asarray(key, dtype=np.int64), (len(ops),))
        self._keys.append(np.repeat(keys, ops.count) if count is not None else keys.copy())
        self.size += len(cmds)
        return ops

    def depend(self, after: Ops, before: Ops, keep: np.ndarray | None = None) -> None:
        """Every command of op ``after[x]`` waits for every command of ``before[x]``
        (pairs where `keep` is false are skipped)."""
        if keep is not None:
            after, before = after[keep], before[keep]
        if not len(after):
            return
        if (after.count == 1).all() and (before.count == 1).all():
            self._after.append(after.first)
            self._before.append(before.first)
            return
        pairs = after.count * before.count
        x = np.repeat(np.arange(len(after)), pairs)
        k = np.arange(pairs.sum()) - np.repeat(np.cumsum(pairs) - pairs, pairs)
        self._after.append(after.first[x] + k // before.count[x])
        self._before.append(before.first[x] + k % before.count[x])

    def commit(self, program: ProgramBuilder) -> int:
        """Append the commands to the program in key order; returns the first's index."""
        raw = np.concatenate([b.view(np.uint8).reshape(len(b), CMD.itemsize) for b in self._blocks])
        order = np.argsort(np.concatenate(self._keys), kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        cmds = raw[order].reshape(-1).view(CMD)  # records moved as bytes: no field promotion
        if self._after:
            after = rank[np.concatenate(self._after)]
            before = rank[np.concatenate(self._before)]
            by = np.argsort(after, kind="stable")
            after, before = after[by], before[by]
            ndeps = np.bincount(after, minlength=cmds.size)
        else:
            before = np.zeros(0, dtype=np.int64)
            ndeps = np.zeros(cmds.size, dtype=np.int64)
        cmds["ndeps"] = ndeps
        cmds["dep_begin"] = np.cumsum(ndeps) - ndeps
        return program.add(cmds, before.astype(np.uint32))
