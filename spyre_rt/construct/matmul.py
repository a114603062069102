"""Matmul construction: C[b] = alpha * A[b] @ B[b] (+ beta * bias), tiled over the cores.

Output tiles (tm x tn) are dealt round-robin to the 32 cores. Each core walks its tiles;
for every K chunk it loads an A tile and a B tile into one of two scratchpad slots (double
buffering: the load of chunk g waits only for the matmul of chunk g-2) and accumulates
on the systolic arrays into an fp32 tile. After the last chunk the SFU applies the
epilogue (bias, scaling) and rounds into one of two staging tiles, which is stored.
Operands whose K dimension is not the contiguous one are loaded transposed and the
matmul command says so, so a weight used as ``W.t()`` is read as it lies in memory.

Tile sizes come from a small cost model over the profile's figures, under the scratchpad
capacity (checked again by the card when the program is committed).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..native import lib
from ..program import (
    CMD_MM,
    CMD_SFU,
    DESC,
    DMA_DESCS,
    INSTR,
    MM_ACCUMULATE,
    MM_TRANS_A,
    MM_TRANS_B,
    OP_LOAD,
    OP_MATMUL,
    OP_SFU,
    OP_STORE,
    OPND_COL,
    OPND_NONE,
    OPND_TILE,
    empty_cmds,
)
from .access import NotAffine, Pattern, descriptor_runs, pattern
from .context import BuildContext, ScratchpadOverflow, ScratchpadPlan, Target, round_up


@dataclass(frozen=True)
class View:
    """A strided view of a buffer, in logical elements (plain data)."""

    buf: str
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True)
class MatmulSpec:
    a: View          # (batch, M, K)
    b: View          # (batch, K, N)
    out: View        # (batch, M, N)
    in_dtype: int    # spy dtype of A and B
    out_dtype: int
    bias: View | None = None  # broadcast to (batch, M, N)
    bias_dtype: int = 0
    alpha: float = 1.0
    beta: float = 1.0


@dataclass(frozen=True)
class Tiles:
    tm: int
    tn: int
    tk: int


ITEMSIZE = {dtypes.CODE[n]: dtypes.ITEMSIZE[n] for n in dtypes.MATMUL}  # by SPY_DT_* code


def _candidates(dim: int, options, gran: int) -> list[int]:
    if dim <= gran:
        return [dim]
    out = [o for o in options if o <= round_up(dim, gran)]
    return out or [gran]


def lx_bytes(t: Tiles, e_in: int, e_out: int, bias: bool, trans_a: bool, trans_b: bool,
             stick_bytes: int = 128) -> int:
    """Scratchpad bytes one core needs for these tiles (the plan `build` lays out)."""
    si, so = stick_bytes // e_in, stick_bytes // e_out
    a = t.tk * round_up(t.tm, si) if trans_a else t.tm * round_up(t.tk, si)
    b = t.tn * round_up(t.tk, si) if trans_b else t.tk * round_up(t.tn, si)
    c = t.tm * round_up(t.tn, 32) * 4
    stage = t.tm * round_up(t.tn, so) * e_out
    total = sum(round_up(x, 128) for x in (a * e_in, a * e_in, b * e_in, b * e_in, c, stage, stage))
    return total + (2 * round_up(t.tn * 4, 128) if bias else 0)


def choose_tiles(target: Target, batch: int, m: int, n: int, k: int, e_in: int, e_out: int,
                 bias: bool, trans_a: bool = False, trans_b: bool = False) -> Tiles:
    """The tile shape with the lowest estimated time that fits the scratchpad.

    The estimate per core is the larger of its arithmetic and its share of DRAM traffic
    (all active cores stream at once), plus a fixed cost per command."""
    best, best_cost = None, None
    for tm, tn, tk in itertools.product(
        _candidates(m, (8, 16, 32, 64, 128, 256, 512), 8),
        _candidates(n, (64, 128, 256, 384, 512), 64),
        _candidates(k, (64, 128, 256, 512, 1024, 2048, 4096), 64),
    ):
        t = Tiles(tm, tn, tk)
        if lx_bytes(t, e_in, e_out, bias, trans_a, trans_b, target.stick_bytes) > target.scratchpad_bytes:
            continue
        tiles = batch * -(-m // tm) * -(-n // tn)
        active = min(tiles, target.num_cores)
        per_core = -(-tiles // target.num_cores)
        macs = round_up(tm, target.gran_m) * round_up(tn, target.gran_n) * k
        compute = macs / target.macs_per_ns
        moved = (tm * k + k * tn) * e_in + tm * tn * e_out
        dma = moved / min(target.core_dma_bytes_per_ns, target.dram_bytes_per_ns / active)
        chunks = -(-k // tk)
        cost = per_core * (max(compute, dma) + 300 * (3 * chunks + 2))
        if best_cost is None or cost < best_cost * 0.999:
            best, best_cost = t, cost
    if best is None:
        raise ScratchpadOverflow(f"no matmul tile of {m}x{n}x{k} fits the scratchpad")
    return best


def _orientation(view: View, contiguous_inner: int, other: int) -> bool:
    """True when the view must be loaded transposed (its `other` dim is the contiguous one)."""
    if view.strides[contiguous_inner] == 1 or view.sizes[contiguous_inner] == 1:
        return False
    if view.strides[other] == 1 or view.sizes[other] == 1:
        return True
    raise ValueError(f"matmul operand {view.buf} has no contiguous dimension (strides {view.strides})")


class _Patterns:
    """The DMA patterns of one operand over many tiles: tiles whose boxes have the same
    shape and start at the same column of a storage row share a pattern and differ only by
    where they start. A box with no compact pattern (its columns wrap into the next storage
    row, as in a matmul over a reshaped input) is moved by a descriptor list of its own."""

    def __init__(self, ctx: BuildContext, view: View, dims: tuple[int, int], boxes: np.ndarray,
                 lx_pitch: int, itemsize: int, bases: np.ndarray):
        layout = ctx.layouts[view.buf]
        self.ctx, self.layout = ctx, layout
        self.strides = (view.strides[dims[0]], view.strides[dims[1]])
        self.lx_strides = (lx_pitch, itemsize)
        self.boxes = boxes
        self.bases = bases = np.asarray(bases, dtype=np.int64)
        # A pattern depends on the box and on where it starts in its storage row (how it
        # meets the sticks and whether it reaches the row's end); boxes a whole number of
        # rows apart share it. A one-row storage is linear: every start shares it.
        column = bases % layout.row_len if layout.rows > 1 else np.zeros_like(bases)
        keys = np.stack([boxes[:, 0], boxes[:, 1], column], axis=1)
        uniq, self.pid = np.unique(keys, axis=0, return_inverse=True)
        self.pid = self.pid.ravel()
        self.patterns: list[Pattern | None] = []
        origin = np.zeros(len(uniq), dtype=np.int64)
        for u, key in enumerate(uniq):
            first = int(np.flatnonzero(self.pid == u)[0])
            try:
                p = pattern(layout, int(bases[first]), (int(key[0]), int(key[1])), self.strides, self.lx_strides)
            except NotAffine:
                p = None
            self.patterns.append(p)
            origin[u] = layout.phys(int(bases[first]))
        # device byte offset of each tile relative to its pattern's first base
        self.start = layout.phys(bases) - origin[self.pid]
        self.nbases = np.array([len(p.bases) if p else 1 for p in self.patterns], dtype=np.int64)[self.pid]

    def descriptors(self, item: int, lx_off: int, load: bool) -> tuple[int, int]:
        """(first descriptor, count) of a descriptor-list DMA moving one item's box."""
        dev, lx, nbytes = descriptor_runs(self.layout, int(self.bases[item]), tuple(int(c) for c in self.boxes[item]),
                                          self.strides, lx_off, self.lx_strides)
        descs = np.zeros(nbytes.size, dtype=DESC)
        descs["src_off"], descs["dst_off"] = (dev, lx) if load else (lx, dev)
        descs["bytes"] = nbytes
        return self.ctx.program.add_descs(descs), int(nbytes.size)


def _fill_dmas(cmds: np.ndarray, rows: np.ndarray, pats: _Patterns, items: np.ndarray, slot: int,
               lx_off: np.ndarray, load: bool) -> None:
    """Fill the DMA commands at `rows` (one run of len(bases) rows per item) for the items
    (tiles or chunks) of an operand; lx_off is each item's scratchpad region."""
    for u, p in enumerate(pats.patterns):
        sel = np.flatnonzero(pats.pid[items] == u)
        if not sel.size:
            continue
        if p is None:
            for s_ in sel:
                first, n = pats.descriptors(int(items[s_]), int(lx_off[s_]), load)
                c = cmds[rows[s_]]
                c["flags"] = DMA_DESCS
                c["src_slot"], c["dst_slot"] = (slot, 0) if load else (0, slot)
                c["src_off"], c["desc_count"] = first, n
                cmds[rows[s_]] = c
            continue
        for j, (dram, lxb) in enumerate(p.bases):
            r = rows[sel] + j
            dev = pats.start[items[sel]] + dram
            lxo = lx_off[sel] + lxb
            c = cmds[r]
            if load:
                c["src_slot"], c["src_off"], c["dst_off"] = slot, dev, lxo
            else:
                c["dst_slot"], c["dst_off"], c["src_off"] = slot, dev, lxo
            c["run_bytes"] = p.run
            c["ndims"] = len(p.dims)
            for k, d in enumerate(p.dims):
                c["count"][:, k] = d.count
                c["src_stride"][:, k] = d.src if load else d.dst
                c["dst_stride"][:, k] = d.dst if load else d.src
            cmds[r] = c


def build(ctx: BuildContext, spec: MatmulSpec, tiles: Tiles | None = None) -> Tiles:
    t = ctx.target
    batch, m, k = spec.a.sizes
    n = spec.b.sizes[2]
    e_in, e_out = ITEMSIZE[spec.in_dtype], ITEMSIZE[spec.out_dtype]
    has_bias = spec.bias is not None
    if spec.alpha != 1 or spec.beta != 1:
        raise NotImplementedError("matmul alpha/beta other than 1 are lowered to pointwise ops")
    trans_a = _orientation(spec.a, 2, 1)
    trans_b = _orientation(spec.b, 2, 1)
    tiles = tiles or choose_tiles(t, batch, m, n, k, e_in, e_out, has_bias, trans_a, trans_b)
    tm, tn, tk = tiles.tm, tiles.tn, tiles.tk
    stick_in = t.stick_bytes // e_in
    stick_out = t.stick_bytes // e_out

    # ---- scratchpad plan (identical on every core) ----
    lx = ScratchpadPlan(t.scratchpad_bytes)
    a_rows, a_pitch = (tk, round_up(tm, stick_in)) if trans_a else (tm, round_up(tk, stick_in))
    b_rows, b_pitch = (tn, round_up(tk, stick_in)) if trans_b else (tk, round_up(tn, stick_in))
    a_slot = np.array([lx.take(a_rows * a_pitch * e_in) for _ in range(2)])
    b_slot = np.array([lx.take(b_rows * b_pitch * e_in) for _ in range(2)])
    c_pitch = round_up(tn, 32)
    c_off = lx.take(tm * c_pitch * 4)
    s_pitch = round_up(tn, stick_out)
    stage = np.array([lx.take(tm * s_pitch * e_out) for _ in range(2)])
    e_bias = ITEMSIZE.get(spec.bias_dtype, 4)
    bias_pitch = round_up(tn, t.stick_bytes // e_bias)
    bias_slot = np.array([lx.take(bias_pitch * e_bias) for _ in range(2)]) if has_bias else None

    # ---- the schedule: tiles round-robin over cores, K chunks inside each tile ----
    mt, nt, kt = -(-m // tm), -(-n // tn), -(-k // tk)
    tb, tmi, tni = (x.ravel() for x in np.meshgrid(np.arange(batch), np.arange(mt), np.arange(nt), indexing="ij"))
    core = np.arange(tb.size) % t.num_cores
    order = np.argsort(core, kind="stable")  # tiles grouped by core, each core in tile order
    tb, tmi, tni, core = tb[order], tmi[order], tni[order], core[order]
    ntiles = tb.size
    rows = np.minimum(tm, m - tmi * tm)
    cols = np.minimum(tn, n - tni * tn)
    core_first = np.searchsorted(core, core)  # index of the first tile of each tile's core
    seq = np.arange(ntiles) - core_first       # position of the tile on its core

    ch_tile = np.repeat(np.arange(ntiles), kt)
    ch_k = np.tile(np.arange(kt), ntiles)
    ch_g = seq[ch_tile] * kt + ch_k             # per-core chunk counter: A/B slot = g % 2
    depth = np.minimum(tk, k - ch_k * tk)
    last = ch_k == kt - 1

    # ---- operand patterns ----
    a_base = (spec.a.offset + tb[ch_tile] * spec.a.strides[0] + tmi[ch_tile] * tm * spec.a.strides[1]
              + ch_k * tk * spec.a.strides[2])
    a_box = np.stack([depth, rows[ch_tile]] if trans_a else [rows[ch_tile], depth], axis=1)
    pa = _Patterns(ctx, spec.a, (2, 1) if trans_a else (1, 2), a_box, a_pitch * e_in, e_in, a_base)
    b_base = (spec.b.offset + tb[ch_tile] * spec.b.strides[0] + ch_k * tk * spec.b.strides[1]
              + tni[ch_tile] * tn * spec.b.strides[2])
    b_box = np.stack([cols[ch_tile], depth] if trans_b else [depth, cols[ch_tile]], axis=1)
    pb = _Patterns(ctx, spec.b, (2, 1) if trans_b else (1, 2), b_box, b_pitch * e_in, e_in, b_base)
    o = spec.out
    o_base = o.offset + tb * o.strides[0] + tmi * tm * o.strides[1] + tni * tn * o.strides[2]
    po = _Patterns(ctx, o, (1, 2), np.stack([rows, cols], axis=1), s_pitch * e_out, e_out, o_base)
    if has_bias:
        bv = spec.bias
        if bv.strides[1] != 0 and bv.sizes[1] != 1:
            raise ValueError("a matmul bias must be broadcast over the rows")
        bias_base = bv.offset + tb * bv.strides[0] + tni * tn * bv.strides[2]
        pbias = _Patterns(ctx, bv, (1, 2), np.stack([np.ones_like(cols), cols], axis=1),
                          bias_pitch * e_bias, e_bias, bias_base)
        nbias = pbias.nbases
    else:
        nbias = np.zeros(ntiles, dtype=np.int64)

    # ---- command positions: per chunk [A.., B.., MM] then, after a tile's last chunk,
    #      [bias.., SFU, stores..] ----
    na, nb_ = pa.nbases, pb.nbases
    tail = np.where(last, nbias[ch_tile] + 1 + po.nbases[ch_tile], 0)
    count = na + nb_ + 1 + tail
    pos_a = np.cumsum(count) - count
    pos_b = pos_a + na
    pos_mm = pos_b + nb_
    pos_bias = pos_mm + 1
    pos_sfu = pos_bias + nbias[ch_tile]
    pos_st = pos_sfu + 1
    total = int(count.sum())
    cmds = np.zeros(total, dtype=empty_cmds(0, 0).dtype)
    ch_core = core[ch_tile]
    cmds["core"] = np.repeat(ch_core, count)

    # ---- dependencies ----
    n_deps = np.zeros(total, dtype=np.int64)
    dep_rows, dep_vals = [], []

    def depend(rows_: np.ndarray, on: np.ndarray) -> None:
        keep = on >= 0
        dep_rows.append(rows_[keep])
        dep_vals.append(on[keep])

    prev2 = np.where(ch_g >= 2, pos_mm[np.maximum(np.arange(ch_g.size) - 2, 0)], -1)
    for j in range(int(na.max())):
        sel = na > j
        depend(pos_a[sel] + j, prev2[sel])
        depend(pos_mm[sel], pos_a[sel] + j)
    for j in range(int(nb_.max())):
        sel = nb_ > j
        depend(pos_b[sel] + j, prev2[sel])
        depend(pos_mm[sel], pos_b[sel] + j)
    # a tile's first matmul overwrites the accumulator: the previous tile's SFU must be done
    first_chunk = (ch_k == 0) & (seq[ch_tile] >= 1)
    idx = np.flatnonzero(first_chunk)
    depend(pos_mm[idx], pos_sfu[idx - 1])
    li = np.flatnonzero(last)                   # chunk index of each tile's end, in tile order
    two_back = np.where(seq >= 2, li - 2 * kt, -1)  # the tile that used this staging/bias slot
    if has_bias:
        for j in range(int(nbias.max())):
            sel = nbias > j
            depend(pos_bias[li[sel]] + j, np.where(two_back[sel] >= 0, pos_sfu[two_back[sel]], -1))
            depend(pos_sfu[li[sel]], pos_bias[li[sel]] + j)
    depend(pos_sfu[li], pos_mm[li])
    last_store = pos_st + po.nbases[ch_tile] - 1
    depend(pos_sfu[li], np.where(two_back >= 0, last_store[np.maximum(two_back, 0)], -1))
    for j in range(int(po.nbases.max())):
        sel = po.nbases > j
        depend(pos_st[li[sel]] + j, pos_sfu[li[sel]])
    drow = np.concatenate(dep_rows)
    dval = np.concatenate(dep_vals)
    order_ = np.argsort(drow, kind="stable")
    drow, dval = drow[order_], dval[order_]
    np.add.at(n_deps, drow, 1)
    cmds["ndeps"] = n_deps
    cmds["dep_begin"] = np.cumsum(n_deps) - n_deps

    # ---- command fields ----
    for j in range(int(na.max())):
        cmds["op"][pos_a[na > j] + j] = OP_LOAD
    for j in range(int(nb_.max())):
        cmds["op"][pos_b[nb_ > j] + j] = OP_LOAD
    slot = ch_g % 2
    _fill_dmas(cmds, pos_a, pa, np.arange(ch_g.size), ctx.slot(spec.a.buf), a_slot[slot], load=True)
    _fill_dmas(cmds, pos_b, pb, np.arange(ch_g.size), ctx.slot(spec.b.buf), b_slot[slot], load=True)
    mm = cmds.view(CMD_MM)
    mm["op"][pos_mm] = OP_MATMUL
    mm["a_off"][pos_mm] = a_slot[slot]
    mm["b_off"][pos_mm] = b_slot[slot]
    mm["c_off"][pos_mm] = c_off
    mm["m"][pos_mm] = rows[ch_tile]
    mm["n"][pos_mm] = cols[ch_tile]
    mm["k"][pos_mm] = depth
    mm["lda"][pos_mm], mm["ldb"][pos_mm], mm["ldc"][pos_mm] = a_pitch, b_pitch, c_pitch
    mm["a_dtype"][pos_mm] = spec.in_dtype
    mm["b_dtype"][pos_mm] = spec.in_dtype
    mm["flags"][pos_mm] = (np.where(ch_k > 0, MM_ACCUMULATE, 0) | (MM_TRANS_A if trans_a else 0)
                           | (MM_TRANS_B if trans_b else 0))
    sslot = seq % 2
    if has_bias:
        for j in range(int(nbias.max())):
            cmds["op"][pos_bias[li[nbias > j]] + j] = OP_LOAD
        _fill_dmas(cmds, pos_bias[li], pbias, np.arange(ntiles), ctx.slot(spec.bias.buf),
                   bias_slot[sslot], load=True)
    # epilogue programs: one per (staging slot, rows, cols)
    sfu = cmds.view(CMD_SFU)
    sfu["op"][pos_sfu[li]] = OP_SFU
    nins = 2 if has_bias else 1
    sfu["ninstrs"][pos_sfu[li]] = nins
    keys = np.stack([sslot, rows, cols], axis=1)
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    firsts = np.array([_epilogue(ctx, spec, int(s_), int(r), int(c), c_pitch, c_off, s_pitch, stage,
                                 bias_slot) for s_, r, c in uniq], dtype=np.int64)
    sfu["instr_begin"][pos_sfu[li]] = firsts[inv.ravel()]
    for j in range(int(po.nbases.max())):
        cmds["op"][pos_st[li[po.nbases > j]] + j] = OP_STORE
    _fill_dmas(cmds, pos_st[li], po, np.arange(ntiles), ctx.slot(o.buf), stage[sslot], load=False)
    ctx.program.add(cmds, dval.astype(np.uint32))
    ctx.scratchpad_peak = lx.top
    return tiles


def _epilogue(ctx: BuildContext, spec: MatmulSpec, slot: int, r: int, c: int, c_pitch: int, c_off: int,
              s_pitch: int, stage: np.ndarray, bias_slot) -> int:
    """SFU program of a tile's end: add the bias, round into the staging tile."""
    none = (OPND_NONE, 0, 0, 0, 0)
    acc = (OPND_TILE, lib.SPY_DT_F32, 0, c_pitch, c_off)
    ins = np.zeros(2 if spec.bias is not None else 1, dtype=INSTR)
    if spec.bias is not None:
        ins[0] = (lib.SPY_SFU_ADD, 0, 0, 0, r, c, acc,
                  [acc, (OPND_COL, spec.bias_dtype, 0, 0, int(bias_slot[slot])), none])
    ins[-1] = (lib.SPY_SFU_MOV, 0, 0, 0, r, c, (OPND_TILE, spec.out_dtype, 0, s_pitch, int(stage[slot])),
               [acc, none, none])
    return ctx.program.add_instrs(ins)


def build_kernel(ctx: BuildContext, k, tiles: Tiles | None = None) -> Tiles:
    """Build a :class:`~spyre_rt.compiler.kernels.MatmulKernel` (views relative to their
    buffers' starts) into the context's program; returns its tiles (pass them back to build
    it again on the same target without choosing them again)."""

    def view(v) -> View:
        name, off, sizes, strides = v
        return View(name, off + ctx.offset(name), tuple(sizes), tuple(strides))

    for dt in (k.in_dtype, k.out_dtype):
        if dt not in dtypes.MATMUL:
            raise NotImplementedError(f"matmul in {dt}")
    spec = MatmulSpec(view(k.a), view(k.b), view(k.out), dtypes.CODE[k.in_dtype], dtypes.CODE[k.out_dtype],
                      bias=view(k.bias) if k.bias else None, bias_dtype=dtypes.CODE.get(k.bias_dtype, 0))
    return build(ctx, spec, tiles)
