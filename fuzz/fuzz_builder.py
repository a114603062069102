"""Fuzz target: the native builder (``spy_build_copy``, ``spy_build_transfer``,
``spy_build_graph``, ``spy_build_matmul``, ``spy_build_loop``, ``spy_build_attention``).

Every input is a decision record as the Python layer hands it over: ``b"C"`` and a
``spy_copy_record`` (its scalar fields, then up to 16 slot extents and 16 ranges, as in
``copy_record_bytes``), ``b"T"`` and a ``spy_transfer_record``, ``b"G"`` and a
``spy_graph_record`` (counts, keys, dependency pairs and commands, as in
``graph_record_bytes``), ``b"M"`` and a ``spy_matmul_record`` with its arrays (as in
``matmul_record_bytes``), ``b"L"`` and a ``spy_loop_record`` (its fields up to its arrays,
then each array at most its ``LOOP_ARRAYS`` bound, then, for merged stores, their count and
arrays, as in ``loop_record_bytes``), or
``b"A"`` and a ``spy_attention_record`` (the struct up to its paged fields, its pointers
ignored, then up to 256 tasks and 16 slot extents, then the paged fields, as in
``attention_record_bytes``), or ``b"S"`` and the matmul
tiling search's arguments (a ``spy_mm_cost``, a ``spy_mm_problem`` and up to 8
``spy_mm_tiling``: ``spy_mm_choose``, then ``spy_mm_estimate`` of its choice and of those,
which must succeed or refuse with a typed error). The builder must refuse it
with a typed error or build a block. Every copy kernel or transfer graph it builds must
pass the card's validator (``spy_job_validate`` for a copy kernel with commands,
``spy_transfer_create`` for a transfer graph): the builder never makes what the card would
refuse. A graph's commands and a loop kernel's SFU instructions are the caller's, and an
attention's task table decides which of its commands wait for which (a corrupt sharing
group can make a cycle), so the validator may refuse those blocks, with a typed error. A
matmul's program (its SFU opcodes, dtypes, element alignment) is the caller's too, but its
tiles and views are the builder's to check: for a record within the card's figures, the
validator never finds a range outside the scratchpad or outside a slot.

    python fuzz/fuzz_builder.py --seconds 600 [--seed N] [--runs N] [--asan]
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402, F401, I001 - first: under --asan it swaps in the sanitized native module

from harness import arguments, mutate_bytes, mutate_value, run, stage  # noqa: E402

from spyre_rt import device_profile, jobs  # noqa: E402
from spyre_rt.card import Card  # noqa: E402
from spyre_rt.errors import SpyreInvalidCommandError  # noqa: E402
from spyre_rt.native import check, ffi, lib  # noqa: E402
from spyre_rt.program import JOB_HEADER, built_block  # noqa: E402

COPY_HEAD = struct.Struct("<IIQQII")  # num_cores, stick_bytes, chunk_max, scratchpad_bytes, nslots, nranges
RANGE = struct.Struct("<IIQQQ")
MAX_ITEMS = 16
MAX_ELEMS = 1 << 20  # a bigger transfer that the builder accepts is real work, not a finding: skipped
MAX_TASKS = 256
MAX_BLOCKS = 4096  # an attention of more blocks (or a scratchpad past MAX_LX) is real work: skipped
MAX_LX = 8 << 20
TASK_BYTES = 96

card = Card(device_profile.load("spyre"), "functional", 0)


def copy_record_bytes(num_cores, stick_bytes, chunk_max, scratchpad, extents, ranges) -> bytes:
    out = COPY_HEAD.pack(num_cores, stick_bytes, chunk_max, scratchpad, len(extents), len(ranges))
    out += b"".join(struct.pack("<Q", e) for e in extents)
    return out + b"".join(RANGE.pack(*r) for r in ranges)


def graph_record_bytes(keys, pairs, cmds: bytes) -> bytes:
    out = struct.pack("<II", len(keys), len(pairs)) + struct.pack(f"<{len(keys)}q", *keys)
    out += struct.pack(f"<{2 * len(pairs)}q", *[v for p in pairs for v in p])
    return out + cmds


def graph_record(data: bytes):
    ncmds, npairs = struct.unpack_from("<II", data.ljust(8, b"\0"))
    ncmds, npairs = min(ncmds, 4 * MAX_ITEMS), min(npairs, 8 * MAX_ITEMS)
    body = data[8:].ljust(8 * ncmds + 16 * npairs + 128 * ncmds, b"\0")
    keys = ffi.new("int64_t[]", list(struct.unpack_from(f"<{ncmds}q", body)) or [0])
    flat = struct.unpack_from(f"<{2 * npairs}q", body, 8 * ncmds)
    after, before = ffi.new("int64_t[]", list(flat[0::2]) or [0]), ffi.new("int64_t[]", list(flat[1::2]) or [0])
    cmds = ffi.new("spy_cmd[]", max(1, ncmds))
    at = 8 * ncmds + 16 * npairs
    ffi.memmove(cmds, body[at: at + 128 * ncmds], 128 * ncmds)
    rec = ffi.new("spy_graph_record *", {"ncmds": ncmds, "npairs": npairs, "cmds": cmds, "keys": keys,
                                         "after": after, "before": before})
    return rec, (keys, after, before, cmds)


# The record's paged fields come after its tasks and extents in an input, so that inputs of
# a dense attention (written before the record had them) read as they did.
ATTENTION_DENSE = ffi.offsetof("spy_attention_record", "page")


def attention_record_bytes(rec, tasks: bytes, extents) -> bytes:
    """An attention record as bytes: the struct up to its paged fields (its pointers zero),
    its tasks and slot extents, then the paged fields."""
    plain = ffi.new("spy_attention_record *", rec[0])
    plain.tasks = plain.slot_extent = ffi.NULL
    raw = bytes(ffi.buffer(plain))
    return raw[:ATTENTION_DENSE] + tasks + b"".join(struct.pack("<Q", e) for e in extents) + raw[ATTENTION_DENSE:]


def attention_record(data: bytes):
    size = ffi.sizeof("spy_attention_record")
    rec = ffi.new("spy_attention_record *")
    head = data[:ATTENTION_DENSE]
    ffi.memmove(rec, head, len(head))
    ntasks, nslots = min(rec.ntasks, MAX_TASKS), min(rec.nslots, MAX_ITEMS)
    body = data[ATTENTION_DENSE:].ljust(TASK_BYTES * ntasks + 8 * nslots, b"\0")
    tasks = ffi.new("spy_attention_task[]", max(1, ntasks))
    ffi.memmove(tasks, body[: TASK_BYTES * ntasks], TASK_BYTES * ntasks)
    at = TASK_BYTES * ntasks
    extents = ffi.new("uint64_t[]", [struct.unpack_from("<Q", body, at + 8 * i)[0] for i in range(nslots)] or [0])
    paged = body[at + 8 * nslots: at + 8 * nslots + size - ATTENTION_DENSE]
    ffi.memmove(ffi.cast("char *", rec) + ATTENTION_DENSE, paged, len(paged))
    rec.ntasks, rec.nslots, rec.tasks, rec.slot_extent = ntasks, nslots, tasks, extents
    return rec, (tasks, extents)


def heavy_attention(rec) -> bool:
    """An attention the builder may accept that is real work: many blocks, or tiles as
    large as a scratchpad past MAX_LX."""
    if rec.scratchpad_bytes > MAX_LX:
        return True
    blocks = 0
    for i in range(rec.ntasks):
        t = rec.tasks[i]
        if rec.kv_block and t.kv1 > t.kv0:
            blocks += -(-(t.kv1 - t.kv0) // rec.kv_block)
    return blocks > MAX_BLOCKS


def copy_record(data: bytes):
    data = data.ljust(COPY_HEAD.size, b"\0")
    cores, stick, chunk, lx, nslots, nranges = COPY_HEAD.unpack_from(data)
    nslots, nranges = min(nslots, MAX_ITEMS), min(nranges, MAX_ITEMS)
    body = data[COPY_HEAD.size:].ljust(8 * nslots + RANGE.size * nranges, b"\0")
    extents = ffi.new("uint64_t[]", [struct.unpack_from("<Q", body, 8 * i)[0] for i in range(nslots)] or [0])
    ranges = ffi.new("spy_copy_range[]", max(1, nranges))
    for i in range(nranges):
        ffi.memmove(ranges + i, body[8 * nslots + RANGE.size * i:][:RANGE.size], RANGE.size)
    rec = ffi.new("spy_copy_record *", {"num_cores": cores, "stick_bytes": stick, "chunk_max": chunk,
                                        "scratchpad_bytes": lx, "nslots": nslots, "nranges": nranges,
                                        "slot_extent": extents, "ranges": ranges})
    return rec, (extents, ranges)  # the arrays live as long as the record is used


# a matmul record's arrays, in this order after the record itself (its pointers ignored),
# each at most this long; counted by a field, or by a product of two (the last one capped)
MM_ARRAYS = (("m_size", "m_tiles", "uint32_t", 256), ("n_size", "n_tiles", "uint32_t", 256),
             ("k_slice", "pk", "uint64_t", 64), ("slots", "nslots", "spy_layout", 16),
             ("loads", "nloads", "spy_mm_tiles", 16), ("stores", "nstores", "spy_mm_tiles", 16),
             ("program", "ninstrs", "spy_mm_instr", 32), ("pro_vectors", "npro_vectors", "spy_mm_vector", 4),
             ("pro_program", ("nbuf", "npro_instrs"), "spy_instr", 64), ("parts", "nparts", "spy_mm_part", 8))


def _count(rec, count) -> int:
    if isinstance(count, str):
        return getattr(rec, count)
    return getattr(rec, count[0]) * getattr(rec, count[1])


def _cap(rec, count, most: int) -> int:
    """The array's length, at most `most`, its counting field lowered to match."""
    if isinstance(count, str):
        n = min(getattr(rec, count), most)
        setattr(rec, count, n)
        return n
    per, field = getattr(rec, count[0]), count[1]
    if per * getattr(rec, field) > most:
        setattr(rec, field, most // per if per else 0)
    return per * getattr(rec, field)
MAX_MM_USES = 1 << 14  # a bigger matmul that the builder accepts is real work, not a finding: skipped


def matmul_record_bytes(rec) -> bytes:
    """A ``spy_matmul_record`` (cdata, its pointers zero) and its arrays as one input body."""
    plain = ffi.new("spy_matmul_record *", rec[0])
    for field, *_ in MM_ARRAYS:
        setattr(plain, field, ffi.NULL)
    out = bytes(ffi.buffer(plain))
    for field, count, ctype, _ in MM_ARRAYS:
        n = _count(rec, count)
        if n:
            out += bytes(ffi.buffer(getattr(rec, field), ffi.sizeof(ctype) * n))
    return out


def matmul_record(data: bytes):
    rec = ffi.new("spy_matmul_record *")
    size = ffi.sizeof("spy_matmul_record")
    ffi.memmove(rec, data.ljust(size, b"\0"), size)
    at, keep = size, []
    for field, count, ctype, most in MM_ARRAYS:
        n = _cap(rec, count, most)
        arr = ffi.new(f"{ctype}[]", max(n, 1))
        nbytes = ffi.sizeof(ctype) * n
        ffi.memmove(arr, data[at: at + nbytes].ljust(nbytes, b"\0"), nbytes)
        at += nbytes
        setattr(rec, field, arr)
        keep.append(arr)
    return rec, keep


LOOP_HEAD = ffi.offsetof("spy_loop_record", "slot_extent")  # the fields before the arrays
# (array field, its C type, the field that counts it, the most a fuzzed record has)
LOOP_ARRAYS = (("slot_extent", "uint64_t", "nslots", 16), ("accesses", "spy_loop_access", "naccesses", 16),
               ("tiles", "spy_loop_tile", "ntiles", 64), ("stages", "spy_loop_stage", "levels", 8),
               ("instrs", "spy_loop_instr", "ninstrs", 64), ("consts", "spy_loop_const", "nconsts", 16))
LOOP_MAX_WORK = 1 << 24  # tiles x accesses x scratchpad bytes bound the boxes' elements: more is skipped


# merged stores (nmerges > 0): a trailer of nmerges, its groups, each tile's group and each
# access's place in a group's region, counted by nmerges, ntiles and naccesses
LOOP_MERGES = (("merges", "spy_loop_merge", "nmerges"), ("tile_merge", "int32_t", "ntiles"),
               ("merge_off", "uint32_t", "naccesses"))
LOOP_MOST_MERGES = 16


def loop_record_bytes(rec) -> bytes:
    out = bytes(ffi.buffer(rec, LOOP_HEAD))
    for name, ctype, count, _ in LOOP_ARRAYS:
        out += bytes(ffi.buffer(getattr(rec, name), ffi.sizeof(ctype) * getattr(rec, count)))
    if rec.nmerges:
        out += struct.pack("<I", rec.nmerges)
        for name, ctype, count in LOOP_MERGES:
            out += bytes(ffi.buffer(getattr(rec, name), ffi.sizeof(ctype) * getattr(rec, count)))
    return out


def loop_record(data: bytes):
    rec = ffi.new("spy_loop_record *")
    head = data[:LOOP_HEAD]
    ffi.memmove(rec, head, len(head))
    keep: list = []
    at = _arrays(rec, data, LOOP_HEAD, LOOP_ARRAYS, keep)
    if len(data) >= at + 4:  # the merged groups' trailer
        rec.nmerges = min(struct.unpack_from("<I", data, at)[0], LOOP_MOST_MERGES)
        _arrays(rec, data, at + 4, [(name, ctype, count, None) for name, ctype, count in LOOP_MERGES], keep)
    return rec, keep


def _arrays(rec, data: bytes, at: int, arrays, keep: list) -> int:
    """Each of `arrays` (field, C type, counting field, most or None) read from `data` at
    `at` into a new array of rec's (its count cut to the most); where the arrays end."""
    for name, ctype, count, most in arrays:
        n = getattr(rec, count) if most is None else min(getattr(rec, count), most)
        setattr(rec, count, n)
        arr = ffi.new(f"{ctype}[]", max(1, n))
        chunk = data[at: at + ffi.sizeof(ctype) * n]
        ffi.memmove(arr, chunk, len(chunk))
        at += ffi.sizeof(ctype) * n
        setattr(rec, name, arr)
        keep.append(arr)
    return at


def heavy_matmul(rec) -> bool:
    """A matmul the builder would accept with more than MAX_MM_USES matmuls, or tiles bigger
    than 8 MiB scratchpads hold (descriptor lists walk their elements)."""
    if not rec.pm or not rec.pn or not rec.tk:
        return False
    chunks = sum(-(-rec.k_slice[i] // rec.tk) for i in range(rec.pk))
    uses = rec.batch * (rec.m_tiles // rec.pm) * (rec.n_tiles // rec.pn) * rec.pm * rec.pn * chunks
    return uses > MAX_MM_USES or rec.scratchpad_bytes > 8 << 20


def validate_matmul(rec, blob) -> None:
    try:
        jobs.validate(card, blob)
    except SpyreInvalidCommandError as e:
        p = card.profile
        within = rec.num_cores <= p.num_cores and rec.scratchpad_bytes <= p.scratchpad_bytes and \
            rec.stick_bytes == p.stick_bytes
        if within and e.status in ("SPY_E_SCRATCHPAD", "SPY_E_BAD_ADDRESS"):
            raise AssertionError(f"the matmul builder made a program the card refuses: {e}") from e
        raise


def transfer_record(data: bytes):
    rec = ffi.new("spy_transfer_record *")
    raw = data[: ffi.sizeof(rec[0])]
    ffi.memmove(rec, raw, len(raw))
    return rec


def heavy(rec) -> bool:
    """A transfer the builder would accept with more than MAX_ELEMS elements."""
    n = 1
    for i in range(min(rec.ndims, lib.SPY_TRANSFER_MAX_DIMS)):
        n *= rec.sizes[i]
    return MAX_ELEMS < n < 1 << 64


def _build_job(build, rec, what: str, validate=None) -> None:
    """Build `rec` with `build`, then validate the job it made (the card runs no empty
    program: a record without work builds a job of no commands, not validated)."""
    blob = stage("build", built_block, build, rec, what)
    if blob[:JOB_HEADER.itemsize].view(JOB_HEADER)["ncmds"][0]:
        if validate is None:
            stage("validate", jobs.validate, card, blob)
        else:
            stage("validate", validate, rec, blob)


TILING_MAX_CORES = 256  # a search over more cores is real work (thousands of grids each), not a finding


def tiling_search(body: bytes) -> None:
    cost, problem = ffi.new("spy_mm_cost *"), ffi.new("spy_mm_problem *")
    sizes = (ffi.sizeof("spy_mm_cost"), ffi.sizeof("spy_mm_problem"), ffi.sizeof("spy_mm_tiling"))
    body = body.ljust(sizes[0] + sizes[1], b"\0")
    ffi.memmove(cost, body[:sizes[0]], sizes[0])
    ffi.memmove(problem, body[sizes[0]:sizes[0] + sizes[1]], sizes[1])
    rest = body[sizes[0] + sizes[1]:]
    n = min(8, len(rest) // sizes[2])
    tilings = ffi.new("spy_mm_tiling[]", n + 1)
    ffi.memmove(tilings + 1, rest[:n * sizes[2]], n * sizes[2])
    if cost.num_cores > TILING_MAX_CORES:
        return
    stage("build", check, lib.spy_mm_choose(cost, problem, tilings), "matmul tiling")
    terms = ffi.new("spy_mm_terms[]", n + 1)
    stage("validate", check, lib.spy_mm_estimate(cost, problem, tilings, n + 1, terms), "matmul tiling estimate")


def target(data: bytes) -> None:
    kind, body = data[:1], data[1:]
    if kind == b"S":
        tiling_search(body)
    elif kind == b"C":
        rec, _keep = copy_record(body)
        _build_job(lib.spy_build_copy, rec, "copy record")
    elif kind == b"G":
        rec, _keep = graph_record(body)
        _build_job(lib.spy_build_graph, rec, "graph record")
    elif kind == b"M":
        rec, _keep = matmul_record(body)
        if not heavy_matmul(rec):
            _build_job(lib.spy_build_matmul, rec, "matmul record", validate_matmul)
    elif kind == b"L":
        rec, _keep = loop_record(body)
        if rec.ntiles * max(1, rec.naccesses) * rec.lx_bytes <= LOOP_MAX_WORK:  # above: real work, not a finding
            _build_job(lib.spy_build_loop, rec, "loop record")
    elif kind == b"A":
        rec, _keep = attention_record(body)
        if not heavy_attention(rec):
            _build_job(lib.spy_build_attention, rec, "attention record")
    elif kind == b"T":
        rec = transfer_record(body)
        if heavy(rec):
            return
        blob = stage("build", built_block, lib.spy_build_transfer, rec, "transfer record")
        out = ffi.new("spy_transfer **")
        stage("validate", check, lib.spy_transfer_create(card.handle, ffi.from_buffer(blob), blob.size, out),
              "transfer graph")
        lib.spy_transfer_destroy(out[0])


def mutate(rng, parent: bytes, corpus: list[bytes]) -> bytes:
    """Mostly one field of the record at a time (a word or quad word at an aligned
    offset), sometimes raw bytes."""
    if len(parent) > 9 and rng.random() < 0.7:
        b = bytearray(parent)
        size = rng.choice([4, 8])
        i = 1 + rng.randrange(max(1, (len(b) - 1) // size)) * size
        old = int.from_bytes(b[i:i + size].ljust(size, b"\0"), "little")
        b[i:i + size] = mutate_value(rng, old, 8 * size).to_bytes(size, "little")[: max(0, len(b) - i)]
        return bytes(b)
    return mutate_bytes(rng, parent, corpus)


if __name__ == "__main__":
    sys.exit(run("builder", target, mutate, arguments(__doc__.splitlines()[0])))
