"""Attention construction: flash attention over the cores, S and P in the scratchpads.

The work is cut into *tasks*: one KV head of one batch element and a tile of query rows.
The query heads that share the KV head (its group) are folded into the rows of one tile,
head-major (row ``g * rows + i`` is query ``q0 + i`` of the group's head g), so each block
of K and V is read once for the group and each matmul is group times taller. A task walks
its keys in blocks, keeping S and P in the scratchpad (FlashAttention's online softmax):

    S  = Q K^T                    systolic arrays, fp32 sums; K read transposed in place
    S  = S * scale (+ mask)       SFU; causal blocks across the diagonal masked by an iota
    m' = max(m, rowmax S)         the running max m and sum l of each row
    P  = exp(S - m')              rounded to the operands' dtype for the arrays
    l  = l * exp(m - m') + rowsum P
    O  = O * exp(m - m') + P V

and stores ``O / l`` once. Blocks above the causal diagonal are never visited. When there
are fewer tasks than cores (decode: one query row per head), the keys of a task are split
into *parts* on several cores; each part sends its (m, l, O) over the ring to the core of
the first part, which combines them and stores.

Per core the engines overlap: loads of the next blocks (two scratchpad slots each for Q, K,
V and mask), the matmul S of the next block while the SFU works on this one, then PV.
Every core lays its scratchpad out alike, so one SFU program serves every block of a kind;
commands are made for all blocks at once with numpy. Tile sizes and the tasks of each core
come from a small cost model over the card's figures (:func:`choose`).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..kernels import View
from ..native import lib
from ..program import (
    CMD_DMA,
    CMD_MM,
    CMD_RING,
    CMD_SFU,
    DESC,
    DMA_DESCS,
    MM_ACCUMULATE,
    MM_TRANS_B,
    OP_LOAD,
    OP_MATMUL,
    OP_RING,
    OP_SFU,
    OP_STORE,
)
from .access import NotAffine, descriptor_runs, pattern
from .context import BuildContext, Refused, ScratchpadOverflow, ScratchpadPlan, Target, round_up
from .matmul.graph import unique_rows
from .sfu import COL, ROW, SCALAR, TILE, Operand, Program

# ---- the problem ------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The numbers of an attention that shape its tiles."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    dim: int
    v_dim: int
    dtype: str          # of q, k, v and out
    mask: str           # "" (none), "bool" (keep where true) or "add"
    mask_dtype: str
    mask_heads: int     # mask rows per query: 1 when the heads share them, else the group
    causal: bool
    q_offset: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def e_in(self) -> int:
        return dtypes.ITEMSIZE[self.dtype]

    @property
    def fp32(self) -> bool:
        return self.dtype == "float32"

    @property
    def guarded(self) -> bool:
        """Rows may see no key in a block: the running max may be -inf."""
        return self.causal or bool(self.mask)

    @classmethod
    def of(cls, k, q: View, kv: View, v: View, mask: View | None) -> Shape:
        batch, heads, q_len, dim = q.sizes
        _, kv_heads, kv_len, _ = kv.sizes
        kind = "" if mask is None else "bool" if k.mask_dtype == "bool" else "add"
        mask_heads = 1 if mask is None or mask.strides[1] == 0 else heads // kv_heads
        return cls(batch, heads, kv_heads, q_len, kv_len, dim, v.sizes[3], k.dtype, kind, k.mask_dtype,
                   mask_heads, bool(k.causal), int(k.q_offset))


# ---- tasks -------------------------------------------------------------------------------

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


def can_share(shape: Shape, target: Target, q_rows: int) -> bool:
    """Several cores can walk one KV head's keys together: each tile sees them all, and
    there are cores enough for two or more per KV head and tiles for each."""
    heads = shape.batch * shape.kv_heads
    return not shape.causal and target.num_cores // heads >= 2 and -(-shape.q_len // q_rows) >= 2


def make_tasks(shape: Shape, target: Target, q_rows: int, kv_block: int, shared: bool = False) -> np.ndarray:
    """The tasks of a tiling, on their cores (see :class:`Tiling`)."""
    units = units_of(shape, q_rows)
    if 0 < len(units) < target.num_cores:
        return _split(shape, target, units)
    if shared:
        return _shared(shape, target, units)
    cost = functools.cache(lambda n, end: task_ns(shape, target, n, end, kv_block))
    return _on_cores(units, [cost(n, end) for _, _, _, n, end in units], target.num_cores)


def _split(shape: Shape, target: Target, units: list) -> np.ndarray:
    """Too few tiles for the cores: each one's keys in parts on cores of their own (at
    least a stick of mask columns each)."""
    cores = target.num_cores
    align = max(64, target.stick_bytes // dtypes.ITEMSIZE.get(shape.mask_dtype, 2))
    rows = []
    for i, (b, h, q0, n, end) in enumerate(units):
        parts = cores // len(units) + (i < cores % len(units))
        cuts = split_points(end, min(parts, -(-end // align)), align)
        leader = len(rows)
        for p, (lo, hi) in enumerate(itertools.pairwise(cuts)):
            rows.append([len(rows), b, h, q0, n, lo, hi, p, len(cuts) - 1, leader, -1, 0])
    return np.array(rows, dtype=np.int64).reshape(-1, COLUMNS)


def _shared(shape: Shape, target: Target, units: list) -> np.ndarray:
    """Each KV head on a group of cores: its tiles dealt round the group, step by step, so
    that every core of the group reads the same block of keys at once (see Commands)."""
    per_group = target.num_cores // (shape.batch * shape.kv_heads)
    rows = []
    tiles = -(-shape.q_len // units[0][3])
    for i, (b, h, q0, n, end) in enumerate(units):
        group, tile = divmod(i, tiles)
        core = group * per_group + tile % per_group
        rows.append([core, b, h, q0, n, 0, end, 0, 1, 0, group, tile // per_group])
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


# ---- cost model ----------------------------------------------------------------------------

# A block's SFU work in passes over S (one per instruction over the tile, the exp counted
# as several) and in instructions: an estimate of the program below, for choosing tiles.
SFU_PASSES = 12
SFU_INSTRS = 16


def block_costs(shape: Shape, target: Target, rows: int, keys: int, share: int = 1) -> tuple[float, float, float]:
    """(arrays ns, SFU ns, DRAM bytes) of one block of `rows` query rows per head, its keys
    read by one of `share` cores that walk them together."""
    r = shape.group * rows
    rate = target.macs_per_ns * (target.pt_fp32_ratio if shape.fp32 else 1.0)
    gm, gn = target.gran_m, target.gran_n
    padded = round_up(r, gm) * (round_up(keys, gn) * shape.dim + round_up(shape.v_dim, gn) * keys)
    arrays = padded / rate + 2 * target.pt_latency_ns
    sfu_rate = target.sfu_elems_per_ns * target.sfu_fp32_ratio  # S, O and the row state are fp32
    sfu = (r * keys * SFU_PASSES + r * shape.v_dim) / sfu_rate + SFU_INSTRS * target.sfu_latency_ns
    moved = keys * (shape.dim + shape.v_dim) * shape.e_in / share
    if shape.mask:
        moved += shape.mask_heads * rows * keys * dtypes.ITEMSIZE[shape.mask_dtype]
    return arrays, sfu, moved


def task_ns(shape: Shape, target: Target, rows: int, keys: int, kv_block: int, rate: float | None = None,
            share: int = 1) -> float:
    """A task's time on one core: its blocks, each as long as its slowest engine, the
    loads of its queries and the store of its output spread over them."""
    rate = rate or target.core_dma_bytes_per_ns
    full, rest = divmod(keys, kv_block)
    tile = shape.group * rows * (shape.dim + shape.v_dim) * shape.e_in / (full + (rest > 0))

    def block_ns(n: int) -> float:
        arrays, sfu, moved = block_costs(shape, target, rows, n, share)
        return max(arrays, sfu, (moved + tile) / rate)

    return full * block_ns(kv_block) + (block_ns(rest) if rest else 0.0)


def estimate(shape: Shape, target: Target, tiling: Tiling) -> float:
    """The slowest core's time (ns): its tasks, with DRAM shared by the active cores, and
    the first query tile and the last store not overlapped."""
    t = tiling.tasks
    active = len(np.unique(t[:, CORE]))
    rate = min(target.core_dma_bytes_per_ns, target.dram_bytes_per_ns / active)
    tile_bytes = shape.group * tiling.q_rows * (shape.dim + shape.v_dim) * shape.e_in
    share = np.ones(len(t), dtype=np.int64)
    grouped = t[:, GROUP] >= 0
    if grouped.any():
        _, inverse, counts = np.unique(t[grouped][:, [GROUP, STEP]], axis=0, return_inverse=True, return_counts=True)
        share[grouped] = counts[inverse.ravel()]
    kinds, inverse = np.unique(np.column_stack([t[:, ROWS], t[:, KV1] - t[:, KV0], share]), axis=0,
                               return_inverse=True)
    ns = np.array([task_ns(shape, target, int(r), int(k), tiling.kv_block, rate, int(n)) for r, k, n in kinds])
    per_core = np.bincount(t[:, CORE], weights=ns[inverse.ravel()])
    return float(per_core.max()) + tile_bytes / rate + 2 * target.dma_latency_ns


def candidates(shape: Shape, target: Target) -> list[tuple[int, int, bool]]:
    """(query rows per head, keys per block, shared), the largest tiles first."""
    rows = sorted({shape.q_len} | {r for r in (8, 16, 32, 64, 128, 256, 512) if r < shape.q_len}, reverse=True)
    keys = [k for k in (512, 256, 128, 64) if k < shape.kv_len + 63] or [shape.kv_len]
    return [(r, k, shared) for r in rows for k in keys
            for shared in ((True, False) if can_share(shape, target, r) else (False,))]


@functools.lru_cache(maxsize=256)
def choose(shape: Shape, target: Target) -> Tiling:
    """The tiling with the lowest estimated time whose scratchpad plan fits (made once per
    shape and card: the layers of a model share it)."""
    best, best_ns = None, None
    for rows, keys, shared in candidates(shape, target):
        tiling = Tiling(rows, keys, make_tasks(shape, target, rows, keys, shared))
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


# ---- the scratchpad --------------------------------------------------------------------------

TINY = float(np.finfo(np.float32).tiny)  # a row that saw no key has l = 0 and O = 0: out 0, as torch's CPU kernel


class Scratchpad:
    """One core's scratchpad (every core lays it out alike). Offsets in bytes, pitches in
    elements; rows of a task's tiles are its query rows of each head of the group.

    The running state (m, l, O) is one contiguous region, so that a part of a split task
    sends it to its leader in one ring transfer; the leader receives each other part's
    state into a region of its own."""

    def __init__(self, shape: Shape, target: Target, tiling: Tiling):
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
        parts = int(tiling.tasks[:, PARTS].max()) if len(tiling.tasks) else 1
        self.recv = [lx.take(self.state_bytes) for _ in range(parts - 1)]
        self.mn, self.safe, self.alpha, self.t = (lx.take(big * 4) for _ in range(4))
        self.flag = lx.take(big)
        self.flag_pitch = pitch(keys, 1)
        self.diag = lx.take(rows * self.s_pitch * 4) if shape.causal else 0
        self.diag_flag = lx.take(rows * self.flag_pitch) if shape.causal else 0
        self.stage_pitch = pitch(shape.v_dim, e)
        self.stage = lx.take(big * self.stage_pitch * e)
        self.top = lx.top

    def state_of(self, part: int) -> int:
        """Where the state of part `part` of a task is on its leader's core."""
        return self.state if part == 0 else self.recv[part - 1]

    def sent_bytes(self, rows: int) -> int:
        """The state of a task of `rows` tile rows: m and l, then O."""
        return 2 * self.row_bytes + rows * self.o_pitch * 4


# ---- SFU programs ------------------------------------------------------------------------------

F32 = "float32"
NEG_INF = float("-inf")


def _tile(off: int, pitch: int, dtype: str = F32) -> Operand:
    return Operand(TILE, dtype, off, pitch)


def _row(off: int, dtype: str = F32) -> Operand:
    return Operand(ROW, dtype, off, 1)


def _imm(value: float, dtype: str = F32) -> Operand:
    return Operand(SCALAR, dtype, imm=value)


class Programs:
    """The SFU programs of one attention, each made once and shared by every block of its
    kind (the scratchpad offsets are the same on every core)."""

    def __init__(self, ctx: BuildContext, shape: Shape, lx: Scratchpad, scale: float):
        self.ctx, self.shape, self.lx, self.scale = ctx, shape, lx, scale
        self.made: dict[tuple, tuple[int, int]] = {}

    def get(self, key: tuple) -> tuple[int, int]:
        """(first instruction, count) of the program `key` names (see :meth:`make`)."""
        hit = self.made.get(key)
        if hit is None:
            prog = self.make(*key)
            hit = self.made[key] = (self.ctx.program.add_instrs(prog.array()), len(prog))
        return hit

    def make(self, kind: str, rows: int, *args) -> Program:
        """``("block", rows, slot, keys, first, diagonal)``: one block of keys;
        ``("finish", rows)``: a task's output; ``("combine", rows, parts)``: a split
        task's output from the states of its parts."""
        prog = Program()
        if kind == "block":
            self._block(prog, rows, *args)
            return prog
        if kind == "combine":
            self._combine(prog, rows, *args)
        self._finish(prog, rows)
        return prog

    def _block(self, prog: Program, rows: int, slot: int, keys: int, first: bool, diagonal: int | None) -> None:
        """One block of S: scale, mask, online softmax, P; O rescaled for its next P V."""
        s, lx = self.shape, self.lx
        r = s.group * rows
        S = _tile(lx.s[slot], lx.s_pitch)
        prog.emit(lib.SPY_SFU_MUL, r, keys, S, S, _imm(self.scale))
        if s.mask:
            self._mask(prog, rows, slot, keys, S)
        if diagonal is not None:
            self._diagonal(prog, rows, keys, S, diagonal)
        top, total, t = _row(lx.m), _row(lx.l), _row(lx.t)
        if first:
            prog.emit(lib.SPY_SFU_RMAX, r, keys, top, S)
            safe = self._safe(prog, r, top)
        else:
            mn, alpha = _row(lx.mn), _row(lx.alpha)
            prog.emit(lib.SPY_SFU_RMAX, r, keys, t, S)
            prog.emit(lib.SPY_SFU_MAX, r, 1, mn, top, t)
            safe = self._safe(prog, r, mn)
            prog.emit(lib.SPY_SFU_SUB, r, 1, alpha, top, safe)  # exp(m - m'): how far the old max fell behind
            prog.emit(lib.SPY_SFU_EXP, r, 1, alpha, alpha)
            prog.emit(lib.SPY_SFU_MOV, r, 1, top, mn)
        prog.emit(lib.SPY_SFU_SUB, r, keys, S, S, safe)
        prog.emit(lib.SPY_SFU_EXP, r, keys, S, S)
        prog.emit(lib.SPY_SFU_RSUM, r, keys, total if first else t, S)
        if not first:
            prog.emit(lib.SPY_SFU_MUL, r, 1, total, total, alpha)
            prog.emit(lib.SPY_SFU_ADD, r, 1, total, total, t)
            acc = _tile(lx.o, lx.o_pitch)
            prog.emit(lib.SPY_SFU_MUL, r, s.v_dim, acc, acc, alpha)
        if lx.p is not None:  # the arrays take P in the operands' dtype; l summed it unrounded
            prog.emit(lib.SPY_SFU_MOV, r, keys, _tile(lx.p, lx.p_pitch, s.dtype), S)

    def _mask(self, prog: Program, rows: int, slot: int, keys: int, S: Operand) -> None:
        """The mask tile on S: one instruction when its rows line up with S's (a mask per
        head, or one query row), else one per head of the group."""
        s, lx = self.shape, self.lx
        if s.mask_heads == s.group:
            pairs = [(s.group * rows, S, _tile(lx.mask[slot], lx.m_pitch, s.mask_dtype))]
        elif rows == 1:
            pairs = [(s.group, S, Operand(COL, s.mask_dtype, lx.mask[slot]))]
        else:
            head = rows * lx.s_pitch * 4
            pairs = [(rows, S.at(S.off + g * head), _tile(lx.mask[slot], lx.m_pitch, s.mask_dtype))
                     for g in range(s.group)]
        for r, dst, mask in pairs:
            if s.mask == "bool":
                prog.emit(lib.SPY_SFU_SELECT, r, keys, dst, mask, dst, _imm(NEG_INF))
            else:
                prog.emit(lib.SPY_SFU_ADD, r, keys, dst, dst, mask)

    def _diagonal(self, prog: Program, rows: int, keys: int, S: Operand, start: int) -> None:
        """Keys past the causal diagonal of each row: key kv0 + j for query q0 + i when
        ``start + j - i > 0``, with start = kv0 - q0 - q_offset."""
        s, lx = self.shape, self.lx
        d = _tile(lx.diag, lx.s_pitch)
        past = _tile(lx.diag_flag, lx.flag_pitch, "bool")
        prog.emit(lib.SPY_SFU_IOTA, rows, keys, d, _imm(float(start)), _imm(-1.0), _imm(1.0))
        prog.emit(lib.SPY_SFU_CMP, rows, keys, past, d, _imm(0.0), aux=lib.SPY_CMP_GT)
        head = rows * lx.s_pitch * 4
        for g in range(s.group):
            dst = S.at(S.off + g * head)
            prog.emit(lib.SPY_SFU_SELECT, rows, keys, dst, past, _imm(NEG_INF), dst)

    def _safe(self, prog: Program, r: int, m: Operand) -> Operand:
        """The max to subtract: 0 where a row has seen no key yet (its max is -inf, and
        -inf - -inf would make its exponentials NaN instead of 0)."""
        if not self.shape.guarded:
            return m
        lx = self.lx
        none, safe = _row(lx.flag, "bool"), _row(lx.safe)
        prog.emit(lib.SPY_SFU_CMP, r, 1, none, m, _imm(NEG_INF), aux=lib.SPY_CMP_EQ)
        prog.emit(lib.SPY_SFU_SELECT, r, 1, safe, none, _imm(0.0), m)
        return safe

    def _combine(self, prog: Program, rows: int, parts: int) -> None:
        """The states of a split task's parts folded into the first part's, each scaled by
        exp(its max - the overall max)."""
        s, lx = self.shape, self.lx
        r, dv, rb = s.group * rows, s.v_dim, lx.row_bytes
        states = [lx.state_of(p) for p in range(parts)]
        mn, alpha, t = _row(lx.mn), _row(lx.alpha), _row(lx.t)
        prog.emit(lib.SPY_SFU_MOV, r, 1, mn, _row(states[0]))
        for st in states[1:]:
            prog.emit(lib.SPY_SFU_MAX, r, 1, mn, mn, _row(st))
        safe = self._safe(prog, r, mn)
        l0, o0 = _row(states[0] + rb), _tile(states[0] + 2 * rb, lx.o_pitch)
        for k, st in enumerate(states):
            prog.emit(lib.SPY_SFU_SUB, r, 1, alpha, _row(st), safe)
            prog.emit(lib.SPY_SFU_EXP, r, 1, alpha, alpha)
            if k == 0:
                prog.emit(lib.SPY_SFU_MUL, r, 1, l0, l0, alpha)
                prog.emit(lib.SPY_SFU_MUL, r, dv, o0, o0, alpha)
                continue
            o = _tile(st + 2 * rb, lx.o_pitch)
            prog.emit(lib.SPY_SFU_MUL, r, 1, t, _row(st + rb), alpha)
            prog.emit(lib.SPY_SFU_ADD, r, 1, l0, l0, t)
            prog.emit(lib.SPY_SFU_MUL, r, dv, o, o, alpha)
            prog.emit(lib.SPY_SFU_ADD, r, dv, o0, o0, o)

    def _finish(self, prog: Program, rows: int) -> None:
        """O / l, rounded into the staging tile that is stored."""
        s, lx = self.shape, self.lx
        r, t = s.group * rows, _row(lx.t)
        prog.emit(lib.SPY_SFU_MAX, r, 1, t, _row(lx.l), _imm(TINY))
        prog.emit(lib.SPY_SFU_RECIP, r, 1, t, t)
        prog.emit(lib.SPY_SFU_MUL, r, s.v_dim, _tile(lx.stage, lx.stage_pitch, s.dtype), _tile(lx.o, lx.o_pitch), t)


# ---- DMA ----------------------------------------------------------------------------------------


class Moves:
    """The DMA commands of one operand, one box per item, between a buffer and the
    scratchpad. Boxes with the same counts, scratchpad strides and column in a storage row
    share one pattern (:func:`~spyre_rt.construct.access.pattern`), shifted to where each
    starts. A box with no compact pattern is a descriptor-list DMA of its own, and so is a
    store whose whole-stick runs would spill into columns past its box."""

    def __init__(self, ctx: BuildContext, buf: str, strides: tuple[int, ...], bases: np.ndarray,
                 counts: np.ndarray, lx_strides: np.ndarray, load: bool):
        self.ctx, self.buf, self.strides, self.load = ctx, buf, tuple(strides), load
        self.layout = layout = ctx.layouts[buf]
        self.bases, self.counts, self.lx_strides = bases, counts, lx_strides
        column = bases % layout.row_len if layout.rows > 1 else np.zeros_like(bases)
        firsts, self.kind = unique_rows(np.column_stack([counts, lx_strides, column]))
        self.patterns = [self._pattern(int(i)) for i in firsts]
        phys = layout.phys(bases)
        self.shift = phys - phys[firsts][self.kind]
        self.count = np.array([len(p.bases) if p else 1 for p in self.patterns], dtype=np.int64)[self.kind]

    def _pattern(self, i: int):
        counts, lxs = [int(c) for c in self.counts[i]], [int(x) for x in self.lx_strides[i]]
        base = int(self.bases[i])
        try:
            p = pattern(self.layout, base, counts, self.strides, lxs)
        except NotAffine:
            return None
        spills = p.bytes != math.prod(counts) * self.layout.itemsize
        if not self.load and spills and (base + counts[-1]) % self.layout.row_len:
            return None  # whole sticks would overwrite the columns after the box
        return p

    def fill(self, cmds: np.ndarray, rows: np.ndarray, lx_off: np.ndarray) -> None:
        """Fill the commands at rows[i] .. rows[i] + count[i] - 1 for every item."""
        slot = self.ctx.slot(self.buf)
        cmds["op"][np.repeat(rows, self.count) + _ranks(self.count)] = OP_LOAD if self.load else OP_STORE
        for u, p in enumerate(self.patterns):
            sel = np.flatnonzero(self.kind == u)
            if p is None:
                for i in sel:
                    self._descriptors(cmds, int(rows[i]), int(i), int(lx_off[i]), slot)
                continue
            for j, (dram, lxb) in enumerate(p.bases):
                c = cmds[rows[sel] + j]
                dev, lx = self.shift[sel] + dram, lx_off[sel] + lxb
                if self.load:
                    c["src_slot"], c["src_off"], c["dst_off"] = slot, dev, lx
                else:
                    c["dst_slot"], c["dst_off"], c["src_off"] = slot, dev, lx
                c["run_bytes"], c["ndims"] = p.run, len(p.dims)
                for k, d in enumerate(p.dims):
                    c["count"][:, k] = d.count
                    c["src_stride"][:, k] = d.src if self.load else d.dst
                    c["dst_stride"][:, k] = d.dst if self.load else d.src
                cmds[rows[sel] + j] = c

    def _descriptors(self, cmds: np.ndarray, row: int, i: int, lx_off: int, slot: int) -> None:
        dev, lx, nbytes = descriptor_runs(self.layout, int(self.bases[i]), tuple(int(c) for c in self.counts[i]),
                                          self.strides, lx_off, tuple(int(x) for x in self.lx_strides[i]))
        descs = np.zeros(nbytes.size, dtype=DESC)
        descs["src_off"], descs["dst_off"] = (dev, lx) if self.load else (lx, dev)
        descs["bytes"] = nbytes
        c = cmds[row]
        c["flags"] = DMA_DESCS
        c["src_slot"], c["dst_slot"] = (slot, 0) if self.load else (0, slot)
        c["src_off"], c["desc_count"] = self.ctx.program.add_descs(descs), nbytes.size
        cmds[row] = c


def _ranks(count: np.ndarray) -> np.ndarray:
    """0, 1, ..., count[i] - 1 for every i, concatenated."""
    return np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)


# ---- commands -------------------------------------------------------------------------------------


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


def build(ctx: BuildContext, kernel, tiling: Tiling | None = None) -> Tiling:
    """Build an :class:`~spyre_rt.kernels.AttentionKernel` into the context's program;
    returns its tiling (pass it back to build it again on the same target)."""

    def view(v) -> View | None:
        if v is None:
            return None
        name, off, sizes, strides = v
        return View(name, off + ctx.offset(name), tuple(sizes), tuple(strides))

    for dt in (kernel.dtype,):
        if dt not in dtypes.MATMUL:
            raise Refused(f"attention in {dt}")
    views = {n: view(getattr(kernel, n)) for n in ("q", "k", "v", "out", "mask")}
    shape = Shape.of(kernel, views["q"], views["k"], views["v"], views["mask"])
    tiling = tiling or choose(shape, ctx.target)
    lx = Scratchpad(shape, ctx.target, tiling)
    if len(tiling.tasks):
        Commands(ctx, shape, tiling, lx, views, kernel.scale).add()
    ctx.scratchpad_peak = lx.top
    return tiling
