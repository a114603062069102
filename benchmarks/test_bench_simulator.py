"""The simulator: timing-mode command throughput (the simulator's own work, and apart from
it the reuse of a simulated program's time), functional matmul beside torch's."""

import time

import pytest
import torch
from targets import check_target

from spyre_rt import jobs
from spyre_rt.construct.context import BuildContext
from spyre_rt.construct.matmul import MatmulSpec, View, build
from spyre_rt.cost import CostModel
from spyre_rt.layout import StickLayout
from spyre_rt.native import lib
from spyre_rt.profiler import host


def _matmul_context(card, m, n, k, dtype=lib.SPY_DT_F16, e=2, tiling=None) -> tuple[BuildContext, object]:
    """A matmul's program built into a fresh context; returns it and its tiling."""
    layouts = {"a": StickLayout(m, k, e), "b": StickLayout(k, n, e), "o": StickLayout(m, n, e)}
    ctx = BuildContext(CostModel.of_figures(card.profile), layouts)
    tiling = build(ctx, MatmulSpec(View("a", 0, (1, m, k), (0, k, 1)), View("b", 0, (1, k, n), (0, n, 1)),
                                   View("o", 0, (1, m, n), (0, n, 1)), dtype, dtype), tiling)
    return ctx, tiling


def _matmul_program(card, m, n, k, dtype=lib.SPY_DT_F16, e=2):
    ctx, _ = _matmul_context(card, m, n, k, dtype, e)
    prog = jobs.ResidentProgram(card, ctx.encode(), "matmul")
    addrs = {name: card.malloc(lay.nbytes) for name, lay in ctx.layouts.items()}
    return prog, [addrs[b] for b in ctx.buffers()], ctx.ncmds


def _launched(prog, args) -> None:
    prog.launch(args)
    prog.card.synchronize()


LARGE = (1024, 12800, 4096)  # Granite 3.3 8B's up projection at a 1024-token prefill


def _timing_matmul(card):
    ctx, _ = _matmul_context(card, *LARGE)
    blob = ctx.encode()
    addrs = {name: card.malloc(lay.nbytes) for name, lay in ctx.layouts.items()}
    return blob, [addrs[b] for b in ctx.buffers()], ctx.ncmds


def _first_and_repeated(card, blob, args, rounds: int) -> tuple[float, float]:
    """Seconds of a program's first launch (simulated) and of its next (its time reused),
    side by side; the best of `rounds`."""
    first, again = [], []
    for _ in range(rounds):
        prog = jobs.ResidentProgram(card, blob, "matmul")
        try:
            for times in (first, again):
                t = time.perf_counter()
                _launched(prog, args)
                times.append(time.perf_counter() - t)
        finally:
            prog.free()
    return min(first), min(again)


@pytest.mark.benchmark(group="simulator")
def test_timing_mode_commands_per_second(benchmark, timing_card):
    """The simulator's own work: every round launches a program never launched before (a
    launch of one already simulated is charged its recorded time: the next benchmark).
    Target: >= 1 million simulated commands per second in timing mode."""
    blob, args, ncmds = _timing_matmul(timing_card)
    made = []

    def fresh():
        made.append(jobs.ResidentProgram(timing_card, blob, "matmul"))
        return (made[-1], args), {}

    try:
        benchmark.pedantic(_launched, setup=fresh, rounds=5, iterations=1, warmup_rounds=1)
    finally:
        for prog in made:
            prog.free()
    benchmark.extra_info["commands"] = ncmds
    if benchmark.stats:
        rate = ncmds / benchmark.stats.stats.min
        benchmark.extra_info["commands_per_second"] = rate
        check_target(benchmark, rate >= 1e6, f"{rate / 1e6:.2f} M simulated commands/s, under the 1 M/s target")


@pytest.mark.benchmark(group="simulator")
def test_timing_mode_repeated_launch(benchmark, timing_card):
    """A timing-mode launch of a program already simulated: charged its recorded time, the
    walk over its commands skipped. The gain of that reuse is the first launch's time over
    this one's, measured side by side."""
    blob, args, ncmds = _timing_matmul(timing_card)
    prog = jobs.ResidentProgram(timing_card, blob, "matmul")
    try:
        _launched(prog, args)  # simulated once: every launch after it reuses its time
        benchmark.pedantic(_launched, args=(prog, args), rounds=5, iterations=1, warmup_rounds=1)
    finally:
        prog.free()
    first, again = _first_and_repeated(timing_card, blob, args, 1 if benchmark.disabled else 3)
    benchmark.extra_info.update({"commands": ncmds, "first_launch_ms": first * 1e3, "repeated_launch_us": again * 1e6,
                                 "reuse_gain": first / again})
    check_target(benchmark, first > again, "a first launch is simulated: it must cost more than one that reuses its time")


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
    # the ratio follows the host's CPU (its vector units and torch's kernels for it): per host
    benchmark.extra_info["host"] = host.cpu_model()
    if benchmark.stats:
        spyre = flop / benchmark.stats.stats.min
        cpu = flop / min(torch_times)
        benchmark.extra_info["spyre_gflops"] = spyre / 1e9
        benchmark.extra_info["torch_fp32_gflops"] = cpu / 1e9
        benchmark.extra_info["ratio"] = spyre / cpu
        check_target(benchmark, spyre / cpu >= 0.25,
                     f"{spyre / cpu:.0%} of torch's CPU fp32 matmul on {host.cpu_model()}, under the 25 % target")
