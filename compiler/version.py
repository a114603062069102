"""The identity of the code that turns a graph into card commands (part of every cache key).

A digest of the compiler's and the runtime's Python sources and of the native module:
a plan depends on all of them (the runtime lays out memory and builds transfers, the native
module encodes and validates), so a change to any of them must miss the caches.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

_version: str | None = None
_lock = threading.Lock()


def sources() -> list[Path]:
    """The files the digest covers, in a fixed order."""
    import spyre_rt._native as native

    import spyre_rt

    roots = [Path(spyre_rt.__file__).parent, Path(__file__).parent]
    files = {p.resolve() for root in roots for p in root.rglob("*.py")}
    files.add(Path(native.__file__).resolve())
    return sorted(files)


def compiler_version() -> str:
    global _version
    if _version is None:
        with _lock:
            if _version is None:
                import spyre_rt

                h = hashlib.sha256(spyre_rt.__version__.encode())
                for path in sources():
                    h.update(path.read_bytes())
                _version = h.hexdigest()[:16]
    return _version
