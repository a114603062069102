"""The plan cache on disk: prebuilt graph plans, so a new process loads instead of building.

One file per key. The key (a sha256) covers everything that changes the commands: the
compiled step, the input geometry (shapes, dtypes, strides, stick layouts, offsets), the
device profile, the compiler and torch versions and the compile options. A file is plain
data, never pickle or code:

    magic "SPYPLAN\\0" | format u32 | header length u32 | payload length u64 | sha256 (32 B)
    | header (JSON) | payload (pieces of the plan blocks, each 8-byte aligned)

A block is stored as pieces (a plan block's tables, each job's program): each distinct
piece once, and per block the list of pieces it is made of (the header's ``pieces`` and
``piece_sizes``). The 40 layers of a decoder run the same programs, so a file holds each
once. The checksum covers header and payload. A file that is truncated, corrupt, of another
format or for another key is detected, logged, counted and rebuilt; the plan blocks are
validated again by the card when the plans are created. Writes go to a temporary file in
the cache directory and are renamed into place, so concurrent writers leave one valid file
and readers never see a partial one. A write is not synced to the disk: a file that a
power loss tears fails its checksum and is rebuilt, like any other corrupt file. After a
write the directory is trimmed to its size bound, least recently used first (a hit
refreshes a file's time); temp files count against the bound, and those left by writers
that died (untouched for :data:`STALE_TEMP_SECONDS`) are removed. Listing the directory
costs a stat per file, so a write does not list it: the counters file keeps the
directory's bytes (:data:`TRACKED_BYTES`, set by each trim, grown by each write under the
counters' lock), and a write trims only when that passes the bound, or when it is the
process's first write there (a count that a writer killed between its rename and its count
left short is made right then). A write thus costs the same with ten plans in the cache or
ten thousand. :meth:`PlanCache.clear` removes every file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import SpyrePlanCacheError

log = logging.getLogger("spyre_rt.plan_cache")

MAGIC = b"SPYPLAN\0"
FORMAT = 2  # 1 stored each block whole
_PREFIX = struct.Struct("<8sIIQ32s")  # magic, format, header length, payload length, sha256
SUFFIX = ".plan"
STATS_FILE = "stats.json"
TEMP_PREFIX = ".tmp-"
# A temp file untouched this long belongs to a writer that died: a live writer creates,
# writes and renames its file within moments.
STALE_TEMP_SECONDS = 600
TRACKED_BYTES = "bytes"  # the counters file's record of the plan files' bytes (see the module docstring)
_TRIMMED: set[Path] = set()  # the directories this process has trimmed (listed whole)


@dataclass
class Entry:
    key: str
    header: dict
    blocks: list[np.ndarray]


class Stats:
    """Counters of this process (hits, misses, corrupt files, writes, evictions)."""

    def __init__(self) -> None:
        self.hits = self.misses = self.corrupt = self.writes = self.evictions = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


stats = Stats()


def digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()


def encode(key: str, header: dict, blocks: list[np.ndarray], cuts: list[list[int]] | None = None) -> bytes:
    """The file of `blocks`; ``cuts[i]`` are the offsets where block i's pieces start (its
    job programs: see :func:`spyre_rt.plan.program_offsets`), each distinct piece stored once."""
    ids: dict[bytes, int] = {}
    pieces: list[bytes] = []
    layout = []
    for i, b in enumerate(blocks):
        raw = memoryview(np.ascontiguousarray(b).view(np.uint8)).cast("B")
        bounds = [0, *sorted({c for c in (cuts[i] if cuts else ()) if 0 < c < len(raw)}), len(raw)]
        made = []
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            piece = bytes(raw[lo:hi])
            n = ids.get(piece)
            if n is None:
                n = ids[piece] = len(pieces)
                pieces.append(piece)
            made.append(n)
        layout.append(made)
    header = dict(header, key=key, blocks=[int(b.size) for b in blocks], pieces=layout,
                  piece_sizes=[len(p) for p in pieces])
    head = json.dumps(header, sort_keys=True).encode()
    head += b" " * (-len(head) % 8)
    payload = b"".join(p + b"\0" * (-len(p) % 8) for p in pieces)
    h = hashlib.sha256(head)
    h.update(payload)
    return _PREFIX.pack(MAGIC, FORMAT, len(head), len(payload), h.digest()) + head + payload


def decode(data: bytes, key: str | None = None) -> Entry:
    """Parse and check a cache file; raises SpyrePlanCacheError saying what is wrong (and no
    other error, whatever the bytes: a caller rejects the file and rebuilds)."""
    if len(data) < _PREFIX.size:
        raise SpyrePlanCacheError(f"truncated: {len(data)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, fmt, nhead, npay, check = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise SpyrePlanCacheError("not a spyre_rt plan file (bad magic)")
    if fmt != FORMAT:
        raise SpyrePlanCacheError(f"plan file format {fmt}, this spyre_rt reads {FORMAT}")
    if len(data) != _PREFIX.size + nhead + npay:
        raise SpyrePlanCacheError(f"truncated or padded: {len(data)} bytes, the prefix says "
                                  f"{_PREFIX.size + nhead + npay}")
    body = memoryview(data)[_PREFIX.size:]
    if hashlib.sha256(body).digest() != check:
        raise SpyrePlanCacheError("checksum mismatch (corrupt file)")
    try:
        header = json.loads(bytes(body[:nhead]).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise SpyrePlanCacheError(f"unreadable header: {e}") from None
    except RecursionError:  # nesting deeper than the json module parses
        raise SpyrePlanCacheError("unreadable header: nested too deeply") from None
    if not isinstance(header, dict) or not isinstance(header.get("blocks"), list):
        raise SpyrePlanCacheError("header lacks the block table")
    if not isinstance(header.get("key"), str):
        raise SpyrePlanCacheError("header lacks its key")
    if key is not None and header["key"] != key:
        raise SpyrePlanCacheError("a file for another key (foreign or stale)")
    sizes, layout, piece_sizes = header["blocks"], header.get("pieces"), header.get("piece_sizes")
    if (not isinstance(layout, list) or len(layout) != len(sizes) or not isinstance(piece_sizes, list)
            or not all(type(n) is int and n >= 0 for n in (*sizes, *piece_sizes))):
        raise SpyrePlanCacheError("header lacks the piece table")
    starts, pos = [], nhead
    for n in piece_sizes:
        starts.append(pos)
        pos += n + (-n % 8)
    if pos != nhead + npay:
        raise SpyrePlanCacheError("piece table points outside the payload")
    blocks = []
    for size, made in zip(sizes, layout, strict=True):
        if (not isinstance(made, list) or not all(type(i) is int and 0 <= i < len(piece_sizes) for i in made)
                or sum(piece_sizes[i] for i in made) != size):
            raise SpyrePlanCacheError("a block's pieces do not make the block")
        aligned = np.zeros((size + 7) // 8, dtype=np.uint64).view(np.uint8)[:size]
        at = 0
        for i in made:
            n = piece_sizes[i]
            aligned[at: at + n] = np.frombuffer(body[starts[i]: starts[i] + n], dtype=np.uint8)
            at += n
        blocks.append(aligned)
    return Entry(header["key"], header, blocks)


class PlanCache:
    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        self.dir = Path(directory)
        self.max_bytes = max_bytes

    def path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def load(self, key: str) -> Entry | None:
        p = self.path(key)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            stats.misses += 1
            self._bump("misses")
            return None
        except OSError as e:
            log.warning("plan cache: cannot read %s (%s); rebuilding", p, e)
            stats.misses += 1
            return None
        try:
            entry = decode(data, key)
        except SpyrePlanCacheError as e:
            self.reject(key, str(e))
            return None
        stats.hits += 1
        self._bump("hits")
        with contextlib.suppress(OSError):
            os.utime(p)  # recently used
        return entry

    def reject(self, key: str, why: str) -> None:
        """A cached file proved unusable: log, count and remove it (it will be rebuilt)."""
        log.warning("plan cache: %s is unusable (%s); rebuilding it", self.path(key).name, why)
        stats.corrupt += 1
        stats.misses += 1
        self._bump("corrupt")
        with contextlib.suppress(OSError):
            self.path(key).unlink()

    def store(self, key: str, header: dict, blocks: list[np.ndarray], cuts: list[list[int]] | None = None) -> None:
        data = encode(key, header, blocks, cuts)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=SUFFIX, dir=self.dir)
            try:
                with os.fdopen(fd, "wb") as f:  # no fsync: a file a crash tore fails its checksum
                    f.write(data)
                os.replace(tmp, self.path(key))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            log.warning("plan cache: cannot write %s (%s); continuing without it", self.path(key), e)
            return
        stats.writes += 1
        over = self._update(lambda counts: _count_write(counts, len(data), self.max_bytes))
        if over is not False or self.dir not in _TRIMMED:  # None: the counters are unreadable
            self.trim()

    def _listing(self, temps: bool) -> list[tuple[Path, os.stat_result]]:
        out = []
        with contextlib.suppress(FileNotFoundError):
            for p in self.dir.iterdir():
                if temps:  # a plan file being written, or a stats file being replaced
                    wanted = p.name.startswith(TEMP_PREFIX) or p.name.startswith(f".{STATS_FILE}.")
                else:
                    wanted = p.suffix == SUFFIX and not p.name.startswith(TEMP_PREFIX)
                if wanted:
                    with contextlib.suppress(FileNotFoundError):
                        out.append((p, p.stat()))
        return out

    def headers(self) -> list[tuple[Path, dict]]:
        """The header of every plan file, read without its payload (for listings: nothing
        here is trusted to run; a file that does not parse is left out)."""
        out = []
        for p, _ in self.entries():
            try:
                with open(p, "rb") as f:
                    prefix = f.read(_PREFIX.size)
                    magic, fmt, nhead, _, _ = _PREFIX.unpack(prefix)
                    if magic != MAGIC or fmt != FORMAT:
                        continue
                    header = json.loads(f.read(nhead).decode())
            except (OSError, ValueError, struct.error, RecursionError):
                continue
            if isinstance(header, dict):
                out.append((p, header))
        return out

    def entries(self) -> list[tuple[Path, os.stat_result]]:
        """The finished plan files."""
        return self._listing(temps=False)

    def temp_files(self) -> list[tuple[Path, os.stat_result]]:
        """Files being written (or left half written by writers that died)."""
        return self._listing(temps=True)

    def trim(self) -> int:
        """Remove temp files left by writers that died (untouched for STALE_TEMP_SECONDS),
        then least recently used plan files until the directory, with the temp files of
        live writers, is within its bound. Returns the number of files removed."""
        now = time.time()
        stale = live = 0
        for p, st in self.temp_files():
            if now - st.st_mtime > STALE_TEMP_SECONDS:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    stale += 1
            else:
                live += st.st_size
        if stale:
            log.info("plan cache: removed %d temp file(s) left by writers that died", stale)
        files = sorted(self.entries(), key=lambda e: e[1].st_mtime)
        total = live + sum(st.st_size for _, st in files)
        removed = 0
        while files and total > self.max_bytes:
            p, st = files.pop(0)
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed += 1
            total -= st.st_size
        stats.evictions += removed

        def record(counts: dict) -> None:
            counts[TRACKED_BYTES] = total - live  # the plan files': the live temps are counted when they land
            if removed:
                _add(counts, "evictions", removed)

        self._update(record)
        _TRIMMED.add(self.dir)
        return stale + removed

    def clear(self) -> int:
        """Remove every plan file, every temp file (a writer busy meanwhile only fails to
        store its file) and the shared counters. Returns the number of files removed."""
        n = 0
        for p, _ in self.entries() + self.temp_files():
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                n += 1
        with contextlib.suppress(FileNotFoundError):
            (self.dir / STATS_FILE).unlink()
        return n

    # ---- persistent counters shared by the processes using this directory ----
    def _bump(self, name: str, by: int = 1) -> None:
        self._update(lambda counts: _add(counts, name, by))

    def _update(self, change):
        """Apply `change` to the shared counters under their lock; its result, or None when
        the counters cannot be read or written."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(self.dir / ".stats.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                counts = self.persistent_stats()
                result = change(counts)
                counts["updated"] = time.time()
                tmp = self.dir / f".{STATS_FILE}.{os.getpid()}"
                tmp.write_text(json.dumps(counts))
                os.replace(tmp, self.dir / STATS_FILE)
                return result
        except OSError:
            return None  # counters are informative; never fail a run for them

    def persistent_stats(self) -> dict:
        try:
            data = json.loads((self.dir / STATS_FILE).read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}


def _add(counts: dict, name: str, by: int) -> None:
    counts[name] = counts.get(name, 0) + by


def _count_write(counts: dict, nbytes: int, bound: int) -> bool:
    """Count a write of `nbytes` in `counts`; whether the directory may now be over `bound`
    (or its bytes are not known: a directory no trim has recorded)."""
    _add(counts, "writes", 1)
    known = counts.get(TRACKED_BYTES)
    if type(known) is not int:
        return True
    counts[TRACKED_BYTES] = known + nbytes
    return known + nbytes > bound


def of(s) -> PlanCache | None:
    """The plan cache that settings `s` name (a step's: ``step.settings``), None when off."""
    return PlanCache(s.cache_dir, s.cache_max_bytes) if s.cache_enabled else None


def default() -> PlanCache | None:
    """The plan cache of the process settings (the tools' and steps made without the compiler)."""
    from . import config

    return of(config.settings())
