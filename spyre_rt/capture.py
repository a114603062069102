"""What a graph capture shares with the eager paths beneath it: whether this thread is
capturing (eager work on the card refuses itself then, :func:`refuse`) and the count of
storage swaps (a spyre tensor pointed at other memory), which tells replays and compiled
steps' fast paths that addresses they bound may be stale.

Kept apart from :mod:`spyre_rt.graphs`, which records and replays on top of the tensor
and executor layers, so that those layers ask these questions without importing it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .errors import SpyreGraphError

capturing = 0  # threads capturing now: the hot paths test this int before anything else
_lock = threading.Lock()
_local = threading.local()

# Bumped whenever a spyre tensor is pointed at another storage (`.data =`, `set_`, a growing
# `resize_`). Compiled steps bind the memory of their static inputs once and re-check it
# only when this changes, instead of asking every parameter for its address on every call.
storage_swaps = 0


def swapped() -> None:
    """A spyre tensor was pointed at another storage."""
    global storage_swaps
    storage_swaps += 1


def begin(graph) -> None:
    """`graph` starts capturing on this thread."""
    global capturing
    _local.graph = graph
    with _lock:
        capturing += 1


def end(graph) -> bool:
    """`graph` stops capturing on this thread; False if it was not capturing here."""
    global capturing
    if getattr(_local, "graph", None) is not graph:
        return False
    _local.graph = None
    with _lock:
        capturing -= 1
    return True


def current():
    """The graph this thread is capturing into, if any."""
    return getattr(_local, "graph", None) if capturing else None


def recording():
    """The graph this thread is capturing into, outside the capture's own work."""
    g = current()
    return None if g is None or getattr(_local, "inside", False) else g


def refuse(what: str) -> None:
    """Raise if this thread is capturing: `what` is eager work a replay cannot repeat."""
    g = current()
    if g is not None and not getattr(_local, "inside", False):
        g._failed = True
        raise SpyreGraphError(
            f"{what} inside a spyre graph capture: a capture records compiled steps and device-to-device "
            "copies only (do eager work before or after it)")


@contextlib.contextmanager
def inside() -> Iterator[None]:
    """The capture's own work (running a step it records), or compile-time work: not
    eager work, neither recorded nor refused."""
    previous = getattr(_local, "inside", False)
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = previous
