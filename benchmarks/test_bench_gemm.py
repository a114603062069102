"""Granite 3.3 8B's GEMMs, one at a time on a timing-mode card, against the roofline.

Each benchmark times the construction of one GEMM's job graph (the host work `construct`
mode repeats per launch: one native call with the GEMM's decision record; thread CPU time,
its target 300 ns per command) and records in ``extra_info`` the device time of one
launch, the kernel's roofline max(MACs / card MAC rate, minimum DRAM bytes / DRAM bandwidth) and the
DRAM bytes the program moves against that minimum. Weights are read as ``W.t()`` in place,
as ``nn.Linear`` does. Run ``pytest benchmarks/test_bench_gemm.py --benchmark-enable -s``
to see the table.
"""

from __future__ import annotations

import time

import pytest
import torch
from side_by_side import compare
from targets import check_target

from spyre_rt import jobs
from spyre_rt.construct.context import BuildContext
from spyre_rt.construct.matmul import MatmulSpec, View, build
from spyre_rt.cost import CostModel
from spyre_rt.layout import StickLayout
from spyre_rt.native import lib

HIDDEN, INTER, HEADS, HEAD_DIM, KV_HEADS, VOCAB = 4096, 12800, 32, 128, 8, 49155
# (name, N, K) of each linear layer; q and o share a shape, k and v, gate and up
LAYERS = [
    ("q_proj", HEADS * HEAD_DIM, HIDDEN),
    ("k_proj", KV_HEADS * HEAD_DIM, HIDDEN),
    ("up_proj", INTER, HIDDEN),
    ("down_proj", HIDDEN, INTER),
    ("lm_head", VOCAB, HIDDEN),
]
PHASES = [("prefill", 1024), ("decode", 1)]


NS_PER_COMMAND = 300  # construction per launch, thread CPU time (Python and numpy took 900 to 2600)


def _thread_us(call) -> float:
    t0 = time.thread_time_ns()
    call()
    return (time.thread_time_ns() - t0) / 1e3


def linear_context(target: CostModel, m: int, n: int, k: int) -> tuple[BuildContext, MatmulSpec]:
    """out (m, n) = x (m, k) @ W.t(), W (n, k) as nn.Linear stores it; fp16."""
    layouts = {"x": StickLayout(m, k, 2), "w": StickLayout(n, k, 2), "o": StickLayout(m, n, 2)}
    spec = MatmulSpec(View("x", 0, (1, m, k), (0, k, 1)), View("w", 0, (1, k, n), (0, 1, k)),
                      View("o", 0, (1, m, n), (0, n, 1)), lib.SPY_DT_F16, lib.SPY_DT_F16)
    return BuildContext(target, layouts), spec


def device_ns(card, ctx: BuildContext) -> tuple[float, dict]:
    """Device time of one launch of the context's program, and the program's figures."""
    return jobs.time_alone(card, ctx.encode(), [ctx.layouts[name].nbytes for name in ctx.buffers()])


@pytest.mark.benchmark(group="gemm")
@pytest.mark.parametrize("phase,m", PHASES, ids=[p for p, _ in PHASES])
@pytest.mark.parametrize("layer,n,k", LAYERS, ids=[name for name, _, _ in LAYERS])
def test_granite_gemm(benchmark, timing_card, layer, n, k, phase, m):
    target = CostModel.of_figures(timing_card.profile)
    ctx, spec = linear_context(target, m, n, k)
    t0 = time.perf_counter()
    tiles = build(ctx, spec)  # the first build also chooses the tiles (compile time)
    choose_and_build_s = time.perf_counter() - t0

    def construct():
        c, s = linear_context(target, m, n, k)
        build(c, s, tiles)
        return c.encode()

    benchmark.pedantic(construct, rounds=3, iterations=1, warmup_rounds=1)
    construct_us = min(_thread_us(construct) for _ in range(5))
    dev, info = device_ns(timing_card, ctx)
    min_bytes = (m * k + k * n + m * n) * 2
    roof = target.kernel_ns(2 * m * n * k, min_bytes)
    benchmark.extra_info.update({
        "shape": f"{m}x{n}x{k}", "tiles": repr(tiles), "commands": ctx.ncmds,
        "device_us": dev / 1e3, "roofline_us": roof / 1e3, "fraction": roof / dev,
        "dram_bytes_over_min": info["dma_bytes"] / min_bytes,
        "first_build_ms": choose_and_build_s * 1e3,
        "construct_us": construct_us, "construct_ns_per_command": construct_us * 1e3 / ctx.ncmds,
        "construct_over_device": construct_us * 1e3 / dev,
    })
    check_target(benchmark, construct_us * 1e3 / ctx.ncmds <= NS_PER_COMMAND,
                 f"{construct_us * 1e3 / ctx.ncmds:.0f} ns of construction per command, over {NS_PER_COMMAND}")
    print(f"\n{layer:9s} {phase:7s} {m}x{n}x{k}: device {dev / 1e3:9.1f} us  roofline {roof / 1e3:9.1f} us"
          f"  {roof / dev:6.1%}  DRAM {info['dma_bytes'] / min_bytes:4.2f}x min  {ctx.ncmds} cmds  {tiles}"
          f"  construct {construct_us:7.1f} us")


def rms_qkv(h, w, wq, wk, wv):
    """A Granite layer's input RMSNorm (Hugging Face's: fp32 statistics, rounded back) and
    the q, k and v projections of its result."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    x = w * x.to(h.dtype)
    return x @ wq.t(), x @ wk.t(), x @ wv.t()


def _side_by_side(benchmark, fn, shapes: list[tuple[int, ...]], option: str, what: str) -> None:
    """`fn` on fp16 tensors of `shapes`, compiled with `option` on and off (side_by_side)."""
    compare(benchmark, fn, lambda: [torch.empty(*shape, dtype=torch.float16).to("spyre") for shape in shapes],
            option, what)


@pytest.mark.benchmark(group="gemm")
def test_norm_in_the_projections(benchmark):
    """Granite 3.3 8B's input norm and q, k, v projections at a 1,024-token prefill, the norm
    as the projections' prologue (fuse_prologues) against the norm as a kernel of its own:
    it no longer writes its rows for the projections to read back."""
    _side_by_side(benchmark, rms_qkv, [(1024, HIDDEN), (HIDDEN,), (HEADS * HEAD_DIM, HIDDEN),
                                       (KV_HEADS * HEAD_DIM, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN)],
                  "fuse_prologues", "norm + q, k, v prefill")


def two_projections(x, wk, wv):
    return x @ wk.t(), x @ wv.t()


@pytest.mark.benchmark(group="gemm")
def test_k_and_v_as_one_matmul(benchmark):
    """Granite 3.3 8B's k and v projections at a 1,024-token prefill, grouped (group_matmuls:
    one matmul, the two weights and outputs its parts) against apart: the fill and drain of
    one matmul instead of two."""
    _side_by_side(benchmark, two_projections, [(1024, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN),
                                               (KV_HEADS * HEAD_DIM, HIDDEN)], "group_matmuls", "k and v prefill")


def rotated_query(x, wq, pos, inv_freq):
    """The q projection and Hugging Face's rotary embedding on its heads, as Granite's layer
    computes them (cos and sin of the positions' angles, rotate-half)."""
    q = (x @ wq.t()).view(1, x.shape[0], HEADS, HEAD_DIM).transpose(1, 2)
    freqs = pos[:, :, None].float() * inv_freq[None, None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    half = HEAD_DIM // 2
    return q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin


@pytest.mark.benchmark(group="gemm")
def test_rotation_in_the_q_projection(benchmark):
    """Granite 3.3 8B's q projection and its rotary embedding at a 1,024-token prefill, the
    rotation as the projection's epilogue in column slices (slice_epilogues) against a
    kernel of its own: q is no longer written and read back."""
    compare(benchmark, rotated_query, lambda: [
        torch.empty(1024, HIDDEN, dtype=torch.float16).to("spyre"),
        torch.empty(HEADS * HEAD_DIM, HIDDEN, dtype=torch.float16).to("spyre"),
        torch.arange(1024)[None].to("spyre"), torch.empty(HEAD_DIM // 2, dtype=torch.float16).to("spyre")],
        "slice_epilogues", "q projection + rotation prefill")


@pytest.mark.benchmark(group="gemm")
def test_last_tiles_in_pieces_walk_their_last_chunks(benchmark, timing_card, monkeypatch):
    """Granite 3.3 8B's prefill GEMMs, each core's last tile in pieces that walk its last K
    chunks (``last_depth`` as the model asks: as many as the last tiles' stores take)
    against pieces of the last chunk alone: the first rows are stored chunks before the
    end, so the job no longer ends with the stores of most of every core's last tile."""
    from spyre_rt.construct.matmul import record

    target = CostModel.of_figures(timing_card.profile)
    chosen = record.last_depth
    figures = {}

    def run():
        for deep in (True, False):
            monkeypatch.setattr(record, "last_depth", chosen if deep else (lambda *_: 1))
            for layer, n, k in LAYERS:
                ctx, spec = linear_context(target, 1024, n, k)
                build(ctx, spec)
                figures[deep, layer] = device_ns(timing_card, ctx)[0]

    benchmark.pedantic(run, rounds=1, iterations=1)
    on, off = (sum(v for (deep, _), v in figures.items() if deep is d) for d in (True, False))
    benchmark.extra_info.update({f"{layer}_us": (figures[True, layer] / 1e3, figures[False, layer] / 1e3)
                                 for layer, _, _ in LAYERS} | {"on_over_off": round(on / off, 4)})
    check_target(benchmark, on < off, f"pieces walking the last chunks take {on / off:.3f} of the time of the last alone")
    for layer, _, _ in LAYERS:
        print(f"\n{layer:9s} prefill: last chunks in pieces {figures[True, layer] / 1e3:8.1f} us, "
              f"the last alone {figures[False, layer] / 1e3:8.1f} us")
