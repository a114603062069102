"""The matmul's tiling and its cost model: choices fit the scratchpad, give every core a
tile in every wave, split K where M x N is too small for the cores, share operands over
the ring so that DRAM traffic stays near the minimum, and the model's time tracks the
simulator's. Shapes off the 64 grid: M of 1, 7 and 1024; N and K from 64 to 49,155."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from spyre_rt import device_profile, jobs
from spyre_rt.construct.context import BuildContext
from spyre_rt.construct.matmul import MatmulSpec, Problem, Tiling, View, build, choose
from spyre_rt.construct.matmul import tiling as tl
from spyre_rt.cost import CostModel
from spyre_rt.layout import StickLayout
from spyre_rt.native import lib

TARGET = CostModel.of_figures(device_profile.load("spyre"))
MS, NKS = (1, 7, 1024), (64, 100, 4097, 49155)


def linear(m: int, n: int, k: int) -> tuple[BuildContext, MatmulSpec]:
    """x (m, k) @ W.t(), W (n, k) as nn.Linear stores it; fp16."""
    layouts = {"x": StickLayout(m, k, 2), "w": StickLayout(n, k, 2), "o": StickLayout(m, n, 2)}
    spec = MatmulSpec(View("x", 0, (1, m, k), (0, k, 1)), View("w", 0, (1, k, n), (0, 1, k)),
                      View("o", 0, (1, m, n), (0, n, 1)), lib.SPY_DT_F16, lib.SPY_DT_F16)
    return BuildContext(TARGET, layouts), spec


def blocks(p: Problem, t: Tiling) -> int:
    return p.batch * (t.m_tiles // t.pm) * (t.n_tiles // t.pn)


@pytest.mark.parametrize("extent,parts,gran", [(1024, 4, 8), (49155, 112, 64), (7, 2, 1), (100, 3, 8),
                                               (65, 65, 1), (4097, 4, 64)])
def test_split_is_as_even_as_whole_granules_allow(extent, parts, gran):
    sizes = tl.split(extent, parts, gran)
    assert sizes.sum() == extent and len(sizes) == parts
    assert (sizes[:-1] % gran == 0).all() and (sizes > 0).all()
    assert sizes.max() - sizes[:-1].min() <= gran
    assert (np.diff(sizes[:-1]) <= 0).all(), "bigger pieces first"


@pytest.mark.parametrize("m,n,k", list(itertools.product(MS, NKS, NKS)))
def test_choice_fits_and_gives_every_core_a_tile_in_every_wave(m, n, k):
    """Every core has a tile in every wave, unless the matmul is so small that its roofline
    is a few job launches (its fixed costs dominate)."""
    ctx, spec = linear(m, n, k)
    p = Problem.of(spec)
    t = choose(TARGET, p)
    assert tl.lx_bytes_of(TARGET, p, t) <= TARGET.scratchpad_bytes
    assert t.groups * t.group_cores == TARGET.num_cores
    if tl.roofline_ns(TARGET, p) < tl.BUSY_FROM * TARGET.job_launch_ns:
        return
    assert blocks(p, t) % t.groups == 0, f"{t}: the last wave leaves groups idle"
    assert (blocks(p, t) * t.group_cores) % TARGET.num_cores == 0  # tiles: a multiple of the cores


@pytest.mark.parametrize("n,k", [(256, 256), (64, 256), (512, 256), (256, 512), (1000, 256)])
def test_tiny_matmuls_take_few_commands(n, k):
    """A decode GEMM of a tiny model is a few job launches of work: within a job launch's
    time of the fastest tiling, the one with the fewest commands (construct mode builds
    them at every launch)."""
    ctx, spec = linear(1, n, k)
    build(ctx, spec)
    assert ctx.ncmds <= 48


@pytest.mark.parametrize("k", [4097, 49155])
def test_decode_with_few_columns_splits_k(k):
    """M x N of 1 x 64 cannot keep 32 cores busy with output tiles: K is cut instead."""
    _, spec = linear(1, 64, k)
    assert choose(TARGET, Problem.of(spec)).pk > 1


def test_large_gemms_share_both_operands():
    """A prefill GEMM uses a 2-D grid: A forwarded along rows, B along columns."""
    _, spec = linear(1024, 12800, 4096)
    t = choose(TARGET, Problem.of(spec))
    assert t.pm > 1 and t.pn > 1


def test_the_model_counts_what_the_ring_saves():
    """Without sharing every core streams its own A and B strips: more DRAM bytes, and a
    slower estimate, for the same tiles."""
    _, spec = linear(1024, 4096, 4096)
    p = Problem.of(spec)
    shared = Tiling(1, 1, 4, 8, 4, 16, 128, 3)
    alone = Tiling(32, 1, 1, 1, 4, 16, 128, 3)
    cols = {k: np.array([getattr(t, k) for t in (shared, alone)]) for k in Tiling.__dataclass_fields__}
    ns, nbytes, _ = tl.estimate(TARGET, p, cols)
    assert nbytes[1] > 2 * nbytes[0] and ns[1] > 1.2 * ns[0]


# ---- against the simulator ------------------------------------------------------------

@pytest.fixture(scope="module")
def card():
    from spyre_rt.card import Card

    return Card(device_profile.load("spyre"), "timing", 0)


def simulate(card, ctx: BuildContext) -> tuple[float, int]:
    """(device ns of one launch, DRAM bytes the program moves)."""
    ns, info = jobs.time_alone(card, ctx.encode(), [ctx.layouts[name].nbytes for name in ctx.buffers()])
    return ns, int(info["dma_bytes"])


@pytest.mark.parametrize("m,n,k", [(1024, 4096, 4096), (1024, 1024, 4096), (1, 4096, 4096), (1, 64, 49155),
                                   (7, 4097, 4097), (1024, 100, 4097), (7, 49155, 64)])
def test_the_model_tracks_the_simulator(card, m, n, k):
    ctx, spec = linear(m, n, k)
    p = Problem.of(spec)
    t = build(ctx, spec).tiling
    ns, _ = simulate(card, ctx)
    assert abs(tl.estimate_one(TARGET, p, t) / ns - 1) < 0.15, f"{t}: model vs simulator"


def swiglu_up(m: int, n: int, k: int) -> tuple[BuildContext, MatmulSpec]:
    """The up projection of a SwiGLU MLP with SiLU(gate) * up as its epilogue, as the
    compiler fuses it (Inductor's ops: gate converted to fp32 twice)."""
    from spyre_rt.ir import Epilogue, Op

    ctx, spec = linear(m, n, k)
    ctx.layouts.update({"g": StickLayout(m, n, 2), "h": StickLayout(m, n, 2)})
    ops = (Op("g", "load", (), "float16", attrs={"input": 0}), Op("a", "to_dtype", ("g",), "float32"),
           Op("b", "to_dtype", ("g",), "float32"), Op("c", "neg", ("b",)), Op("d", "exp", ("c",)),
           Op("one", "constant", (), "float32", attrs={"value": 1.0}), Op("e", "add", ("d", "one")),
           Op("f", "truediv", ("a", "e")), Op("s", "to_dtype", ("f",), "float16"),
           Op("p", "product", dtype="float16"), Op("y", "mul", ("s", "p")),
           Op("o", "store", ("y",), "float16", attrs={"output": 0}))
    tile = (0, (1, m, n), (0, n, 1))
    ep = Epilogue(ops, (View("g", *tile),), ("float16",), (View("h", *tile),), ("float16",))
    return ctx, MatmulSpec(spec.a, spec.b, spec.out, spec.in_dtype, spec.out_dtype, epilogue=ep)


def test_an_epilogue_costs_its_gemm_little_and_the_model_sees_it(card):
    """Granite 3.3 8B's up projection at a 1,024-token prefill with SiLU(gate) * up fused:
    the epilogue's loads spread over each wave, so its cores do not all load at once at
    the wave's end while the arrays wait, and its temporaries leave room for the plain
    GEMM's tiles. Simulated, within 2 % of the same GEMM without it and within 3 % of the
    model (which does not count the tiles' pieces: their programs and stores overlap the
    last matmuls, 2.2 % of this GEMM's time)."""
    plain_ctx, plain = linear(1024, 12800, 4096)
    build(plain_ctx, plain)
    plain_ns, _ = simulate(card, plain_ctx)
    ctx, spec = swiglu_up(1024, 12800, 4096)
    t = build(ctx, spec).tiling
    ns, _ = simulate(card, ctx)
    assert ns <= 1.02 * plain_ns, f"{t}: {ns / 1e3:.0f} us with the epilogue, {plain_ns / 1e3:.0f} without"
    assert abs(tl.estimate_one(TARGET, Problem.of(spec), t) / ns - 1) < 0.03, f"{t}: model vs simulator"


@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (12800, 4096), (4096, 12800)])
def test_prefill_gemms_move_at_most_one_and_a_half_times_the_minimum(card, n, k):
    """Each operand once and the output once is the minimum; sharing over the ring keeps a
    1024-row GEMM within 1.5 times it, and its device time within 15 % of the roofline."""
    ctx, spec = linear(1024, n, k)
    p = Problem.of(spec)
    build(ctx, spec)
    ns, moved = simulate(card, ctx)
    assert moved <= 1.5 * p.min_bytes
    roofline = max(p.macs / (TARGET.macs_per_ns * TARGET.num_cores), p.min_bytes / TARGET.dram_bytes_per_ns)
    assert ns <= roofline / 0.85


# ---- the search itself: its shortcuts choose what the whole search would ----------------------

SEARCH_PROBLEMS = [Problem(1, m, n, k, e, e, bias, ta, tb, e == 4, stores=stores, epi_temps=temps)
                   for (m, n, k), e, bias, ta, tb, stores, temps in [
                       ((31, 4096, 4096), 2, 0, False, True, (), 0),
                       ((1024, 12800, 4096), 2, 0, False, True, (), 0),
                       ((1, 49155, 4096), 2, 0, False, True, (), 0),
                       ((7, 100, 4097), 4, 4, True, False, (4,), 0),
                       ((513, 96, 12800), 2, 2, False, False, (2, 4), 2),
                       ((2, 12800, 17), 4, 0, True, True, (), 0)]]


def _grids_one_split_at_a_time(p: Problem) -> np.ndarray:
    """The grid rows as the search defines them, split by split (what the search makes)."""
    c, rows = TARGET.num_cores, []
    for pk in tl.divisors(c):
        if pk > max(p.k, 1):
            continue
        for pm in tl.divisors(c // pk):
            for pn in tl.divisors(c // (pk * pm)):
                for wm in sorted({max(1, -(-p.m // (pm * a))) for a in tl.M_TILE_AIMS}):
                    for wn in sorted({max(1, -(-p.n // (pn * a))) for a in tl.N_TILE_AIMS}):
                        rows.append((c // (pk * pm * pn), pk, pm, pn, pm * wm, pn * wn, wm * wn))
    groups, pk, pm, pn, m_tiles, n_tiles, blocks_ = np.array(rows).T
    exist = (m_tiles <= p.m) & (n_tiles <= p.n)
    smallest = np.minimum(tl.K_GRANULE, max(p.k, 1))
    lx = tl.terms(TARGET, p, {"groups": groups, "pk": pk, "pm": pm, "pn": pn, "m_tiles": np.minimum(m_tiles, max(p.m, 1)),
                              "n_tiles": np.minimum(n_tiles, max(p.n, 1)), "tk": smallest, "nbuf": 2})["lx_bytes"]
    keep = exist & (lx <= TARGET.scratchpad_bytes)
    if tl.roofline_ns(TARGET, p) >= tl.BUSY_FROM * TARGET.job_launch_ns:
        busy = keep & (p.batch * blocks_ % groups == 0)
        keep = busy if busy.any() else keep
    return np.column_stack([groups, pk, pm, pn, m_tiles, n_tiles])[keep]


@pytest.mark.parametrize("p", SEARCH_PROBLEMS, ids=lambda p: f"{p.m}x{p.n}x{p.k}")
def test_the_grids_are_every_split_with_every_distinct_tile_count_in_order(p):
    assert np.array_equal(tl.grids(TARGET, p), _grids_one_split_at_a_time(p))


def _every_chunk_and_buffer_count(p: Problem, tks) -> np.ndarray:
    """Per grid, its best estimate over the K chunks `tks` and two or three operand buffers,
    each that fits (inf where none does)."""
    grid = tl.grids(TARGET, p)
    best = np.full(len(grid), np.inf)
    for tk in tks:
        for nbuf in (2, 3):
            t = tl.terms(TARGET, p, dict(zip(tl.GRID_COLUMNS, grid.T, strict=True)) | {"tk": tk, "nbuf": nbuf})
            best = np.where(t["lx_bytes"] <= TARGET.scratchpad_bytes, np.minimum(best, t["ns"]), best)
    return best


def _coarse_chunks(p: Problem) -> tuple[int, ...]:
    k_max = -(-max(p.k, 1) // tl.K_GRANULE) * tl.K_GRANULE
    return tuple(sorted({tl.K_GRANULE, min(256, k_max)}))


@pytest.mark.parametrize("p", SEARCH_PROBLEMS, ids=lambda p: f"{p.m}x{p.n}x{p.k}")
def test_the_coarse_pass_ranks_grids_as_with_every_buffer_count(p):
    # it tries two operand buffers only where three do not fit: three never take longer
    best, _, _ = tl.coarse(TARGET, p, prune=False)
    assert np.array_equal(best, _every_chunk_and_buffer_count(p, _coarse_chunks(p)))
    assert np.isfinite(best).any()


# prompt-length GEMMs of a small fp32 model (one with a fused epilogue): thousands of grids
PRUNED_PROBLEMS = SEARCH_PROBLEMS + [Problem(1, m, n, k, 4, 4, 0, False, True, True, stores=stores, epi_temps=temps)
                                     for (m, n, k), stores, temps in [((47, 1000, 256), (4,), 2), ((29, 64, 256), (), 0),
                                                                      ((300, 512, 256), (4,), 3)]]


@pytest.mark.parametrize("p", PRUNED_PROBLEMS, ids=lambda p: f"{p.m}x{p.n}x{p.k}")
def test_the_shortlist_is_the_best_coarse_estimates_of_every_grid(p):
    # grids whose DRAM floor is above the shortlist's worst are never estimated
    every, floor, whole = tl.coarse(TARGET, p, prune=False)
    assert np.array_equal(whole, np.argsort(every, kind="stable")[:tl.SHORTLIST])
    pruned, _, short = tl.coarse(TARGET, p)
    assert np.array_equal(short, whole)
    assert (floor <= every).all()
    estimated = ~np.isnan(pruned)
    assert np.array_equal(pruned[estimated], every[estimated])
    if len(every) > 4 * tl.SHORTLIST:
        assert estimated.sum() < len(every) / 2, "the floors pruned nothing"


@pytest.mark.parametrize("p", PRUNED_PROBLEMS, ids=lambda p: f"{p.m}x{p.n}x{p.k}")
def test_the_native_model_is_made_of_the_cost_models_charges(p):
    """The search's terms (native/tiling.c) are the command charges of spyre_rt.cost,
    term by term, for the tiling it chooses and a few grids of its own."""
    t = tl.choose(TARGET, p)
    grid = tl.grids(TARGET, p)[::97][:8]
    cand = {k: np.append(grid[:, i], getattr(t, k)) for i, k in enumerate(tl.GRID_COLUMNS)}
    cand |= {"tk": np.append(np.full(len(grid), 128), t.tk), "nbuf": np.append(np.full(len(grid), 3), t.nbuf)}
    terms = tl.terms(TARGET, p, cand)
    for i in range(len(cand["tk"])):
        tm, tn = int(terms["tm"][i]), int(terms["tn"][i])
        depth = min(int(cand["tk"][i]), max(p.k, 1))
        assert terms["t_mm"][i] == TARGET.matmul_ns(tm, tn, depth, p.fp32)
        sfu = TARGET.sfu_ns(tm * tn)
        assert terms["t_epilogue"][i] == sfu * ((2 if p.e_bias else 1) + p.epi_instrs)
        assert terms["floor_ns"][i] == TARGET.dram_ns(terms["dram_bytes"][i]) + 2 * TARGET.dma_latency_ns
        stored = sum(TARGET.charged_bytes(tm, tn, e) for e in p.e_stores)
        active = terms["active"][i]
        assert terms["t_drain"][i] == TARGET.transfer_ns(stored, TARGET.dram_share(active * cand["pm"][i] * cand["pn"][i]))
        tm_avg, tn_avg = p.m / cand["m_tiles"][i], p.n / cand["n_tiles"][i]
        a = TARGET.charged_bytes(p.k, tm_avg, p.e_in) if p.trans_a else TARGET.charged_bytes(tm_avg, p.k, p.e_in)
        b = TARGET.charged_bytes(tn_avg, p.k, p.e_in) if p.trans_b else TARGET.charged_bytes(p.k, tn_avg, p.e_in)
        tiles = sum(TARGET.charged_bytes(tm_avg, tn_avg, e) for e in (*p.e_stores, *p.epi_tiles))
        pm, pn = int(cand["pm"][i]), int(cand["pn"][i])
        assert terms["per_block"][i] == pm * a + pn * b + pm * pn * tiles
        assert terms["ns"][i] >= terms["floor_ns"][i]


def test_an_empty_matmul_with_a_prologue_or_strips_is_estimated_not_divided_by_zero():
    """No rows (m 0) gives no tile rows: the prologue's strips must not divide by them (the
    builder fuzzer's find, a SIGFPE in a plain build)."""
    p = Problem(1, 0, 64, 64, 2, 2, 0, False, True, False, pro_instrs=3, pro_temps=1, pro_strip=32,
                epi_strip=32, epi_temps=1, epi_instrs=2, stores=(2,))
    t = Tiling(1, 1, 1, 1, 1, 1, 64, 2)
    assert np.isfinite(tl.estimate_one(TARGET, p, t))
    assert tl.lx_bytes_of(TARGET, p, t) >= 0


def test_prologue_temporaries_of_an_unknown_element_size_are_refused_not_overflowed():
    """Temporaries with no instructions still take room: their element size is checked as
    any other's (the builder fuzzer's find: a signed overflow of the scratchpad estimate,
    under UBSan, for 64 temporaries of 2^32-byte elements)."""
    from spyre_rt.errors import SpyreError

    p = Problem(1, 64, 64, 64, 2, 2, 0, False, True, False, pro_temps=64, pro_temp_e=1 << 31)
    with pytest.raises(SpyreError, match="prologue of 64 temporaries"):
        tl.lx_bytes_of(TARGET, p, Tiling(1, 1, 1, 1, 1, 1, 64, 2))
