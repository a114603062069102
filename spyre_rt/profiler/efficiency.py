"""Device efficiency of a phase: its device time against the roofline of its kernels.

The roofline of a phase is the sum over its kernels of each kernel's roofline time (see
:mod:`.roofline`), from what :mod:`spyre_rt.job_facts` knows of each kernel; the
fraction is roofline / device time (1.0: the card ran at its roofline throughout). Where
the kernels carry no info, the analytic cost of the model (:mod:`.analytic`) stands in,
and the result says so (``source``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .. import job_facts
from ..cost import CostModel
from ..transfer import D2H, H2D
from .analytic import StepCost
from .roofline import COMPUTE, DRAM, compute_bound, kernel_figures

TRANSFER_JOBS = frozenset((H2D, D2H))  # jobs of the transfer path, not kernels


def kernel_names(job_names: Iterable[str]) -> list[str]:
    """The jobs of a step that are kernels (not host-device copies)."""
    return [n for n in job_names if n not in TRANSFER_JOBS]


def kernels_roofline(names: Iterable[str], roofline: CostModel,
                     lookup: Callable[[str], dict[str, Any] | None] = job_facts.lookup) -> dict[str, Any]:
    """The summed roofline of kernels by job name, split into the time of compute-bound and
    of DRAM-bound kernels, and how many of the kernels had the figures it needs."""
    by_bound = {COMPUTE: 0.0, DRAM: 0.0}
    known = count = 0
    for name in names:
        count += 1
        fig = kernel_figures(lookup(name))
        if fig is None:
            continue
        flops, nbytes, dtype = fig
        c, d = roofline.compute_ns(flops, dtype), roofline.dram_ns(nbytes)
        by_bound[COMPUTE if c >= d else DRAM] += max(c, d)
        known += 1
    return {"roofline_ms": (by_bound[COMPUTE] + by_bound[DRAM]) / 1e6, "compute_bound_ms": by_bound[COMPUTE] / 1e6,
            "dram_bound_ms": by_bound[DRAM] / 1e6, "kernels": count, "kernels_with_info": known}


def compute_bound_edges_ms(edges: Iterable[tuple[str, float]], roofline: CostModel,
                           lookup: Callable[[str], dict[str, Any] | None] = job_facts.lookup) -> float:
    """The fill and drain (ms) of the compute-bound kernels among `edges` ((job name, ns)
    pairs): the time their arrays waited while their first operands loaded and their last
    results stored. A DRAM-bound kernel's are left out: DRAM works through them."""
    return sum(ns for name, ns in edges if compute_bound(lookup(name), roofline)) / 1e6


def phase_efficiency(device_ms: float, kernels: dict[str, Any], analytic: StepCost, roofline: CostModel) -> dict[str, Any]:
    """``{"device_ms", "roofline_ms", "fraction", "bound", ...}`` of one phase step: from
    the kernels' roofline when every kernel has info, else from the analytic model. The
    bound is the one that holds most of the roofline time."""
    analytic_ms = analytic.roofline_ms(roofline)
    complete = kernels["kernels"] > 0 and kernels["kernels_with_info"] == kernels["kernels"]
    if complete:
        roofline_ms = kernels["roofline_ms"]
        bound = COMPUTE if kernels["compute_bound_ms"] >= kernels["dram_bound_ms"] else DRAM
    else:
        roofline_ms, bound = analytic_ms, analytic.bound(roofline)
    return {
        "device_ms": device_ms,
        "roofline_ms": roofline_ms,
        "fraction": roofline_ms / device_ms if device_ms > 0 else None,
        "bound": bound,
        "source": "kernels" if complete else "analytic",
        "kernels": kernels["kernels"],
        "kernels_with_info": kernels["kernels_with_info"],
        "analytic": analytic.as_dict(roofline),
    }
