"""Fuzz target: the plan-file reader (``spyre_rt.plan_cache.decode``) and graph plan
creation on a card (``spyre_rt.plan.GraphPlan``, the card's ``spy_plan_create``).

Every input is a plan cache file. Most are mutations of real files *resealed* with a
valid checksum (as a hostile writer would), so that they reach the block table, the JSON
header and the card's plan validation; the rest are raw damage (bit flips, truncation,
splices) that the checksum must catch. ``decode`` must accept or raise
``SpyrePlanCacheError``; every block of an accepted file must be created as a plan or
rejected with a typed error (a plan job with a host slot is one: plans bind device memory
only); a plan the card accepts is launched with every binding it uses bound to device
memory of its declared extent and stick layout (what a caller must provide).

    python fuzz/fuzz_plan_reader.py --seconds 600 [--seed N] [--runs N] [--asan]
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402, F401, I001 - first: under --asan it swaps in the sanitized native module

import numpy as np  # noqa: E402
from blocks import mutate_plan  # noqa: E402
from harness import aligned, arguments, mutate_bytes, mutate_record, run, stage  # noqa: E402

from spyre_rt import device_profile, jobs, plan_cache  # noqa: E402
from spyre_rt.card import Card  # noqa: E402
from spyre_rt.layout import StickLayout  # noqa: E402
from spyre_rt.plan import GraphPlan  # noqa: E402
from spyre_rt.program import plan_tables, program_tables  # noqa: E402

PREFIX = np.dtype([("magic", "u8"), ("format", "u4"), ("nhead", "u4"), ("npay", "u8")])
MAX_BLOCKS = 16           # blocks of one file given to the card
WORK_LIMITS = {"macs": 4 << 20, "sfu_elems": 4 << 20, "dma_bytes": 32 << 20}
MAX_BINDING_BYTES = 64 << 20

card = Card(device_profile.load("spyre"), "functional", 0)


# ---- the target ----------------------------------------------------------------------------

def target(data: bytes) -> None:
    entry = stage("decode", plan_cache.decode, data)          # as `spyre-profile cache inspect` reads
    stage("decode for its key", plan_cache.decode, data, entry.key)  # as the plan cache loads
    for block in entry.blocks[:MAX_BLOCKS]:
        plan = stage("plan", GraphPlan, card, block)
        bindings = binding_kinds(block, plan)
        if bindings is not None:
            launch(plan, bindings)


def binding_kinds(block: np.ndarray, plan: GraphPlan) -> list[tuple[int, int, StickLayout | None]] | None:
    """(kind, extent, layout) per binding of an accepted plan, or None when it is too big
    to run."""
    kinds = {}
    work = dict.fromkeys(WORK_LIMITS, 0)
    tables = plan_tables(block)
    for job in tables.jobs:
        off, length = int(job["prog_off"]), int(job["prog_len"])
        info = jobs.validate(card, block[off: off + length])
        for k in work:
            work[k] += info[k]
        first = int(job["reloc_begin"])
        for k, slot in enumerate(program_tables(block, off).slots):
            kinds[int(tables.relocs["binding"][first + k])] = int(slot["kind"])
    layouts = [StickLayout(*(int(x) for x in row)) if row["itemsize"] else None for row in tables.layouts]
    extents = [max(plan.extent(b), layouts[b].nbytes if layouts[b] else 0) for b in range(plan.nbindings)]
    if any(work[k] > v for k, v in WORK_LIMITS.items()) or sum(extents) > MAX_BINDING_BYTES:
        return None
    return [(kinds.get(b, -1), extents[b], layouts[b]) for b in range(plan.nbindings)]


def launch(plan: GraphPlan, bindings: list[tuple[int, int, StickLayout | None]]) -> None:
    addrs, device = [], []
    try:
        for kind, extent, layout in bindings:
            if kind < 0:
                addrs.append(0)  # a binding no job uses
            else:
                device.append(stage("bind", lambda n, x: card.malloc(n, layout=x), max(extent, 1), layout))
                addrs.append(device[-1])
        stage("launch", plan.launch, addrs)
    finally:
        for addr in device:
            card.free(addr)


# ---- mutations -----------------------------------------------------------------------------

def seal(head: bytes, payload: bytes) -> bytes:
    """A file with a valid checksum around any header and payload."""
    head += b" " * (-len(head) % 8)
    check = hashlib.sha256(head + payload).digest()
    return plan_cache._PREFIX.pack(plan_cache.MAGIC, plan_cache.FORMAT, len(head), len(payload), check) + head + payload


def split(data: bytes) -> tuple[dict, bytes] | None:
    try:
        entry = plan_cache.decode(data)
    except Exception:  # noqa: BLE001 - not a file to mutate structurally
        return None
    nhead = plan_cache._PREFIX.unpack_from(data)[2]
    return entry, data[plan_cache._PREFIX.size + nhead:]


WEIRD = [None, True, -1, 0, 2 ** 70, 1.5, "", "x" * 300, [], {}, [1, 2], {"a": 1}, "\u0000", "\ud7ff"]


def mutate_header(rng, header: dict) -> bytes:
    h = dict(header)
    r = rng.random()
    keys = sorted(h) or ["key"]
    if r < 0.25:
        h.pop(rng.choice(keys), None)
    elif r < 0.45:
        h[rng.choice(keys + ["blocks", "key", "names"])] = rng.choice(WEIRD)
    elif r < 0.65 and isinstance(h.get("blocks"), list):
        blocks = list(h["blocks"])
        choice = rng.random()
        if choice < 0.3 and blocks:
            blocks[rng.randrange(len(blocks))] = rng.choice([-8, -1, 0, 1, 7, 9, 2 ** 31, 2 ** 64, 2 ** 100, True, 1.0, "8"])
        elif choice < 0.5:
            blocks.append(rng.choice([0, 8, 64]))
        elif choice < 0.7 and blocks:
            blocks.pop(rng.randrange(len(blocks)))
        else:
            blocks = blocks * rng.choice([2, 100, 10000])
        h["blocks"] = blocks
    elif r < 0.75:
        depth = rng.choice([10, 100, 900, 5000, 50000])
        value = rng.choice(keys)
        h[value] = json.loads("[" * depth + "1" + "]" * depth) if depth < 900 else None
        if depth >= 900:  # deeper than the json module builds: write the text
            text = json.dumps(h).replace("null", "[" * depth + "1" + "]" * depth, 1)
            return text.encode()
    elif r < 0.85:
        return json.dumps(rng.choice([[h], "header", 7, None, [1, 2, 3]])).encode()
    else:
        text = json.dumps(h).encode()
        i = rng.randrange(len(text) + 1)
        return text[:i] + rng.choice([b"\xff", b"\xc3", b"{", b"]", b'"', b"\\", b"\x00", b"NaN", b"1e999"]) + text[i:]
    return json.dumps(h, sort_keys=True).encode()


def mutate(rng, parent: bytes, corpus: list[bytes]) -> bytes:
    parts = split(parent)
    r = rng.random()
    if parts is None or r < 0.12:  # raw damage: the checksum or the prefix must catch it
        return mutate_bytes(rng, parent, corpus)
    entry, payload = parts
    if r < 0.20:  # prefix fields (the checksum covers header and payload only)
        buf = aligned(parent)
        if buf.size >= PREFIX.itemsize:
            mutate_record(rng, buf, 0, PREFIX)
        return buf.tobytes()
    if r < 0.35:
        return seal(mutate_header(rng, entry.header), payload)
    header = {k: v for k, v in entry.header.items() if k not in ("key", "blocks")}
    blocks = [b.copy() for b in entry.blocks]
    if not blocks:
        blocks = [aligned(b"")]
    r = rng.random()
    i = rng.randrange(len(blocks))
    if r < 0.8:
        for _ in range(1 + int(rng.random() < 0.3) + int(rng.random() < 0.1)):
            mutate_plan(rng, blocks[i])
    elif r < 0.9:
        blocks[i] = aligned(mutate_bytes(rng, blocks[i].tobytes(), []))
    elif r < 0.95:
        blocks.insert(rng.randrange(len(blocks) + 1), blocks[rng.randrange(len(blocks))].copy())
    else:
        blocks.pop(i)
    return plan_cache.encode(entry.key if isinstance(entry.key, str) else "k", header, blocks)


if __name__ == "__main__":
    sys.exit(run("plan_reader", target, mutate, arguments(__doc__.splitlines()[0])))
