"""The card's roofline as the profiler prints it: what bounds a kernel, and which of the
figures it is made of are assumptions.

The least time a kernel can take is the cost model's (:class:`spyre_rt.cost.CostModel`:
``compute_ns``, ``dram_ns``, ``kernel_ns``, ``bound``): its FLOPs at the card's sustained MAC
rate or its minimum DRAM bytes at the DRAM bandwidth, whichever is longer. For the
``spyre`` profile: 32 cores x 1536 MAC/ns x 0.7422 sustained = 36,481 MAC/ns (fp16; fp32 at
``pt_fp32_ratio`` of that) and 150 GB/s. Of these only the core count is published: the MAC
rate, the utilization and the bandwidth are assumptions (their reasoning is in the
profile), and :func:`assumptions` names them wherever a roofline is printed.

A kernel whose roofline time is below the card's fixed cost of a job (the job launch and
one DMA latency) is bound by latency: no rate makes it faster. The rest of the time a
kernel takes beyond its roofline is the kernel's inefficiency (tiling, ramp-up, shared
bandwidth) and what the profiler's per-op table shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..cost import COMPUTE, DRAM, LATENCY, CostModel
from ..device_profile import DeviceProfile

HOST = "host"
__all__ = ["COMPUTE", "DRAM", "HOST", "LATENCY", "assumptions", "compute_bound", "kernel_figures"]


def assumptions(profile: DeviceProfile) -> list[str]:
    """The figures the roofline is made of that the profile marks as assumptions."""
    return [k for k in CostModel.ROOFLINE_FIGURES if profile.figures[k].kind == "assumption"]


def kernel_figures(info: Mapping[str, Any] | None) -> tuple[float, float, str | None] | None:
    """(flops, dram_bytes_min, dtype) of a kernel's info; None when it lacks either figure."""
    if not info:
        return None
    flops, nbytes = info.get("flops"), info.get("dram_bytes_min")
    if not (_is_number(flops) and _is_number(nbytes)):
        return None
    dtype = info.get("dtype")
    return float(flops), float(nbytes), dtype if isinstance(dtype, str) else None


def compute_bound(info: Mapping[str, Any] | None, roofline: CostModel) -> bool:
    """Whether a kernel's FLOPs take the card longer than its minimum bytes (False when its
    info lacks either figure)."""
    fig = kernel_figures(info)
    return fig is not None and roofline.compute_ns(fig[0], fig[2]) >= roofline.dram_ns(fig[1])


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
