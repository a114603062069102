"""One core's scratchpad regions for an attention's tiles."""

from __future__ import annotations

import numpy as np

from ... import dtypes
from ...cost import CostModel, round_up
from ..context import ScratchpadPlan
from .shape import Shape
from .tasks import BATCH, CORE, Tiling


class Scratchpad:
    """One core's scratchpad (every core lays it out alike). Offsets in bytes, pitches in
    elements; rows of a task's tiles are its query rows of each head of the group.

    The running state (m, l, O) is one contiguous region, so that a part of a split task
    sends it to its leader in one ring transfer; the leader receives each other part's
    state into a region of its own."""

    def __init__(self, shape: Shape, target: CostModel, tiling: Tiling):
        lx = ScratchpadPlan(target.scratchpad_bytes)
        rows, keys = tiling.q_rows, tiling.kv_block
        big = shape.group * rows  # rows of the largest tile
        e = shape.e_in

        def pitch(n: int, itemsize: int) -> int:
            return round_up(n, target.stick_bytes // itemsize)

        def pair(nbytes: int) -> list[int]:
            return [lx.take(nbytes), lx.take(nbytes)]

        self.q_pitch, self.k_pitch, self.v_pitch = pitch(shape.dim, e), pitch(shape.dim, e), pitch(shape.v_dim, e)
        self.q = pair(big * self.q_pitch * e)
        if tiling.resident:  # a slot for every block of the keys: [first, second] and how many
            self.kv_slots = -(-shape.kv_len // keys)
            nk, nv = keys * self.k_pitch * e, keys * self.v_pitch * e
            k0, v0 = lx.take(self.kv_slots * nk), lx.take(self.kv_slots * nv)
            self.k, self.v = [k0, k0 + nk], [v0, v0 + nv]
        else:
            self.kv_slots = 2
            self.k = pair(keys * self.k_pitch * e)
            self.v = pair(keys * self.v_pitch * e)
        self.e_mask = dtypes.ITEMSIZE.get(shape.mask_dtype, 1)
        self.m_pitch = pitch(keys, self.e_mask)
        self.mask = pair(shape.mask_heads * rows * self.m_pitch * self.e_mask) if shape.mask else [0, 0]
        self.s_pitch = pitch(keys, 4)
        self.s = pair(big * self.s_pitch * 4)
        self.p_pitch = self.s_pitch if shape.fp32 else pitch(keys, e)
        self.p = None if shape.fp32 else lx.take(big * self.p_pitch * e)  # fp32: P is S itself
        self.o_pitch = pitch(shape.v_dim, 4)
        self.row_bytes = round_up(big * 4, 128)
        self.state_bytes = 2 * self.row_bytes + round_up(big * self.o_pitch * 4, 128)
        self.state = lx.take(self.state_bytes)
        self.m, self.l, self.o = self.state, self.state + self.row_bytes, self.state + 2 * self.row_bytes
        parts = tiling.max_parts
        self.recv = [lx.take(self.state_bytes) for _ in range(parts - 1)]
        self.mn, self.safe, self.alpha, self.t = (lx.take(big * 4) for _ in range(4))
        self.flag = lx.take(big)
        self.flag_pitch = pitch(keys, 1)
        self.diag = lx.take(rows * self.s_pitch * 4) if shape.causal else 0
        self.diag_flag = lx.take(rows * self.flag_pitch) if shape.causal else 0
        self.stage_pitch = pitch(shape.v_dim, e)
        self.stage = lx.take(big * self.stage_pitch * e)
        # paged: the block-table row of each batch element a core's tasks read, loaded once
        # (a row of more than a stick loads as whole sticks)
        row = shape.table_width * dtypes.ITEMSIZE.get(shape.table_dtype, 8)
        self.table_pitch = round_up(row, target.stick_bytes if row > target.stick_bytes else 8)
        self.table_rows = _most_batches(tiling) if shape.page else 0
        self.table = lx.take(self.table_rows * self.table_pitch) if shape.page else 0
        self.top = lx.top

    def state_of(self, part: int) -> int:
        """Where the state of part `part` of a task is on its leader's core."""
        return self.state if part == 0 else self.recv[part - 1]

    def sent_bytes(self, rows: int) -> int:
        """The state of a task of `rows` tile rows: m and l, then O."""
        return 2 * self.row_bytes + rows * self.o_pitch * 4



def _most_batches(tiling: Tiling) -> int:
    """The most distinct batch elements among one core's tasks."""
    t = tiling.tasks
    if not len(t):
        return 0
    return int(np.bincount(np.unique(t[:, [CORE, BATCH]], axis=0)[:, 0]).max())
