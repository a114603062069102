"""The card's cost model: its sizes and rates, what each command costs, and the least time a
kernel can take, all from the device profile's figures.

The simulator (``native/sim.c``, ``native/sfu.c``) charges every command of a program as it
runs it. Construction cannot run a candidate tiling to see what it costs, and the profiler
must say how far a kernel is from the best the card could do, so both estimate from the
same figures. They do it here and nowhere else:

- **command charges** (:meth:`CostModel.matmul_ns`, :meth:`~CostModel.sfu_ns`,
  :meth:`~CostModel.charged_bytes`, :meth:`~CostModel.transfer_ns`,
  :meth:`~CostModel.ring_ns`): what the simulator charges one matmul, SFU, DMA or ring
  command, the formulas of sim.c in Python (``tests/test_cost_model.py`` holds each to the
  simulator's time of a one-command program). The tilings' estimates are made of them:
  the attention's here (``construct/attention/cost.py``), the matmul's in the native
  search (``native/tiling.c``, the same charges in the same order of operations, which
  ``tests/test_matmul_tiling.py`` holds term by term to these);
- **the roofline** (:meth:`~CostModel.compute_ns`, :meth:`~CostModel.dram_ns`,
  :meth:`~CostModel.kernel_ns`, :meth:`~CostModel.bound`): a kernel needs at least its
  FLOPs at the card's sustained MAC rate (a multiply-add is two FLOPs) and its minimum DRAM
  bytes at the DRAM bandwidth; the larger is its least time. A kernel whose least time is
  below the card's fixed cost of a job (its launch and one DMA latency) is bound by
  latency. The profiler's per-op table, efficiency and analytic bounds use these.

The command charges take numbers or numpy arrays alike: a tiling estimates many
candidates at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

COMPUTE, DRAM, LATENCY = "compute", "DRAM", "latency"


def round_up(x, g):
    """`x` rounded up to a multiple of `g` (numbers or arrays)."""
    return -(-x // g) * g


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The card's figures as construction and the profiler use them (from a device profile,
    or from the figures a trace recorded: :meth:`of_figures`)."""

    num_cores: int
    scratchpad_bytes: int      # one core's
    stick_bytes: int
    macs_per_ns: float         # one core's sustained fp16 MAC rate (peak x utilization)
    gran_m: int                # the systolic arrays fill output rows and columns in these
    gran_n: int
    dram_bytes_per_ns: float   # shared by every core's transfers
    core_dma_bytes_per_ns: float  # one core's DMA port
    pt_fp32_ratio: float       # the arrays' rate on fp32 operands, relative
    pt_latency_ns: float       # per matmul command
    dma_latency_ns: float      # per DRAM <-> scratchpad command, before its bytes flow
    dram_burst_bytes: int      # a DRAM run is charged in whole bursts
    ring_bytes_per_ns: float   # one core's ring port, per direction
    ring_hop_ns: float
    sfu_elems_per_ns: float    # the SFU's element rate on fp16 operands
    sfu_fp32_ratio: float      # its rate on fp32 operands (a scratchpad destination or source), relative
    sfu_latency_ns: float      # per SFU instruction
    job_launch_ns: float       # the command processor's fixed cost of a job
    gran_k: int                # ... and the depth in these (last: recorded corpora list the fields before it)

    # the device profile's figures each field is made of
    FIGURES = ("num_cores", "scratchpad_mib", "stick_bytes", "pt_macs_per_ns", "pt_utilization", "pt_gran_m",
               "pt_gran_n", "pt_gran_k", "dram_bandwidth_gbps", "core_dma_gbps", "pt_fp32_ratio", "pt_latency_ns",
               "dma_latency_ns", "dram_burst_bytes", "ring_bytes_per_cycle", "clock_ghz", "ring_hop_ns",
               "sfu_elems_per_cycle", "sfu_fp32_ratio", "sfu_latency_ns", "job_launch_ns")
    # those the roofline is made of (what a printed roofline names when they are assumptions)
    ROOFLINE_FIGURES = ("num_cores", "pt_macs_per_ns", "pt_utilization", "pt_fp32_ratio", "dram_bandwidth_gbps",
                        "job_launch_ns", "dma_latency_ns")

    @classmethod
    def of_figures(cls, figures: Mapping[str, Any]) -> CostModel:
        """From figures by name: a :class:`~spyre_rt.device_profile.DeviceProfile` (which
        reads as one) or a trace's ``metadata.spyre_rt.device.figures``. KeyError names a
        missing figure."""
        f = {k: float(figures[k]) for k in cls.FIGURES}
        return cls(
            num_cores=int(f["num_cores"]),
            scratchpad_bytes=int(f["scratchpad_mib"] * (1 << 20)),
            stick_bytes=int(f["stick_bytes"]),
            macs_per_ns=f["pt_macs_per_ns"] * f["pt_utilization"],
            gran_m=int(f["pt_gran_m"]),
            gran_n=int(f["pt_gran_n"]),
            dram_bytes_per_ns=f["dram_bandwidth_gbps"],
            core_dma_bytes_per_ns=f["core_dma_gbps"],
            pt_fp32_ratio=f["pt_fp32_ratio"],
            pt_latency_ns=f["pt_latency_ns"],
            dma_latency_ns=f["dma_latency_ns"],
            dram_burst_bytes=int(f["dram_burst_bytes"]),
            ring_bytes_per_ns=f["ring_bytes_per_cycle"] * f["clock_ghz"],
            ring_hop_ns=f["ring_hop_ns"],
            sfu_elems_per_ns=f["sfu_elems_per_cycle"] * f["clock_ghz"],
            sfu_fp32_ratio=f["sfu_fp32_ratio"],
            sfu_latency_ns=f["sfu_latency_ns"],
            job_launch_ns=f["job_launch_ns"],
            gran_k=int(f["pt_gran_k"]),
        )

    @classmethod
    def of_trace_metadata(cls, metadata: Mapping[str, Any]) -> CostModel | None:
        """From ``metadata.spyre_rt.device.figures`` of a trace; None when it has none."""
        try:
            return cls.of_figures(metadata["spyre_rt"]["device"]["figures"])
        except (KeyError, TypeError, ValueError):
            return None

    # ---- what the simulator charges a command ------------------------------------------

    def matmul_rate(self, fp32: bool = False) -> float:
        """One core's MAC rate on fp16 operands, or on fp32 ones."""
        return self.macs_per_ns * (self.pt_fp32_ratio if fp32 else 1.0)

    def matmul_ns(self, rows, cols, depth, fp32: bool = False):
        """One matmul command of a `rows` x `depth` by `depth` x `cols` tile: its latency,
        then the arrays' granules it fills (a part-filled granule costs a whole one)."""
        padded = round_up(rows, self.gran_m) * round_up(cols, self.gran_n) * round_up(depth, self.gran_k)
        return self.pt_latency_ns + padded / self.matmul_rate(fp32)

    def sfu_rate(self, fp32: bool = True) -> float:
        """The SFU's elements per ns, on fp32 operands where `fp32`."""
        return self.sfu_elems_per_ns * (self.sfu_fp32_ratio if fp32 else 1.0)

    def sfu_ns(self, elems, fp32: bool = True, instrs=1, cycles_per_elem: float = 1.0):
        """`instrs` SFU instructions over `elems` elements in all, each element taking
        `cycles_per_elem` passes (a transcendental takes several)."""
        return instrs * self.sfu_latency_ns + elems * cycles_per_elem / self.sfu_rate(fp32)

    def charged_bytes(self, rows, cols, itemsize: int):
        """DRAM bytes a transfer of `rows` runs of `cols` contiguous elements in the stick
        layout is charged: whole sticks are exact, a stick's remainder costs whole bursts."""
        s = self.stick_bytes // itemsize
        return rows * ((cols // s) * self.stick_bytes + round_up((cols % s) * itemsize, self.dram_burst_bytes))

    def dram_share(self, transfers):
        """The rate each of `transfers` concurrent DRAM transfers gets: its core's port, or
        its share of the DRAM when that is less."""
        return np.minimum(self.core_dma_bytes_per_ns, self.dram_bytes_per_ns / transfers)

    def transfer_ns(self, nbytes, rate=None):
        """One DRAM <-> scratchpad command of `nbytes` at `rate` (its core's port when alone)."""
        return self.dma_latency_ns + nbytes / (self.core_dma_bytes_per_ns if rate is None else rate)

    def ring_ns(self, nbytes, hops=1):
        """One ring send of `nbytes` over `hops` stops."""
        return hops * self.ring_hop_ns + nbytes / self.ring_bytes_per_ns

    # ---- the roofline -----------------------------------------------------------------

    @property
    def card_macs_per_ns(self) -> float:
        """The card's sustained fp16 MAC rate, all cores."""
        return self.macs_per_ns * self.num_cores

    @property
    def job_latency_ns(self) -> float:
        """The fixed cost of any job: its launch and one DMA latency."""
        return self.job_launch_ns + self.dma_latency_ns

    def compute_ns(self, flops, dtype: str | None = None):
        """`flops` at the card's sustained rate (fp32 at the arrays' fp32 ratio)."""
        return flops / (2.0 * self.num_cores * self.matmul_rate(dtype == "float32"))

    def dram_ns(self, nbytes):
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
