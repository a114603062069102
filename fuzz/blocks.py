"""Field-aware mutations of program blocks and plan blocks, using the numpy dtypes that
mirror native/spyre.h and the block reader of spyre_rt.program."""

from __future__ import annotations

import random

import numpy as np
from harness import mutate_record, mutate_value

from spyre_rt.program import (
    CMD_DMA,
    CMD_GATHER,
    CMD_MM,
    CMD_RING,
    CMD_SFU,
    DESC,
    INSTR,
    JOB_HEADER,
    LAYOUT,
    OP_GATHER,
    OP_MATMUL,
    OP_RING,
    OP_SCATTER,
    OP_SFU,
    PLAN_HEADER,
    PLAN_JOB,
    RELOC,
    SLOT,
    PlanLayout,
    ProgramLayout,
    plan_layout,
    plan_tables,
    program_layout,
    program_tables,
)

CMD_VARIANT = {OP_MATMUL: CMD_MM, OP_SFU: CMD_SFU, OP_RING: CMD_RING, OP_GATHER: CMD_GATHER, OP_SCATTER: CMD_GATHER}
VARIANTS = (CMD_DMA, CMD_MM, CMD_SFU, CMD_RING, CMD_GATHER)


def program_sections(buf: np.ndarray, off: int = 0, length: int | None = None) -> ProgramLayout | None:
    """The layout of the program block at `off`, or None when its header does not describe
    a block that fits in `length` bytes (default: the rest of `buf`)."""
    end = buf.size if length is None else off + length
    if off < 0 or off + JOB_HEADER.itemsize > end:
        return None
    lay = program_layout(buf, off)
    return lay if lay.end <= end else None


def mutate_program(rng: random.Random, buf: np.ndarray, off: int = 0, length: int | None = None) -> str:
    """Change one field of the program block at `off` (in place); what was changed."""
    sec = program_sections(buf, off, length)
    if sec is None:
        return mutate_record(rng, buf, off, JOB_HEADER) if off + JOB_HEADER.itemsize <= buf.size else "nothing"
    tables = {"ncmds": (sec.cmds, sec.ncmds), "nslots": (sec.slots, sec.nslots), "ndeps": (sec.deps, sec.ndeps),
              "ninstrs": (sec.instrs, sec.ninstrs), "ndescs": (sec.descs, sec.ndescs)}
    choices = [("header", 1)]
    for name, weight in (("ncmds", 8), ("nslots", 2), ("ndeps", 2), ("ninstrs", 4), ("ndescs", 2)):
        if tables[name][1]:
            choices.append((name, weight))
    what = rng.choices([c for c, _ in choices], [w for _, w in choices])[0]
    if what == "header":
        return "job header " + mutate_record(rng, buf, off, JOB_HEADER)
    pos, count = tables[what]
    i = rng.randrange(count)
    if what == "ndeps":
        dep = buf[pos + 4 * i: pos + 4 * i + 4].view(np.uint32)
        dep[0] = mutate_value(rng, int(dep[0]), 32) if rng.random() < 0.5 else rng.randrange(sec.ncmds + 2)
        return "dependency"
    if what == "nslots":
        return "slot " + mutate_record(rng, buf, pos + i * SLOT.itemsize, SLOT)
    if what == "ninstrs":
        return "instruction " + mutate_record(rng, buf, pos + i * INSTR.itemsize, INSTR)
    if what == "ndescs":
        return "descriptor " + mutate_record(rng, buf, pos + i * DESC.itemsize, DESC)
    at = pos + i * CMD_DMA.itemsize
    r = rng.random()
    if r < 0.1 and count > 1:  # one command over another
        j = rng.randrange(count)
        buf[at: at + CMD_DMA.itemsize] = buf[pos + j * CMD_DMA.itemsize: pos + (j + 1) * CMD_DMA.itemsize].copy()
        return "command copied"
    op = int(buf[at])
    variant = CMD_VARIANT.get(op, CMD_DMA) if r < 0.85 else rng.choice(VARIANTS)
    return "command " + mutate_record(rng, buf, at, variant)


def plan_sections(buf: np.ndarray) -> tuple[PlanLayout, list[tuple[int, int]]] | None:
    """The layout of a plan block and (offset, length) of each job's program, or None when
    its tables do not fit in the block."""
    if buf.size < PLAN_HEADER.itemsize:
        return None
    lay = plan_layout(buf)
    if lay.end > buf.size:
        return None
    table = plan_tables(buf).jobs
    return lay, [(int(j["prog_off"]), int(j["prog_len"])) for j in table]


def mutate_plan(rng: random.Random, buf: np.ndarray) -> str:
    """Change one field of a plan block (its header, job table, relocations or one of its
    programs), in place; what was changed."""
    sec = plan_sections(buf)
    if sec is None:
        return "plan header " + mutate_record(rng, buf, 0, PLAN_HEADER) if buf.size >= PLAN_HEADER.itemsize else "nothing"
    lay, programs = sec
    r = rng.random()
    if r < 0.12:
        return "plan header " + mutate_record(rng, buf, 0, PLAN_HEADER)
    pos, njobs = lay.jobs, lay.njobs
    if r < 0.30 and njobs:
        j = rng.randrange(njobs)
        if rng.random() < 0.15 and njobs > 1:  # two jobs swap their entries
            k = rng.randrange(njobs)
            a, b = pos + j * PLAN_JOB.itemsize, pos + k * PLAN_JOB.itemsize
            buf[a: a + PLAN_JOB.itemsize], buf[b: b + PLAN_JOB.itemsize] = (
                buf[b: b + PLAN_JOB.itemsize].copy(), buf[a: a + PLAN_JOB.itemsize].copy())
            return "plan jobs swapped"
        return "plan job " + mutate_record(rng, buf, pos + j * PLAN_JOB.itemsize, PLAN_JOB)
    rpos, nrelocs = lay.relocs, lay.nrelocs
    if r < 0.45 and nrelocs:
        return "relocation " + mutate_record(rng, buf, rpos + rng.randrange(nrelocs) * RELOC.itemsize, RELOC)
    lpos, nbindings = lay.layouts, lay.nbindings
    if r < 0.52 and nbindings:
        return "binding layout " + mutate_record(rng, buf, lpos + rng.randrange(nbindings) * LAYOUT.itemsize, LAYOUT)
    inside = [(o, n) for o, n in programs if 0 <= o and o + n <= buf.size]
    if inside:
        o, n = rng.choice(inside)
        return "program " + mutate_program(rng, buf, o, n)
    return "plan header " + mutate_record(rng, buf, 0, PLAN_HEADER)


def slot_table(buf: np.ndarray, off: int = 0) -> np.ndarray:
    """The slots of a program block that the card accepted."""
    return program_tables(buf, off).slots
