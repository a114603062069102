"""The pieces a step's sequence is cut into, each of which knows how to run itself.

A :class:`DeviceSegment` is a run of card kernels: one graph plan in the modes with plans
(``prebuilt``, ``prebuilt-compute``), one job built and launched per kernel in the others. A :class:`CpuSegment` is an op
the card cannot run, run on the host inside the step; a :class:`HostKernelSegment` a
kernel construction refused for this card, run on the host from its description; a
:class:`PickSegment` uploads one element of a CPU op's tuple result into a buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ..card import Card
from ..dispatch import DispatchMode
from ..errors import SpyreError, SpyreIndexError
from ..ir import CpuOp
from .cpu_ops import CpuOps
from .host_kernels import HostKernels


class Runs(Protocol):
    """What a segment needs of the executable it belongs to (:class:`.executable.Executable`)."""

    card: Card
    kernels: dict              # name -> the kernel's description
    cpu: CpuOps
    host: HostKernels

    def plans(self, epoch: int | None = None, fallback: bool = True) -> list: ...

    def construct_and_run(self, kernels, table, mode: DispatchMode) -> None: ...


@dataclass
class Call:
    """One call of an executable: its binding table and what its segments leave behind."""

    exe: Runs
    table: Any             # cffi uint64_t[] bindings: arena, inputs, constants, outputs
    mode: DispatchMode
    epoch: int
    cpu_values: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceSegment:
    kernels: tuple[str, ...]
    index: int  # among the step's device segments: which plan of the plan file

    def run(self, call: Call) -> None:
        exe = call.exe
        try:
            if call.mode.plans:
                exe.plans(call.epoch)[self.index].launch(call.table)
            else:
                exe.construct_and_run(self.kernels, call.table, call.mode)
        except SpyreError as e:
            named = self.named(exe, e)
            if named is e:
                raise
            raise named from None

    def named(self, exe: Runs, e: SpyreError) -> SpyreError:
        """The error to raise for `e`, raised by this segment's jobs: it names the segment,
        and for a bad index of the user's data, the op that read it."""
        if isinstance(e, SpyreIndexError):
            named = SpyreIndexError(f"{self._ops_of(exe, e.job)}: {e}", e.command)
            named.job, named.segment = e.job, self.index
            return named
        e.segment = self.index
        return e

    def _ops_of(self, exe: Runs, job: int) -> str:
        if not 0 <= job < len(self.kernels) or self.kernels[job] not in exe.kernels:
            return "a kernel of the step"
        origins = exe.kernels[self.kernels[job]].origins
        return ", ".join(origins) or self.kernels[job]


@dataclass(frozen=True)
class CpuSegment:
    op: CpuOp

    def run(self, call: Call) -> None:
        call.cpu_values[self.op.name] = call.exe.card.on_cpu(
            self.op.op, call.exe.cpu.run, self.op, call.table, call.mode)


@dataclass(frozen=True)
class HostKernelSegment:
    kernel: str

    def run(self, call: Call) -> None:
        call.exe.card.on_cpu(f"kernel {self.kernel}", call.exe.host.run, self.kernel, call.table, call.mode)


@dataclass(frozen=True)
class PickSegment:
    src: str
    path: tuple[int, ...]
    out: str

    def run(self, call: Call) -> None:
        value = call.cpu_values[self.src]
        for i in self.path:
            value = value[i]
        call.exe.cpu.upload(self.out, value, call.table, call.mode)


def cut(sequence, first: tuple[str, ...] = (), on_host=frozenset()) -> list:
    """The segments of a step's sequence; `first` are jobs that run before everything else
    (in the first device segment, which is made for them if the step starts on the host);
    kernels `on_host` run on the host."""
    segs: list = []
    run: list[str] = list(first)
    ndevice = 0

    def close() -> None:
        nonlocal run, ndevice
        if run:
            segs.append(DeviceSegment(tuple(run), ndevice))
            ndevice += 1
            run = []

    for kind, x in sequence:
        if kind == "run" and x not in on_host:
            run.append(x)
            continue
        if kind == "run":
            close()
            segs.append(HostKernelSegment(x))
            continue
        close()
        segs.append(CpuSegment(x) if kind == "cpu" else PickSegment(x[0], tuple(x[1]), x[2]))
    close()
    return segs
