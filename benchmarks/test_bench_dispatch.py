"""The compute-dispatch path: host time per Granite decode step in each dispatch mode.

pytest-benchmark times the whole call (Dynamo's guards included). Beside it, in the same
test, the card's host clock measures this mode and ``construct`` interleaved, and the
ratio goes into ``extra_info``; so does the share of the call spent in Dynamo, measured by
running the same steps with guard evaluation skipped.
"""

import pytest
import torch

from spyre_rt.dispatch import dispatch_mode

MODES = ("construct", "prebuilt-transfer", "prebuilt")


def _host_us(decoder, mode: str, steps: int) -> tuple[float, float]:
    with dispatch_mode(mode):
        decoder.step()
        ns, calls = decoder.host_ns_per_step(steps)
    return ns / 1e3, calls


def _side_by_side(benchmark, decoder, mode: str, steps: int, rounds: int) -> None:
    """This mode and ``construct``, alternated; the best round of each."""
    ours, base = [], []
    for _ in range(rounds):
        ours.append(_host_us(decoder, mode, steps))
        base.append(_host_us(decoder, "construct", max(1, steps // 10)))
    host, calls = min(ours)
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        unguarded, _ = min(_host_us(decoder, mode, steps) for _ in range(rounds))
    construct = min(b[0] for b in base)
    benchmark.extra_info.update({
        "host_us_per_step": round(host, 1),
        "native_calls_per_step": calls,
        "host_us_per_step_guards_skipped": round(unguarded, 1),
        "construct_host_us_per_step": round(construct, 1),
        "speedup_vs_construct": round(construct / host, 2),
    })


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.benchmark(group="dispatch: tiny Granite decode step")
def test_decode_step(benchmark, tiny_granite, mode):
    decoder = tiny_granite()
    rounds = 5 if mode == "construct" else 50
    with dispatch_mode(mode):
        decoder.step()  # transfer graphs and plans exist before the clock starts
        benchmark.pedantic(decoder.step, rounds=1 if benchmark.disabled else rounds, iterations=1,
                           warmup_rounds=0 if benchmark.disabled else 1)
    steps = 2 if benchmark.disabled else 20
    _side_by_side(benchmark, decoder, mode, steps, rounds=1 if benchmark.disabled else 3)


@pytest.mark.slow
@pytest.mark.benchmark(group="dispatch: 40-layer Granite decode step")
def test_prebuilt_decode_step_40_layers(benchmark, tiny_granite):
    """40 layers (Granite 3.3 8B's depth) at the tiny width: the host path depends on the
    number of kernels, not on their size."""
    decoder = tiny_granite(layers=40)
    with dispatch_mode("prebuilt"):
        decoder.step()
        benchmark.pedantic(decoder.step, rounds=1 if benchmark.disabled else 50, iterations=1,
                           warmup_rounds=0 if benchmark.disabled else 1)
    _side_by_side(benchmark, decoder, "prebuilt", 2 if benchmark.disabled else 20,
                  rounds=1 if benchmark.disabled else 3)
