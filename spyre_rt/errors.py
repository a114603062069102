"""Typed errors (every native status becomes one of these, naming what was wrong), and the
warnings spyre_rt gives once per process."""

from __future__ import annotations

import threading
import warnings

import torch
import torch.distributed as dist

_warned: set[tuple[str, str]] = set()  # (subject, what) of warn_once
_warned_lock = threading.Lock()


def warn_once(subject: str, what: str, category=UserWarning, stacklevel: int = 3) -> None:
    """Warn ``spyre: {subject} {what}`` once per process (until :func:`forget_warnings`);
    `stacklevel` as ``warnings.warn``'s, counted from the caller."""
    with _warned_lock:
        first = (subject, what) not in _warned
        _warned.add((subject, what))
    if first:
        warnings.warn(f"spyre: {subject} {what}", category, stacklevel=stacklevel + 1)


def forget_warnings(subject: str) -> None:
    """Warn again about every subject that contains `subject`."""
    with _warned_lock:
        _warned.difference_update({w for w in _warned if subject in w[0]})


class SpyreError(RuntimeError):
    """Base class of every error spyre_rt raises."""

    job: int = -1  # the failing job of a graph plan launch, -1 otherwise


class SpyreProfileError(SpyreError, ValueError):
    """A device or model profile is missing a figure, has an unknown one, or a bad value."""


class SpyreOutOfMemoryError(SpyreError, torch.OutOfMemoryError):
    """Device DRAM cannot satisfy an allocation. Names the requested and free bytes."""

    def __init__(self, message: str, requested: int = 0, free: int = 0):
        super().__init__(message)
        self.requested = requested
        self.free = free


class SpyreInvalidCommandError(SpyreError):
    """A program was rejected before it ran: a command out of bounds, over the scratchpad,
    in a dependency cycle, malformed, or a binding outside its allocation."""

    def __init__(self, message: str, status: str = "", command: int = -1):
        super().__init__(message)
        self.status = status
        self.command = command


class SpyreIndexError(SpyreError, IndexError):
    """A gather or scatter index fell outside its table while the job ran."""

    def __init__(self, message: str, command: int = -1):
        super().__init__(message)
        self.command = command


class SpyreDeviceError(SpyreError):
    """An engine of the card reported an error while running a job."""

    def __init__(self, message: str, status: str = "", command: int = -1):
        super().__init__(message)
        self.status = status
        self.command = command


class SpyreDMAError(SpyreDeviceError):
    """The DMA engine reported an error."""


class SpyreDeviceLostError(SpyreDeviceError):
    """The card is lost: every call on it fails until ``spyre_rt.reset_device(device)``
    resets it (tensors that were on it are gone; compiled functions keep working)."""


class SpyreNoDataError(SpyreError):
    """The value of a timing-mode tensor was asked for: timing mode keeps no data."""


class SpyreCompileError(SpyreError):
    """The compiler cannot place an op on the card and CPU fallback is off."""


class SpyreRefusedError(SpyreCompileError):
    """The card's construction refused kernels of a compiled step (a pattern it cannot
    express, tiles that do not fit the scratchpad) and CPU fallback is off. ``kernels``
    maps each refused kernel to what construction said; ``indirect`` names those refused
    for an access through an index (a gather or scatter it cannot address)."""

    def __init__(self, message: str, kernels: dict[str, str] | None = None, indirect=()):
        super().__init__(message)
        self.kernels = dict(kernels or {})
        self.indirect = frozenset(indirect)


class SpyrePlanCacheError(SpyreError):
    """A plan cache file is corrupt, truncated, of another version or not a plan file."""


class SpyreLayoutError(SpyreError):
    """A graph plan was bound to a storage of another stick layout than it was built for
    (the card checks every binding against the layout its allocation records)."""


class SpyreGraphError(SpyreError):
    """A graph capture or replay was refused: eager work inside a capture, a replay after
    the card was reset or after a static input was pointed at other memory."""


class SpyreCollectiveError(SpyreError, dist.DistBackendError):
    """A collective between cards failed: a peer timed out or exited, the ranks' calls did
    not match, or the group was aborted by an earlier failure (a card fault on a peer during
    a compiled step, say). The group refuses every later call, as NCCL's does, until its
    ranks rearm it together (:meth:`~spyre_rt.distributed.ProcessGroupSpyre.rearm`)."""

    def __init__(self, message: str, status: str = ""):
        super().__init__(message)
        self.status = status
