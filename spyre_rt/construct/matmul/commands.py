"""A matmul's job graph: loads, ring forwards, matmuls, split-K reduction and epilogue.

The schedule (:mod:`.schedule`) says who does what; this module turns it into commands and
their dependencies, every kind of command as whole arrays:

* A and B chunks: one LOAD per shared chunk on its loader, one RING send per other task
  that needs it (after the load landed). Each write into an operand buffer (a load or an
  incoming send) waits for the previous use of that buffer on its core: the matmul that
  read it and the forwards that read it.
* Matmuls: one per use, after both of its chunks arrived; the first of a task overwrites
  the accumulator, so it waits for everything that read the core's previous accumulator.
* Split-K: the partial sum goes over the ring into the receiver's receive buffer (after the
  receiver's previous add read it) and the receiver's SFU adds it.
* Epilogue, on each tile's root: the bias row is loaded, the SFU adds it and rounds the
  accumulator into one of two staging tiles, which is stored.

Program order (the key of each command) is the time order of the steps, with a wave's
reduction and epilogue placed ``nbuf - 1`` steps into the next wave: the forwards of the
next wave's first chunks must not queue on a core's ring port behind its reduction send,
which waits for the last matmul of the wave.
"""

from __future__ import annotations

import numpy as np

from ... import dtypes
from ...native import lib
from ...program import (
    CMD_MM,
    CMD_RING,
    CMD_SFU,
    INSTR,
    MM_ACCUMULATE,
    MM_TRANS_A,
    MM_TRANS_B,
    OP_MATMUL,
    OP_RING,
    OP_SFU,
    OPND_COL,
    OPND_IMM,
    OPND_NONE,
    OPND_TILE,
    empty_cmds,
)
from .. import sfu as sfu_ops
from ..context import BuildContext, ScratchpadPlan, round_up
from ..sfu import TILE
from . import epilogue
from .dma import Patterns, dma_block
from .graph import CommandGraph, Ops, unique_rows
from .schedule import Schedule, Sharing, prev_alike
from .spec import ITEMSIZE, MatmulSpec, Problem
from .tiling import Tiling

# program-order phases inside one step
LOAD, SEND, MATMUL, REDUCE_SEND, REDUCE_ADD, BIAS, EPILOGUE, STORE = range(8)
NONE = (OPND_NONE, 0, 0, 0, 0)


class Scratchpad:
    """The regions every core uses, at the same offsets on all of them (a forwarded chunk
    lands where the receiver reads it)."""

    def __init__(self, ctx: BuildContext, spec: MatmulSpec, p: Problem, t: Tiling, sched: Schedule):
        target = ctx.target
        geo = sched.geometry
        tm, tn = int(geo.m_size.max()), int(geo.n_size.max())
        depth = int(geo.k_size.max(initial=1))
        si = target.stick_bytes // p.e_in
        lx = ScratchpadPlan(target.scratchpad_bytes)
        self.a_pitch = round_up(tm, si) if p.trans_a else round_up(depth, si)
        self.b_pitch = round_up(depth, si) if p.trans_b else round_up(tn, si)
        a_rows, b_rows = (depth if p.trans_a else tm), (tn if p.trans_b else depth)
        self.a = np.array([lx.take(a_rows * self.a_pitch * p.e_in) for _ in range(t.nbuf)])
        self.b = np.array([lx.take(b_rows * self.b_pitch * p.e_in) for _ in range(t.nbuf)])
        self.c_pitch = round_up(tn, 32)
        self.acc = lx.take(tm * self.c_pitch * 4)
        self.recv = lx.take(tm * self.c_pitch * 4) if t.pk > 1 else -1
        # the staging tiles of each stored tile (pitch, itemsize, two offsets): the product's,
        # or an epilogue's outputs
        self.outs = []
        for e in p.e_stores:
            pitch = round_up(tn, target.stick_bytes // e)
            self.outs.append((pitch, e, np.array([lx.take(tm * pitch * e) for _ in range(2)])))
        self.s_pitch, _, self.stage = self.outs[0]
        if spec.bias is not None:
            e_bias = ITEMSIZE.get(spec.bias_dtype, 4)
            self.bias = np.array([lx.take(round_up(tn, target.stick_bytes // e_bias) * e_bias) for _ in range(2)])
        self.epi_in, self.temps = [], []
        if spec.epilogue is not None:  # landing tiles (rows) of its inputs, its temporaries
            ep, pl = spec.epilogue, epilogue.plan(spec.epilogue)
            for dt, kind in zip(ep.input_dtypes, pl.input_kinds, strict=True):
                e = dtypes.ITEMSIZE[dt]
                pitch = round_up(tn, target.stick_bytes // e)
                rows = tm if kind == TILE else 1
                self.epi_in.append((pitch, e, np.array([lx.take(rows * pitch * e) for _ in range(2)])))
            self.temps = [lx.take(tm * self.c_pitch * pl.temp_itemsize) for _ in range(pl.ntemps)]
        self.peak = lx.top  # bytes of each core's scratchpad the program holds


def build(ctx: BuildContext, spec: MatmulSpec, t: Tiling) -> None:
    """Fill the context's program with the matmul's commands under tiling `t`."""
    p = Problem.of(spec)
    if p.batch * p.m * p.n == 0:
        return  # an empty result: nothing to compute or store
    _Builder(ctx, spec, p, t).run()


class _Builder:
    def __init__(self, ctx: BuildContext, spec: MatmulSpec, p: Problem, t: Tiling):
        self.ctx, self.spec, self.p, self.t = ctx, spec, p, t
        self.sched = Schedule.of(ctx.target, p, t)
        self.lx = Scratchpad(ctx, spec, p, t, self.sched)
        self.plan = epilogue.plan(spec.epilogue) if spec.epilogue is not None else None
        self.g = CommandGraph()
        tasks, uses = self.sched.tasks, self.sched.uses
        steps = self.sched.geometry.steps
        self.use_key = (tasks.wave[uses.task] * steps + uses.step) * 8
        # a wave's end goes nbuf - 1 steps into the next wave (see the module docstring)
        self.end_key = ((tasks.wave + 1) * max(steps, 1) + t.nbuf - 2) * 8

    def run(self) -> None:
        a_load, a_in, a_sends = self._operand(self.sched.a, "a")
        b_load, b_in, b_sends = self._operand(self.sched.b, "b")
        mm = self._matmuls()
        for share, arrival, sends in ((self.sched.a, a_in, a_sends), (self.sched.b, b_in, b_sends)):
            self.g.depend(mm, arrival)  # a matmul waits for both of its chunks
            self._buffer_reuse(share, arrival, sends, mm)
        self._in_step_order(self.sched.a, a_load, a_in, b_in)
        self._in_step_order(self.sched.b, b_load, a_in, b_in)
        rsend, radd = self._reduction(mm)
        sfu = self._epilogue(mm, radd)
        self._accumulator_reuse(mm, rsend, radd, sfu)
        self.ctx.block = self.g.encode(self.ctx.program)
        self.ctx.scratchpad_peak = self.lx.peak

    # ---- operands ---------------------------------------------------------------------

    def _operand_boxes(self, which: str, chunk_uses: np.ndarray) -> Patterns:
        """DMA patterns of the chunks loaded at `chunk_uses` (one use per chunk)."""
        tasks, geo, p = self.sched.tasks, self.sched.geometry, self.p
        view = self.spec.a if which == "a" else self.spec.b
        task = self.sched.uses.task[chunk_uses]
        k0 = geo.k_start[self.sched.uses.chunk[chunk_uses]]
        depth = geo.k_size[self.sched.uses.chunk[chunk_uses]]
        st = view.strides
        if which == "a":
            base = view.offset + tasks.batch[task] * st[0] + tasks.row0[task] * st[1] + k0 * st[2]
            box = np.stack([depth, tasks.rows[task]] if p.trans_a else [tasks.rows[task], depth], axis=1)
            trans, pitch = p.trans_a, self.lx.a_pitch
        else:
            base = view.offset + tasks.batch[task] * st[0] + k0 * st[1] + tasks.col0[task] * st[2]
            box = np.stack([tasks.cols[task], depth] if p.trans_b else [depth, tasks.cols[task]], axis=1)
            trans, pitch = p.trans_b, self.lx.b_pitch
        return Patterns(self.ctx, view, (2, 1) if trans else (1, 2), box, pitch * p.e_in, p.e_in, base)

    def _operand(self, share: Sharing, which: str) -> tuple[Ops, Ops, Ops]:
        """(the load of each chunk, what brought each use its chunk: its own load or a
        send, the sends of each chunk as one run of ops), indexed as the schedule does."""
        uses, tasks = self.sched.uses, self.sched.tasks
        slots = self.lx.a if which == "a" else self.lx.b
        loader = share.loader_use
        pats = self._operand_boxes(which, loader)
        view = self.spec.a if which == "a" else self.spec.b
        cmds, first, count = dma_block(pats, np.arange(loader.size), tasks.core[uses.task[loader]],
                                       self.ctx.slot(view.buf), slots[uses.slot[loader]], load=True)
        loads = self.g.add(cmds, self.use_key[loader] + LOAD, first, count)

        # the sends, grouped by chunk so that a chunk's sends are one run of ops
        receivers = np.flatnonzero(~share.loads)
        receivers = receivers[np.argsort(share.chunk[receivers], kind="stable")]
        src_use = loader[share.chunk[receivers]]
        ring = empty_cmds(receivers.size, OP_RING, tasks.core[uses.task[src_use]], CMD_RING)
        ring["dst_core"] = tasks.core[uses.task[receivers]]
        ring["ring_src"] = ring["ring_dst"] = slots[uses.slot[receivers]]
        ring["bytes"] = self._chunk_bytes(which, src_use)
        sent = self.g.add(ring, self.use_key[receivers] + SEND)
        self.g.depend(sent, loads[share.chunk[receivers]])  # a chunk is forwarded once it landed

        arrival = loads[share.chunk].with_runs(receivers, sent.first, 1)
        per_chunk = np.bincount(share.chunk[receivers], minlength=loader.size)
        sends_of_chunk = Ops(sent.first[0] + np.cumsum(per_chunk) - per_chunk if receivers.size
                             else np.zeros(loader.size, dtype=np.int64), per_chunk)
        return loads, arrival, sends_of_chunk

    def _chunk_bytes(self, which: str, use: np.ndarray) -> np.ndarray:
        """Bytes of a chunk in its operand buffer: its rows times the buffer's pitch."""
        tasks, geo, p = self.sched.tasks, self.sched.geometry, self.p
        task = self.sched.uses.task[use]
        depth = geo.k_size[self.sched.uses.chunk[use]]
        if which == "a":
            rows = depth if p.trans_a else tasks.rows[task]
            return rows * self.lx.a_pitch * p.e_in
        rows = tasks.cols[task] if p.trans_b else depth
        return rows * self.lx.b_pitch * p.e_in

    def _buffer_reuse(self, share: Sharing, arrival: Ops, sends_of_chunk: Ops, mm: Ops) -> None:
        """A write into an operand buffer waits for the previous use of that buffer on the
        core: its matmul, and the forwards of its chunk if the core was the loader."""
        prev = self.sched.uses.prev
        before = np.maximum(prev, 0)
        self.g.depend(arrival, mm[before], keep=prev >= 0)
        forwards = sends_of_chunk[share.chunk[before]]
        self.g.depend(arrival, forwards, keep=(prev >= 0) & share.loads[before] & (forwards.counts() > 0))

    def _in_step_order(self, share: Sharing, loads: Ops, a_in: Ops, b_in: Ops) -> None:
        """At the start, when every buffer is free, a load for step c waits until its core
        has the chunks of step c - 1: the first step's chunks get the DRAM to themselves
        instead of sharing it with the next steps'. (Later, buffer reuse paces the loads.)"""
        uses = self.sched.uses
        loader = share.loader_use
        later = (uses.step[loader] > 0) & (uses.prev[loader] < 0)
        self.g.depend(loads, a_in[np.maximum(loader - 1, 0)], keep=later)
        self.g.depend(loads, b_in[np.maximum(loader - 1, 0)], keep=later)

    # ---- matmuls ----------------------------------------------------------------------

    def _matmuls(self) -> Ops:
        uses, tasks, geo, p, lx = self.sched.uses, self.sched.tasks, self.sched.geometry, self.p, self.lx
        task = uses.task
        mm = empty_cmds(task.size, OP_MATMUL, tasks.core[task], CMD_MM)
        mm["a_off"], mm["b_off"], mm["c_off"] = lx.a[uses.slot], lx.b[uses.slot], lx.acc
        mm["m"], mm["n"], mm["k"] = tasks.rows[task], tasks.cols[task], geo.k_size[uses.chunk]
        mm["lda"], mm["ldb"], mm["ldc"] = lx.a_pitch, lx.b_pitch, lx.c_pitch
        mm["a_dtype"] = mm["b_dtype"] = self.spec.in_dtype
        mm["flags"] = (np.where(uses.step > 0, MM_ACCUMULATE, 0) | (MM_TRANS_A if p.trans_a else 0)
                       | (MM_TRANS_B if p.trans_b else 0))
        return self.g.add(mm, self.use_key + MATMUL)

    def _last_mm(self, task: np.ndarray) -> np.ndarray:
        """The last matmul use of each task (-1 for a task without K chunks)."""
        tasks = self.sched.tasks
        return np.where(tasks.nuses[task] > 0, tasks.first_use[task] + tasks.nuses[task] - 1, -1)

    # ---- split-K --------------------------------------------------------------------------

    def _reduction(self, mm: Ops) -> tuple[Ops, Ops]:
        """Sends of partial sums into receive buffers, and the adds that consume them."""
        red, tasks, lx = self.sched.reduction, self.sched.tasks, self.lx
        snd, rcv = red.sender, red.receiver
        if not snd.size:
            return Ops(np.zeros(0, dtype=np.int64)), Ops(np.zeros(0, dtype=np.int64))
        ring = empty_cmds(snd.size, OP_RING, tasks.core[snd], CMD_RING)
        ring["dst_core"] = tasks.core[rcv]
        ring["ring_src"], ring["ring_dst"] = lx.acc, max(lx.recv, 0)
        ring["bytes"] = tasks.rows[snd] * lx.c_pitch * 4
        sends = self.g.add(ring, self.end_key[rcv] + REDUCE_SEND)
        sfu = empty_cmds(snd.size, OP_SFU, tasks.core[rcv], CMD_SFU)
        sfu["ninstrs"] = 1
        sfu["instr_begin"] = self._adds(tasks.rows[rcv], tasks.cols[rcv])
        adds = self.g.add(sfu, self.end_key[rcv] + REDUCE_ADD)
        self.g.depend(sends, mm[self._last_mm(snd)])          # the sender's sum is complete
        own_adds = red.last_add[snd]
        self.g.depend(sends, adds[np.maximum(own_adds, 0)], keep=own_adds >= 0)
        self.g.depend(sends, adds[np.maximum(red.prev_add, 0)], keep=red.prev_add >= 0)  # receive buffer free
        self.g.depend(adds, sends)
        self.g.depend(adds, mm[self._last_mm(rcv)])
        return sends, adds

    def _adds(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """SFU programs acc += recv, one per tile shape; each pair's first instruction."""
        acc = (OPND_TILE, lib.SPY_DT_F32, 0, self.lx.c_pitch, self.lx.acc)
        recv = (OPND_TILE, lib.SPY_DT_F32, 0, self.lx.c_pitch, max(self.lx.recv, 0))
        first, inv = unique_rows(np.stack([rows, cols], axis=1))
        ins = np.zeros(len(first), dtype=INSTR)
        for x, (r, c) in enumerate(zip(rows[first], cols[first], strict=True)):
            ins[x] = (lib.SPY_SFU_ADD, 0, 0, 0, r, c, acc, [acc, recv, NONE])
        return self.ctx.program.add_instrs(ins) + inv.ravel()

    # ---- epilogue -------------------------------------------------------------------------

    def _epilogue(self, mm: Ops, radd: Ops) -> Ops:
        """Per root: bias load, SFU (bias, rounding into staging), stores of the tile."""
        roots, tasks, spec = self.sched.roots, self.sched.tasks, self.spec
        core = tasks.core[roots]
        slot = self.sched.root_seq % 2
        prev = prev_alike(core)
        prev2 = np.where(prev >= 0, prev[np.maximum(prev, 0)], -1)  # the root that used this slot
        key = self.end_key[roots]
        sfu = empty_cmds(roots.size, OP_SFU, core, CMD_SFU)
        sfu["ninstrs"], sfu["instr_begin"] = self._epilogue_programs(slot, tasks.rows[roots], tasks.cols[roots])
        sfus = self.g.add(sfu, key + EPILOGUE)
        if len(mm):
            last = self._last_mm(roots)
            self.g.depend(sfus, mm[np.maximum(last, 0)], keep=last >= 0)
        if len(radd):
            adds = self.sched.reduction.last_add[roots]
            self.g.depend(sfus, radd[np.maximum(adds, 0)], keep=adds >= 0)
        loads = [self._bias_loads(roots, slot, key)] if spec.bias is not None else []
        loads += [self._epilogue_loads(roots, slot, key, i) for i in range(len(self.lx.epi_in))]
        for ld in loads:
            self.g.depend(sfus, ld)
            self.g.depend(ld, sfus[np.maximum(prev2, 0)], keep=prev2 >= 0)  # its tile was read
        for o in range(len(self.lx.outs)):
            stores = self._stores(roots, slot, key, o)
            self.g.depend(stores, sfus)
            self.g.depend(sfus, stores[np.maximum(prev2, 0)], keep=prev2 >= 0)  # staging tile free
            if len(mm):
                self._pace(stores, roots, mm)
        return sfus

    def _pace(self, stores: Ops, roots: np.ndarray, mm: Ops) -> None:
        """Spread a wave's stores over the next wave: the store of the r-th of a wave's R
        roots waits for matmul r * steps / R of its core's next task. Stored all at once,
        the tiles would take most of the DRAM from the next wave's first loads and stall
        the arrays; spread out, they take what the loads leave. The staging tile is not
        needed again before the wave after next."""
        tasks = self.sched.tasks
        following = np.full(tasks.core.size, -1, dtype=np.int64)
        has_prev = tasks.prev_task >= 0
        following[tasks.prev_task[has_prev]] = np.flatnonzero(has_prev)
        nxt = following[roots]
        wave = tasks.wave[roots]
        rank = np.arange(roots.size) - np.searchsorted(wave, wave)
        per_wave = np.bincount(wave)[wave]
        step = rank * tasks.nuses[np.maximum(nxt, 0)] // per_wave
        paced = (nxt >= 0) & (tasks.nuses[np.maximum(nxt, 0)] > 0)
        self.g.depend(stores, mm[tasks.first_use[np.maximum(nxt, 0)] + step], keep=paced)

    def _bias_loads(self, roots: np.ndarray, slot: np.ndarray, key: np.ndarray) -> Ops:
        tasks, bv, e = self.sched.tasks, self.spec.bias, ITEMSIZE.get(self.spec.bias_dtype, 4)
        if bv.strides[1] != 0 and bv.sizes[1] != 1:
            raise ValueError("a matmul bias must be broadcast over the rows")
        base = bv.offset + tasks.batch[roots] * bv.strides[0] + tasks.col0[roots] * bv.strides[2]
        box = np.stack([np.ones_like(roots), tasks.cols[roots]], axis=1)
        pitch = round_up(int(tasks.cols.max()), self.ctx.target.stick_bytes // e) * e
        pats = Patterns(self.ctx, bv, (1, 2), box, pitch, e, base)
        cmds, first, count = dma_block(pats, np.arange(roots.size), tasks.core[roots], self.ctx.slot(bv.buf),
                                       self.lx.bias[slot], load=True)
        return self.g.add(cmds, key + BIAS, first, count)

    def _epilogue_loads(self, roots: np.ndarray, slot: np.ndarray, key: np.ndarray, i: int) -> Ops:
        """Each root's tile (or row, when broadcast over the rows) of the epilogue's input `i`."""
        tasks, v = self.sched.tasks, self.spec.epilogue.inputs[i]
        pitch, e, offs = self.lx.epi_in[i]
        base = v.offset + tasks.batch[roots] * v.strides[0] + tasks.row0[roots] * v.strides[1] \
            + tasks.col0[roots] * v.strides[2]
        rows = tasks.rows[roots] if self.plan.input_kinds[i] == TILE else np.ones_like(roots)
        box = np.stack([rows, tasks.cols[roots]], axis=1)
        pats = Patterns(self.ctx, v, (1, 2), box, pitch * e, e, base)
        cmds, first, count = dma_block(pats, np.arange(roots.size), tasks.core[roots], self.ctx.slot(v.buf),
                                       offs[slot], load=True)
        return self.g.add(cmds, key + BIAS, first, count)

    def _stores(self, roots: np.ndarray, slot: np.ndarray, key: np.ndarray, out: int = 0) -> Ops:
        tasks = self.sched.tasks
        o = self.spec.out if self.spec.epilogue is None else self.spec.epilogue.outputs[out]
        pitch, e, stage = self.lx.outs[out]
        base = o.offset + tasks.batch[roots] * o.strides[0] + tasks.row0[roots] * o.strides[1] \
            + tasks.col0[roots] * o.strides[2]
        box = np.stack([tasks.rows[roots], tasks.cols[roots]], axis=1)
        pats = Patterns(self.ctx, o, (1, 2), box, pitch * e, e, base, writes=True)
        cmds, first, count = dma_block(pats, np.arange(roots.size), tasks.core[roots], self.ctx.slot(o.buf),
                                       stage[slot], load=False)
        return self.g.add(cmds, key + STORE, first, count)

    def _epilogue_programs(self, slot: np.ndarray, rows: np.ndarray, cols: np.ndarray):
        """(instructions, first instruction) of each root's SFU program: zero the
        accumulator when K is empty, add the bias, round into the staging tile."""
        spec, lx = self.spec, self.lx
        acc = (OPND_TILE, lib.SPY_DT_F32, 0, lx.c_pitch, lx.acc)
        zero = (OPND_IMM, lib.SPY_DT_F32, 0, 0, 0)  # 0.0 as the immediate's bits
        first, inv = unique_rows(np.stack([slot, rows, cols], axis=1))
        ins = []  # the programs one after the other, all of one length
        for s_, r, c in zip(slot[first], rows[first], cols[first], strict=True):
            if self.p.k == 0:
                ins.append((lib.SPY_SFU_MOV, 0, 0, 0, r, c, acc, [zero, NONE, NONE]))
            if spec.bias is not None:
                ins.append((lib.SPY_SFU_ADD, 0, 0, 0, r, c, acc,
                            [acc, (OPND_COL, spec.bias_dtype, 0, 0, int(lx.bias[s_])), NONE]))
            if spec.epilogue is None:
                ins.append((lib.SPY_SFU_MOV, 0, 0, 0, r, c,
                            (OPND_TILE, spec.out_dtype, 0, lx.s_pitch, int(lx.stage[s_])), [acc, NONE, NONE]))
            else:
                ins += epilogue.program(
                    spec.epilogue, self.plan, int(r), int(c),
                    sfu_ops.Operand(TILE, "float32", lx.acc, lx.c_pitch), lx.temps, lx.c_pitch,
                    [(int(offs[s_]), pitch) for pitch, _, offs in lx.epi_in],
                    [(int(offs[s_]), pitch) for pitch, _, offs in lx.outs])
        n = len(ins) // len(first)
        begin = self.ctx.program.add_instrs(np.array(ins, dtype=INSTR))
        return n, begin + n * inv

    def _accumulator_reuse(self, mm: Ops, rsend: Ops, radd: Ops, sfu: Ops) -> None:
        """A task's first matmul overwrites the accumulator: the core's previous task must
        have sent it (split-K) and its SFU must have read it."""
        uses, tasks, red = self.sched.uses, self.sched.tasks, self.sched.reduction
        if not len(mm):
            return  # no matmuls: the accumulator is written by the SFU alone, in order
        first = np.flatnonzero(uses.step == 0)
        prev = tasks.prev_task[uses.task[first]]
        has = prev >= 0
        prev = np.maximum(prev, 0)
        if len(rsend):
            sent, added = red.sent[prev], red.last_add[prev]
            self.g.depend(mm[first], rsend[np.maximum(sent, 0)], keep=has & (sent >= 0))
            self.g.depend(mm[first], radd[np.maximum(added, 0)], keep=has & (added >= 0))
        root_of = np.full(tasks.core.size, -1, dtype=np.int64)
        root_of[self.sched.roots] = np.arange(self.sched.roots.size)
        was_root = root_of[prev]
        self.g.depend(mm[first], sfu[np.maximum(was_root, 0)], keep=has & (was_root >= 0))
