"""A matmul's decision record: what is decided once per kernel, for the native builder.

Python decides; C builds. At a matmul's first construction this module decides everything
that does not change from one launch to the next: the tiling (:mod:`.tiling`), the sizes of
the M and N tiles and K slices, the scratchpad regions every core uses, the slots and views
of the buffers, and the per-tile SFU program (zeroing, bias, a fused epilogue, rounding)
with its operands placed for both staging slots. It hands them over as one
``spy_matmul_record``, made once; every build, every ``construct``-mode launch included, is
one call of ``spy_build_matmul`` (native/build_matmul.c), which derives the schedule and
makes the commands, dependencies, DMA patterns and SFU programs, and encodes the block.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import numpy as np

from ... import dtypes
from ...cost import CostModel, round_up
from ...layout import StickLayout
from ...native import ffi, lib
from ...program import INSTR, OPND_COL, OPND_IMM, OPND_NONE, OPND_TILE, built_block
from .. import sfu as sfu_ops
from ..context import BuildContext, Refused, ScratchpadOverflow, ScratchpadPlan
from ..sfu import COL, ROW, TILE
from . import epilogue
from .spec import ITEMSIZE, PRO_STRIP, MatmulSpec, Problem, View
from .tiling import (
    GRID_COLUMNS,
    K_GRANULE,
    Tiling,
    choose,
    granule,
    grids,
    last_depth,
    lx_bytes_of,
    preferred_granules,
    split,
    terms,
)

NONE = (OPND_NONE, 0, 0, 0, 0)
MM_INSTR = np.dtype([("ins", INSTR), ("v1", "u8", (4,))])  # spy_mm_instr


class Scratchpad:
    """The regions every core uses, at the same offsets on all of them (a forwarded chunk
    lands where the receiver reads it)."""

    def __init__(self, target: CostModel, spec: MatmulSpec, p: Problem, t: Tiling, tm: int, tn: int, depth: int):
        si = target.stick_bytes // p.e_in
        lx = ScratchpadPlan(target.scratchpad_bytes)
        self.a_pitch = round_up(tm, si) if p.trans_a else round_up(depth, si)
        self.b_pitch = round_up(depth, si) if p.trans_b else round_up(tn, si)
        a_rows, b_rows = (depth if p.trans_a else tm), (tn if p.trans_b else depth)
        self.a = [lx.take(a_rows * self.a_pitch * p.e_in) for _ in range(t.nbuf)]
        self.b = [lx.take(b_rows * self.b_pitch * p.e_in) for _ in range(t.nbuf)]
        self.tn = tn
        self.c_pitch = round_up(tn, 32)
        self.acc = lx.take(tm * self.c_pitch * 4)
        self.recv = lx.take(tm * self.c_pitch * 4) if t.pk > 1 else 0
        # the staging tiles of each stored tile (pitch, itemsize, two offsets): the product's,
        # or an epilogue's outputs
        self.outs = []
        for e in p.e_stores:
            pitch = round_up(tn, target.stick_bytes // e)
            self.outs.append((pitch, e, [lx.take(tm * pitch * e) for _ in range(2)]))
        if spec.bias is not None:
            e = ITEMSIZE.get(spec.bias_dtype, 4)
            pitch = round_up(tn, target.stick_bytes // e)
            self.bias = (pitch, e, [lx.take(pitch * e) for _ in range(2)])
        self.epi_in, self.temps = [], []
        if spec.epilogue is not None:  # landing tiles (rows) of its inputs, its temporaries
            ep, pl = spec.epilogue, epilogue.plan(spec.epilogue)
            for v, dt, kind in zip(ep.inputs, ep.input_dtypes, pl.input_kinds, strict=True):
                e = dtypes.ITEMSIZE[dt]
                # a row of the tile's columns, of its rows' values (ROW), or of one period
                periodic = kind in (epilogue.PERIODIC, epilogue.PERIODIC_ROWS)
                width = tm if kind == ROW else v[2][2] if periodic else tn
                pitch = width if periodic else round_up(width, target.stick_bytes // e)
                rows = tm if kind in (TILE, epilogue.PERIODIC_ROWS) else 1
                self.epi_in.append((pitch, e, [lx.take(rows * round_up(pitch * e, target.stick_bytes))
                                               for _ in range(2)]))
            self.temps = [lx.take(min(tm, p.epi_strip or tm) * self.c_pitch * pl.temp_itemsize)
                          for _ in range(pl.ntemps)]
        self.pro_vectors, self.pro_temps, self.pro_pitch = [], [], round_up(depth, 32)
        if spec.prologue is not None:  # per operand buffer its vectors' regions; its temporaries
            pro = spec.prologue
            pl = epilogue.prologue_plan(pro, dtypes.NAME[spec.in_dtype])
            for dt, kind in zip(pro.input_dtypes[1:], pl.input_kinds[1:], strict=True):
                n = tm if kind == ROW else depth
                self.pro_vectors.append([lx.take(n * dtypes.ITEMSIZE[dt]) for _ in range(t.nbuf)])
            strip = min(tm, PRO_STRIP)
            self.pro_temps = [lx.take(strip * self.pro_pitch * pl.temp_itemsize) for _ in range(pl.ntemps)]
        self.peak = lx.top  # bytes of each core's scratchpad the program holds


class MatmulRecord:
    """A matmul's decisions (its tiling, scratchpad, slots, views, program) and the native
    record made of them; :meth:`build` is a launch's whole construction."""

    __slots__ = ("spec", "kernel", "tiling", "target", "layouts", "offsets", "slot_of", "scratchpad_peak", "cdata",
                 "_sources", "_keep")

    def __init__(self, spec: MatmulSpec, tiling: Tiling, ctx: BuildContext):
        self.spec, self.tiling, self.target = spec, tiling, ctx.target
        self.kernel = None
        self._sources = (ctx.layouts, ctx.offsets)
        self.slot_of: dict[str, int] = {}
        self.layouts: dict[str, StickLayout] = {}
        self.offsets: dict[str, int] = {}
        self.scratchpad_peak = 0
        self.cdata = None
        self._keep: list = []

    def __repr__(self) -> str:
        return f"MatmulRecord({self.tiling})"

    def fits(self, ctx: BuildContext) -> bool:
        """Whether a build into `ctx` is one of the same kernel: the same card, and its buffers
        in the same layouts at the same offsets."""
        if ctx.target is not self.target and ctx.target != self.target:
            return False
        if (ctx.layouts, ctx.offsets) == self._sources:  # the same dicts, as a launch passes
            return True
        return all(ctx.layouts.get(n) == lay and ctx.offset(n) == self.offsets[n] for n, lay in self.layouts.items())

    def build(self, ctx: BuildContext) -> None:
        """The program, built natively from the record into the (fresh) context."""
        ctx.block = built_block(lib.spy_build_matmul, self.cdata, "building a matmul")
        ctx.slot_of = dict(self.slot_of)
        ctx.scratchpad_peak = self.scratchpad_peak


def decide(ctx: BuildContext, spec: MatmulSpec, tiling: Tiling | None = None) -> MatmulRecord:
    """Every decision of the matmul `spec` into the context's slots (the tiling chosen unless
    given); the record the native builder builds from."""
    if spec.alpha != 1 or spec.beta != 1:
        raise NotImplementedError("matmul alpha/beta other than 1 are lowered to pointwise ops")
    target = ctx.target
    p = Problem.of(spec)
    t = tiling or _tiling(target, spec, p)
    rec = MatmulRecord(spec, t, ctx)
    r = {"num_cores": target.num_cores, "stick_bytes": target.stick_bytes,
         "scratchpad_bytes": target.scratchpad_bytes, "batch": p.batch, "m": p.m, "n": p.n, "k": p.k}
    if p.batch * p.m * p.n:
        _decide(ctx, spec, p, t, rec, r)
    rec.slot_of = dict(ctx.slot_of)
    names = ctx.buffers()
    rec.layouts = {n: ctx.layouts[n] for n in names}
    rec.offsets = {n: ctx.offset(n) for n in names}
    slots = ffi.new("spy_layout[]", [tuple(ctx.layouts[n]) for n in names] or 1)
    r["nslots"], r["slots"] = len(names), slots
    rec.cdata = ffi.new("spy_matmul_record *", r)
    rec._keep.append(slots)
    return rec


def members(spec: MatmulSpec) -> list[MatmulSpec]:
    """The matmuls a grouped one computes, each alone (the spec itself when it is one)."""
    return [dataclasses.replace(spec, b=b, out=o, parts=()) for b, o in ((spec.b, spec.out), *spec.parts)]


def grouped_tiling(target: CostModel, spec: MatmulSpec) -> Tiling | None:
    """A grouped matmul's tiling: its members' own, which must be one tiling, with the N
    tiles of all of them (so that each part is cut as its matmul alone would be, and each
    dot product is added in the same order, bit for bit); None when the members' differ."""
    alone = {_tiling(target, m, Problem.of(m)) for m in members(spec)}
    if len(alone) != 1:
        return None
    (t,) = alone
    return dataclasses.replace(t, n_tiles=t.n_tiles * (1 + len(spec.parts)))


def exact_tiling(target: CostModel, spec: MatmulSpec) -> Tiling | None:
    """A tiling of the fused matmul (an A prologue, an epilogue) whose values are those of
    the unfused kernels bit for bit, or None. The arrays add each dot product over the K
    chunks of a command, and split-K adds the slices' partial sums in a fixed tree: the order
    of the additions follows from the K chunk and the slices alone, not from how M and N are
    cut. So: the matmul alone's tiling where the fused work fits beside it; else the fastest
    tiling with its K chunk and slices that fits (the fused work may want other tiles of M
    and N, an epilogue's loads room of their own); None where none fits. The fusion passes
    fuse only where one exists. A sliced epilogue's tiles must also be alike in their columns,
    a whole number of its periods each."""
    alone = choose(target, Problem.of(dataclasses.replace(spec, prologue=None, epilogue=None)))
    p = Problem.of(spec)
    period = spec.epilogue.period if spec.epilogue is not None else 0
    if lx_bytes_of(target, p, alone) <= target.scratchpad_bytes and _in_periods(target, p, alone.n_tiles, period):
        t = alone
    else:
        t = _same_k(target, p, alone.pk, alone.tk, period)
    return t if t is not None and _fits(target, spec, p, t) else None


def _in_periods(target: CostModel, p: Problem, n_tiles: int, period: int) -> bool:
    """Whether N cut in `n_tiles` tiles gives tiles alike, each a whole number of periods."""
    if not period:
        return True
    sizes = split(p.n, n_tiles, granule(p.n, n_tiles, preferred_granules(target, p)[1]))
    return bool((sizes == sizes[0]).all() and sizes[0] % period == 0)


@functools.lru_cache(maxsize=256)
def _same_k(target: CostModel, p: Problem, pk: int, tk: int, period: int = 0) -> Tiling | None:
    rows = grids(target, p)
    rows = rows[rows[:, 1] == pk]
    if period:
        n_tiles = GRID_COLUMNS.index("n_tiles")
        rows = rows[[_in_periods(target, p, int(n), period) for n in rows[:, n_tiles]]]
    if not len(rows):
        return None
    nbufs = np.arange(2, lib.SPY_MM_MAX_NBUF + 1)
    cand = {name: np.repeat(rows[:, i], len(nbufs)) for i, name in enumerate(GRID_COLUMNS)}
    cand.update(tk=np.full(len(rows) * len(nbufs), tk), nbuf=np.tile(nbufs, len(rows)))
    t = terms(target, p, cand)
    ok = np.flatnonzero(t["lx_bytes"] <= target.scratchpad_bytes)
    if not len(ok):
        return None
    best = int(ok[np.argmin(t["ns"][ok])])
    return Tiling(*(int(cand[f.name][best]) for f in dataclasses.fields(Tiling)))


def _tiling(target: CostModel, spec: MatmulSpec, p: Problem) -> Tiling:
    """The cost model's choice; with fused work (an A prologue, an epilogue), the choice
    without it (:func:`exact_tiling`), else the cost model's for the fused matmul (a step
    made by hand: the passes never fuse where the exact tiling does not fit). A grouped
    matmul's, its members' (:func:`grouped_tiling`)."""
    if spec.parts:
        t = grouped_tiling(target, spec)
        if t is None:
            raise ValueError("a grouped matmul of matmuls whose tilings differ")
        return t
    if spec.prologue is None and spec.epilogue is None:
        return choose(target, p)
    exact = exact_tiling(target, spec)
    if exact is None and spec.epilogue is not None and spec.epilogue.slices:
        raise Refused(f"no tiling of a {p.m}x{p.n}x{p.k} matmul cuts its columns in whole "
                      f"{spec.epilogue.period}-column periods of its sliced epilogue")
    return exact or choose(target, p)


def _cuts(target: CostModel, spec: MatmulSpec, p: Problem, t: Tiling) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sizes of the M tiles, of the N tiles and of the K slices."""
    gm, gn = preferred_granules(target, p)
    m_size = split(p.m, t.m_tiles, granule(p.m, t.m_tiles, gm))
    if spec.parts:  # each part cut as its matmul alone (the parts' N tiles never straddle two)
        per = t.n_tiles // (1 + len(spec.parts))
        n_size = np.concatenate([split(b.sizes[2], per, granule(b.sizes[2], per, gn))
                                 for b in (spec.b, *(b for b, _ in spec.parts))])
    else:
        n_size = split(p.n, t.n_tiles, granule(p.n, t.n_tiles, gn))
    k_slice = split(p.k, t.pk, granule(p.k, t.pk, K_GRANULE)) if p.k else np.zeros(1, dtype=np.int64)
    return m_size, n_size, k_slice


def _fits(target: CostModel, spec: MatmulSpec, p: Problem, t: Tiling) -> bool:
    """Whether the regions of the matmul cut so fit a core's scratchpad (the estimate the
    tiling search uses counts some of an epilogue's rows at the tiles' width)."""
    if not p.batch * p.m * p.n:
        return True
    m_size, n_size, k_slice = _cuts(target, spec, p, t)
    try:
        Scratchpad(target, spec, p, t, int(m_size.max()), int(n_size.max()),
                   min(t.tk, int(k_slice.max())) if p.k else 1)
    except ScratchpadOverflow:
        return False
    return True


def _decide(ctx: BuildContext, spec: MatmulSpec, p: Problem, t: Tiling, rec: MatmulRecord, r: dict) -> None:
    target = ctx.target
    m_size, n_size, k_slice = _cuts(target, spec, p, t)
    tm, tn = int(m_size.max()), int(n_size.max())
    depth = min(t.tk, int(k_slice.max())) if p.k else 1
    lx = Scratchpad(target, spec, p, t, tm, tn, depth)
    rec.scratchpad_peak = lx.peak

    # the slots in the order the buffers are first used: operands, epilogue loads, stores
    a, b = _view(ctx, spec.a), _view(ctx, spec.b)
    loads, stores = [], []
    if spec.bias is not None:
        bv = spec.bias
        if bv.strides[1] != 0 and bv.sizes[1] != 1:
            raise ValueError("a matmul bias must be broadcast over the rows")
        bv = View(bv.buf, bv.offset, bv.sizes, (bv.strides[0], 0, bv.strides[2]))  # one row per tile
        loads.append(_tiles(ctx, bv, *lx.bias, row=True))
    plan = epilogue.plan(spec.epilogue) if spec.epilogue is not None else None
    if plan is not None:
        for v, (pitch, e, offs), kind in zip(spec.epilogue.inputs, lx.epi_in, plan.input_kinds, strict=True):
            loads.append(_tiles(ctx, v, pitch, e, offs, row=LANDS[kind]))
    if spec.parts:  # a grouped matmul: each part's columns stored from the one staging tile
        if spec.epilogue is not None or spec.bias is not None:
            raise ValueError("a grouped matmul has no epilogue and no bias")
        pitch, e, offs = lx.outs[0]
        for i, v in enumerate([spec.out, *(o for _, o in spec.parts)]):
            stores.append(_tiles(ctx, v, pitch, e, offs, part=i + 1))
    else:
        outs = [spec.out] if spec.epilogue is None else list(spec.epilogue.outputs)
        for v, (pitch, e, offs) in zip(outs, lx.outs, strict=True):
            stores.append(_tiles(ctx, v, pitch, e, offs))

    slot0, slot1 = (np.array(_program(spec, p, lx, plan, s), dtype=INSTR) for s in (0, 1))
    if len(slot0) > lib.SPY_MM_MAX_PROGRAM:  # (a sliced epilogue over wide tiles; the pass checks it)
        raise Refused(f"a matmul's per-tile program of {len(slot0)} instructions (at most {lib.SPY_MM_MAX_PROGRAM})")
    program = np.zeros(len(slot0), dtype=MM_INSTR)
    program["ins"] = slot0
    program["v1"][:, 0] = slot1["dst"]["v"]
    program["v1"][:, 1:] = slot1["src"]["v"]

    arrays = {"m_size": ffi.new("uint32_t[]", m_size.tolist()), "n_size": ffi.new("uint32_t[]", n_size.tolist()),
              "k_slice": ffi.new("uint64_t[]", k_slice.tolist()),
              "loads": ffi.new("spy_mm_tiles[]", loads or 1), "stores": ffi.new("spy_mm_tiles[]", stores),
              "program": ffi.cast("spy_mm_instr *", ffi.from_buffer(program))}
    if spec.prologue is not None:
        _prologue(ctx, spec, lx, rec, arrays)
    if spec.parts:
        n0 = np.cumsum([0, spec.b.sizes[2], *(bv.sizes[2] for bv, _ in spec.parts)])[:-1]
        parts = [{"b": _view(ctx, bv), "n0": int(at)} for bv, at in zip([spec.b, *(bv for bv, _ in spec.parts)], n0,
                                                                        strict=True)]
        arrays["parts"], arrays["nparts"] = ffi.new("spy_mm_part[]", parts), len(parts)
    rec._keep += [*arrays.values(), program]
    r.update(arrays)
    r.update({"in_dtype": spec.in_dtype,
              "flags": (lib.SPY_MM_TRANS_A if p.trans_a else 0) | (lib.SPY_MM_TRANS_B if p.trans_b else 0),
              "groups": t.groups, "pk": t.pk, "pm": t.pm, "pn": t.pn, "m_tiles": t.m_tiles, "n_tiles": t.n_tiles,
              "tk": t.tk, "nbuf": t.nbuf, "last_depth": last_depth(target, p, t), "a_lx": lx.a, "b_lx": lx.b,
              "acc_lx": lx.acc, "recv_lx": lx.recv,
              "a_pitch": lx.a_pitch, "b_pitch": lx.b_pitch, "c_pitch": lx.c_pitch, "a": a, "b": b,
              "nloads": len(loads), "nstores": len(stores), "ninstrs": len(program), "epi_strip": p.epi_strip})


def _prologue(ctx: BuildContext, spec: MatmulSpec, lx: Scratchpad, rec: MatmulRecord, arrays: dict) -> None:
    """An A prologue's vectors and its program for a chunk in each operand buffer, rewriting
    the chunk in place."""
    pro = spec.prologue
    in_dtype = dtypes.NAME[spec.in_dtype]
    pl = epilogue.prologue_plan(pro, in_dtype)
    vectors = []
    for v, dt, kind, regions in zip(pro.inputs[1:], pro.input_dtypes[1:], pl.input_kinds[1:], lx.pro_vectors,
                                    strict=True):
        vectors.append({"view": _view(ctx, v), "lx": regions + [0] * (lib.SPY_MM_MAX_NBUF - len(regions)),
                        "itemsize": dtypes.ITEMSIZE[dt], "per_row": int(kind == ROW)})
    program = []
    body = SimpleNamespace(output_dtypes=(in_dtype,))
    for i, chunk in enumerate(lx.a):
        inputs = [(chunk, lx.a_pitch)] + [(regions[i], 1 if kind == ROW else 0)
                                          for regions, kind in zip(lx.pro_vectors, pl.input_kinds[1:], strict=True)]
        program += epilogue.program(body, pl, 0, 0, None, lx.pro_temps, lx.pro_pitch, inputs, [(chunk, lx.a_pitch)],
                                    strips=True)
    if len(program) != len(lx.a) * pl.instrs:
        raise AssertionError(f"an A prologue of {len(program)} instructions for {len(lx.a)} buffers of {pl.instrs}")
    instrs = np.array(program, dtype=INSTR)
    arrays["pro_vectors"] = ffi.new("spy_mm_vector[]", vectors or 1)
    arrays["pro_program"] = ffi.cast("spy_instr *", ffi.from_buffer(instrs))
    rec._keep.append(instrs)
    arrays["npro_vectors"], arrays["npro_instrs"], arrays["pro_strip"] = len(vectors), pl.instrs, PRO_STRIP


def _view(ctx: BuildContext, v: View) -> dict:
    return {"slot": ctx.slot(v.buf), "offset": v.offset, "strides": list(v.strides)}


# how an epilogue input of each kind lands (spy_mm_tiles.row)
LANDS = {TILE: lib.SPY_MM_TILES_WHOLE, COL: lib.SPY_MM_TILES_ROW, ROW: lib.SPY_MM_TILES_PER_ROW,
         epilogue.PERIODIC: lib.SPY_MM_TILES_PERIODIC, epilogue.PERIODIC_ROWS: lib.SPY_MM_TILES_PERIODIC_ROWS}


def _tiles(ctx: BuildContext, v: View, pitch: int, itemsize: int, offs, row: int = 0, part: int = 0) -> dict:
    return {"view": _view(ctx, v), "lx": list(offs), "pitch": pitch, "itemsize": itemsize, "row": int(row),
            "part": part}


def _program(spec: MatmulSpec, p: Problem, lx: Scratchpad, plan, s: int) -> list[tuple]:
    """The per-tile program for tiles in staging slot `s` (rows and columns left 0): zero
    the accumulator when K is empty, add the bias, then round into the staging tile or run
    the fused epilogue."""
    acc = (OPND_TILE, lib.SPY_DT_F32, 0, lx.c_pitch, lx.acc)
    zero = (OPND_IMM, lib.SPY_DT_F32, 0, 0, 0)  # 0.0 as the immediate's bits
    ins = []
    if p.k == 0:
        ins.append((lib.SPY_SFU_MOV, 0, 0, 0, 0, 0, acc, [zero, NONE, NONE]))
    if spec.bias is not None:
        ins.append((lib.SPY_SFU_ADD, 0, 0, 0, 0, 0, acc, [acc, (OPND_COL, spec.bias_dtype, 0, 0, lx.bias[2][s]), NONE]))
    if spec.epilogue is None:
        pitch, _, stage = lx.outs[0]
        ins.append((lib.SPY_SFU_MOV, 0, 0, 0, 0, 0, (OPND_TILE, spec.out_dtype, 0, pitch, stage[s]),
                    [acc, NONE, NONE]))
    else:
        ins += epilogue.program(spec.epilogue, plan, 0, 0, sfu_ops.Operand(TILE, "float32", lx.acc, lx.c_pitch),
                                lx.temps, lx.c_pitch,
                                [(offs[s], 1 if kind == ROW else pitch)
                                 for (pitch, _, offs), kind in zip(lx.epi_in, plan.input_kinds, strict=True)],
                                [(offs[s], pitch) for pitch, _, offs in lx.outs], strips=bool(p.epi_strip),
                                tile_cols=lx.tn)
    return ins
