"""Graph plans: a whole compiled step, prebuilt, resident on the card, run with one call.

A plan block holds every job's program and a relocation table: each slot of each job is
``binding + offset``, where the bindings are the few addresses a step call provides (the
arena of intermediates, the inputs, the outputs), and the stick layout each binding's
storage must have (the programs address it through that layout). The card validates the
block and every program once when the plan is created; a launch checks each binding's
extent and layout against the card's own allocation records, patches the table and runs
the jobs back to back.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import torch_ranges
from .card import Card
from .layout import StickLayout
from .native import check, ffi, lib
from .program import LAYOUT, PLAN_HEADER, PLAN_JOB, plan_layout, plan_tables

PROGRAM = lib.SPY_PLAN_JOB_PROGRAM
COLLECTIVE = lib.SPY_PLAN_JOB_COLLECTIVE


class PlanJob(NamedTuple):
    blob: np.ndarray                    # an encoded program block, or a collective (spy_collective)
    relocs: tuple[tuple[int, int], ...]  # per slot: (binding, byte offset)
    name: str
    kind: int = PROGRAM


def encode(jobs: list[PlanJob], layouts: list[StickLayout | None], names, ngroups: int = 0) -> np.ndarray:
    """The plan block of `jobs` over one binding per entry of `layouts`: the stick layout
    a launch must bind there, or None for memory that records none (an arena). `names`
    is a function from job name to trace id; `ngroups` the process groups its collective
    jobs run in. Jobs whose blob is one array (a plan build's distinct kernels, see
    :mod:`spyre_rt.executor.distinct`) name one copy of it, which the card uploads once."""
    hdr = np.zeros(1, dtype=PLAN_HEADER)
    hdr["magic"], hdr["version"] = lib.SPY_PLAN_MAGIC, lib.SPY_PLAN_VERSION
    hdr["njobs"], hdr["nrelocs"], hdr["nbindings"] = len(jobs), sum(len(j.relocs) for j in jobs), len(layouts)
    hdr["ngroups"] = ngroups
    offsets, pos = [], (plan_layout(hdr.view(np.uint8)).end + 7) & ~7  # the programs follow the tables
    placed: dict[int, int] = {}  # id of a program blob -> where it is: jobs of one program share it
    first: list[bool] = []       # whether the job's blob is written at its offset (the first to name it)
    for j in jobs:
        at = placed.get(id(j.blob)) if j.kind == PROGRAM else None
        first.append(at is None)
        if at is None:
            at = pos
            pos += (j.blob.size + 7) & ~7
            if j.kind == PROGRAM:
                placed[id(j.blob)] = at
        offsets.append(at)
    hdr["total_bytes"] = pos
    buf = np.zeros(pos // 8, dtype=np.uint64).view(np.uint8)
    buf[: PLAN_HEADER.itemsize] = hdr.view(np.uint8)
    tables = plan_tables(buf)
    r = 0
    for i, j in enumerate(jobs):
        tables.jobs[i] = (offsets[i], j.blob.size, r, len(j.relocs), names(j.name), j.kind)
        for b, off in j.relocs:
            tables.relocs[r] = (b, 0, off)
            r += 1
        if first[i]:
            buf[offsets[i]: offsets[i] + j.blob.size] = j.blob
    tables.layouts[:] = layout_table(layouts)
    return buf


def layout_table(layouts: list[StickLayout | None]) -> np.ndarray:
    """The binding layout table of a plan block (a zero row: a binding not checked)."""
    table = np.zeros(len(layouts), dtype=LAYOUT)
    for b, layout in enumerate(layouts):
        if layout is not None:
            table[b] = (layout.rows, layout.row_len, layout.itemsize, layout.stick_bytes)
    return table


def binding_layouts(block: np.ndarray) -> np.ndarray:
    """The binding layout table of a plan block the card accepted."""
    return plan_tables(block).layouts


def program_offsets(block: np.ndarray) -> list[int]:
    """Where each job's program starts in a plan block (a plan file stores each distinct
    program once: see :mod:`spyre_rt.plan_cache`)."""
    return [int(x) for x in plan_tables(block).jobs["prog_off"]]


def job_count(block: np.ndarray) -> int:
    """Number of jobs of a plan block (its header's count)."""
    return int(block[: PLAN_HEADER.itemsize].view(PLAN_HEADER)["njobs"][0])


def set_job_names(block: np.ndarray, names: list[str], intern) -> None:
    """Write this process's trace ids of the jobs' names into a plan block (ids are
    per process, so a block loaded from disk carries stale ones)."""
    njobs = job_count(block)
    if len(names) != njobs:
        raise ValueError(f"{len(names)} names for {njobs} jobs")
    lay = plan_layout(block)  # the block is not checked yet: only its job table must be inside
    block[lay.jobs: lay.relocs].view(PLAN_JOB)["name"] = [intern(n) for n in names]


class GraphPlan:
    """A plan created on a card from a plan block. `groups` are the rings its collective
    jobs run in (objects with a ``handle``, kept alive as long as the plan), by group index."""

    def __init__(self, card: Card, block: np.ndarray, name: str = "step", groups=()):
        self.card = card
        self.block = block
        out = ffi.new("spy_plan **")
        check(lib.spy_plan_create(card.handle, ffi.from_buffer(block), block.size, out), "creating a graph plan")
        self.handle = ffi.gc(out[0], lib.spy_plan_destroy)
        self.groups = tuple(groups)
        for i, ring in enumerate(self.groups):
            check(lib.spy_plan_set_group(self.handle, i, ring.handle), f"attaching process group {i} to a graph plan")
        self.nbindings = plan_layout(block).nbindings
        self.njobs = int(lib.spy_plan_num_jobs(self.handle))
        self.name = card.intern(name)
        self._end = ffi.new("double *")

    def extent(self, binding: int) -> int:
        out = ffi.new("uint64_t *")
        check(lib.spy_plan_binding_extent(self.handle, binding, out))
        return int(out[0])

    def launch(self, bindings) -> float:
        """Run the whole step: one native call. `bindings` is a list of addresses or a
        ``uint64_t[]`` table the caller keeps (no copy then)."""
        if torch_ranges.active():
            with torch_ranges.launch_range(self.card, self.name):
                return self._launch(bindings)
        return self._launch(bindings)

    def _launch(self, bindings) -> float:
        if not isinstance(bindings, ffi.CData):
            bindings = ffi.new("uint64_t[]", bindings)
        check(lib.spy_plan_launch(self.handle, bindings, self.nbindings, self.name, self._end), "running a graph plan")
        return self._end[0]
