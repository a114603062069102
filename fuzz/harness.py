"""The fuzz loop shared by the targets: a deterministic, coverage-guided mutation fuzzer.

A target is a function of one input (bytes) that either returns (the input was accepted)
or raises. Raising a ``SpyreError`` is a *typed rejection*, the expected way to refuse bad
input; any other exception is a *finding*. A crash of the process (a signal) is a finding
too: the input being tried is always in ``--crash-file`` before it runs.

The native module is an instrumented copy (instrumented.py): every input's edges through
the native files are recorded (native_coverage.py). Inputs come from mutating a working
corpus: the seeds (``fuzz/seeds/<target>/``, real compiles written by
make_corpus.py), the kept corpus (``fuzz/corpus/<target>/``, inputs that reached edges the
seeds do not), and every input that reached a new *feature* (an edge, or an edge taken a
new number of times) or a new outcome (the stage that answered, the exception type, the
native status and the message with numbers taken out; the Python stages have no edges).
``--feedback outcomes`` keeps inputs by outcome only, ``--feedback none`` keeps none (a
blind run): runs to compare with.
With a fixed ``--seed`` the sequence of inputs is always the same; ``--seconds`` bounds the
time of the mutated inputs (the seeds and the corpus always run), ``--runs`` their number.

The summary (a JSON line at the end) gives the edges and the lines (gcov) reached in each
instrumented file. ``--measure`` runs the starting inputs once, unmutated, and reports the
same; ``--merge`` ends a run by minimising the kept corpus: the run's inputs and the old
corpus, smallest first, each kept only if it reaches an edge that the seeds and the inputs
kept before it do not.

Findings are written to ``--findings`` (an input and its traceback per new signature).
Exit status: 0 when every input was accepted or typed-rejected, 3 when there were
findings, ``instrumented.EXIT_STATUS`` when a sanitizer stopped the process (``--asan``).

Inputs that trigger a known, reported library bug are skipped and counted as
``suppressed`` (each target names its suppressions), so that a long run finds new bugs;
``--no-suppress`` turns that off, ``--replay FILE...`` runs given inputs once each
without suppression.

Importing this module first matters: it puts the instrumented native module in place
before spyre_rt loads (and under ``--asan`` starts the program again with the sanitizer
runtime first).
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

import instrumented
import numpy as np

instrumented.reexec_if_asked(sys.argv)
NATIVE_MODULE, BUILD_DIR, SANITIZERS = instrumented.load()

from native_coverage import Coverage  # noqa: E402

HERE = Path(__file__).resolve().parent
SEEDS = HERE / "seeds"
CORPUS = HERE / "corpus"
MAX_CORPUS = 2048
MAX_SAVED_PER_FINDING = 3
DIGEST_INPUTS = 200  # the summary's digest covers this many mutated inputs

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
    p.add_argument("--seconds", type=float, default=60.0,
                   help="time budget of the mutated inputs, after the seeds and the corpus (default 60)")
    p.add_argument("--runs", type=int, default=0, help="stop after this many mutated inputs (0: no limit)")
    p.add_argument("--seed", type=int, default=1, help="seed of the mutation sequence (default 1)")
    p.add_argument("--seeds", type=Path, default=None, help="seed directory (default fuzz/seeds/<target>)")
    p.add_argument("--corpus", type=Path, default=None, help="kept corpus (default fuzz/corpus/<target>)")
    p.add_argument("--no-corpus", action="store_true", help="start from the seeds alone")
    p.add_argument("--feedback", choices=("edges", "outcomes", "none"), default="edges",
                   help="keep inputs that reach new edges or outcomes (default), new outcomes only, or none")
    p.add_argument("--measure", action="store_true",
                   help="run the seeds and the corpus once, unmutated, and report what they reach")
    p.add_argument("--merge", type=Path, nargs="?", const=True, default=None, metavar="DIR",
                   help="end by writing the minimised corpus (the old one and the run's inputs) to DIR "
                        "(default: the --corpus directory)")
    p.add_argument("--edges-out", type=Path, default=None, metavar="FILE",
                   help="write every edge reached (offsets into the module, and its file) to FILE, as JSON")
    p.add_argument("--annotate", type=Path, default=None, metavar="DIR",
                   help="write gcov's annotated sources (lines reached and not) to DIR")
    p.add_argument("--findings", type=Path, default=HERE / "findings", help="where inputs with findings go")
    p.add_argument("--crash-file", type=Path, default=None,
                   help="holds the input being tried (default <findings>/<target>.current)")
    p.add_argument("--quiet", action="store_true", help="only the summary line")
    p.add_argument("--asan", action="store_true", help="run the native code under AddressSanitizer and UBSan")
    p.add_argument("--no-suppress", action="store_true", help="also run inputs that trigger known bugs")
    p.add_argument("--replay", type=Path, nargs="+", default=None, metavar="FILE",
                   help="run these inputs once each (no mutation, no suppression) and report")
    return p.parse_args()


def read_inputs(directory: Path, required: bool = False) -> list[bytes]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")) \
        if directory.is_dir() else []
    if required and not files:
        raise SystemExit(f"no seed inputs in {directory}; run fuzz/make_corpus.py (plan files: make_corpus.py plan_reader)")
    return [p.read_bytes() for p in files]


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


class Attempt:
    """Runs inputs through a target, each written to the crash file first and its edges
    recorded: (outcome signature, the error when it is a finding, new features, new edges)."""

    def __init__(self, target: Callable[[bytes], object], crash_path: Path, cov: Coverage):
        self.target, self.crash_path, self.cov = target, crash_path, cov
        self.fd = os.open(crash_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)

    def __call__(self, data: bytes) -> tuple[str, BaseException | None, int, int]:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        edges = self.cov.edges()
        self.cov.begin()
        try:
            self.target(data)
            sig, error = signature("target", None), None
        except Stage as s:
            sig, error = signature(s.stage, s.error), (None if _typed(s.error) else s.error)
        except Exception as e:  # noqa: BLE001 - a failure of the target outside any stage
            sig, error = signature("target", e), e
        return sig, error, self.cov.end(), self.cov.edges() - edges

    def close(self) -> None:
        os.close(self.fd)
        self.crash_path.unlink(missing_ok=True)  # another run of the target may share it
        self.cov.close()


def run(name: str, target: Callable[[bytes], object], mutate: Callable, args: argparse.Namespace,
        known_bug: Callable[[bytes], str | None] = lambda data: None) -> int:
    """Fuzz `target` with inputs from `mutate(rng, parent, corpus)`; prints a JSON summary.
    Inputs for which `known_bug` names a reported bug are skipped (unless --no-suppress)."""
    if args.replay:
        return replay(name, target, args.replay)
    faulthandler.enable()
    seeds = read_inputs(args.seeds or SEEDS / name, required=True)
    corpus_dir = args.corpus or CORPUS / name
    kept = [] if args.no_corpus else [d for d in read_inputs(corpus_dir) if d not in set(seeds)]
    args.findings.mkdir(parents=True, exist_ok=True)
    cov = Coverage(NATIVE_MODULE.ffi, NATIVE_MODULE.lib, BUILD_DIR)
    attempt = Attempt(target, args.crash_file or args.findings / f"{name}.current", cov)
    rng = random.Random(args.seed)
    corpus = seeds + kept    # the working corpus: the parents of mutations
    discoveries = []         # the mutated inputs that reached an edge first
    seen: Counter = Counter()
    findings: Counter = Counter()
    accepted = rejected = seeds_accepted = mutated = 0
    suppressed: Counter = Counter()
    start = time.monotonic()
    deadline = float("inf")  # set when the starting inputs are done
    summary = {"target": name, "seed": args.seed, "feedback": args.feedback, "seeds": len(seeds),
               "corpus_in": len(kept)}
    trail = hashlib.sha256()  # the mutated inputs, their outcomes and new features, in order
    cov.reset_lines()
    n = 0
    queue = list(corpus)  # the starting inputs first, unmutated: the seeds must all be accepted
    while True:
        from_seeds = n < len(seeds)
        if not queue and "start" not in summary:  # what the seeds and the kept corpus reach
            summary["start"] = {"edges": cov.edges(), "edges_by_file": cov.edges_by_file(), "lines": cov.lines(),
                                "seconds": round(time.monotonic() - start, 2)}
            deadline = time.monotonic() + args.seconds  # the time budget is the mutations'
        starting = bool(queue)
        if starting:
            data = queue.pop(0)
        else:
            if args.measure or (args.runs and mutated >= args.runs) or time.monotonic() >= deadline:
                break
            parent = rng.choice(corpus if rng.random() < 0.8 else seeds)
            data = mutate(rng, parent, corpus)
            mutated += 1
        n += 1
        bug = None if args.no_suppress else known_bug(data)
        if bug:
            suppressed[bug] += 1
            sig, error, features, edges = f"suppressed: {bug}", None, 0, 0
        else:
            sig, error, features, edges = attempt(data)
        if not starting and mutated <= DIGEST_INPUTS:
            trail.update(hashlib.sha256(data).digest() + f"{sig}|{features}|{edges}".encode())
            if mutated == DIGEST_INPUTS:
                summary["digest"] = {"inputs": mutated, "sha256": trail.hexdigest()}
        if bug:
            continue
        if error is not None:
            _finding(args.findings, name, sig, data, error, findings)
        elif sig.endswith(": ok"):
            accepted += 1
            seeds_accepted += from_seeds
        else:
            rejected += 1
        if edges and not starting:
            discoveries.append(data)
        novel = sig not in seen or (features > 0 and args.feedback == "edges")
        if novel and args.feedback != "none" and not starting:
            if len(corpus) < MAX_CORPUS:
                corpus.append(data)
            else:
                corpus[rng.randrange(len(seeds), MAX_CORPUS)] = data
        seen[sig] += 1
        if not args.quiet and n % 5000 == 0:
            print(f"{name}: {n} inputs, {cov.edges()} edges, {len(seen)} outcomes, {sum(findings.values())} "
                  f"findings, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    summary.update({
        "seconds": round(time.monotonic() - start, 2), "inputs": n, "mutated": mutated, "seeds_accepted": seeds_accepted,
        "accepted": accepted, "rejected": rejected, "suppressed": dict(suppressed), "findings": dict(findings),
        "outcomes": len(seen), "working_corpus": len(corpus), "discoveries": len(discoveries), "edges": cov.edges(),
        "edges_by_file": cov.edges_by_file(), "lines": cov.lines(args.annotate), "sanitizers": SANITIZERS or "none",
    })
    if args.edges_out:
        args.edges_out.write_text(json.dumps({"module": str(BUILD_DIR), "edges": cov.edge_list()}))
    if args.merge:
        into = corpus_dir if args.merge is True else args.merge
        summary["merged"] = merge(attempt, seeds, kept + discoveries, into, args, known_bug)
    attempt.close()
    if not args.quiet:
        for sig, count in seen.most_common():
            print(f"{count:8d}  {sig}", file=sys.stderr)
    print(json.dumps(summary), flush=True)
    return 3 if findings else 0


def merge(attempt: Attempt, seeds: list[bytes], candidates: list[bytes], directory: Path,
          args: argparse.Namespace, known_bug: Callable[[bytes], str | None]) -> dict:
    """Write to `directory` the candidates, smallest first, that reach an edge the seeds and
    the candidates kept before them do not (measured again from nothing). Inputs with
    findings or known bugs are left out. Returns the number kept and the edges reached."""
    attempt.cov.clear()
    for data in seeds:
        attempt(data)
    kept = []
    for data in sorted(set(candidates) - set(seeds), key=lambda d: (len(d), hashlib.sha256(d).digest())):
        if not args.no_suppress and known_bug(data):
            continue
        _sig, error, _features, edges = attempt(data)
        if error is None and edges:
            kept.append(data)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.bin"):
        old.unlink()
    for data in kept:
        (directory / f"{hashlib.sha256(data).hexdigest()[:16]}.bin").write_bytes(data)
    return {"inputs": len(kept), "bytes": sum(map(len, kept)), "edges": attempt.cov.edges(),
            "edges_by_file": attempt.cov.edges_by_file()}


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
