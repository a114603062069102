"""The simulator: timing-mode command throughput, functional matmul beside torch's."""

import time

import pytest
import torch

from spyre_rt import jobs
from spyre_rt.construct.context import BuildContext, Target
from spyre_rt.construct.matmul import MatmulSpec, View, build
from spyre_rt.layout import StickLayout
from spyre_rt.native import lib


def _matmul_context(card, m, n, k, dtype=lib.SPY_DT_F16, e=2, tiling=None) -> tuple[BuildContext, object]:
    """A matmul's program built into a fresh context; returns it and its tiling."""
    layouts = {"a": StickLayout(m, k, e), "b": StickLayout(k, n, e), "o": StickLayout(m, n, e)}
    ctx = BuildContext(Target.from_profile(card.profile), layouts)
    tiling = build(ctx, MatmulSpec(View("a", 0, (1, m, k), (0, k, 1)), View("b", 0, (1, k, n), (0, n, 1)),
                                   View("o", 0, (1, m, n), (0, n, 1)), dtype, dtype), tiling)
    return ctx, tiling


def _matmul_program(card, m, n, k, dtype=lib.SPY_DT_F16, e=2):
    ctx, _ = _matmul_context(card, m, n, k, dtype, e)
    prog = jobs.ResidentProgram(card, ctx.encode(), "matmul")
    addrs = {name: card.malloc(lay.nbytes) for name, lay in ctx.layouts.items()}
    return prog, [addrs[b] for b in ctx.buffers()], ctx.ncmds


@pytest.mark.benchmark(group="simulator")
def test_timing_mode_commands_per_second(benchmark, timing_card):
    """Target: >= 1 million simulated commands per second in timing mode."""
    prog, args, ncmds = _matmul_program(timing_card, 1024, 12800, 4096)
    benchmark.pedantic(prog.launch, args=(args,), rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info["commands"] = ncmds
    benchmark.extra_info["commands_per_second"] = ncmds / benchmark.stats.stats.min if benchmark.stats else 0


@pytest.mark.benchmark(group="simulator")
def test_matmul_construction(benchmark, timing_card):
    """Host time of building the 1024x1024x1024 fp16 matmul's job graph with its tiling
    chosen: the work `construct` mode repeats at every launch."""
    n = 1024
    _, tiling = _matmul_context(timing_card, n, n, n)

    def construct():
        ctx, _ = _matmul_context(timing_card, n, n, n, tiling=tiling)
        return ctx.encode()

    benchmark.pedantic(construct, rounds=10, iterations=1, warmup_rounds=1)
    benchmark.extra_info["commands"] = _matmul_context(timing_card, n, n, n, tiling=tiling)[0].ncmds


@pytest.mark.benchmark(group="simulator")
def test_functional_fp16_matmul_vs_torch_cpu(benchmark, functional_card):
    """Target: functional fp16 matmul at >= 25 % of torch's CPU fp32 matmul throughput,
    1024x1024x1024, measured side by side in this test."""
    n = 1024
    card = functional_card
    prog, args, _ = _matmul_program(card, n, n, n)
    benchmark.pedantic(prog.launch, args=(args,), rounds=5, iterations=1, warmup_rounds=1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    torch_times = []
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        torch_times.append(time.perf_counter() - t)
    flop = 2 * n ** 3
    if benchmark.stats:
        spyre = flop / benchmark.stats.stats.min
        cpu = flop / min(torch_times)
        benchmark.extra_info["spyre_gflops"] = spyre / 1e9
        benchmark.extra_info["torch_fp32_gflops"] = cpu / 1e9
        benchmark.extra_info["ratio"] = spyre / cpu
