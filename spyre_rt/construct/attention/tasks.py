"""The tasks of an attention: its work cut into tiles of queries, placed on the cores.

A task is one KV head of one batch element and a tile of query rows; a task whose keys
are split over several cores is in *parts*, and tasks of a sharing group walk one KV
head's keys together (see the column names below).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass

import numpy as np

from ... import dtypes
from ...cost import CostModel
from .cost import task_ns
from .shape import Shape

# Columns of the task table (one row per task, in each core's program order). A task split
# over cores has PARTS > 1 and its parts name the first, their LEADER; tasks of a sharing
# GROUP (one KV head on several cores) walk the same keys in STEPs, in lockstep.
CORE, BATCH, KV_HEAD, Q0, ROWS, KV0, KV1, PART, PARTS, LEADER, GROUP, STEP = range(12)
COLUMNS = 12


@dataclass(frozen=True)
class Tiling:
    """The decisions of construction: query rows per head in a task, keys per block, and
    the tasks (see the column names above), grouped by core in program order."""

    q_rows: int
    kv_block: int
    tasks: np.ndarray  # (ntasks, COLUMNS) int64
    # every core keeps its KV head's keys in the scratchpad across its tasks (sharing groups
    # of several steps): each block of the keys is loaded once per group, not once a step
    resident: bool = False

    @property
    def max_parts(self) -> int:
        """The most parts any task is split into (1 when none is split)."""
        return int(self.tasks[:, PARTS].max()) if len(self.tasks) else 1


def visible_keys(shape: Shape, q0: int, rows: int) -> int:
    """Keys [0, n) that queries [q0, q0 + rows) may see: all but those past the causal
    diagonal of the last row."""
    if not shape.causal:
        return shape.kv_len
    return max(0, min(shape.kv_len, q0 + rows + shape.q_offset))


def split_points(kv_end: int, parts: int, align: int) -> list[int]:
    """Boundaries of `parts` ranges covering [0, kv_end), each starting on `align` keys
    (so every block's mask columns start where a DMA pattern can)."""
    cuts = {0, kv_end}
    for p in range(1, parts):
        cuts.add(min(kv_end, round(p * kv_end / parts / align) * align))
    return sorted(cuts)


def units_of(shape: Shape, q_rows: int) -> list[tuple[int, int, int, int, int]]:
    """(batch, kv head, first query, query rows, keys seen) of every tile of queries."""
    units = []
    for b, h, q0 in itertools.product(range(shape.batch), range(shape.kv_heads), range(0, shape.q_len, q_rows)):
        n = min(q_rows, shape.q_len - q0)
        end = visible_keys(shape, q0, n)
        if end > 0:
            units.append((b, h, q0, n, end))
    return units


def can_share(shape: Shape, target: CostModel, q_rows: int) -> bool:
    """Several cores can walk one KV head's keys together (from its first key, each as far
    as its tile sees: a causal tile's keys end at its diagonal): there are cores enough for
    two or more per KV head and tiles for each."""
    heads = shape.batch * shape.kv_heads
    return target.num_cores // heads >= 2 and -(-shape.q_len // q_rows) >= 2


def make_tasks(shape: Shape, target: CostModel, q_rows: int, kv_block: int, shared: bool = False) -> np.ndarray:
    """The tasks of a tiling, on their cores (see :class:`Tiling`)."""
    units = units_of(shape, q_rows)
    if 0 < len(units) < target.num_cores:
        return _split(shape, target, units, min(shape.page, kv_block) if shape.page else 1)
    if shared:
        return _shared(shape, target, units)
    cost = functools.cache(lambda n, end: task_ns(shape, target, n, end, kv_block))
    return _on_cores(units, [cost(n, end) for _, _, _, n, end in units], target.num_cores)


def _split(shape: Shape, target: CostModel, units: list, unit: int = 1) -> np.ndarray:
    """Too few tiles for the cores: each one's keys in parts on cores of their own (at
    least a stick of mask columns each, and whole `unit`s of keys: paged, the blocks a
    gather moves)."""
    cores = target.num_cores
    align = math.lcm(max(64, target.stick_bytes // dtypes.ITEMSIZE.get(shape.mask_dtype, 2)), unit)
    rows = []
    for i, (b, h, q0, n, end) in enumerate(units):
        parts = cores // len(units) + (i < cores % len(units))
        cuts = split_points(end, min(parts, -(-end // align)), align)
        leader = len(rows)
        for p, (lo, hi) in enumerate(itertools.pairwise(cuts)):
            rows.append([len(rows), b, h, q0, n, lo, hi, p, len(cuts) - 1, leader, -1, 0])
    return np.array(rows, dtype=np.int64).reshape(-1, COLUMNS)


def _shared(shape: Shape, target: CostModel, units: list) -> np.ndarray:
    """Each KV head on a group of cores: its tiles dealt round the group, step by step, so
    that every core of the group reads the same block of keys at once (one of them loads
    each block and sends it to the others: native/build_attention.c). In each step the
    tile that sees the most keys goes to the member with the least so far: causal tiles see
    more keys the later their queries, and dealt in order the last member would take the
    longest tile of every step."""
    per_group = target.num_cores // (shape.batch * shape.kv_heads)
    rows = []
    for g, (_, head) in enumerate(itertools.groupby(units, key=lambda u: u[:2])):  # (batch, KV head)
        head = list(head)
        load = [0] * per_group
        for step in range(-(-len(head) // per_group)):
            dealt = head[step * per_group:(step + 1) * per_group]
            # ties keep the order (tile i of a step to member i): the last tile to the last
            order = sorted(range(len(dealt)), key=lambda i: (-dealt[i][3] * dealt[i][4], -i))
            members = sorted(range(per_group), key=lambda c: (load[c], -c))
            for i, member in zip(order, members[:len(order)], strict=True):
                b, h, q0, n, end = dealt[i]
                load[member] += n * end
                rows.append([g * per_group + member, b, h, q0, n, 0, end, 0, 1, 0, g, step])
    tasks = np.array(rows, dtype=np.int64)
    tasks = tasks[np.lexsort((tasks[:, STEP], tasks[:, CORE]))]
    tasks[:, LEADER] = np.arange(len(tasks))
    return tasks


def _on_cores(units: list, work: list[float], cores: int) -> np.ndarray:
    """Longest task first onto the least loaded core (LPT); each core's tasks in that order."""
    tasks = np.array([[0, b, h, q0, n, 0, end, 0, 1, 0, -1, 0] for b, h, q0, n, end in units],
                     dtype=np.int64).reshape(-1, COLUMNS)
    load = [(0.0, c) for c in range(cores)]
    order = sorted(range(len(work)), key=lambda i: (-work[i], i))
    seq = np.zeros(len(work), dtype=np.int64)
    for rank, i in enumerate(order):
        busy, core = heapq.heappop(load)
        tasks[i, CORE] = core
        seq[i] = rank
        heapq.heappush(load, (busy + work[i], core))
    tasks = tasks[np.lexsort((seq, tasks[:, CORE]))]
    tasks[:, LEADER] = np.arange(len(tasks))  # unsplit: each task is its own leader
    return tasks

