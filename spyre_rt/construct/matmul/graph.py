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
