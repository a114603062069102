"""Every command of one attention, with its dependencies."""

from __future__ import annotations

import numpy as np

from ... import dtypes
from ...kernels import View
from ...program import (
    CMD_DMA,
    CMD_MM,
    CMD_RING,
    CMD_SFU,
    MM_ACCUMULATE,
    MM_TRANS_B,
    OP_MATMUL,
    OP_RING,
    OP_SFU,
)
from ..context import BuildContext
from .moves import Moves, _ranks
from .programs import Programs
from .scratchpad import Scratchpad
from .shape import Shape
from .tasks import BATCH, CORE, GROUP, KV0, KV1, KV_HEAD, LEADER, PART, PARTS, Q0, ROWS, STEP, Tiling


def sources(tasks: np.ndarray, task: np.ndarray, first_block: np.ndarray) -> np.ndarray:
    """The block that loads each block's K and V: itself, or in a sharing group the block
    at the same step and keys on one of the group's cores (they take turns)."""
    j = np.arange(len(task)) - first_block[task]
    src = np.arange(len(task))
    grouped = np.flatnonzero(tasks[:, GROUP] >= 0)
    for group, step in np.unique(tasks[grouped][:, [GROUP, STEP]], axis=0):
        members = grouped[(tasks[grouped, GROUP] == group) & (tasks[grouped, STEP] == step)]
        sel = np.flatnonzero(np.isin(task, members))
        src[sel] = first_block[members[j[sel] % len(members)]] + j[sel]
    return src


def blocks_of(tiling: Tiling) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every block, in per-core program order: (its task, its first key, its keys)."""
    t = tiling.tasks
    counts = -(-(t[:, KV1] - t[:, KV0]) // tiling.kv_block)
    task = np.repeat(np.arange(len(t)), counts)
    j = np.arange(task.size) - np.repeat(np.cumsum(counts) - counts, counts)
    kv0 = t[task, KV0] + j * tiling.kv_block
    return task, kv0, np.minimum(tiling.kv_block, t[task, KV1] - kv0)




class Links:
    """Dependencies, by groups of consecutive commands: every command of a group waits for
    every command of another (a group of -1 waits for nothing)."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.on: list[np.ndarray] = []

    def add(self, first, count, on_first, on_count=1) -> None:
        args = (first, count, on_first, on_count)
        n = max(np.size(a) for a in args)  # scalars are broadcast
        first, count, on_first, on_count = (np.full(n, a, dtype=np.int64) if np.ndim(a) == 0
                                            else np.asarray(a, dtype=np.int64) for a in args)
        keep = (on_first >= 0) & (count > 0) & (on_count > 0)
        if not keep.all():
            first, count, on_first, on_count = first[keep], count[keep], on_first[keep], on_count[keep]
        pairs = count * on_count
        group = np.repeat(np.arange(len(first)), pairs)
        k = _ranks(pairs)
        self.rows.append(first[group] + k // on_count[group])
        self.on.append(on_first[group] + k % on_count[group])

    def encode(self, cmds: np.ndarray) -> np.ndarray:
        """Set each command's dependency range; the dependency list."""
        rows = np.concatenate(self.rows) if self.rows else np.zeros(0, dtype=np.int64)
        on = np.concatenate(self.on) if self.on else np.zeros(0, dtype=np.int64)
        order = np.argsort(rows, kind="stable")
        counts = np.bincount(rows, minlength=len(cmds))
        cmds["ndeps"] = counts
        cmds["dep_begin"] = np.cumsum(counts) - counts
        return on[order].astype(np.uint32)


class Commands:
    """Every command of one attention, made for all blocks at once.

    Per core, block i brings group A (loads of Q when it starts a task, of K, the mask and
    V; the matmul S = Q K^T) and group B (the SFU program; the matmul O += P V; after a
    task's last block its finish, or the ring transfer of a part's state). Program order
    per core is A0 A1 B0 A2 B1 ...: the arrays compute the next block's S while the SFU
    works on this one's.

    In a sharing group one core loads a block's K and V from DRAM and sends them over the
    ring into the same slots of the group's other cores (the cores take turns, block by
    block): K and V leave DRAM once per group instead of once per tile."""

    def __init__(self, ctx: BuildContext, shape: Shape, tiling: Tiling, lx: Scratchpad, views: dict, scale: float):
        self.ctx, self.shape, self.tiling, self.lx, self.views = ctx, shape, tiling, lx, views
        self.programs = Programs(ctx, shape, lx, scale)
        t = self.tasks = tiling.tasks
        self.task, self.kv0, self.keys = blocks_of(tiling)
        n = len(self.task)
        self.core = t[self.task, CORE]
        self.g = np.arange(n) - np.searchsorted(self.core, self.core)  # the block's place on its core
        starts = self.task[1:] != self.task[:-1]
        self.first = np.concatenate(([True], starts))
        self.last = np.concatenate((starts, [True]))
        self.prev1 = np.where(self.g >= 1, np.arange(n) - 1, -1)
        self.prev2 = np.where(self.g >= 2, np.arange(n) - 2, -1)
        self.first_block, self.last_block = np.flatnonzero(self.first), np.flatnonzero(self.last)
        self.tseq = np.arange(len(t)) - np.searchsorted(t[:, CORE], t[:, CORE])  # the task's place on its core
        self.storing = np.flatnonzero(t[:, PART] == 0)
        self.src = sources(t, self.task, self.first_block)
        self.own = np.flatnonzero(self.src == np.arange(n))
        recv = np.flatnonzero(self.src != np.arange(n))
        self.recv = recv[np.lexsort((recv, self.src[recv]))]  # sends, grouped by the block that sends
        self.nsend = np.bincount(self.src[self.recv], minlength=n)

    # -- DMA of each operand --
    def moves(self) -> None:
        s, t, lx, e = self.shape, self.tasks, self.lx, self.shape.e_in
        q, k, v, out, mask = (self.views[n] for n in ("q", "k", "v", "out", "mask"))
        rows, heads = t[:, ROWS], t[:, KV_HEAD] * s.group
        ones = np.ones(len(t), dtype=np.int64)
        self.mq = Moves(self.ctx, q.buf, q.strides[1:], q.offset + t[:, BATCH] * q.strides[0] + heads * q.strides[1]
                        + t[:, Q0] * q.strides[2], np.column_stack([ones * s.group, rows, ones * s.dim]),
                        np.column_stack([rows * lx.q_pitch * e, ones * lx.q_pitch * e, ones * e]), load=True)
        b = self.task
        self.mk = self._kv(k, lx.k_pitch, s.dim)
        self.mv = self._kv(v, lx.v_pitch, s.v_dim)
        self.mmask = None
        if mask is not None:
            em, brows = lx.e_mask, t[b, ROWS]
            bones = np.ones(len(b), dtype=np.int64)
            base = (mask.offset + t[b, BATCH] * mask.strides[0] + t[b, KV_HEAD] * s.group * mask.strides[1]
                    + t[b, Q0] * mask.strides[2] + self.kv0 * mask.strides[3])
            self.mmask = Moves(self.ctx, mask.buf, mask.strides[1:], base,
                            np.column_stack([bones * s.mask_heads, brows, self.keys]),
                            np.column_stack([brows * lx.m_pitch * em, bones * lx.m_pitch * em, bones * em]), load=True)
        st = self.storing
        srows, sones = rows[st], ones[st]
        self.mo = Moves(self.ctx, out.buf, out.strides[1:], out.offset + t[st, BATCH] * out.strides[0]
                        + heads[st] * out.strides[1] + t[st, Q0] * out.strides[2],
                        np.column_stack([sones * s.group, srows, sones * s.v_dim]),
                        np.column_stack([srows * lx.stage_pitch * e, sones * lx.stage_pitch * e, sones * e]), load=False)

    def _kv(self, view: View, pitch: int, dim: int) -> Moves:
        """Loads of the blocks that read K or V from DRAM themselves."""
        t, b, e, own = self.tasks, self.task[self.own], self.shape.e_in, self.own
        base = (view.offset + t[b, BATCH] * view.strides[0] + t[b, KV_HEAD] * view.strides[1]
                + self.kv0[own] * view.strides[2])
        ones = np.ones(len(b), dtype=np.int64)
        return Moves(self.ctx, view.buf, view.strides[2:], base, np.column_stack([self.keys[own], ones * dim]),
                     np.column_stack([ones * pitch * e, ones * e]), load=True)

    # -- where each command goes --
    def place(self) -> int:
        """Rows of every group's commands; the number of commands."""
        n, t = len(self.task), self.tasks
        # A core's first task loads its queries with its first block's keys; each later
        # task's load while the task before it runs (in its second block, behind that
        # block's own loads: Q has two slots).
        t_all = np.arange(len(t))
        ahead = self.tseq >= 1
        prev_first = self.first_block[np.maximum(t_all - 1, 0)]
        second = np.minimum(prev_first + 1, self.last_block[np.maximum(t_all - 1, 0)])
        self.q_host = np.where(ahead, second, self.first_block)
        self.nq0 = np.zeros(n, dtype=np.int64)  # before the block's mask and V
        self.nq0[self.q_host[~ahead]] = self.mq.count[~ahead]
        self.nq1 = np.zeros(n, dtype=np.int64)  # after them
        self.nq1[self.q_host[ahead]] = self.mq.count[ahead]
        self.nk, self.nv = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        self.nk[self.own], self.nv[self.own] = self.mk.count, self.mv.count
        self.nm = self.mmask.count if self.mmask is not None else np.zeros(n, dtype=np.int64)
        self.no = np.zeros(len(t), dtype=np.int64)
        self.no[self.storing] = self.mo.count
        size_a = self.nq0 + self.nq1 + self.nk + self.nm + self.nv + 2 * self.nsend + 1
        size_b = 2 + np.where(self.last, 1 + self.no[self.task], 0)
        sizes = np.concatenate((size_a, size_b))
        cores = np.concatenate((self.core, self.core))
        order = np.lexsort((np.concatenate((2 * self.g, 2 * self.g + 3)), cores))  # A_i before B_{i-1}: see the class
        start = np.empty(2 * n, dtype=np.int64)
        start[order] = np.cumsum(sizes[order]) - sizes[order]
        self.core_of_row = np.repeat(cores[order], sizes[order])
        a, b = start[:n], start[n:]
        self.k_row = a
        self.m_row = self.k_row + self.nk + self.nq0
        self.v_row = self.m_row + self.nm
        self.q_row = np.where(self.tseq >= 1, (self.v_row + self.nv)[self.q_host], (a + self.nk)[self.q_host])
        self.ks_row = self.v_row + self.nv + self.nq1  # the sends of K, then of V, to the group's other cores
        self.vs_row = self.ks_row + self.nsend
        self.mm1_row = self.vs_row + self.nsend
        self.sfu_row, self.mm2_row, self.end_row = b, b + 1, b + 2
        return int(sizes.sum())

    # -- the commands --
    def fill(self, cmds: np.ndarray) -> None:
        s, t, lx, g = self.shape, self.tasks, self.lx, self.g
        cmds["core"] = self.core_of_row
        self.mq.fill(cmds, self.q_row, np.array(lx.q)[self.tseq % 2])
        own = self.own
        self.mk.fill(cmds, self.k_row[own], np.array(lx.k)[g[own] % 2])
        self.mv.fill(cmds, self.v_row[own], np.array(lx.v)[g[own] % 2])
        self._sends(cmds)
        if self.mmask is not None:
            self.mmask.fill(cmds, self.m_row, np.array(lx.mask)[g % 2])
        rows = s.group * t[self.task, ROWS]
        code = dtypes.CODE[s.dtype]
        mm = cmds.view(CMD_MM)
        for r, a, b, c, m, n, k, lda, ldb, ldc, flags in (
            (self.mm1_row, np.array(lx.q)[self.tseq[self.task] % 2], np.array(lx.k)[g % 2], np.array(lx.s)[g % 2],
             rows, self.keys, s.dim, lx.q_pitch, lx.k_pitch, lx.s_pitch, MM_TRANS_B),  # K as it lies: transposed
            (self.mm2_row, np.array(lx.s)[g % 2] if lx.p is None else lx.p, np.array(lx.v)[g % 2], lx.o,
             rows, s.v_dim, self.keys, lx.p_pitch, lx.v_pitch, lx.o_pitch, np.where(self.first, 0, MM_ACCUMULATE)),
        ):
            mm["op"][r] = OP_MATMUL
            mm["flags"][r] = flags
            mm["a_off"][r], mm["b_off"][r], mm["c_off"][r] = a, b, c
            mm["m"][r], mm["n"][r], mm["k"][r] = m, n, k
            mm["lda"][r], mm["ldb"][r], mm["ldc"][r] = lda, ldb, ldc
            mm["a_dtype"][r], mm["b_dtype"][r] = code, code
        self._sfu(cmds, self.sfu_row, [self._block_key(i) for i in range(len(self.task))])
        self._ends(cmds)

    def _sends(self, cmds: np.ndarray) -> None:
        """K and V of a shared block, from the core that loaded them into the same slots of
        each other core of its group."""
        lx, e, recv = self.lx, self.shape.e_in, self.recv
        src = self.src[recv]
        rank = _ranks(self.nsend[self.nsend > 0]) if len(recv) else np.zeros(0, dtype=np.int64)
        ring = cmds.view(CMD_RING)
        for rows, slots, pitch in ((self.ks_row, lx.k, lx.k_pitch), (self.vs_row, lx.v, lx.v_pitch)):
            r = rows[src] + rank
            ring["op"][r] = OP_RING
            ring["dst_core"][r] = self.core[recv]
            ring["ring_src"][r] = np.array(slots)[self.g[src] % 2]
            ring["ring_dst"][r] = np.array(slots)[self.g[recv] % 2]
            ring["bytes"][r] = self.keys[recv] * pitch * e
        self.send_row = self.ks_row[src] + rank  # of each receiving block's K; its V's is nsend further

    def _block_key(self, i: int) -> tuple:
        s, task = self.shape, self.tasks[self.task[i]]
        kv0, keys = int(self.kv0[i]), int(self.keys[i])
        start = kv0 - int(task[Q0]) - s.q_offset  # key kv0 + j is past query q0 + i's diagonal when start + j > i
        diagonal = start if s.causal and start + keys - 1 > 0 else None
        return ("block", int(task[ROWS]), int(self.g[i] % 2), keys, bool(self.first[i]), diagonal)

    def _sfu(self, cmds: np.ndarray, rows: np.ndarray, keys: list[tuple]) -> None:
        sfu = cmds.view(CMD_SFU)
        sfu["op"][rows] = OP_SFU
        made = np.array([self.programs.get(key) for key in keys], dtype=np.int64).reshape(-1, 2)
        sfu["instr_begin"][rows], sfu["ninstrs"][rows] = made[:, 0], made[:, 1]

    def _ends(self, cmds: np.ndarray) -> None:
        """After a task's last block: its output (finished, or combined from the parts'
        states), or the ring transfer of a part's state to its leader."""
        t, lx = self.tasks, self.lx
        last = self.last_block
        store = self.storing
        keys = [("finish", int(t[i, ROWS])) if t[i, PARTS] == 1 else ("combine", int(t[i, ROWS]), int(t[i, PARTS]))
                for i in store]
        self._sfu(cmds, self.end_row[last[store]], keys)
        self.mo.fill(cmds, self.end_row[last[store]] + 1, np.full(len(store), lx.stage))
        parts = np.flatnonzero(t[:, PART] > 0)
        ring = cmds.view(CMD_RING)
        r = self.end_row[last[parts]]
        ring["op"][r] = OP_RING
        ring["dst_core"][r] = t[t[parts, LEADER], CORE]
        ring["ring_src"][r] = lx.state
        ring["ring_dst"][r] = np.array([lx.state_of(int(p)) for p in t[parts, PART]], dtype=np.int64)
        ring["bytes"][r] = [lx.sent_bytes(self.shape.group * int(n)) for n in t[parts, ROWS]]

    # -- dependencies --
    def links(self) -> Links:
        deps, t = Links(), self.tasks
        p1, p2 = self.prev1, self.prev2

        def at(rows: np.ndarray, i: np.ndarray) -> np.ndarray:  # rows[i], -1 where i is
            return np.where(i >= 0, rows[np.maximum(i, 0)], -1)

        # a scratchpad slot is free once the block two back on the core read it (and sent it)
        deps.add(self.k_row, self.nk, at(self.mm1_row, p2))
        deps.add(self.k_row, self.nk, at(self.ks_row, p2), at(self.nsend, p2))
        deps.add(self.m_row, self.nm, at(self.sfu_row, p2))
        deps.add(self.v_row, self.nv, at(self.mm2_row, p2))
        deps.add(self.v_row, self.nv, at(self.vs_row, p2), at(self.nsend, p2))
        self._send_links(deps, at)
        fb, nq = self.first_block, self.mq.count
        two_back = np.where(self.tseq >= 2, np.arange(len(t)) - 2, -1)
        deps.add(self.q_row, nq, at(self.mm1_row[self.last_block], two_back))
        deps.add(self.mm1_row, 1, self.k_row, self.nk)
        deps.add(self.mm1_row[fb], 1, self.q_row, nq)
        deps.add(self.mm1_row, 1, at(self.sfu_row, p2))  # S slot
        deps.add(self.sfu_row, 1, self.mm1_row)
        deps.add(self.sfu_row, 1, self.m_row, self.nm)
        deps.add(self.sfu_row, 1, at(self.mm2_row, p1))  # P, and O rescaled
        deps.add(self.mm2_row, 1, self.sfu_row)
        deps.add(self.mm2_row, 1, self.v_row, self.nv)
        # a task's first block overwrites the state its core's previous task ended with
        after = fb[p1[fb] >= 0]
        deps.add(self.sfu_row[after], 1, self.end_row[p1[after]])
        deps.add(self.mm2_row[after], 1, self.end_row[p1[after]])
        self._end_links(deps)
        return deps

    def _send_links(self, deps: Links, at) -> None:
        """A send leaves once its block is loaded and the receiver's slot is free; the
        receiver's matmul waits for it."""
        recv, src = self.recv, self.src[self.recv]
        p2 = self.prev2[recv]
        k_send, v_send = self.send_row, self.send_row + self.nsend[src]
        for send, load, nload, reader, sent in ((k_send, self.k_row, self.nk, self.mm1_row, self.ks_row),
                                                (v_send, self.v_row, self.nv, self.mm2_row, self.vs_row)):
            deps.add(send, 1, load[src], nload[src])
            deps.add(send, 1, at(reader, p2))
            deps.add(send, 1, at(sent, p2), at(self.nsend, p2))
            deps.add(reader[recv], 1, send)

    def _end_links(self, deps: Links) -> None:
        t, last = self.tasks, self.last_block
        end = self.end_row[last]
        deps.add(end, 1, self.mm2_row[last])
        st = self.storing
        deps.add(end[st] + 1, self.no[st], end[st])  # the store waits for its staging tile
        previous = {}  # the staging tile is free once the core's previous store is done
        for i in st:
            j = previous.get(int(t[i, CORE]))
            if j is not None:
                deps.add(end[i], 1, end[j] + 1, self.no[j])
            previous[int(t[i, CORE])] = i
        parts = np.flatnonzero(t[:, PART] > 0)  # a leader combines once every part's state arrived
        deps.add(end[t[parts, LEADER]], 1, end[parts])

    def add(self) -> None:
        self.moves()
        cmds = np.zeros(self.place(), dtype=CMD_DMA)
        self.fill(cmds)
        deps = self.links().encode(cmds)
        self.ctx.program.add(cmds, deps)

