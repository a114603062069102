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
(:class:`spyre_rt.cost.CostModel`, what the simulator charges each command): the
systolic arrays' time per chunk with their granularity, the DRAM bytes (charged in whole
bursts) shared by every core that loads at once, each command's fixed latency, a core's
DMA port, the ring sends a chunk costs its loader, the split-K reduction and the epilogue
the arrays wait for between waves, and the pipeline's fill and drain. Tilings that do not
fit the scratchpad are not candidates. The model is within a few per cent of the
simulator (tests hold it to 15 %); tilings it cannot tell apart are ranked by DRAM bytes,
operand buffers and commands (`choose`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import numpy as np

from ...cost import CostModel, round_up
from ..context import LX_ALIGN, ScratchpadOverflow
from .spec import Problem

# sizes a tile or chunk may aim at; tile counts are derived from them, then deduplicated
M_TILE_AIMS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024)
N_TILE_AIMS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 1024, 1536, 2048)
K_GRANULE = 64  # K slices and chunks start on whole fp16 sticks (two fp32 ones)
K_CHUNKS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096)
NBUFS = (2, 3)
TIE = 0.02  # tilings within this fraction of the cheapest are equal to the model (its error)
DRAM_BUDGET = 1.5  # DRAM bytes a tiling may move, in minimums (each operand and the output once)
SHORTLIST = 48  # grids estimated with every K chunk and buffer count
COARSE_FIRST = 8 * SHORTLIST  # grids of the lowest DRAM floors estimated first (see _shortlist)
BUSY_FROM = 10  # job launches of roofline from which every core must have a tile in every wave


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
GRID_COLUMNS = ("groups", "pk", "pm", "pn", "m_tiles", "n_tiles")  # a grid row's (see _grids)


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


def chunk_count(k: int, tk: int) -> int:
    return -(-k // tk) if k else 0


# ---- the cost model, vectorised over candidate tilings ------------------------------------

def lx_bytes(target: CostModel, p: Problem, tm, tn, tk, pk, nbuf):
    """Scratchpad bytes a core needs (the layout :class:`.record.Scratchpad` makes):
    operand buffers, the fp32 accumulator, the receive buffer of split-K, two staging tiles
    and two bias rows."""
    si = target.stick_bytes // p.e_in
    depth = np.minimum(tk, max(p.k, 1))
    a = (depth * round_up(tm, si) if p.trans_a else tm * round_up(depth, si)) * p.e_in
    b = (tn * round_up(depth, si) if p.trans_b else depth * round_up(tn, si)) * p.e_in
    acc = tm * round_up(tn, 32) * 4
    bias = round_up(tn, target.stick_bytes // p.e_bias) * p.e_bias if p.e_bias else np.zeros_like(tn)
    al = LX_ALIGN
    # a fused epilogue's landing tiles and rows and its staging tiles (two of each), its temporaries
    stages = sum(2 * round_up(tm * round_up(tn, target.stick_bytes // e) * e, al) for e in p.e_stores)
    loads = sum(2 * round_up(tm * round_up(tn, target.stick_bytes // e) * e, al) for e in p.epi_tiles)
    loads = loads + sum(2 * round_up(round_up(tn, target.stick_bytes // e) * e, al) for e in p.epi_rows)
    temps = p.epi_temps * round_up(tm * round_up(tn, 32) * p.epi_temp_e, al)
    return (nbuf * (round_up(a, al) + round_up(b, al)) + round_up(acc, al) * np.where(pk > 1, 2, 1)
            + stages + 2 * round_up(bias, al) + loads + temps)


def _tile_max(extent: int, tiles: np.ndarray, preferred: int) -> np.ndarray:
    """The largest piece of ``split(extent, tiles, granule(extent, tiles, preferred))``,
    vectorised over tile counts."""
    gran = np.full(tiles.shape, preferred, dtype=np.int64)
    while (shrink := (gran > 8) & (extent < gran * tiles)).any():
        gran[shrink] //= 2
    gran[extent < gran * tiles] = 1
    q = -(-extent // gran)
    return np.minimum(-(-q // tiles) * gran, extent)


def tile_max(target: CostModel, p: Problem, m_tiles: np.ndarray, n_tiles: np.ndarray):
    """(rows, columns) of the largest tile, vectorised over tile counts."""
    gm, gn = preferred_granules(target, p)
    return _tile_max(p.m, m_tiles, gm), _tile_max(p.n, n_tiles, gn)


def _grids(target: CostModel, p: Problem) -> np.ndarray:
    """Rows (groups, pk, pm, pn, m_tiles, n_tiles) of every grid and tile count worth
    trying: grids of all the cores, tiles aimed at the sizes above that fit the scratchpad,
    and as many blocks as whole waves of all groups need, so that every core has a tile in
    every wave. A matmul whose roofline is a few job launches is exempt: its fixed costs
    dominate, and the fewest commands serve it best."""
    return _grids_and_tiles(target, p)[0]


def _grids_and_tiles(target: CostModel, p: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of :func:`_grids`, and the rows and columns of each row's largest tile."""
    combos = _core_splits(target.num_cores)
    combos = combos[combos[:, 1] <= max(p.k, 1)]
    groups, pk, pm, pn = combos.T
    # per split, the distinct tiles per core along M and N that the aims give, ascending,
    # and every pair of them (M outer): one row per distinct (split, M tiles, N tiles)
    split_m, wm = _distinct_ascending(np.maximum(1, -(-p.m // (pm[:, None] * np.array(M_TILE_AIMS)))))
    split_n, wn = _distinct_ascending(np.maximum(1, -(-p.n // (pn[:, None] * np.array(N_TILE_AIMS)))))
    count_n = np.bincount(split_n, minlength=len(combos))
    reps = count_n[split_m]
    split_of, wm = np.repeat(split_m, reps), np.repeat(wm, reps)
    within = np.arange(len(split_of)) - np.repeat(np.cumsum(reps) - reps, reps)
    wn = wn[(np.cumsum(count_n) - count_n)[split_of] + within]
    groups, pk, pm, pn = groups[split_of], pk[split_of], pm[split_of], pn[split_of]
    m_tiles, n_tiles, blocks = pm * wm, pn * wn, wm * wn
    keep = np.flatnonzero((m_tiles <= p.m) & (n_tiles <= p.n))  # the tiles' sizes only where there are so many
    tm, tn = tile_max(target, p, m_tiles[keep], n_tiles[keep])
    fits = lx_bytes(target, p, tm, tn, np.minimum(K_GRANULE, max(p.k, 1)), pk[keep], 2) <= target.scratchpad_bytes
    keep, tm, tn = keep[fits], tm[fits], tn[fits]
    if roofline_ns(target, p) >= BUSY_FROM * target.job_launch_ns:
        busy = p.batch * blocks[keep] % groups[keep] == 0
        if busy.any():
            keep, tm, tn = keep[busy], tm[busy], tn[busy]
    return np.column_stack([groups, pk, pm, pn, m_tiles, n_tiles])[keep], tm, tn


def _distinct_ascending(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, value) of each distinct value of each row of `w`, whose rows do not increase
    (tile counts of increasing aims), row by row and ascending within a row."""
    w = w[:, ::-1]
    first = np.ones(w.shape, dtype=bool)
    first[:, 1:] = w[:, 1:] != w[:, :-1]
    return np.nonzero(first)[0], w[first]


@functools.lru_cache(maxsize=8)
def _core_splits(cores: int) -> np.ndarray:
    """Rows (groups, pk, pm, pn) of every way to split the cores into groups of pk x pm x pn,
    pk outermost, then pm, then pn, each ascending."""
    return np.array([(cores // (pk * pm * pn), pk, pm, pn) for pk in divisors(cores)
                     for pm in divisors(cores // pk) for pn in divisors(cores // (pk * pm))], dtype=np.int64)


def roofline_ns(target: CostModel, p: Problem) -> float:
    """The least time the card can take: all its arrays busy, or the DRAM streaming the
    minimum bytes."""
    return target.kernel_ns(2 * p.macs, p.min_bytes, "float32" if p.fp32 else None)


def _with_chunks(target: CostModel, p: Problem, grid: np.ndarray, tks, nbufs,
                 first_fit: bool = False, tiles=None) -> dict[str, np.ndarray]:
    """Every grid row with every K chunk and buffer count, as columns (fitting ones only;
    ``row`` names the grid row, ``tm`` and ``tn`` are its largest tile, or `tiles` when
    given). With `first_fit`, per row and chunk only the first buffer count of `nbufs`
    that fits."""
    cand, fits = _chunked(target, p, grid, tks, nbufs, first_fit, tiles)
    cand["row"] = np.arange(len(grid))
    # grid row outer, as the candidates are numbered
    return {k: np.broadcast_to(v, fits.shape).T[fits.T] for k, v in cand.items()}


def _chunked(target: CostModel, p: Problem, grid: np.ndarray, tks, nbufs, first_fit: bool = False,
             tiles=None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """What :func:`_with_chunks` makes, unfiltered and in two dimensions: a K chunk and
    buffer count per row (chunk outer; with `first_fit`, a chunk per row, and per grid row
    its first buffer count that fits), a grid row per column. The columns broadcast against
    each other, so that what depends on the grid row only is computed once for all chunks;
    the mask says which fit."""
    tm, tn = tile_max(target, p, grid[:, 4], grid[:, 5]) if tiles is None else tiles
    cand = dict(zip(GRID_COLUMNS, grid.T, strict=True))
    cand["tm"], cand["tn"] = tm, tn
    cap = target.scratchpad_bytes

    def fit(tk, nbuf):
        return lx_bytes(target, p, tm, tn, tk, cand["pk"], nbuf) <= cap

    if first_fit:
        cand["tk"] = np.array(tks, dtype=np.int64)[:, None]
        fits = fit(cand["tk"], nbufs[-1])
        nbuf = np.full(fits.shape, nbufs[-1], dtype=np.int64)
        for nb in reversed(nbufs[:-1]):  # an earlier buffer count wins where it fits
            first = fit(cand["tk"], nb)
            nbuf[first] = nb
            fits |= first
        cand["nbuf"] = nbuf
        return cand, fits
    combos = np.array([(tk, nb) for tk in tks for nb in nbufs], dtype=np.int64)
    cand["tk"], cand["nbuf"] = combos[:, :1], combos[:, 1:]
    return cand, fit(cand["tk"], cand["nbuf"])


def candidates(target: CostModel, p: Problem) -> dict[str, np.ndarray]:
    """The tilings worth estimating finely: every grid is estimated with two K chunks
    first, and the most promising are tried with every chunk and buffer count. The coarse
    pass keeps only a grid's best estimate, and three operand buffers never take longer
    than two (the loads hide behind two steps instead of one): it tries two only where
    three do not fit."""
    k_max = round_up(max(p.k, 1), K_GRANULE)
    tks = sorted({t for t in K_CHUNKS if t < k_max} | {k_max})
    grid, tm, tn = _grids_and_tiles(target, p)
    short = _shortlist(target, p, grid, tm, tn, sorted({tks[0], min(256, k_max)}))
    fine = _with_chunks(target, p, grid[short], tks, NBUFS, tiles=(tm[short], tn[short]))
    del fine["row"]
    return fine


def _shortlist(target: CostModel, p: Problem, grid: np.ndarray, tm, tn, tks) -> np.ndarray:
    """The SHORTLIST grid rows of the best coarse estimates, best first (equal ones in row
    order). No estimate of a row is below the DRAM streaming its bytes (:func:`_dram_floor`),
    so rows are estimated from the lowest floor up: once SHORTLIST estimates are at most a
    value, a row whose floor is above it cannot make the list and is not estimated."""
    cand = dict(zip(GRID_COLUMNS, grid.T, strict=True)) | {"tm": tm, "tn": tn}
    floor = _dram_floor(target, p, cand)
    best = np.full(len(grid), np.inf)
    first = np.arange(len(grid)) if len(grid) <= COARSE_FIRST else np.sort(np.argpartition(floor, COARSE_FIRST)[:COARSE_FIRST])
    best[first] = _coarse(target, p, grid[first], tm[first], tn[first], tks)
    estimated = np.zeros(len(grid), dtype=bool)
    estimated[first] = True
    if len(first) < len(grid):
        cut = np.partition(best[first], SHORTLIST - 1)[SHORTLIST - 1]
        rest = np.flatnonzero(~estimated & ~(floor > cut))  # a NaN cut prunes nothing
        best[rest] = _coarse(target, p, grid[rest], tm[rest], tn[rest], tks)
        estimated[rest] = True
    rows = np.flatnonzero(estimated)
    return rows[np.argsort(best[rows], kind="stable")[:SHORTLIST]]


def _coarse(target: CostModel, p: Problem, grid: np.ndarray, tm, tn, tks) -> np.ndarray:
    """Each grid row's best estimate with the K chunks `tks` (three operand buffers where
    they fit, else two); inf where none fits."""
    if not len(grid):
        return np.zeros(0)
    cand, fits = _chunked(target, p, grid, tks, (3, 2), first_fit=True, tiles=(tm, tn))
    ns, _, _ = estimate(target, p, cand)
    return np.where(fits, ns, np.inf).min(axis=0)


def _dram_floor(target: CostModel, p: Problem, cand: dict[str, np.ndarray]) -> np.ndarray:
    """Per grid row, a time no estimate of it is below, whatever its K chunk and buffers:
    the DRAM streaming all its bytes and two DMA latencies (`_time`'s ``t_stream`` before
    it adds the arrays' and the epilogue's time, computed alike)."""
    moved = _bytes(target, p, cand, _blocks(target, p, cand))
    return target.dram_ns(moved["dram_bytes"]) + 2 * target.dma_latency_ns


def estimate(target: CostModel, p: Problem, cand: dict[str, np.ndarray]):
    """(estimated device ns, DRAM bytes, commands) of each candidate tiling (its columns
    may be arrays that broadcast against each other)."""
    t = terms(target, p, cand)
    return t["ns"], t["dram_bytes"], t["cmds"]


def terms(target: CostModel, p: Problem, cand: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every term of the estimate by name (``t_*`` in ns): the tiles, the bytes, the time."""
    shape = _shape(target, p, cand)
    moved = _dram_bytes(target, p, cand, shape)
    return shape | moved | _time(target, p, cand, shape, moved)


def _shape(target: CostModel, p: Problem, cand: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Tiles (largest and average), blocks, waves and the groups active in a wave
    (:func:`_blocks`), and steps per wave: the longest K slice sets them, full chunks and a
    shorter last one."""
    pk, tk = cand["pk"], cand["tk"]
    k_slice = _tile_max(p.k, pk, K_GRANULE)
    steps = -(-k_slice // tk)
    return _blocks(target, p, cand) | {"steps": steps, "tail": k_slice - (steps - 1) * tk}


def _blocks(target: CostModel, p: Problem, cand: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What does not depend on the K chunk: tiles (largest and average), blocks, waves and
    the groups active in a wave."""
    pm, pn = cand["pm"], cand["pn"]
    tm, tn = (cand["tm"], cand["tn"]) if "tm" in cand else tile_max(target, p, cand["m_tiles"], cand["n_tiles"])
    blocks = p.batch * (cand["m_tiles"] // pm) * (cand["n_tiles"] // pn)
    return {"tm": tm, "tn": tn, "tm_avg": p.m / cand["m_tiles"], "tn_avg": p.n / cand["n_tiles"], "blocks": blocks,
            "waves": -(-blocks // cand["groups"]), "active": np.minimum(blocks, cand["groups"])}


def _dram_bytes(target: CostModel, p: Problem, cand: dict[str, np.ndarray], shape: dict) -> dict[str, np.ndarray]:
    """Every byte the kernel moves (:func:`_bytes`), and the commands that move and
    compute them."""
    pk, pm, pn = cand["pk"], cand["pm"], cand["pn"]
    sends = pm * (pn - 1) + pn * (pm - 1)
    cmds = shape["blocks"] * (shape["steps"] * pk * (pm + pn + sends + pm * pn) + pm * pn * (pk + 2))
    return _bytes(target, p, cand, shape) | {"cmds": cmds}


def _bytes(target: CostModel, p: Problem, cand: dict[str, np.ndarray], shape: dict) -> dict[str, np.ndarray]:
    """Every byte the kernel moves, with average tiles: A once per N block, B once per M
    block, the output once."""
    pm, pn, k = cand["pm"], cand["pn"], p.k
    tm_avg, tn_avg = shape["tm_avg"], shape["tn_avg"]
    a_strip = target.charged_bytes(k, tm_avg, p.e_in) if p.trans_a else target.charged_bytes(tm_avg, k, p.e_in)
    b_strip = target.charged_bytes(tn_avg, k, p.e_in) if p.trans_b else target.charged_bytes(k, tn_avg, p.e_in)
    tile_bytes = sum(target.charged_bytes(tm_avg, tn_avg, e) for e in (*p.e_stores, *p.epi_tiles))
    per_block = pm * a_strip + pn * b_strip + pm * pn * tile_bytes
    return {"per_block": per_block, "dram_bytes": shape["blocks"] * per_block}


def _time(target: CostModel, p: Problem, cand: dict[str, np.ndarray], shape: dict, moved: dict) -> dict:
    """Per step the busiest core, per wave the DRAM every active group shares; between
    waves the arrays wait for the split-K reduction and the epilogue; the pipeline's fill
    (the first chunk's latency and forwards, and its transfer where the arrays would wait
    for it) and drain (the last tiles' stores). Never less than the DRAM streaming all of
    the kernel's bytes."""
    pk, tk = cand["pk"], cand["tk"]
    tm, tn, steps, active = shape["tm"], shape["tn"], shape["steps"], shape["active"]
    tiles = ((tm, tn), (shape["tm_avg"], shape["tn_avg"]))
    step = _step_terms(target, p, cand, tiles, np.minimum(tk, max(p.k, 1)), active)
    last = _step_terms(target, p, cand, tiles, np.maximum(shape["tail"], 1), active)
    t_steps = np.where(steps > 0, (steps - 1) * step["t_step"] + last["t_step"], 0)

    # the reduction's adds and the epilogue work on the fp32 accumulator
    sfu = target.sfu_ns(tm * tn)
    acc_bytes = tm * round_up(tn, 32) * 4
    t_reduce = np.ceil(np.log2(pk)) * (target.ring_ns(acc_bytes) + sfu)
    t_epilogue = sfu * ((2 if p.e_bias else 1) + p.epi_instrs)
    t_wave = np.maximum(t_steps, target.dram_ns(active * moved["per_block"])) + t_reduce + t_epilogue

    t_mm, t_load = step["t_mm"], step["t_load"]
    t_fill = np.where(steps > 0, step["t_fwd"] + t_load - np.maximum(0, t_load - target.dma_latency_ns - t_mm), 0)
    storing = target.dram_share(active * cand["pm"] * cand["pn"])
    t_drain = target.transfer_ns(sum(target.charged_bytes(tm, tn, e) for e in p.e_stores), storing)
    t_stream = target.dram_ns(moved["dram_bytes"]) + 2 * target.dma_latency_ns + t_mm + t_epilogue
    ns = np.maximum(t_fill + shape["waves"] * t_wave + t_drain, t_stream)
    return step | {"t_steps": t_steps, "t_reduce": t_reduce, "t_epilogue": t_epilogue, "t_wave": t_wave,
                   "t_fill": t_fill, "t_drain": t_drain, "t_stream": t_stream, "ns": ns}


def _step_terms(target: CostModel, p: Problem, cand: dict[str, np.ndarray], tiles, depth, active) -> dict:
    """The time of one step of a wave (chunks `depth` deep) on its busiest core: the
    arrays, its load engine (its share of the step's loads at its port's rate), its ring
    port, and the time a chunk takes to arrive (latency, its share of the DRAM, the
    forwards), which the other operand buffers hide. The DRAM the cores share is counted
    per wave (`terms`): it serves whoever is still loading, so an average chunk is what
    waits for it."""
    pk, pm, pn, nbuf = cand["pk"], cand["pm"], cand["pn"], cand["nbuf"]
    (tm, tn), (tm_avg, tn_avg) = tiles
    t_mm = target.matmul_ns(tm, tn, depth, p.fp32)
    a, b = _chunks(target, p, tm, tn, depth)
    a_avg, b_avg = _chunks(target, p, tm_avg, tn_avg, depth)
    # a core's load engine moves one transfer at a time: its share of a step's loads
    t_port = ((pm + pn) * target.dma_latency_ns + (pm * a + pn * b) / target.core_dma_bytes_per_ns) / (pm * pn)
    loads = active * pk * (pm + pn)  # transfers sharing DRAM in a step
    t_load = target.transfer_ns((pm * a_avg + pn * b_avg) / (pm + pn), target.dram_share(loads))
    hops = np.maximum(pm, pn) / 2  # a chunk is forwarded along its row or column: half of it on average
    a_send, b_send = target.ring_ns(a, hops), target.ring_ns(b, hops)
    t_fwd = np.maximum((pn - 1) * a_send, (pm - 1) * b_send)
    t_ring = (pm * (pn - 1) * a_send + pn * (pm - 1) * b_send) / (pm * pn)
    t_step = np.maximum(np.maximum(np.maximum(t_mm, t_ring), t_port), (t_load + t_fwd) / (nbuf - 1))
    return {"t_mm": t_mm, "t_port": t_port, "t_ring": t_ring, "t_load": t_load, "t_fwd": t_fwd, "t_step": t_step}


def _chunks(target: CostModel, p: Problem, tm, tn, depth):
    """DRAM bytes of an A chunk and a B chunk (`depth` deep) of `tm` x `tn` tiles."""
    a = target.charged_bytes(depth, tm, p.e_in) if p.trans_a else target.charged_bytes(tm, depth, p.e_in)
    b = target.charged_bytes(tn, depth, p.e_in) if p.trans_b else target.charged_bytes(depth, tn, p.e_in)
    return a, b


@functools.lru_cache(maxsize=512)
def choose(target: CostModel, p: Problem) -> Tiling:
    """The cheapest tiling that fits the scratchpad (cached: one choice per shape). Among
    those the model cannot tell apart (within its error, or within the card's fixed cost of
    a job, which no tiling changes), one that moves at most 1.5 times the minimum DRAM
    bytes (the bandwidth is shared with whatever else the card runs), with the most
    operand buffers (slack for what the model does not see), then with the fewest commands
    (it builds fastest and takes the least of the card's memory)."""
    if p.batch * p.m * p.n == 0:
        return Tiling(target.num_cores, 1, 1, 1, 1, 1, K_GRANULE, 2)  # nothing to compute
    cand = candidates(target, p)
    if not cand["tk"].size:
        raise ScratchpadOverflow(f"no matmul tile of {p.m}x{p.n}x{p.k} fits the scratchpad")
    ns, nbytes, cmds = estimate(target, p, cand)
    near = np.flatnonzero(ns <= ns.min() + max(TIE * ns.min(), target.job_launch_ns))
    lean = near[nbytes[near] <= DRAM_BUDGET * p.min_bytes]
    lean = lean if lean.size else near
    lean = lean[cand["nbuf"][lean] == cand["nbuf"][lean].max()]
    best = lean[np.argmin(cmds[lean])]
    return Tiling(**{k: int(cand[k][best]) for k in _TILING_FIELDS})


def estimate_one(target: CostModel, p: Problem, t: Tiling) -> float:
    """The model's device time of one tiling, in ns."""
    ns, _, _ = estimate(target, p, {k: np.array([getattr(t, k)]) for k in Tiling.__dataclass_fields__})
    return float(ns[0])


def lx_bytes_of(target: CostModel, p: Problem, t: Tiling) -> int:
    tm, tn = tile_max(target, p, np.array([t.m_tiles]), np.array([t.n_tiles]))
    return int(lx_bytes(target, p, tm, tn, np.array([t.tk]), np.array([t.pk]), np.array([t.nbuf]))[0])

