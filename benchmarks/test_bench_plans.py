"""Plans and the plan cache: loading every plan of the tiny Granite from disk (a cache hit),
beside building them from the kernel descriptions (a miss), in one run."""

import time

import pytest
from targets import check_target

from spyre_rt import executor as steps
from spyre_rt.executor import plans as plan_files


def thread_cost(call, times: int) -> tuple[float, float]:
    """ns per call: the thread's CPU time (the host clock's) and wall time (as conftest's)."""
    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    for _ in range(times):
        call()
    return (time.thread_time_ns() - c0) / times, (time.perf_counter_ns() - w0) / times


def _executables(card):
    return [exe for s in steps.live_steps() for exe in s.executables() if exe.card is card]


def _load_all(exes) -> int:
    return sum(len(plan_files.load_or_build(exe)) for exe in exes)


@pytest.mark.benchmark(group="plans and cache")
def test_plan_cache_hit_tiny_granite(benchmark, tiny_granite):
    decoder = tiny_granite()
    decoder.step()  # prefill and decode plans are built and stored
    exes = _executables(decoder.card)
    assert len(exes) >= 2, "prefill and decode executables"
    built = steps.stats["plans_built"]
    loaded = steps.stats["plans_loaded"]
    plans = benchmark(_load_all, exes)
    assert steps.stats["plans_built"] == built, "a cache hit builds nothing"
    assert steps.stats["plans_loaded"] > loaded
    # the same plans built from the kernel descriptions, for the ratio
    # (host work on both sides: the thread's CPU time, wall time beside it)
    def build_all():
        for exe in exes:
            for segment in exe.device_segments():
                plan_files.build_block(exe, segment)

    (build_cpu, build_wall), (hit_cpu, hit_wall) = thread_cost(build_all, 1), thread_cost(lambda: _load_all(exes), 1)
    benchmark.extra_info.update({"plans": plans, "kernels": sum(len(seg.kernels) for exe in exes for seg in exe.device_segments()),
                                 "clock": "thread-cpu; *_wall: wall time",
                                 "hit_ms": round(hit_cpu / 1e6, 2), "build_ms": round(build_cpu / 1e6, 1),
                                 "hit_wall_ms": round(hit_wall / 1e6, 2), "build_wall_ms": round(build_wall / 1e6, 1),
                                 "build_over_hit": round(build_cpu / hit_cpu, 1),
                                 "build_over_hit_wall": round(build_wall / hit_wall, 1)})
    check_target(benchmark, hit_cpu <= 10e6, f"a plan-cache hit took {hit_cpu / 1e6:.1f} ms, over 10 ms")
    check_target(benchmark, hit_cpu < build_cpu, "a plan-cache hit must cost less than building the plans")
