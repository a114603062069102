"""The SFU's fp32 rate (``sfu_fp32_ratio``): an instruction with an fp32 destination or
source in the scratchpad runs at that fraction of the element rate, one on fp16 operands at
the full rate; the construction's cost estimates charge their fp32 SFU work the same way;
and the figure is range-checked (0 < ratio <= 1)."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch
from small_profiles import profile_text_with

from spyre_rt import card as cards
from spyre_rt import device_profile, jobs
from spyre_rt.card import Card
from spyre_rt.construct import attention
from spyre_rt.construct.matmul import MatmulSpec, Problem, Tiling, View
from spyre_rt.construct.matmul import tiling as tl
from spyre_rt.cost import CostModel
from spyre_rt.errors import SpyreProfileError
from spyre_rt.native import lib
from spyre_rt.program import (
    CMD_SFU,
    INSTR,
    OP_SFU,
    OPND_IMM,
    OPND_NONE,
    OPND_TILE,
    ProgramBuilder,
    empty_cmds,
)


def with_ratio(ratio) -> str:
    return profile_text_with(sfu_fp32_ratio=ratio)


@pytest.fixture(scope="module")
def cards_by_ratio():
    """Timing cards of the shipped profile and of one whose SFU runs fp32 at half rate."""
    return {r: Card(device_profile.parse(with_ratio(r)), "timing", 0) for r in (1.0, 0.5)}


F16, F32 = lib.SPY_DT_F16, lib.SPY_DT_F32
ROWS, COLS = 32, 64


def sfu_program(op: int, dst: int, src: int, imm: bool = False) -> np.ndarray:
    """One SFU command of one instruction over a ROWS x COLS tile: dst = op(src[, 2.0])."""
    b = ProgramBuilder()
    c = empty_cmds(1, OP_SFU, 0, CMD_SFU)
    c["instr_begin"], c["ninstrs"] = 0, 1
    none = (OPND_NONE, 0, 0, 0, 0)
    second = (OPND_IMM, F32, 0, 0, struct.unpack("<Q", struct.pack("<d", 2.0))[0]) if imm else none
    b.add_instrs(np.array([(op, 0, 0, 0, ROWS, COLS, (OPND_TILE, dst, 0, COLS, 0),
                            [(OPND_TILE, src, 0, COLS, 64 << 10), second, none])], dtype=INSTR))
    b.add(c)
    return b.encode()


@pytest.mark.parametrize("op,dst,src,imm,fp32", [
    (lib.SPY_SFU_EXP, F16, F16, False, False),
    (lib.SPY_SFU_ADD, F16, F16, True, False),   # an fp32 immediate is one constant, not a stream
    (lib.SPY_SFU_EXP, F32, F32, False, True),
    (lib.SPY_SFU_EXP, F32, F16, False, True),   # widening into fp32
    (lib.SPY_SFU_EXP, F16, F32, False, True),   # narrowing from fp32
])
def test_an_instruction_runs_at_the_fp32_rate_when_an_operand_is_fp32(cards_by_ratio, op, dst, src, imm, fp32):
    blob = sfu_program(op, dst, src, imm)
    full, half = (jobs.time_alone(cards_by_ratio[r], blob, [])[0] for r in (1.0, 0.5))
    p = cards_by_ratio[1.0].profile
    per = p["sfu_transcendental_cycles"] if op == lib.SPY_SFU_EXP else 1.0
    compute_ns = ROWS * COLS * per / p["sfu_elems_per_cycle"] / p["clock_ghz"]
    # at half the rate the elements take twice as long; fp16 instructions are unchanged
    assert half - full == pytest.approx(compute_ns if fp32 else 0.0, abs=1e-6)


def chain(x):
    for _ in range(8):
        x = torch.exp(torch.sin(x))
    return x


def test_a_compiled_fp32_kernel_of_transcendentals_slows_with_the_ratio(tmp_path):
    """Device time of one compiled call on a card of each ratio, in one run."""
    times = {}
    for ratio in (1.0, 0.5):
        path = tmp_path / f"ratio-{ratio}.toml"
        path.write_text(with_ratio(ratio))
        with cards.configured(str(path), "timing") as cs:
            f = torch.compile(chain, backend="spyre_rt", dynamic=False)
            x = torch.zeros(64, 64, dtype=torch.float32).to("spyre")
            f(x)
            before = cs.cards[0].counters()["device_busy_ns"]
            f(x)
            times[ratio] = cs.cards[0].counters()["device_busy_ns"] - before
    assert times[0.5] / times[1.0] > 1.3, times


def test_construction_estimates_charge_fp32_sfu_work_at_the_ratio():
    """The matmul's split-K adds and epilogue (on the fp32 accumulator) and the attention's
    softmax (on fp32 S and O): their SFU element time doubles at half the rate."""
    full = CostModel.of_figures(device_profile.load("spyre"))
    half = dataclasses.replace(full, sfu_fp32_ratio=0.5)
    assert full.sfu_fp32_ratio == 1.0

    m, n, k = 1, 64, 49155  # a decode GEMV: K split over the cores, reduced over the ring
    spec = MatmulSpec(View("x", 0, (1, m, k), (0, k, 1)), View("w", 0, (1, k, n), (0, 1, k)),
                      View("o", 0, (1, m, n), (0, n, 1)), lib.SPY_DT_F16, lib.SPY_DT_F16)
    p = Problem.of(spec)
    t = tl.choose(full, p)
    assert t.pk > 1
    cand = {k: np.array([getattr(t, k)]) for k in Tiling.__dataclass_fields__}
    terms = {target.sfu_fp32_ratio: tl.terms(target, p, cand) for target in (full, half)}
    elems_ns = terms[1.0]["tm"] * terms[1.0]["tn"] / full.sfu_elems_per_ns  # one pass over a tile, fp16 rate
    assert terms[0.5]["t_epilogue"] - terms[1.0]["t_epilogue"] == pytest.approx(elems_ns)
    rounds = np.ceil(np.log2(t.pk))
    assert terms[0.5]["t_reduce"] - terms[1.0]["t_reduce"] == pytest.approx(rounds * elems_ns)

    shape = attention.Shape(batch=1, heads=8, kv_heads=8, q_len=128, kv_len=512, dim=64, v_dim=64,
                            dtype="float16", mask="", mask_dtype="", mask_heads=1, causal=False, q_offset=0)
    fixed = attention.SFU_INSTRS * full.sfu_latency_ns
    sfu = {target.sfu_fp32_ratio: attention.block_costs(shape, target, 32, 256)[1] - fixed for target in (full, half)}
    assert sfu[0.5] == pytest.approx(2 * sfu[1.0])


@pytest.mark.parametrize("value,message", [(0, "must be positive"), (1.5, r"\(1.5\) is above 1")])
def test_the_ratio_is_checked_when_a_card_opens(value, message):
    with pytest.raises(SpyreProfileError, match=f"sfu_fp32_ratio {message}"):
        Card(device_profile.parse(with_ratio(value)), "timing", 0)
    Card(device_profile.parse(with_ratio(1)), "timing", 0)  # at most 1: 1 itself is a rate


def test_a_negative_ratio_is_refused_by_the_loader():
    with pytest.raises(SpyreProfileError, match="sfu_fp32_ratio.*must not be negative"):
        device_profile.parse(with_ratio(-0.5))
