"""The fuzz loop shared by the targets: a deterministic mutation fuzzer, standard library only.

A target is a function of one input (bytes) that either returns (the input was accepted)
or raises. Raising a ``SpyreError`` is a *typed rejection*, the expected way to refuse bad
input; any other exception is a *finding*. A crash of the process (a signal) is a finding
too: the input being tried is always in ``--crash-file`` before it runs.

Inputs come from mutating a corpus: the seed files of ``fuzz/corpus/<target>/`` plus every
input that produced an outcome not seen before (its *signature*: the stage that answered,
the exception type, the native status and the message with numbers taken out). Outcome
signatures stand in for coverage: an input that gets one check further is kept and mutated
further. With a fixed ``--seed`` the sequence of inputs is always the same; ``--seconds``
bounds the time, ``--runs`` the count.

Findings are written to ``--findings`` (an input and its traceback per new signature) and
summarised in the JSON line printed at the end. Exit status: 0 when every input was
accepted or typed-rejected, 3 when there were findings, ``sanitize.EXIT_STATUS`` when a
sanitizer stopped the process (``--asan``, see sanitize.py).

Inputs that trigger a known, reported library bug are skipped and counted as
``suppressed`` (each target names its suppressions), so that a long run finds new bugs;
``--no-suppress`` turns that off, ``--replay FILE...`` runs given inputs once each
without suppression.

Importing this module first matters under ``--asan``: it starts the program again with the
sanitizer runtime and then swaps in the sanitized native module before spyre_rt loads.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import random
import re
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import sanitize

sanitize.reexec_if_asked(sys.argv)
SANITIZERS = sanitize.load_if_active()

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
MAX_CORPUS = 512
MAX_SAVED_PER_FINDING = 3

INTERESTING_32 = [0, 1, 2, 3, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 1023, 1024, 4095, 4096,
                  0x7FFF, 0x8000, 0xFFFF, 0x10000, 1 << 20, (1 << 20) + 1, 1 << 24, (1 << 24) + 1,
                  (1 << 26) - 1, 1 << 26, (1 << 26) + 1, 2 << 20, (2 << 20) - 8, 0x7FFFFFFF, 0x80000000,
                  0xFFFFFFF0, 0xFFFFFFFE, 0xFFFFFFFF]
INTERESTING_64 = INTERESTING_32 + [1 << 32, (1 << 32) + 8, 1 << 40, 1 << 44, 1 << 48, 1 << 56, 1 << 62,
                                   1 << 63, (1 << 64) - 128, (1 << 64) - 8, (1 << 64) - 1]


# ---- outcomes ----------------------------------------------------------------------------

class Stage(Exception):
    """Wraps the exception a target's stage raised, naming the stage."""

    def __init__(self, stage: str, error: BaseException):
        super().__init__(stage)
        self.stage = stage
        self.error = error


def stage(name: str, fn: Callable, *args):
    """Run one stage of a target; exceptions come out wrapped with the stage's name."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - classified by the loop
        raise Stage(name, e) from e


_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


def signature(stage_name: str, error: BaseException | None) -> str:
    if error is None:
        return f"{stage_name}: ok"
    message = _NUMBERS.sub("#", str(error))[:100]
    status = getattr(error, "status", "")
    return f"{stage_name}: {type(error).__name__} {status} {message}"


# ---- field-aware mutation of numpy records ------------------------------------------------

def _leaf_fields(dtype: np.dtype, prefix=()) -> list[tuple]:
    """Paths to every scalar of a structured dtype: (field, [index], field, ...)."""
    out = []
    for name in dtype.names:
        sub = dtype.fields[name][0]
        if sub.subdtype is not None:
            base, shape = sub.subdtype
            for i in range(int(np.prod(shape))):
                if base.names:
                    out += _leaf_fields(base, prefix + (name, i))
                else:
                    out.append(prefix + (name, i))
        elif sub.names:
            out += _leaf_fields(sub, prefix + (name,))
        else:
            out.append(prefix + (name,))
    return out


_LEAVES: dict[np.dtype, list] = {}


def leaves(dtype: np.dtype) -> list[tuple]:
    if dtype not in _LEAVES:
        _LEAVES[dtype] = _leaf_fields(dtype)
    return _LEAVES[dtype]


def mutate_value(rng: random.Random, old: int, bits: int) -> int:
    mask = (1 << bits) - 1
    pool = INTERESTING_64 if bits == 64 else [v for v in INTERESTING_32 if v <= mask]
    r = rng.random()
    if r < 0.40:
        return rng.choice(pool) & mask
    if r < 0.65:
        return (old + rng.choice([-8, -4, -2, -1, 1, 2, 4, 8, 64, 128, 4096])) & mask
    if r < 0.80:
        return old ^ (1 << rng.randrange(bits))
    if r < 0.90:
        return (old * rng.choice([2, 3, 16, 1 << 10])) & mask
    return rng.getrandbits(bits)


def mutate_record(rng: random.Random, buf: np.ndarray, offset: int, dtype: np.dtype) -> str:
    """Change one scalar field of the record of `dtype` at `offset` in `buf`; its name."""
    record = buf[offset: offset + dtype.itemsize].view(dtype)
    path = rng.choice(leaves(dtype))
    arr = record
    for step in path:
        arr = arr[step] if isinstance(step, str) else arr[..., step]
    size = arr.dtype.itemsize  # every field of the device formats is an unsigned integer
    old = int(arr.reshape(-1)[0])
    arr[...] = mutate_value(rng, old, 8 * size)
    return ".".join(str(p) for p in path)


# ---- byte-level mutation ------------------------------------------------------------------

def mutate_bytes(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(1 + int(rng.expovariate(1.0))):
        r = rng.random()
        if not b:
            b += bytes(rng.randrange(1, 64))
        elif r < 0.25:  # bit flip
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif r < 0.40:  # an interesting byte, word or quad word
            size = rng.choice([1, 2, 4, 8])
            i = rng.randrange(max(1, len(b) - size + 1))
            value = mutate_value(rng, int.from_bytes(b[i:i + size], "little"), 8 * size)
            b[i:i + size] = value.to_bytes(size, "little")[: len(b) - i]
        elif r < 0.55:  # insert bytes
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.getrandbits(8) for _ in range(rng.choice([1, 4, 8, 16])))
        elif r < 0.70:  # delete bytes
            i = rng.randrange(len(b))
            del b[i: i + rng.choice([1, 4, 8, 16, 64])]
        elif r < 0.80:  # truncate
            del b[rng.randrange(len(b)):]
        elif r < 0.90 and others:  # splice from another input
            o = rng.choice(others)
            if o:
                i, j = rng.randrange(len(b)), rng.randrange(len(o))
                n = rng.randrange(1, 256)
                b[i: i + n] = o[j: j + n]
        else:  # copy a chunk within the input
            i, j = rng.randrange(len(b)), rng.randrange(len(b))
            n = rng.randrange(1, 129)
            b[i: i + n] = b[j: j + n]
    return bytes(b)


def aligned(data: bytes) -> np.ndarray:
    """An 8-byte aligned uint8 copy (the card rejects misaligned blocks outright)."""
    out = np.zeros((len(data) + 7) // 8, dtype=np.uint64).view(np.uint8)[: len(data)]
    out[:] = np.frombuffer(data, dtype=np.uint8)
    return out


# ---- the loop -----------------------------------------------------------------------------

def arguments(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seconds", type=float, default=60.0, help="time budget (default 60)")
    p.add_argument("--runs", type=int, default=0, help="stop after this many inputs (0: no limit)")
    p.add_argument("--seed", type=int, default=1, help="seed of the mutation sequence (default 1)")
    p.add_argument("--corpus", type=Path, default=None, help="seed directory (default fuzz/corpus/<target>)")
    p.add_argument("--findings", type=Path, default=HERE / "findings", help="where inputs with findings go")
    p.add_argument("--crash-file", type=Path, default=None,
                   help="holds the input being tried (default <findings>/<target>.current)")
    p.add_argument("--quiet", action="store_true", help="only the summary line")
    p.add_argument("--asan", action="store_true", help="run the native code under AddressSanitizer and UBSan")
    p.add_argument("--no-suppress", action="store_true", help="also run inputs that trigger known bugs")
    p.add_argument("--replay", type=Path, nargs="+", default=None, metavar="FILE",
                   help="run these inputs once each (no mutation, no suppression) and report")
    return p.parse_args()


def read_corpus(directory: Path) -> list[bytes]:
    seeds = [p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and not p.name.startswith(".")]
    if not seeds:
        raise SystemExit(f"no seed inputs in {directory}; run fuzz/make_corpus.py")
    return seeds


def replay(name: str, target: Callable[[bytes], object], files: list[Path]) -> int:
    """Run each file through the target once; print its outcome. Exit status 3 on findings."""
    faulthandler.enable()
    bad = 0
    for path in files:
        print(f"{path}: ", end="", flush=True)
        try:
            target(path.read_bytes())
            print("accepted", flush=True)
        except Stage as s:
            print(signature(s.stage, s.error), flush=True)
            if not _typed(s.error):
                bad += 1
                traceback.print_exception(type(s.error), s.error, s.error.__traceback__)
    return 3 if bad else 0


def run(name: str, target: Callable[[bytes], object], mutate: Callable, args: argparse.Namespace,
        known_bug: Callable[[bytes], str | None] = lambda data: None) -> int:
    """Fuzz `target` with inputs from `mutate(rng, parent, corpus)`; prints a JSON summary.
    Inputs for which `known_bug` names a reported bug are skipped (unless --no-suppress)."""
    if args.replay:
        return replay(name, target, args.replay)
    faulthandler.enable()
    seeds = read_corpus(args.corpus or CORPUS / name)
    args.findings.mkdir(parents=True, exist_ok=True)
    crash_path = args.crash_file or args.findings / f"{name}.current"
    crash_fd = os.open(crash_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    rng = random.Random(args.seed)
    corpus = list(seeds)
    seen: Counter = Counter()
    findings: Counter = Counter()
    accepted = rejected = seeds_accepted = 0
    suppressed: Counter = Counter()
    start = time.monotonic()
    deadline = start + args.seconds
    n = 0
    # the seeds first, unmutated: they must all be accepted
    queue = list(seeds)
    while True:
        from_seeds = bool(queue)
        if queue:
            data = queue.pop(0)
        else:
            if (args.runs and n >= args.runs) or time.monotonic() >= deadline:
                break
            parent = rng.choice(corpus if rng.random() < 0.8 else seeds)
            data = mutate(rng, parent, corpus)
        n += 1
        bug = None if args.no_suppress else known_bug(data)
        if bug:
            suppressed[bug] += 1
            continue
        os.ftruncate(crash_fd, 0)
        os.pwrite(crash_fd, data, 0)
        try:
            target(data)
            sig = signature("target", None)
            accepted += 1
            seeds_accepted += from_seeds
        except Stage as s:
            sig = signature(s.stage, s.error)
            if _typed(s.error):
                rejected += 1
            else:
                _finding(args.findings, name, sig, data, s.error, findings)
        except Exception as e:  # noqa: BLE001 - a failure of the target outside any stage
            sig = signature("target", e)
            _finding(args.findings, name, sig, data, e, findings)
        if sig not in seen and len(corpus) < MAX_CORPUS:
            corpus.append(data)
        elif sig not in seen:
            corpus[rng.randrange(len(seeds), MAX_CORPUS)] = data
        seen[sig] += 1
        if not args.quiet and n % 5000 == 0:
            print(f"{name}: {n} inputs, {len(seen)} outcomes, {sum(findings.values())} findings, "
                  f"{time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    os.close(crash_fd)
    crash_path.unlink()
    summary = {
        "target": name, "seed": args.seed, "seconds": round(time.monotonic() - start, 2), "inputs": n,
        "seeds": len(seeds), "seeds_accepted": seeds_accepted, "accepted": accepted, "rejected": rejected,
        "suppressed": dict(suppressed), "findings": dict(findings), "outcomes": len(seen), "corpus": len(corpus),
        "sanitizers": SANITIZERS or "none",
    }
    if not args.quiet:
        for sig, count in seen.most_common():
            print(f"{count:8d}  {sig}", file=sys.stderr)
    print(json.dumps(summary), flush=True)
    return 3 if findings else 0


def _typed(error: BaseException) -> bool:
    from spyre_rt.errors import SpyreError

    return isinstance(error, SpyreError)


def _finding(directory: Path, name: str, sig: str, data: bytes, error: BaseException, findings: Counter) -> None:
    findings[sig] += 1
    if findings[sig] <= MAX_SAVED_PER_FINDING:
        tag = hashlib.sha256(sig.encode()).hexdigest()[:12]
        base = directory / f"{name}-{tag}-{findings[sig]}"
        base.with_suffix(".bin").write_bytes(data)
        base.with_suffix(".txt").write_text(
            sig + "\n\n" + "".join(traceback.format_exception(type(error), error, error.__traceback__)))
