"""The identity of the compiler (part of every cache key): a digest of its sources and of
the runtime it compiles for. A compiled step carries it in its options, so plans made by
another compiler are never taken for its own."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from spyre_rt.version import runtime_version

_version: str | None = None
_lock = threading.Lock()


def sources() -> list[Path]:
    return sorted(p.resolve() for p in Path(__file__).parent.rglob("*.py"))


def compiler_version() -> str:
    global _version
    if _version is None:
        with _lock:
            if _version is None:
                h = hashlib.sha256(runtime_version().encode())
                for path in sources():
                    h.update(path.read_bytes())
                _version = h.hexdigest()[:16]
    return _version
