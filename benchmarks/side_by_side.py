"""A compiled function's card time with an option on and off, one after the other in one
run: the ratio is the figure (device time is simulated, so the host's load does not move it)."""

from __future__ import annotations

import torch
from targets import check_target

from spyre_rt import card as cards


def step_device_ns(fn, args, options: dict) -> float:
    """Device ns of one call of `fn` compiled with `options` (the second call: plans built)."""
    torch._dynamo.reset()
    f = torch.compile(fn, backend="spyre_rt", dynamic=False, options=options)
    card = cards.card_set().cards[0]
    f(*args)
    card.synchronize()
    before = card.counters()["device_busy_ns"]
    f(*args)
    card.synchronize()
    return card.counters()["device_busy_ns"] - before


def compare(benchmark, fn, make_args, option: str, what: str) -> None:
    """`fn` on the tensors `make_args()` makes on a timing-mode card, compiled with `option`
    on and off: the device time of each step, and the ratio on / off (target: below 1)."""
    with cards.configured(None, "timing"):
        args = make_args()
        figures = {}

        def run():
            for on in (True, False):
                figures[on] = step_device_ns(fn, args, {option: on})

        benchmark.pedantic(run, rounds=1, iterations=1)
    ratio = figures[True] / figures[False]
    benchmark.extra_info.update({"on_device_us": figures[True] / 1e3, "off_device_us": figures[False] / 1e3,
                                 "on_over_off": round(ratio, 4)})
    check_target(benchmark, ratio < 1, f"{what} with {option} takes {ratio:.3f} of its device time without")
    print(f"\n{what}: {option} on {figures[True] / 1e3:.1f} us, off {figures[False] / 1e3:.1f} us ({ratio:.3f})")
