"""The compute-dispatch path: how a kernel's job reaches the card in each mode.

``construct``          build the job's program and its upload's transfer graph, every launch
``prebuilt-transfer``  build the program every launch; its upload uses a cached transfer graph
``prebuilt``           the whole step is a graph plan built once: one native call per step

The construction code is the same in every mode; a mode only moves it. The mode of a
compiled step comes from its compile options (or ``SPYRE_RT_DISPATCH``) and can be
overridden for a block with :func:`dispatch_mode`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .config import DISPATCH_MODES

_local = threading.local()


def override() -> str | None:
    return getattr(_local, "mode", None)


@contextlib.contextmanager
def dispatch_mode(mode: str) -> Iterator[None]:
    """Run compiled steps in `mode` inside the block (this thread only)."""
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch mode must be one of {DISPATCH_MODES}, not {mode!r}")
    previous = override()
    _local.mode = mode
    try:
        yield
    finally:
        _local.mode = previous
