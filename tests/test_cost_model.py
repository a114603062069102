"""The one cost model (spyre_rt.cost) against the simulator.

Per command kind: what the model charges one matmul, SFU, DMA or ring command is what the
simulator charges it, on the shipped profile and on one whose figures all differ. Per
kernel kind: no kernel of a compiled step (matmul, loop, reduction, attention, copy) takes
less simulated time than the model's roofline says it can, and the tilings' estimates
(made of the model's charges) track the simulator's time of the kernels they chose: the
attention's here, the matmul's in tests/test_matmul_tiling.py."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from small_profiles import profile_text_with

from spyre_rt import card as cards
from spyre_rt import construct, device_profile, jobs, trace
from spyre_rt.card import Card
from spyre_rt.construct import attention
from spyre_rt.construct.context import BuildContext
from spyre_rt.cost import CostModel
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.ir import AttentionKernel
from spyre_rt.layout import StickLayout
from spyre_rt.native import lib
from spyre_rt.program import (
    CMD_MM,
    CMD_RING,
    CMD_SFU,
    INSTR,
    OP_LOAD,
    OP_MATMUL,
    OP_RING,
    OP_SFU,
    OPND_IMM,
    OPND_NONE,
    OPND_TILE,
    SLOT_DRAM,
    ProgramBuilder,
    empty_cmds,
)

# every figure a command's charge is made of, changed (a profile no card ships)
CHANGED = {"pt_gran_m": 16, "pt_gran_n": 32, "pt_gran_k": 4, "pt_latency_ns": 33, "pt_utilization": 0.6,
           "pt_fp32_ratio": 0.5, "dma_latency_ns": 170, "dram_burst_bytes": 128, "core_dma_gbps": 40,
           "ring_hop_ns": 7, "ring_bytes_per_cycle": 64, "sfu_latency_ns": 13, "sfu_elems_per_cycle": 96,
           "sfu_fp32_ratio": 0.5, "clock_ghz": 1.25}


@pytest.fixture(scope="module", params=["shipped", "changed"])
def card(request):
    text = profile_text_with() if request.param == "shipped" else profile_text_with(**CHANGED)
    c = Card(device_profile.parse(text), "timing", 0)
    return c


def _chain(cmd: np.ndarray, n: int, slots=(), instrs=None) -> np.ndarray:
    """A program of `n` copies of one command, each waiting for the one before."""
    b = ProgramBuilder()
    for kind, extent in slots:
        b.slot(kind, extent)
    if instrs is not None:
        b.add_instrs(instrs)
    cmds = np.repeat(cmd, n)
    cmds["dep_begin"] = np.maximum(np.arange(n) - 1, 0)
    cmds["ndeps"] = np.arange(n) > 0
    b.add(cmds, np.arange(max(n - 1, 0), dtype=np.uint32))
    return b.encode()


def simulated_ns(card: Card, cmd: np.ndarray, slots=(), instrs=None) -> float:
    """The simulator's charge for one command: a chain of two less a chain of one, so that
    the job's own fixed costs cancel."""
    sizes = [extent for _, extent in slots]
    one = jobs.time_alone(card, _chain(cmd, 1, slots, instrs), sizes)[0]
    two = jobs.time_alone(card, _chain(cmd, 2, slots, instrs), sizes)[0]
    return two - one


@pytest.mark.parametrize("m,n,k,dtype", [(64, 64, 64, lib.SPY_DT_F16), (100, 70, 50, lib.SPY_DT_F16),
                                         (8, 512, 129, lib.SPY_DT_F16), (33, 65, 17, lib.SPY_DT_F32)])
def test_a_matmul_command_costs_what_the_simulator_charges(card, m, n, k, dtype):
    model = CostModel.of_figures(card.profile)
    c = empty_cmds(1, OP_MATMUL, 0, CMD_MM)
    e = 4 if dtype == lib.SPY_DT_F32 else 2
    c["a_off"], c["b_off"], c["c_off"] = 0, 256 << 10, 512 << 10
    c["m"], c["n"], c["k"], c["lda"], c["ldb"], c["ldc"] = m, n, k, k, n, n
    c["a_dtype"] = c["b_dtype"] = dtype
    assert m * k * e < 256 << 10 and k * n * e < 256 << 10
    expected = model.matmul_ns(m, n, k, fp32=dtype == lib.SPY_DT_F32)
    assert simulated_ns(card, c) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("op,dst,src,imm,fp32", [
    (lib.SPY_SFU_ADD, lib.SPY_DT_F16, lib.SPY_DT_F16, True, False),
    (lib.SPY_SFU_ADD, lib.SPY_DT_F32, lib.SPY_DT_F32, True, True),
    (lib.SPY_SFU_EXP, lib.SPY_DT_F32, lib.SPY_DT_F16, False, True),
])
def test_an_sfu_instruction_costs_what_the_simulator_charges(card, op, dst, src, imm, fp32):
    rows, cols = 32, 64
    model = CostModel.of_figures(card.profile)
    none = (OPND_NONE, 0, 0, 0, 0)
    second = (OPND_IMM, lib.SPY_DT_F32, 0, 0, struct.unpack("<Q", struct.pack("<d", 2.0))[0]) if imm else none
    instrs = np.array([(op, 0, 0, 0, rows, cols, (OPND_TILE, dst, 0, cols, 0),
                        [(OPND_TILE, src, 0, cols, 64 << 10), second, none])], dtype=INSTR)
    c = empty_cmds(1, OP_SFU, 0, CMD_SFU)
    c["instr_begin"], c["ninstrs"] = 0, 1
    per = card.profile["sfu_transcendental_cycles"] if op == lib.SPY_SFU_EXP else 1.0
    expected = model.sfu_ns(rows * cols, fp32=fp32, cycles_per_elem=per)
    assert simulated_ns(card, c, instrs=instrs) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("rows,cols,itemsize", [(1, 64, 2), (16, 100, 2), (7, 33, 4), (3, 2048, 2)])
def test_a_load_costs_its_latency_and_its_charged_bytes_at_its_rate(card, rows, cols, itemsize):
    """A run of `cols` elements starting on a stick, `rows` of them a stick-padded row
    apart: whole sticks are charged exactly, a remainder in whole bursts."""
    model = CostModel.of_figures(card.profile)
    pitch = -(-cols * itemsize // model.stick_bytes) * model.stick_bytes
    c = empty_cmds(1, OP_LOAD, 0)
    c["src_slot"], c["src_off"], c["dst_off"] = 0, 0, 0
    c["run_bytes"], c["ndims"] = cols * itemsize, 1
    c["count"][0, 0], c["src_stride"][0, 0], c["dst_stride"][0, 0] = rows, pitch, cols * itemsize
    charged = model.charged_bytes(rows, cols, itemsize)
    expected = model.transfer_ns(charged, model.dram_share(1))
    assert simulated_ns(card, c, slots=[(SLOT_DRAM, rows * pitch)]) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("dst_core,nbytes", [(1, 4096), (5, 128), (31, 65536), (16, 1000)])
def test_a_ring_send_costs_its_hops_and_its_bytes(card, dst_core, nbytes):
    model = CostModel.of_figures(card.profile)
    c = empty_cmds(1, OP_RING, 0, CMD_RING)
    c["dst_core"], c["ring_src"], c["ring_dst"], c["bytes"] = dst_core, 0, 1 << 20, nbytes
    hops = min(dst_core, model.num_cores - dst_core)  # the short way round the ring, as sim.c counts
    expected = model.ring_ns(nbytes, hops)
    assert simulated_ns(card, c) == pytest.approx(expected, rel=1e-9)


def test_the_model_reads_every_figure_from_the_profile():
    shipped = CostModel.of_figures(device_profile.load("spyre"))
    changed = CostModel.of_figures(device_profile.parse(profile_text_with(**CHANGED)))
    assert changed.gran_m == 16 and changed.gran_k == 4 and changed.ring_hop_ns == 7
    assert changed.macs_per_ns == pytest.approx(1536 * 0.6)
    assert changed.sfu_elems_per_ns == pytest.approx(96 * 1.25)
    differing = [f for f in CostModel.__dataclass_fields__ if getattr(shipped, f) != getattr(changed, f)]
    assert len(differing) >= 14, differing


def test_a_trace_records_the_figures_the_model_is_made_of():
    profile = device_profile.load("spyre")
    meta = {"spyre_rt": {"device": {"figures": {k: f.value for k, f in profile.figures.items()}}}}
    assert CostModel.of_trace_metadata(meta) == CostModel.of_figures(profile)
    assert CostModel.of_trace_metadata({}) is None


# ---- per kernel kind -------------------------------------------------------------------

def step(x, w, q, k, v, table, ids):
    h = torch.relu(x @ w)                                                   # matmul, loop
    s = torch.softmax(h, dim=-1).sum(dim=0)                                 # reductions
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)             # attention
    return h, s, a, table[ids] * 1.0, torch.sin(x) * 2.0                    # gather, elementwise


def test_no_kernel_takes_less_than_its_roofline():
    torch._dynamo.reset()
    torch.manual_seed(0)
    card = cards.get(0)
    args = [torch.randn(256, 512), torch.randn(512, 1024), torch.randn(1, 8, 128, 64), torch.randn(1, 8, 128, 64),
            torch.randn(1, 8, 128, 64), torch.randn(1000, 128), torch.randint(0, 1000, (64,))]
    dev = [a.to("spyre") for a in args]
    f = torch.compile(step, backend="spyre_rt", dynamic=False)
    with torch.no_grad(), dispatch_mode("prebuilt"):
        f(*dev)
        with trace.recording(card, commands=False) as cap:
            f(*dev)
    model = CostModel.of_figures(card.profile)
    jobs_seen = [e for e in cap.export()["traceEvents"] if e.get("ph") == "X" and "flops" in e.get("args", {})]
    kinds = {e["args"].get("kind") for e in jobs_seen}
    assert {"matmul", "pointwise", "reduction", "attention", "gather"} <= kinds, kinds
    for e in jobs_seen:
        a = e["args"]
        least = model.kernel_ns(a["flops"], a["dram_bytes_min"], a.get("dtype"))
        assert e["dur"] * 1e3 >= least * (1 - 1e-9), (e["name"], a["kind"], e["dur"], least / 1e3)


def _time_alone(card, ctx: BuildContext) -> float:
    return jobs.time_alone(card, ctx.encode(), [ctx.layouts[n].nbytes for n in ctx.buffers()])[0]


@pytest.mark.parametrize("heads,kv_heads,dim,q_len,kv_len,causal", [
    (8, 8, 64, 1, 1024, False), (8, 8, 64, 512, 512, False), (32, 8, 128, 1, 4096, False),
    (32, 8, 128, 256, 2048, False), (8, 8, 64, 128, 128, True), (32, 8, 128, 1024, 1024, True)])
def test_the_attention_estimate_tracks_the_simulator(heads, kv_heads, dim, q_len, kv_len, causal):
    """q, k, v and out fp16 in their stick layouts. Without a causal mask the estimate is
    within 10 % of the simulator; with one it is high, by 19-34 % on these shapes where each
    core walks its own keys (the blocks on the diagonal), and within a few % where the cores
    of a KV head share them (1.3 % low at 1,024 queries): it may rank causal tilings, not
    time them."""
    card = Card(device_profile.load("spyre"), "timing", 0)
    model = CostModel.of_figures(card.profile)

    def view(name, h, n):
        return (name, 0, (1, h, n, dim), (h * n * dim, n * dim, dim, 1))

    kernel = AttentionKernel("attn", view("q", heads, q_len), view("k", kv_heads, kv_len), view("v", kv_heads, kv_len),
                             view("o", heads, q_len), "float16", dim ** -0.5, causal=causal)
    layouts = {"q": StickLayout(heads * q_len, dim, 2), "k": StickLayout(kv_heads * kv_len, dim, 2),
               "v": StickLayout(kv_heads * kv_len, dim, 2), "o": StickLayout(heads * q_len, dim, 2)}
    ctx = BuildContext(model, layouts)
    record = construct.build(ctx, kernel)
    ratio = attention.estimate(record.shape, model, record.tiling) / _time_alone(card, ctx)
    if causal:
        assert 0.95 <= ratio <= 1.4, ratio
    else:
        assert ratio == pytest.approx(1, abs=0.1)
