"""How a matmul is spread over the cores, and the cost model that chooses how.

The cores form ``groups`` independent groups. A group is a ``pk x pm x pn`` grid: per wave
it computes one *block* of the output, ``pm`` M tiles by ``pn`` N tiles, and its K range is
cut into ``pk`` slices, one per layer of the grid (split-K). Within a slice, the cores of a
grid row need the same A chunk and the cores of a grid column the same B chunk: each chunk
is loaded from DRAM once, by one of them, and forwarded to the others over the ring. The
``pk`` partial sums of a tile are added over the ring before its epilogue.

M is cut into ``m_tiles`` (a multiple of ``pm``) and N into ``n_tiles`` (a multiple of
``pn``) pieces of whole granules, as even as they can be, bigger first, so that the waves
are balanced and the tile count is a multiple of the core count whenever the blocks fill
the groups. K is walked in chunks of ``tk``, through ``nbuf`` operand buffers per core.

The estimate of a tiling's device time is made of the card's command charges
(those of :class:`spyre_rt.cost.CostModel`, what the simulator charges each command): the
systolic arrays' time per chunk with their granularity, the DRAM bytes (charged in whole
bursts) shared by every core that loads at once, each command's fixed latency, a core's
DMA port, the ring sends a chunk costs its loader, the split-K reduction and the epilogue
the arrays wait for between waves, and the pipeline's fill and drain. Tilings that do not
fit the scratchpad are not candidates. The model is within a few per cent of the
simulator (tests hold it to 15 %); tilings it cannot tell apart are ranked by DRAM bytes,
operand buffers and commands (`choose`).

The search and the model are native code (``native/tiling.c``, the one implementation):
a new prompt length chooses a tiling for each of its matmul shapes, thousands of grids
each, while the call waits. This module hands it the card's figures and the problem and
reads back the choice, or the model's terms by name (:func:`terms`) for the tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import numpy as np

from ...cost import CostModel
from ...native import check, ffi, lib
from ..context import ScratchpadOverflow
from .spec import Problem

K_GRANULE = lib.SPY_MM_K_GRANULE  # K slices and chunks start on whole fp16 sticks (two fp32 ones)
SHORTLIST = lib.SPY_MM_SHORTLIST  # grids estimated with every K chunk and buffer count
BUSY_FROM = lib.SPY_MM_BUSY_FROM  # job launches of roofline from which every core must have a tile in every wave


def _tables() -> tuple[tuple[int, ...], ...]:
    m, nm, n, nn, k, nk = (ffi.new(t) for t in ("uint32_t **", "uint32_t *") * 3)
    check(lib.spy_mm_aims(m, nm, n, nn, k, nk), "reading the matmul search's tables")
    return tuple(tuple(ptr[0][i] for i in range(count[0])) for ptr, count in ((m, nm), (n, nn), (k, nk)))


# sizes a tile or chunk may aim at; tile counts are derived from them, then deduplicated
M_TILE_AIMS, N_TILE_AIMS, K_CHUNKS = _tables()


@dataclass(frozen=True)
class Tiling:
    """A matmul's spread over the cores (see the module docstring)."""

    groups: int
    pk: int
    pm: int
    pn: int
    m_tiles: int
    n_tiles: int
    tk: int
    nbuf: int

    @property
    def group_cores(self) -> int:
        return self.pk * self.pm * self.pn


_TILING_FIELDS = tuple(f.name for f in fields(Tiling))
GRID_COLUMNS = ("groups", "pk", "pm", "pn", "m_tiles", "n_tiles")  # a grid row's
TERMS = np.dtype([(name, "f8") for name, _ in ffi.typeof("spy_mm_terms").fields])
_TILINGS = np.dtype([(name, "u4") for name in _TILING_FIELDS])  # spy_mm_tiling


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def preferred_granules(target: CostModel, p: Problem) -> tuple[int, int]:
    """The units M and N tiles are cut in when there is enough of them: for M the rows the
    arrays fill at once, or whole sticks where M is A's contiguous dimension; for N a
    stick's worth of columns (the arrays' width; whole sticks of B and of the output)."""
    return (target.stick_bytes // p.e_in if p.trans_a else target.gran_m), target.gran_n


def granule(extent: int, parts: int, preferred: int) -> int:
    """The preferred unit if every part gets one, else halved (down to 8): halves of a
    stick keep a tile inside its sticks. Below 8, single elements."""
    g = preferred
    while g > 8 and extent < g * parts:
        g //= 2
    return g if extent >= g * parts else 1


def split(extent: int, parts: int, gran: int) -> np.ndarray:
    """Sizes of `parts` consecutive pieces of `extent` in whole granules (the last one
    ends where the extent does), as even as possible, the bigger ones first."""
    q = -(-extent // gran)
    if not 1 <= parts <= max(q, 1):
        raise ValueError(f"{extent} in {parts} pieces of {gran}")
    base, extra = divmod(q, parts)
    sizes = np.full(parts, base * gran, dtype=np.int64)
    sizes[:extra] += gran
    sizes[-1] -= q * gran - extent
    return sizes


def roofline_ns(target: CostModel, p: Problem) -> float:
    """The least time the card can take: all its arrays busy, or the DRAM streaming the
    minimum bytes."""
    return target.kernel_ns(2 * p.macs, p.min_bytes, "float32" if p.fp32 else None)


# ---- the native search and model ---------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _cost(target: CostModel):
    c = ffi.new("spy_mm_cost *")
    for name, _ in ffi.typeof("spy_mm_cost").fields:
        setattr(c, name, getattr(target, name))
    return c


@functools.lru_cache(maxsize=512)
def _problem(p: Problem):
    c = ffi.new("spy_mm_problem *", {
        "batch": p.batch, "m": p.m, "n": p.n, "k": p.k, "e_in": p.e_in, "e_out": p.e_out, "e_bias": p.e_bias,
        "trans_a": int(p.trans_a), "trans_b": int(p.trans_b), "fp32": int(p.fp32),
        "nstores": len(p.stores), "ntiles": len(p.epi_tiles), "nrows": len(p.epi_rows),
        "epi_temps": p.epi_temps, "epi_temp_e": p.epi_temp_e, "epi_instrs": p.epi_instrs,
        "pro_temps": p.pro_temps, "pro_temp_e": p.pro_temp_e, "pro_instrs": p.pro_instrs,
        "npro_rows": len(p.pro_rows), "npro_cols": len(p.pro_cols), "pro_strip": p.pro_strip,
        "epi_strip": p.epi_strip})
    for name, values in (("e_stores", p.stores), ("e_tiles", p.epi_tiles), ("e_rows", p.epi_rows)):
        if len(values) > lib.SPY_MM_MAX_EPI:
            raise ValueError(f"an epilogue with {len(values)} {name[2:]}: at most {lib.SPY_MM_MAX_EPI}")
        getattr(c, name)[0:len(values)] = list(values)
    for name, values in (("e_pro_rows", p.pro_rows), ("e_pro_cols", p.pro_cols)):
        if len(values) > lib.SPY_MM_MAX_VECTORS:
            raise ValueError(f"an A prologue with {len(values)} vectors of one kind: at most {lib.SPY_MM_MAX_VECTORS}")
        getattr(c, name)[0:len(values)] = list(values)
    return c


@functools.lru_cache(maxsize=512)
def choose(target: CostModel, p: Problem) -> Tiling:
    """The cheapest tiling that fits the scratchpad (cached: one choice per shape). Among
    those the model cannot tell apart (within its error, or within the card's fixed cost of
    a job, which no tiling changes), one that moves at most 1.5 times the minimum DRAM
    bytes (the bandwidth is shared with whatever else the card runs), with the most
    operand buffers (slack for what the model does not see), then with the fewest commands
    (it builds fastest and takes the least of the card's memory)."""
    out = ffi.new("spy_mm_tiling *")
    status = lib.spy_mm_choose(_cost(target), _problem(p), out)
    if status == lib.SPY_E_SCRATCHPAD:
        raise ScratchpadOverflow(f"no matmul tile of {p.m}x{p.n}x{p.k} fits the scratchpad")
    check(status, "choosing a matmul tiling")
    return Tiling(*(getattr(out, name) for name in _TILING_FIELDS))


def terms(target: CostModel, p: Problem, cand: dict) -> dict[str, np.ndarray]:
    """Every term of the estimate of each candidate tiling by name (``t_*`` in ns): the
    tiles, the bytes, the time, the scratchpad bytes (``lx_bytes``) and the DRAM floor. The
    candidates are columns named as Tiling's fields, arrays that broadcast together."""
    cols = np.broadcast_arrays(*(np.asarray(cand[name]) for name in _TILING_FIELDS))
    shape = cols[0].shape
    rows = np.empty(cols[0].size, dtype=_TILINGS)
    for name, col in zip(_TILING_FIELDS, cols, strict=True):
        rows[name] = col.reshape(-1)
    out = np.empty(rows.size, dtype=TERMS)
    check(lib.spy_mm_estimate(_cost(target), _problem(p), ffi.from_buffer("spy_mm_tiling[]", rows), rows.size,
                              ffi.from_buffer("spy_mm_terms[]", out, require_writable=True)),
          "estimating matmul tilings")
    return {name: out[name].reshape(shape) for name in TERMS.names}


def estimate(target: CostModel, p: Problem, cand: dict):
    """(estimated device ns, DRAM bytes, commands) of each candidate tiling (see :func:`terms`)."""
    t = terms(target, p, cand)
    return t["ns"], t["dram_bytes"], t["cmds"]


def _one(t: Tiling) -> dict:
    return {k: np.array([getattr(t, k)]) for k in _TILING_FIELDS}


def estimate_one(target: CostModel, p: Problem, t: Tiling) -> float:
    """The model's device time of one tiling, in ns."""
    return float(terms(target, p, _one(t))["ns"][0])


def last_depth(target: CostModel, p: Problem, t: Tiling) -> int:
    """The K chunks the pieces of a core's last tile walk in turn (``last_depth`` of the
    native record): as many chunks' matmuls as the stores of every core's last tile take
    (the model's drain), so that the first pieces' stores are done by the time the arrays
    finish; at most the operand buffers, which hold them all."""
    out = ffi.new("uint32_t *")
    check(lib.spy_mm_last_depth(_cost(target), _problem(p), ffi.new("spy_mm_tiling *", {
        name: getattr(t, name) for name in _TILING_FIELDS}), out), "choosing a matmul's last depth")
    return int(out[0])


def lx_bytes_of(target: CostModel, p: Problem, t: Tiling) -> int:
    """The scratchpad bytes a core needs for tiling `t` (the layout record.Scratchpad makes)."""
    return int(terms(target, p, _one(t))["lx_bytes"][0])


def grids(target: CostModel, p: Problem) -> np.ndarray:
    """Rows (groups, pk, pm, pn, m_tiles, n_tiles) of every grid the search tries, in its
    order: grids of all the cores, tiles aimed at the sizes above that fit the scratchpad
    with the smallest K chunk, and as many blocks as whole waves of all groups need, so
    that every core has a tile in every wave. A matmul whose roofline is a few job launches
    is exempt: its fixed costs dominate, and the fewest commands serve it best."""
    n = ffi.new("uint32_t *")
    out = np.zeros(_grid_count(target, p), dtype=_TILINGS)
    check(lib.spy_mm_grids(_cost(target), _problem(p), ffi.from_buffer("spy_mm_tiling[]", out, require_writable=True),
                           len(out), n), "listing matmul grids")
    return np.column_stack([out[name].astype(np.int64) for name in GRID_COLUMNS]).reshape(-1, len(GRID_COLUMNS))


def _grid_count(target: CostModel, p: Problem) -> int:
    n = ffi.new("uint32_t *")
    check(lib.spy_mm_grids(_cost(target), _problem(p), ffi.NULL, 0, n), "listing matmul grids")
    return n[0]


def coarse(target: CostModel, p: Problem, prune: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per grid of :func:`grids`, its best estimate with the coarse pass's two K chunks (inf
    where none fits; NaN where pruning left it out) and its DRAM floor; and the rows the
    search shortlists, best first. With `prune` false every grid is estimated."""
    cap = max(_grid_count(target, p), SHORTLIST)
    best, floor, short = np.empty(cap), np.empty(cap), np.empty(cap, dtype=np.uint32)
    got, nshort = ffi.new("uint32_t *"), ffi.new("uint32_t *")
    check(lib.spy_mm_coarse(_cost(target), _problem(p), int(prune), ffi.from_buffer("double[]", best, require_writable=True),
                            ffi.from_buffer("double[]", floor, require_writable=True),
                            ffi.from_buffer("uint32_t[]", short, require_writable=True), cap, got, nshort),
          "estimating matmul grids")
    return best[:got[0]], floor[:got[0]], short[:nshort[0]].astype(np.int64)
