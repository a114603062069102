"""What a kernel builder needs: the card's figures, buffer layouts, a program to fill."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..device_profile import DeviceProfile
from ..layout import StickLayout
from ..program import SLOT_DRAM, ProgramBuilder, block_sections

LX_ALIGN = 128  # scratchpad regions start on a stick


@dataclass(frozen=True)
class Target:
    """The figures of the card that shape construction (from the device profile)."""

    num_cores: int
    scratchpad_bytes: int
    stick_bytes: int
    macs_per_ns: float
    gran_m: int
    gran_n: int
    dram_bytes_per_ns: float
    core_dma_bytes_per_ns: float
    # what a cost model needs beyond bandwidths: the fixed costs of commands, the ring
    pt_fp32_ratio: float       # the systolic arrays' rate on fp32 operands, relative
    pt_latency_ns: float       # per matmul command
    dma_latency_ns: float      # per DRAM <-> scratchpad command, before its bytes flow
    dram_burst_bytes: int      # a DRAM run is charged in whole bursts
    ring_bytes_per_ns: float   # one core's ring port, per direction
    ring_hop_ns: float
    sfu_elems_per_ns: float    # the SFU's element rate on fp16 operands
    sfu_fp32_ratio: float      # its rate on fp32 operands (a scratchpad destination or source), relative
    sfu_latency_ns: float      # per SFU instruction
    job_launch_ns: float       # the command processor's fixed cost of a job

    @classmethod
    def from_profile(cls, p: DeviceProfile) -> Target:
        return cls(
            num_cores=p.num_cores,
            scratchpad_bytes=p.scratchpad_bytes,
            stick_bytes=p.stick_bytes,
            macs_per_ns=p["pt_macs_per_ns"] * p["pt_utilization"],
            gran_m=int(p["pt_gran_m"]),
            gran_n=int(p["pt_gran_n"]),
            dram_bytes_per_ns=p["dram_bandwidth_gbps"],
            core_dma_bytes_per_ns=p["core_dma_gbps"],
            pt_fp32_ratio=p["pt_fp32_ratio"],
            pt_latency_ns=p["pt_latency_ns"],
            dma_latency_ns=p["dma_latency_ns"],
            dram_burst_bytes=int(p["dram_burst_bytes"]),
            ring_bytes_per_ns=p["ring_bytes_per_cycle"] * p["clock_ghz"],
            ring_hop_ns=p["ring_hop_ns"],
            sfu_elems_per_ns=p["sfu_elems_per_cycle"] * p["clock_ghz"],
            sfu_fp32_ratio=p["sfu_fp32_ratio"],
            sfu_latency_ns=p["sfu_latency_ns"],
            job_launch_ns=p["job_launch_ns"],
        )


class ScratchpadPlan:
    """Bump allocation of one core's scratchpad; every core uses the same offsets."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.top = 0

    def take(self, nbytes: int) -> int:
        off = self.top
        self.top += -(-max(nbytes, 1) // LX_ALIGN) * LX_ALIGN
        if self.top > self.capacity:
            raise ScratchpadOverflow(f"tiles need {self.top} bytes of a {self.capacity}-byte scratchpad")
        return off


class Refused(Exception):
    """Construction cannot build this kernel for this card: a pattern it cannot express or
    tiles that do not fit, a limitation rather than a bug. The compiler, or the executor
    when it meets one first, runs the kernel's ops on the CPU instead."""


class ScratchpadOverflow(Refused):
    """The kernel's tiles do not fit one core's scratchpad."""


@dataclass
class BuildContext:
    """One program under construction: its slots are the kernel's buffers."""

    target: Target
    layouts: dict[str, StickLayout]
    program: ProgramBuilder = field(default_factory=ProgramBuilder)
    slot_of: dict[str, int] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)  # logical start of a buffer in its storage
    scratchpad_peak: int = 0  # bytes of one core's scratchpad the program holds at most (set by builders)
    block: np.ndarray | None = None  # the whole program, when the native builder encoded it

    def offset(self, buffer: str) -> int:
        return self.offsets.get(buffer, 0)

    def slot(self, buffer: str) -> int:
        s = self.slot_of.get(buffer)
        if s is None:
            s = self.slot_of[buffer] = self.program.slot(SLOT_DRAM, self.layouts[buffer].nbytes)
        return s

    def buffers(self) -> list[str]:
        """Buffer names in slot order: what a launch binds."""
        return sorted(self.slot_of, key=self.slot_of.get)

    def encode(self) -> np.ndarray:
        return self.program.encode() if self.block is None else self.block

    def commands(self) -> np.ndarray:
        """The program's commands, in program order."""
        return self.program.commands() if self.block is None else block_sections(self.block)[0]

    def descriptors(self) -> np.ndarray:
        return self.program.descriptors() if self.block is None else block_sections(self.block)[1]

    @property
    def ncmds(self) -> int:
        return self.program.ncmds if self.block is None else len(self.commands())


def round_up(x: int, g: int) -> int:
    return -(-x // g) * g
