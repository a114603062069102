"""Plans and the plan cache: loading every plan of the tiny Granite from disk (a cache hit),
beside building them from the kernel descriptions (a miss), in one run."""

import time

import pytest

from spyre_rt import executor as steps
from spyre_rt.executor import plans as plan_files


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
    t0 = time.perf_counter()
    for exe in exes:
        for segment in exe.device_segments():
            plan_files.build_block(exe, segment)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _load_all(exes)
    hit_s = time.perf_counter() - t0
    benchmark.extra_info.update({"plans": plans, "kernels": sum(len(seg.kernels) for exe in exes for seg in exe.device_segments()),
                                 "hit_ms": round(hit_s * 1e3, 2), "build_ms": round(build_s * 1e3, 1),
                                 "build_over_hit": round(build_s / hit_s, 1)})
