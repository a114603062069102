"""Who does what, and when: the index arithmetic of a tiled matmul (no commands yet).

A *task* is one core's share of a wave: one output tile over one K slice. A *use* is one
step of a task: the matmul of one K chunk, which needs that chunk of A (shared by the
tasks of its grid row) and of B (shared by its grid column). Each shared chunk has one
*loader*, a task that loads it from DRAM and forwards it to the others over the ring; the
loader rotates with the step and the wave so that every core loads and forwards its share
(on a grid with even sides no core loads an A and a B chunk for the same step).

A use's chunks go to operand buffer ``slot = (wave * steps + step) % nbuf``, the same on
every core of the group, so a forwarded chunk lands where the receiver's matmul reads it.
Before a buffer is written again, its previous use on that core must be over: its matmul
and, if the core loaded that chunk, its forwards (``Uses.prev``).

Split-K: the tasks of one tile in slices ``s`` add their partial sums pairwise over the ring
in rounds (slice ``s + 2**r`` into slice ``s`` for ``s`` a multiple of ``2**(r+1)``); the
task of slice 0, the *root*, runs the epilogue and stores the tile.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from ..context import Target
from .spec import Problem
from .tiling import K_GRANULE, Tiling, chunk_count, granule, preferred_granules, split


def _starts(sizes: np.ndarray) -> np.ndarray:
    return np.cumsum(sizes) - sizes


@dataclass
class Geometry:
    """Where the tiles and chunks lie: M and N tiles, K chunks and K slices."""

    m_size: np.ndarray
    m_start: np.ndarray
    n_size: np.ndarray
    n_start: np.ndarray
    k_size: np.ndarray     # per K chunk
    k_start: np.ndarray
    slice_first: np.ndarray  # first chunk of each K slice
    slice_len: np.ndarray
    steps: int             # chunks of the longest slice: steps per wave

    @classmethod
    def of(cls, target: Target, p: Problem, t: Tiling) -> Geometry:
        gm, gn = preferred_granules(target, p)
        m_size = split(p.m, t.m_tiles, granule(p.m, t.m_tiles, gm))
        n_size = split(p.n, t.n_tiles, granule(p.n, t.n_tiles, gn))
        # K slices as even as whole sticks allow, then chunks of tk from each slice's start
        slices = split(p.k, t.pk, granule(p.k, t.pk, K_GRANULE)) if p.k else np.zeros(1, dtype=np.int64)
        slice_len = np.array([chunk_count(int(x), t.tk) for x in slices], dtype=np.int64)
        k_size = np.concatenate([np.minimum(t.tk, x - np.arange(n) * t.tk) for x, n in zip(slices, slice_len,
                                                                                          strict=True)])
        return cls(m_size, _starts(m_size), n_size, _starts(n_size), k_size, _starts(k_size),
                   _starts(slice_len), slice_len, int(slice_len.max()))


@dataclass
class Tasks:
    """One per (block, slice, grid row, grid col), in wave order."""

    wave: np.ndarray
    core: np.ndarray
    batch: np.ndarray
    s: np.ndarray        # K slice
    i: np.ndarray        # grid row
    j: np.ndarray        # grid column
    rows: np.ndarray
    cols: np.ndarray
    row0: np.ndarray
    col0: np.ndarray
    nuses: np.ndarray
    first_use: np.ndarray
    prev_task: np.ndarray  # the core's task before this one (-1: none): the accumulator's last user


@dataclass
class Uses:
    """One per (task, step): a matmul of one K chunk."""

    task: np.ndarray
    step: np.ndarray
    chunk: np.ndarray     # K chunk
    slot: np.ndarray
    prev: np.ndarray      # the core's previous use of the same operand buffers (-1: none)


@dataclass
class Sharing:
    """How one operand's chunks reach the uses that need them."""

    chunk: np.ndarray      # per use: its shared chunk (0 .. nchunks-1)
    loads: np.ndarray      # per use: is its task the chunk's loader
    loader_use: np.ndarray  # per chunk: the use that loads it


@dataclass
class Reduction:
    """Split-K: one send and one add per (tile, round, receiving slice)."""

    sender: np.ndarray    # task
    receiver: np.ndarray  # task
    prev_add: np.ndarray  # per pair: the receiver's add before this one (-1: none)
    last_add: np.ndarray  # per task: its last add (-1: none)
    sent: np.ndarray      # per task: the pair in which it sends its sum (-1: the root)


@dataclass
class Schedule:
    geometry: Geometry
    tasks: Tasks
    uses: Uses
    a: Sharing
    b: Sharing
    reduction: Reduction
    roots: np.ndarray       # tasks of slice 0, in order
    root_seq: np.ndarray    # per root: its position among the roots of its core

    @classmethod
    def of(cls, target: Target, p: Problem, t: Tiling) -> Schedule:
        return _schedule(target, p, t)


# Who does what depends on the shape and the tiling alone (no buffer, layout or address):
# like the tiling (tiling.choose), it is decided once per (target, problem, tiling), the
# work a compiler does once at compile time. Every launch still builds all the commands
# from it. Its arrays are read-only, shared by every build of that matmul.
@functools.lru_cache(maxsize=512)
def _schedule(target: Target, p: Problem, t: Tiling) -> Schedule:
    geo = Geometry.of(target, p, t)
    tasks = _tasks(p, t, geo)
    uses = _uses(tasks, geo, t)
    a = _share(tasks, uses, t, along=tasks.j, across=tasks.i, width=t.pn, offset=0)
    b = _share(tasks, uses, t, along=tasks.i, across=tasks.j, width=t.pm, offset=1)
    roots = np.flatnonzero(tasks.s == 0)
    sched = Schedule(geo, tasks, uses, a, b, _reduction(tasks, t), roots, _seq_on_core(tasks.core[roots]))
    _freeze(sched)
    return sched


def _freeze(x) -> None:
    """Make every array of a schedule (and of its parts) read-only."""
    for f in dataclasses.fields(x):
        v = getattr(x, f.name)
        if isinstance(v, np.ndarray):
            v.flags.writeable = False
        elif dataclasses.is_dataclass(v):
            _freeze(v)


def _seq_on_core(core: np.ndarray) -> np.ndarray:
    """Position of each item among the earlier items of its core (items in order)."""
    order = np.argsort(core, kind="stable")
    sorted_core = core[order]
    first = np.searchsorted(sorted_core, sorted_core)
    seq = np.empty_like(core)
    seq[order] = np.arange(core.size) - first
    return seq


def prev_alike(key: np.ndarray) -> np.ndarray:
    """For items in order: the previous item with the same key (-1: none)."""
    order = np.argsort(key, kind="stable")
    k = key[order]
    same = k[1:] == k[:-1]
    prev = np.full(key.size, -1, dtype=np.int64)
    prev[order[1:][same]] = order[:-1][same]
    return prev


def _tasks(p: Problem, t: Tiling, geo: Geometry) -> Tasks:
    """Blocks in order (batch, M block, N block), dealt to the groups wave by wave."""
    wm, wn = t.m_tiles // t.pm, t.n_tiles // t.pn
    nblocks = p.batch * wm * wn
    block = np.arange(nblocks)
    b, rest = np.divmod(block, wm * wn)
    mb, nb = np.divmod(rest, wn)
    wave, group = np.divmod(block, t.groups)
    # tasks of a block: (s, i, j) with j fastest, so that a grid row sits on neighbouring cores
    rep, local = np.divmod(np.arange(nblocks * t.pk * t.pm * t.pn), t.pk * t.pm * t.pn)
    s, local = np.divmod(local, t.pm * t.pn)
    i, j = np.divmod(local, t.pn)
    mt, nt = mb[rep] * t.pm + i, nb[rep] * t.pn + j
    core = ((group[rep] * t.pk + s) * t.pm + i) * t.pn + j
    nuses = geo.slice_len[s]
    return Tasks(wave[rep], core, b[rep], s, i, j, geo.m_size[mt], geo.n_size[nt], geo.m_start[mt],
                 geo.n_start[nt], nuses, np.cumsum(nuses) - nuses, prev_alike(core))


def _uses(tasks: Tasks, geo: Geometry, t: Tiling) -> Uses:
    task = np.repeat(np.arange(tasks.core.size), tasks.nuses)
    step = np.arange(task.size) - tasks.first_use[task]
    counter = tasks.wave[task] * geo.steps + step  # the same on every core of a slice
    slot = counter % t.nbuf
    return Uses(task, step, geo.slice_first[tasks.s[task]] + step, slot, prev_alike(tasks.core[task] * t.nbuf + slot))


def _share(tasks: Tasks, uses: Uses, t: Tiling, along: np.ndarray, across: np.ndarray, width: int,
           offset: int) -> Sharing:
    """Chunks shared by the tasks that differ only in `along` (a grid row shares A: `along`
    is the column). The loader's position rotates with step and wave; `offset` keeps A and B
    loaders apart on grids with even sides."""
    tk = uses.task
    block = np.arange(tasks.core.size) // t.group_cores  # a block's tasks follow each other
    steps = int(uses.step.max(initial=0)) + 1
    key = ((block[tk] * t.pk + tasks.s[tk]) * max(t.pm, t.pn) + across[tk]) * steps + uses.step
    # the rank of each key among the distinct keys (np.unique's inverse, without its sort:
    # keys are small non-negative integers)
    rank = np.cumsum(np.bincount(key) > 0) - 1
    chunk = rank[key]
    loads = along[tk] == (across[tk] + uses.step + tasks.wave[tk] + offset) % width
    loader_use = np.empty(int(rank[-1]) + 1 if rank.size else 0, dtype=np.int64)
    loader_use[chunk[loads]] = np.flatnonzero(loads)
    return Sharing(chunk, loads, loader_use)


def _reduction(tasks: Tasks, t: Tiling) -> Reduction:
    """The pairwise rounds of split-K, wave by wave and round by round (the time order of a
    core's adds)."""
    n = tasks.core.size
    sender, receiver, rnd = [], [], []
    tile_first = np.flatnonzero(tasks.s == 0)  # tasks of one block and tile: s varies slowest
    stride = t.pm * t.pn
    r = 0
    while (1 << r) < t.pk:
        for s in range(0, t.pk - (1 << r), 1 << (r + 1)):
            receiver.append(tile_first + s * stride)
            sender.append(tile_first + (s + (1 << r)) * stride)
            rnd.append(np.full(tile_first.size, r))
        r += 1
    if not sender:
        empty = np.zeros(0, dtype=np.int64)
        return Reduction(empty, empty, empty, np.full(n, -1), np.full(n, -1))
    sender, receiver, rnd = np.concatenate(sender), np.concatenate(receiver), np.concatenate(rnd)
    order = np.lexsort((rnd, tasks.wave[receiver]))  # wave by wave, round by round
    sender, receiver = sender[order], receiver[order]
    pair = np.arange(sender.size)
    prev_add = prev_alike(tasks.core[receiver])
    last_add = np.full(n, -1, dtype=np.int64)
    np.maximum.at(last_add, receiver, pair)  # pairs are in time order: the last is the largest
    sent = np.full(n, -1, dtype=np.int64)
    sent[sender] = pair
    return Reduction(sender, receiver, prev_add, last_add, sent)
