"""The identity of the runtime's code (part of every plan key).

A digest of the runtime's Python sources and of the native module: plans depend on both
(the runtime lays out memory and builds transfers and jobs, the native module encodes and
validates them), so a change to either must miss the plan cache.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

__version__ = "0.1.0"  # the release (pyproject.toml's); the digest below is the code's identity

_version: str | None = None
_lock = threading.Lock()


def sources() -> list[Path]:
    """The files the digest covers, in a fixed order."""
    from . import _native

    root = Path(__file__).parent
    files = {p.resolve() for p in root.rglob("*.py")}
    files.add(Path(_native.__file__).resolve())
    return sorted(files)


def runtime_version() -> str:
    global _version
    if _version is None:
        with _lock:
            if _version is None:
                h = hashlib.sha256(__version__.encode())
                for path in sources():
                    h.update(path.read_bytes())
                _version = h.hexdigest()[:16]
    return _version
