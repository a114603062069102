"""The choice of tiles: each candidate's tasks estimated, the fastest whose scratchpad fits."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ...cost import CostModel
from ..context import ScratchpadOverflow
from .cost import task_ns
from .scratchpad import Scratchpad
from .shape import Shape
from .tasks import CORE, GROUP, KV0, KV1, ROWS, STEP, Tiling, can_share, make_tasks


def estimate(shape: Shape, target: CostModel, tiling: Tiling) -> float:
    """The slowest core's time (ns): its tasks, with DRAM shared by the active cores, and
    the first query tile and the last store not overlapped."""
    t = tiling.tasks
    active = len(np.unique(t[:, CORE]))
    rate = float(target.dram_share(active))
    tile_bytes = shape.group * tiling.q_rows * (shape.dim + shape.v_dim) * shape.e_in
    share = np.ones(len(t))
    grouped = t[:, GROUP] >= 0
    if grouped.any():
        _, inverse, counts = np.unique(t[grouped][:, [GROUP, STEP]], axis=0, return_inverse=True, return_counts=True)
        share[grouped] = counts[inverse.ravel()]
    if tiling.resident:  # a step's members load only the keys past those of the steps before
        share *= (t[:, KV1] - t[:, KV0]) / np.maximum(_new_keys(t), 1e-9)
    kinds, inverse = np.unique(np.column_stack([t[:, ROWS], t[:, KV1] - t[:, KV0], share]), axis=0,
                               return_inverse=True)
    ns = np.array([task_ns(shape, target, int(r), int(k), tiling.kv_block, rate, n) for r, k, n in kinds])
    # a task's query tile and its output each wait a DMA latency its blocks may not hide
    per_core = np.bincount(t[:, CORE], weights=ns[inverse.ravel()] + 2 * target.dma_latency_ns)
    return float(per_core.max()) + tile_bytes / rate


def _new_keys(t: np.ndarray) -> np.ndarray:
    """For each task of a sharing group, the keys its step sees past those of the group's
    steps before it."""
    new = np.zeros(len(t))
    seen: dict[int, int] = {}
    for step in np.unique(t[:, STEP]):
        for g in np.unique(t[t[:, STEP] == step, GROUP]):
            at = (t[:, STEP] == step) & (t[:, GROUP] == g)
            end = int(t[at, KV1].max())
            new[at] = max(0, end - seen.get(int(g), 0))
            seen[int(g)] = max(end, seen.get(int(g), 0))
    return new


def candidates(shape: Shape, target: CostModel) -> list[tuple[int, int, bool]]:
    """(query rows per head, keys per block, shared), the largest tiles first."""
    rows = sorted({shape.q_len} | {r for r in (8, 16, 32, 64, 128, 256, 512) if r < shape.q_len}, reverse=True)
    keys = [k for k in (512, 256, 128, 64) if k < shape.kv_len + 63] or [shape.kv_len]
    if shape.page:  # a block is whole pages, or rows of one page (a gather each)
        keys = [k for k in (512, 256, 128, 64) if k % shape.page == 0 or shape.page % k == 0] or [shape.page]
    if shape.blocks:  # the keys per block it must keep, and the query rows if not 0
        rows, keys = [shape.blocks[0]] if shape.blocks[0] else rows, [shape.blocks[1]]
    return [(r, k, shared) for r in rows for k in keys
            for shared in ((True, False) if can_share(shape, target, r) else (False,))]


def _resident(shape: Shape, target: CostModel, tiling: Tiling) -> Tiling:
    """`tiling` with its keys resident when every core's slots for them fit (each core's
    tasks are of one KV head: a sharing group walks its keys once a step)."""
    resident = dataclasses.replace(tiling, resident=True)
    try:
        Scratchpad(shape, target, resident)
    except ScratchpadOverflow:
        return tiling
    return resident


@functools.lru_cache(maxsize=256)
def choose(shape: Shape, target: CostModel) -> Tiling:
    """The tiling with the lowest estimated time whose scratchpad plan fits (made once per
    shape and card: the layers of a model share it)."""
    best, best_ns = None, None
    for rows, keys, shared in candidates(shape, target):
        tiling = Tiling(rows, keys, make_tasks(shape, target, rows, keys, shared))
        if (shared and not shape.page and len(tiling.tasks) and tiling.tasks[:, STEP].max() > 0
                and -(-shape.kv_len // keys) > 2):
            tiling = _resident(shape, target, tiling)
        try:
            Scratchpad(shape, target, tiling)
        except ScratchpadOverflow:
            continue
        ns = estimate(shape, target, tiling)
        if best_ns is None or ns < best_ns * 0.98:  # near-ties: the larger tiles, fewer commands
            best, best_ns = tiling, ns
    if best is None:
        raise ScratchpadOverflow(f"no attention tile of head dim {shape.dim} fits the scratchpad")
    best.tasks.flags.writeable = False  # shared by every build that takes this choice
    return best

