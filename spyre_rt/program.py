"""Program blocks: the device's command format, built with numpy.

The dtypes below mirror the C structures of ``native/spyre.h`` byte for byte (a test
checks every offset against the compiled module). Construction code fills whole arrays of
commands at once; :class:`ProgramBuilder` concatenates blocks of commands, each with its
own dependency list, and encodes the program block the card validates and runs.
:func:`program_tables` and :func:`plan_tables` are the one reader of both block layouts
(program blocks, and the plan blocks of ``plan.py``) that everything else uses.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .native import check, ffi, lib

# ---- opcodes, dtypes, flags (values from spyre.h) ----
OP_BARRIER = lib.SPY_OP_BARRIER
OP_H2D = lib.SPY_OP_H2D
OP_D2H = lib.SPY_OP_D2H
OP_LOAD = lib.SPY_OP_LOAD
OP_STORE = lib.SPY_OP_STORE
OP_MATMUL = lib.SPY_OP_MATMUL
OP_SFU = lib.SPY_OP_SFU
OP_RING = lib.SPY_OP_RING
OP_GATHER = lib.SPY_OP_GATHER
OP_SCATTER = lib.SPY_OP_SCATTER
CORE_CARD = lib.SPY_CORE_CARD
SLOT_DRAM = lib.SPY_SLOT_DRAM
SLOT_HOST = lib.SPY_SLOT_HOST
DMA_DESCS = lib.SPY_DMA_DESCS
MM_ACCUMULATE = lib.SPY_MM_ACCUMULATE
MM_TRANS_A = lib.SPY_MM_TRANS_A
MM_TRANS_B = lib.SPY_MM_TRANS_B

OP_NAMES = {
    OP_BARRIER: "barrier", OP_H2D: "h2d", OP_D2H: "d2h", OP_LOAD: "load", OP_STORE: "store",
    OP_MATMUL: "matmul", OP_SFU: "sfu", OP_RING: "ring", OP_GATHER: "gather", OP_SCATTER: "scatter",
}

_HDR = [("op", "u1"), ("flags", "u1"), ("core", "u2"), ("dep_begin", "u4"), ("ndeps", "u4"), ("reserved", "u4")]
_PAD = [("pad", "u1", (16,))]

CMD_DMA = np.dtype(_HDR + [
    ("src_slot", "u4"), ("dst_slot", "u4"), ("src_off", "u8"), ("dst_off", "u8"),
    ("run_bytes", "u4"), ("ndims", "u4"), ("count", "u4", (3,)), ("desc_count", "u4"),
    ("src_stride", "u8", (3,)), ("dst_stride", "u8", (3,)),
] + _PAD)
CMD_MM = np.dtype(_HDR + [
    ("a_off", "u4"), ("b_off", "u4"), ("c_off", "u4"), ("m", "u4"), ("n", "u4"), ("k", "u4"),
    ("lda", "u4"), ("ldb", "u4"), ("ldc", "u4"), ("a_dtype", "u4"), ("b_dtype", "u4"),
    ("mm_reserved", "u4", (13,)),
] + _PAD)
CMD_SFU = np.dtype(_HDR + [("instr_begin", "u4"), ("ninstrs", "u4"), ("sfu_reserved", "u4", (22,))] + _PAD)
CMD_RING = np.dtype(_HDR + [
    ("dst_core", "u4"), ("ring_src", "u4"), ("ring_dst", "u4"), ("bytes", "u4"), ("ring_reserved", "u4", (20,)),
] + _PAD)
CMD_GATHER = np.dtype(_HDR + [
    ("table_slot", "u4"), ("idx_off", "u4"), ("idx_dtype", "u4"), ("nidx", "u4"),
    ("table_off", "u8"), ("row_stride", "u8"), ("limit", "u8"), ("lx_off", "u4"), ("lx_pitch", "u4"),
    ("run_bytes", "u4"), ("ndims", "u4"), ("count", "u4", (2,)), ("stride", "u8", (2,)),
    ("g_reserved", "u4", (4,)),
] + _PAD)
CMD = CMD_DMA  # the storage dtype of a command array; view it as another variant to fill it

OPERAND = np.dtype([("kind", "u1"), ("dtype", "u1"), ("reserved", "u2"), ("pitch", "u4"), ("v", "u8")])
INSTR = np.dtype([
    ("op", "u1"), ("aux", "u1"), ("flags", "u2"), ("reserved", "u4"), ("rows", "u4"), ("cols", "u4"),
    ("dst", OPERAND), ("src", OPERAND, (3,)),
])
SLOT = np.dtype([("kind", "u4"), ("reserved", "u4"), ("extent", "u8")])
DESC = np.dtype([("src_off", "u8"), ("dst_off", "u8"), ("bytes", "u4"), ("reserved", "u4")])
JOB_HEADER = np.dtype([
    ("magic", "u4"), ("version", "u4"), ("ncmds", "u4"), ("ndeps", "u4"), ("ninstrs", "u4"),
    ("nslots", "u4"), ("ndescs", "u4"), ("flags", "u4"), ("total_bytes", "u8"), ("reserved", "u8", (3,)),
])
PLAN_HEADER = np.dtype([
    ("magic", "u4"), ("version", "u4"), ("njobs", "u4"), ("nrelocs", "u4"), ("nbindings", "u4"),
    ("ngroups", "u4"), ("total_bytes", "u8"), ("reserved", "u8", (4,)),
])
PLAN_JOB = np.dtype([("prog_off", "u8"), ("prog_len", "u8"), ("reloc_begin", "u4"), ("nslots", "u4"),
                     ("name", "u4"), ("kind", "u4")])
COLLECTIVE = np.dtype([
    ("kind", "u4"), ("dtype", "u4"), ("op", "u4"), ("nranks", "u4"), ("root", "u4"), ("group", "u4"),
    ("in_bytes", "u8"), ("out_bytes", "u8"), ("chunk_bytes", "u8"), ("tag", "u8"), ("duration_ns", "f8"),
])
RELOC = np.dtype([("binding", "u4"), ("reserved", "u4"), ("offset", "u8")])
LAYOUT = np.dtype([("rows", "u8"), ("row_len", "u8"), ("itemsize", "u4"), ("stick_bytes", "u4")])
# a loop kernel's decision record (spy_loop_record): its stage instructions and its tiles
LOOP_INSTR = np.dtype([("instr", INSTR), ("tile_rows", "u4"), ("reserved", "u4")])
LOOP_TILE = np.dtype([("core", "u4"), ("size", "u4"), ("start", "i8"), ("fixed", "i8", (lib.SPY_LOOP_MAX_VARS,))])
LOOP_MERGE = np.dtype([("box", LOOP_TILE), ("lx_off", "u4"), ("reserved", "u4")])

OPND_NONE, OPND_TILE, OPND_ROW, OPND_COL, OPND_SCALAR, OPND_IMM = 0, 1, 2, 3, 4, 5
OPND_FIXED = lib.SPY_OPND_FIXED  # an operand's flag in a matmul record's program (see spyre.h)


def empty_cmds(n: int, op: int, core: int | np.ndarray = 0, variant: np.dtype = CMD_DMA) -> np.ndarray:
    """n zeroed commands of one opcode, viewed as `variant`."""
    a = np.zeros(n, dtype=CMD_DMA).view(variant)
    a["op"] = op
    a["core"] = core
    return a


class ProgramBuilder:
    """Accumulates slots and blocks of commands; encodes one program block.

    A block is an array of commands plus the flat list of their dependencies:
    ``cmds['dep_begin']`` indexes into that list and dependencies name commands of the
    same block by their index in it. Appending offsets both to the whole program.
    """

    __slots__ = ("slots", "_cmds", "_deps", "_instrs", "_descs", "ncmds", "ndeps", "ninstrs", "ndescs")

    def __init__(self) -> None:
        self.slots: list[tuple[int, int]] = []
        self._cmds: list[np.ndarray] = []
        self._deps: list[np.ndarray] = []
        self._instrs: list[np.ndarray] = []
        self._descs: list[np.ndarray] = []
        self.ncmds = self.ndeps = self.ninstrs = self.ndescs = 0

    def slot(self, kind: int, extent: int) -> int:
        self.slots.append((kind, int(extent)))
        return len(self.slots) - 1

    def add_instrs(self, instrs: np.ndarray) -> int:
        """Append SFU instructions; returns the index of the first."""
        first = self.ninstrs
        self._instrs.append(instrs)
        self.ninstrs += len(instrs)
        return first

    def add_descs(self, descs: np.ndarray) -> int:
        first = self.ndescs
        self._descs.append(descs)
        self.ndescs += len(descs)
        return first

    def add(self, cmds: np.ndarray, deps: np.ndarray | None = None) -> int:
        """Append a block; returns the program index of its first command."""
        first = self.ncmds
        cmds = cmds.view(CMD_DMA)
        if deps is not None and len(deps):
            cmds["dep_begin"] += self.ndeps
            self._deps.append(np.asarray(deps, dtype=np.uint32) + np.uint32(first))
            self.ndeps += len(deps)
        else:
            cmds["dep_begin"] = self.ndeps
            cmds["ndeps"] = 0
        self._cmds.append(cmds)
        self.ncmds += len(cmds)
        return first

    def commands(self) -> np.ndarray:
        """Every command appended so far, in program order."""
        return np.concatenate(self._cmds) if self._cmds else np.zeros(0, dtype=CMD_DMA)

    def descriptors(self) -> np.ndarray:
        return np.concatenate(self._descs) if self._descs else np.zeros(0, dtype=DESC)

    def encode(self) -> np.ndarray:
        """The program block, as an 8-byte aligned uint8 array."""
        slots = np.array([(kind, 0, extent) for kind, extent in self.slots], dtype=SLOT)
        deps_pad = (-self.ndeps * 4) % 8
        total = (JOB_HEADER.itemsize + slots.nbytes + self.ncmds * CMD_DMA.itemsize + self.ndeps * 4 + deps_pad
                 + self.ninstrs * INSTR.itemsize + self.ndescs * DESC.itemsize)
        hdr = np.array([(lib.SPY_JOB_MAGIC, lib.SPY_JOB_VERSION, self.ncmds, self.ndeps, self.ninstrs,
                         len(self.slots), self.ndescs, 0, total, 0)], dtype=JOB_HEADER)
        parts = [hdr, slots, *self._cmds, *self._deps, np.zeros(deps_pad, dtype=np.uint8), *self._instrs,
                 *self._descs]
        buf = np.empty((total + 7) // 8, dtype=np.uint64).view(np.uint8)[:total]  # the 8-byte alignment
        np.concatenate([np.ascontiguousarray(a).view(np.uint8).reshape(-1) for a in parts], out=buf)
        return buf


# ---- reading blocks: where their tables are ----

class ProgramLayout(NamedTuple):
    """Where the tables of a program block are, as its header says: byte offsets into the
    buffer read, and counts. Nothing is checked: a hostile header's tables may run past the
    buffer (``end``, where they stop, tells)."""
    at: int
    slots: int
    nslots: int
    cmds: int
    ncmds: int
    deps: int
    ndeps: int
    instrs: int
    ninstrs: int
    descs: int
    ndescs: int
    end: int


def program_layout(buf: np.ndarray, at: int = 0) -> ProgramLayout:
    """The layout of the program block at byte `at` of `buf` (its header must be inside)."""
    h = buf[at: at + JOB_HEADER.itemsize].view(JOB_HEADER)[0]
    nslots, ncmds, ndeps, ninstrs, ndescs = (int(h[f]) for f in ("nslots", "ncmds", "ndeps", "ninstrs", "ndescs"))
    slots = at + JOB_HEADER.itemsize
    cmds = slots + nslots * SLOT.itemsize
    deps = cmds + ncmds * CMD.itemsize
    instrs = deps + (ndeps * 4 + 7) // 8 * 8  # the dependency table is padded to 8 bytes
    descs = instrs + ninstrs * INSTR.itemsize
    return ProgramLayout(at, slots, nslots, cmds, ncmds, deps, ndeps, instrs, ninstrs, descs, ndescs,
                         descs + ndescs * DESC.itemsize)


class ProgramTables(NamedTuple):
    """Views of a program block's header (one record) and tables; writes go to the block."""
    header: np.ndarray
    slots: np.ndarray
    cmds: np.ndarray    # as CMD_DMA: view a command as another variant to read its fields
    deps: np.ndarray    # uint32
    instrs: np.ndarray
    descs: np.ndarray


def program_tables(buf: np.ndarray, at: int = 0) -> ProgramTables:
    """The tables of the program block at byte `at` of `buf`."""
    lay = program_layout(buf, at)
    if lay.end > buf.size:
        raise ValueError(f"the program block at {at} has tables up to byte {lay.end}, past {buf.size}")
    return ProgramTables(buf[at: lay.slots].view(JOB_HEADER), buf[lay.slots: lay.cmds].view(SLOT),
                         buf[lay.cmds: lay.deps].view(CMD), buf[lay.deps: lay.deps + 4 * lay.ndeps].view(np.uint32),
                         buf[lay.instrs: lay.descs].view(INSTR), buf[lay.descs: lay.end].view(DESC))


def block_sections(blob: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(commands, descriptors) of an encoded program block, as views into it."""
    t = program_tables(blob)
    return t.cmds, t.descs


class PlanLayout(NamedTuple):
    """Where the tables of a plan block are, as its header says (byte offsets and counts;
    nothing checked, as for ProgramLayout). The programs are where the job table says."""
    jobs: int
    njobs: int
    relocs: int
    nrelocs: int
    layouts: int
    nbindings: int
    end: int


def plan_layout(buf: np.ndarray) -> PlanLayout:
    """The layout of a plan block (its header must be inside `buf`)."""
    h = buf[: PLAN_HEADER.itemsize].view(PLAN_HEADER)[0]
    njobs, nrelocs, nbindings = int(h["njobs"]), int(h["nrelocs"]), int(h["nbindings"])
    jobs = PLAN_HEADER.itemsize
    relocs = jobs + njobs * PLAN_JOB.itemsize
    layouts = relocs + nrelocs * RELOC.itemsize
    return PlanLayout(jobs, njobs, relocs, nrelocs, layouts, nbindings, layouts + nbindings * LAYOUT.itemsize)


class PlanTables(NamedTuple):
    """Views of a plan block's header (one record), job table, relocations and binding layouts."""
    header: np.ndarray
    jobs: np.ndarray
    relocs: np.ndarray
    layouts: np.ndarray


def plan_tables(buf: np.ndarray) -> PlanTables:
    lay = plan_layout(buf)
    if lay.end > buf.size:
        raise ValueError(f"the plan block has tables up to byte {lay.end}, past {buf.size}")
    return PlanTables(buf[: lay.jobs].view(PLAN_HEADER), buf[lay.jobs: lay.relocs].view(PLAN_JOB),
                      buf[lay.relocs: lay.layouts].view(RELOC), buf[lay.layouts: lay.end].view(LAYOUT))


def job_program(buf: np.ndarray, j: int) -> ProgramTables:
    """The tables of plan job j's program."""
    return program_tables(buf, int(plan_tables(buf).jobs["prog_off"][j]))


def built_block(build, record, context: str) -> np.ndarray:
    """The program block a native builder makes of a decision record (``build(record,
    spy_built *)``), as an 8-byte aligned uint8 array over the builder's memory (not a
    copy: it is freed with the array). A record the builder refuses raises its typed
    error, naming the field."""
    out = ffi.new("spy_built *")
    check(build(record, out), context)
    data = ffi.gc(out.data, _free_built, size=int(out.bytes))
    return np.frombuffer(ffi.buffer(data, int(out.bytes)), dtype=np.uint8)


def _free_built(data, free=lib.spy_built_free, new=ffi.new) -> None:
    free(new("spy_built *", {"data": data}))  # bound now: this may run as the interpreter exits


def make_operand(kind: int, dtype: int = 0, off: int = 0, pitch: int = 0) -> tuple:
    return (kind, dtype, 0, pitch, off)


def imm_f(value: float, dtype: int) -> tuple:
    return (OPND_IMM, dtype, 0, 0, int(np.float64(value).view(np.uint64)))


def imm_i(value: int, dtype: int) -> tuple:
    return (OPND_IMM, dtype, 0, 0, int(np.int64(value).view(np.uint64)))


NO_OPERAND = (OPND_NONE, 0, 0, 0, 0)
