"""The dispatch modes: when the host builds what the card runs.

Two paths reach the card: the data-transfer path (eager copies, a CPU op's reads and
writes, a constructed job's program upload: transfer graphs) and the compute path (each
kernel's job graph). A mode says, for each path, whether its graphs are built on every
launch or built once and reused:

=====================  ============================  ===================================
mode                   data transfers                kernels
=====================  ============================  ===================================
``construct``          built every launch            built every launch
``prebuilt-transfer``  prebuilt (cached per view)    built every launch
``prebuilt-compute``   built every launch            a graph plan per step, built once
``prebuilt``           prebuilt (cached per view)    a graph plan per step, built once
=====================  ============================  ===================================

The construction code is the same in every mode; a mode only moves it. The modes are one
table, :data:`MODES`: code that behaves differently per mode asks the mode's record
(:attr:`DispatchMode.prebuilt_transfers`, :attr:`DispatchMode.plans`), never its name. The
public API names modes by string: a compiled step's mode comes from its compile options
(or ``SPYRE_RT_DISPATCH``) and can be overridden for a block with :func:`dispatch_mode`.

This module imports nothing else of spyre_rt: :mod:`spyre_rt.config` validates names
against it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class DispatchMode:
    name: str
    prebuilt_transfers: bool  # transfer graphs from the card's cache, not built per copy
    plans: bool               # kernels from the step's prebuilt graph plans, not built per launch
    summary: str

    def __str__(self) -> str:
        return self.name


MODES: dict[str, DispatchMode] = {m.name: m for m in (
    DispatchMode("construct", prebuilt_transfers=False, plans=False,
                 summary="every kernel's job and every transfer graph built at its launch"),
    DispatchMode("prebuilt-transfer", prebuilt_transfers=True, plans=False,
                 summary="kernels built at their launch; transfer graphs prebuilt"),
    DispatchMode("prebuilt-compute", prebuilt_transfers=False, plans=True,
                 summary="kernels from prebuilt graph plans; transfer graphs built per launch"),
    DispatchMode("prebuilt", prebuilt_transfers=True, plans=True,
                 summary="kernels from prebuilt graph plans; transfer graphs prebuilt"),
)}
NAMES: tuple[str, ...] = tuple(MODES)


def named(mode: str | DispatchMode) -> DispatchMode:
    """The mode of a name (a mode is its own); an unknown name is a ValueError that lists
    the known ones."""
    if isinstance(mode, DispatchMode):
        return mode
    try:
        return MODES[mode]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dispatch mode {mode!r}; the modes are {', '.join(NAMES)}") from None


def check(name: str, what: str = "dispatch mode") -> str:
    """`name` if it names a mode, else a ValueError naming `what` and listing the modes."""
    if not isinstance(name, str) or name not in MODES:
        raise ValueError(f"{what} must be one of {', '.join(NAMES)}, not {name!r}")
    return name


_local = threading.local()


def override() -> str | None:
    return getattr(_local, "mode", None)


@contextlib.contextmanager
def dispatch_mode(mode: str) -> Iterator[None]:
    """Run compiled steps in `mode` inside the block (this thread only)."""
    check(mode)
    previous = override()
    _local.mode = mode
    try:
        yield
    finally:
        _local.mode = previous
