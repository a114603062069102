"""Construction per kernel of one Granite 3.3 8B layer, prefill and decode, and the
transfer graphs construct mode builds per launch (each kernel's program upload).

Every figure is host work: CPU time of this thread (the card's host clock), the best of a
few rounds, recorded in ``extra_info`` side by side in one run: every kind per kernel
(copies and transfer graphs built by native/construct.c, loop kernels and matmuls by
native/build_loop.c and native/build_matmul.c from their decision records). A timed run
fails when loop kernels take more than ``LOOP_US`` each.
Run ``pytest benchmarks/test_bench_construct.py --benchmark-enable -s`` to see the table.
"""

from __future__ import annotations

import time

import pytest
from granite_kernels import GraniteKernels, per_kind_us
from targets import check_target

from spyre_rt import jobs
from spyre_rt.construct import copy
from spyre_rt.construct.context import BuildContext
from spyre_rt.executor.executable import SNAPSHOT
from spyre_rt.layout import StickLayout
from spyre_rt.transfer import ViewGeometry, transfer_program

ROUNDS = 5
LOOP_US = 100  # a loop kernel's construction, per launch (the numpy builder took ~2,000 µs in prefill)
pytestmark = pytest.mark.slow  # a one-layer Granite 3.3 8B compiles for a minute


@pytest.fixture(scope="module")
def granite():
    return GraniteKernels()


def best_us(call, rounds: int = ROUNDS) -> float:
    best = None
    for _ in range(rounds):
        t0 = time.thread_time_ns()
        call()
        t = time.thread_time_ns() - t0
        best = t if best is None else min(best, t)
    return best / 1e3


def _snapshot_copies(granite, phase: str):
    """(context factory, copies) of each snapshot kernel of the phase."""
    out = []
    for exe in granite.executables[phase]:
        if exe.snapshots:
            out.append((lambda e=exe: BuildContext(e.target, e.bindings.layouts, offsets=e.bindings.offsets), exe.snapshots))
    return out


@pytest.mark.benchmark(group="construct")
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_granite_construction_per_kernel(benchmark, granite, phase):
    kernels = granite.kernels(phase)
    table = per_kind_us(kernels, rounds=ROUNDS)
    total = sum(n * us for n, us in table.values())
    info = {"kernels": len(kernels), "us_per_kernel": round(total / len(kernels), 1)}
    info |= {f"{kind}_us_per_kernel": round(us, 1) for kind, (_, us) in table.items()}
    snaps = _snapshot_copies(granite, phase)
    if snaps:
        make, copies = snaps[0]
        info["snapshot_copy_build_us"] = round(best_us(lambda: copy.build(make(), copies)), 1)
    # each kernel's program goes up through a transfer graph built per launch in construct mode
    sizes = [int(build().size) for kind, name, build in kernels if name != SNAPSHOT]
    views = [jobs.program_view(n) for n in sizes]
    info["upload_transfer_us"] = round(sum(best_us(lambda v=v: transfer_program("h2d", v)) for v in views)
                                       / len(views), 1)
    benchmark.extra_info.update(info)
    benchmark.pedantic(lambda: [build() for _, _, build in kernels], rounds=1, iterations=1)
    print(f"\n{phase}: {info}")
    loop_us = table["loop"][1]
    check_target(benchmark, loop_us <= LOOP_US, f"{phase} loop kernels built in {loop_us:.0f} µs each, over {LOOP_US}")


@pytest.mark.benchmark(group="construct")
def test_hidden_state_transfer_graph(benchmark):
    """A Granite 8B prefill's hidden state (1024 x 4096 fp16) to the host."""
    view = ViewGeometry(StickLayout(1024, 4096, 2), 0, (1024, 4096), (4096, 1))
    us = best_us(lambda: transfer_program("d2h", view))
    benchmark.extra_info["build_us"] = round(us, 1)
    benchmark.pedantic(lambda: transfer_program("d2h", view), rounds=3, iterations=1)
    print(f"\nhidden state d2h: {us:.0f} µs")
