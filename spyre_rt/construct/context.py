"""What a kernel builder needs: the card's cost model, buffer layouts, a program to fill."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..cost import CostModel
from ..layout import StickLayout
from ..program import SLOT_DRAM, ProgramBuilder, block_sections

LX_ALIGN = 128  # scratchpad regions start on a stick


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

    target: CostModel
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

    def sections(self) -> tuple[np.ndarray, np.ndarray]:
        """(commands, descriptors): the block's tables read once."""
        return (self.commands(), self.descriptors()) if self.block is None else block_sections(self.block)

    @property
    def ncmds(self) -> int:
        return self.program.ncmds if self.block is None else len(self.commands())

