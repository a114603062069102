"""The card's roofline: the least time a kernel can take, from the device profile's figures.

A kernel needs at least its FLOPs at the card's sustained MAC rate (a multiply-add is two
FLOPs) and at least its minimum DRAM bytes at the DRAM bandwidth; its roofline time is the
larger of the two, and that one is what bounds it. For the ``spyre`` profile:
32 cores x 1536 MAC/ns x 0.7422 sustained = 36,481 MAC/ns (fp16; fp32 at
``pt_fp32_ratio`` of that) and 150 GB/s. Of these only the core count is published: the MAC
rate, the utilization and the bandwidth are assumptions (their reasoning is in the
profile), and :func:`assumptions` names them wherever a roofline is printed.

A kernel whose roofline time is below the card's fixed cost of a job (the job launch and
one DMA latency) is bound by latency: no rate makes it faster. The rest of the time a
kernel takes beyond its roofline is the kernel's inefficiency (tiling, ramp-up, shared
bandwidth) and what the profiler's per-op table shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..device_profile import DeviceProfile

COMPUTE, DRAM, LATENCY, HOST = "compute", "DRAM", "latency", "host"
_FIGURES = ("num_cores", "pt_macs_per_ns", "pt_utilization", "pt_fp32_ratio", "dram_bandwidth_gbps",
            "job_launch_ns", "dma_latency_ns")


def assumptions(profile: DeviceProfile) -> list[str]:
    """The figures the roofline is made of that the profile marks as assumptions."""
    return [k for k in _FIGURES if profile.figures[k].kind == "assumption"]


@dataclasses.dataclass(frozen=True)
class Roofline:
    macs_per_ns: float  # the card's sustained fp16 MAC rate, all cores
    fp32_ratio: float  # fp32 MAC rate over fp16
    dram_bytes_per_ns: float  # DRAM bandwidth (GB/s is bytes per ns)
    job_latency_ns: float  # fixed cost of any job: its launch and one DMA latency

    @classmethod
    def of_figures(cls, figures: Mapping[str, float]) -> Roofline:
        """From a device profile's figures by name (as a trace's metadata records them);
        KeyError names a missing one."""
        f = {k: float(figures[k]) for k in _FIGURES}
        return cls(macs_per_ns=f["num_cores"] * f["pt_macs_per_ns"] * f["pt_utilization"],
                   fp32_ratio=f["pt_fp32_ratio"], dram_bytes_per_ns=f["dram_bandwidth_gbps"],
                   job_latency_ns=f["job_launch_ns"] + f["dma_latency_ns"])

    @classmethod
    def of_profile(cls, profile: DeviceProfile) -> Roofline:
        return cls.of_figures({k: profile[k] for k in _FIGURES})

    @classmethod
    def of_trace_metadata(cls, metadata: Mapping[str, Any]) -> Roofline | None:
        """From ``metadata.spyre_rt.device.figures`` of a trace; None when it has none."""
        try:
            return cls.of_figures(metadata["spyre_rt"]["device"]["figures"])
        except (KeyError, TypeError, ValueError):
            return None

    def compute_ns(self, flops: float, dtype: str | None = None) -> float:
        rate = self.macs_per_ns * (self.fp32_ratio if dtype == "float32" else 1.0)
        return flops / (2.0 * rate)

    def dram_ns(self, nbytes: float) -> float:
        return nbytes / self.dram_bytes_per_ns

    def kernel_ns(self, flops: float, dram_bytes_min: float, dtype: str | None = None) -> float:
        """The least time a kernel of these figures can take."""
        return max(self.compute_ns(flops, dtype), self.dram_ns(dram_bytes_min))

    def bound(self, flops: float, dram_bytes_min: float, calls: int = 1, dtype: str | None = None) -> str:
        """What bounds `calls` kernels of these total figures: compute, DRAM or latency."""
        return self.bound_of(self.compute_ns(flops, dtype), self.dram_ns(dram_bytes_min), calls)

    def bound_of(self, compute_ns: float, dram_ns: float, calls: int = 1) -> str:
        """What bounds `calls` kernels whose roofline times add up to these."""
        if max(compute_ns, dram_ns) < self.job_latency_ns * max(calls, 1):
            return LATENCY
        return COMPUTE if compute_ns >= dram_ns else DRAM


def kernel_figures(info: Mapping[str, Any] | None) -> tuple[float, float, str | None] | None:
    """(flops, dram_bytes_min, dtype) of a kernel's info; None when it lacks either figure."""
    if not info:
        return None
    flops, nbytes = info.get("flops"), info.get("dram_bytes_min")
    if not (_is_number(flops) and _is_number(nbytes)):
        return None
    dtype = info.get("dtype")
    return float(flops), float(nbytes), dtype if isinstance(dtype, str) else None


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
