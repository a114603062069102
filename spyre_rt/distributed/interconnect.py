"""Time on the interconnect: what a collective between cards lasts, from the device
profile's ``[interconnect]`` figures (peer-to-peer bandwidth and the latency of one step
between the cards of one machine; the network's between machines).

The cost of each algorithm is the usual alpha-beta model of collective libraries, for p
ranks, M bytes (the full tensor), BW the peer-to-peer bandwidth and α one step's latency:

- ring all-reduce: 2(p−1)/p · M/BW + 2(p−1)·α (a reduce-scatter then an all-gather);
- tree all-reduce: 2·M/BW + 2⌈log2 p⌉·α (up a binary tree and down again, pipelined);
- all-gather, reduce-scatter, all-to-all (ring): (p−1)/p · M/BW + (p−1)·α, M the whole
  gathered (or scattered) tensor;
- broadcast (tree): M/BW + ⌈log2 p⌉·α; barrier: a tree all-reduce of nothing.

An all-reduce takes whichever of ring and tree is faster for its size, as NCCL's tuner
chooses between them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..device_profile import DeviceProfile


class Cost(NamedTuple):
    ns: float
    algorithm: str  # "ring" or "tree"


def _figures(profile: DeviceProfile, between_machines: bool) -> tuple[float, float] | None:
    """(bytes per ns, ns per step) of the cards' links (of the machines' network when the
    group spans machines), or None for a profile without them."""
    ic = profile.interconnect
    bw, alpha = ("network_bandwidth_gbps", "network_latency_ns") if between_machines else \
        ("p2p_bandwidth_gbps", "p2p_latency_ns")
    if bw not in ic or alpha not in ic:
        return None
    return ic[bw].value, ic[alpha].value  # GB/s is bytes per ns


def cost(profile: DeviceProfile, kind: str, nbytes: int, ranks: int, between_machines: bool = False) -> Cost | None:
    """The time of one collective of `kind` over `ranks` cards moving a tensor of `nbytes`;
    a group on several machines goes at the network's figures (its slowest links)."""
    figs = _figures(profile, between_machines)
    if figs is None or ranks < 2:
        return None if figs is None else Cost(0.0, "none")
    bw, alpha = figs
    p, m = ranks, float(nbytes)
    depth = math.ceil(math.log2(p))
    if kind == "all_reduce":
        ring = 2 * (p - 1) / p * m / bw + 2 * (p - 1) * alpha
        tree = 2 * m / bw + 2 * depth * alpha
        return Cost(ring, "ring") if ring <= tree else Cost(tree, "tree")
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return Cost((p - 1) / p * m / bw + (p - 1) * alpha, "ring")
    if kind in ("broadcast", "reduce", "gather", "scatter"):
        return Cost(m / bw + depth * alpha, "tree")
    if kind == "barrier":
        return Cost(2 * depth * alpha, "tree")
    raise ValueError(f"no cost model for the collective {kind!r}")
