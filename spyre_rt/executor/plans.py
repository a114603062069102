"""The graph plans of an executable: loaded from the plan cache, or built and cached.

A plan file holds one plan block per device segment, keyed by everything that changes
their commands (:func:`cache_key`). A file that does not fit this executable (another
count of segments or bindings, jobs it does not name, extents beyond the memory a call
binds, bindings of other stick layouts) is rejected and rebuilt.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .. import __version__, kernel_info, plan_cache
from ..errors import SpyreError
from ..native import lib
from ..plan import GraphPlan, PlanJob, binding_layouts, layout_table, set_job_names
from ..plan import encode as encode_plan
from ..version import runtime_version
from .stats import stats


def cache_key(exe) -> str:
    """Everything that changes the commands of an executable's plans (the compiler's
    identity is among the step's options)."""
    geometry = [(tuple(exe.layouts[n]), exe.offsets[n]) for n in exe.binding_names[1:]]
    # The memory plan too: CPU ops and restores address the arena through this process's
    # offsets, which must be the ones the plan's jobs were built with.
    memory = [exe.arena_bytes, sorted(exe.relocs.items())]
    return plan_cache.digest("spyre_rt plans", __version__, runtime_version(), torch.__version__,
                             int(lib.SPY_JOB_VERSION), int(lib.SPY_PLAN_VERSION), exe.card.profile.digest,
                             exe.step.digest, geometry, memory, exe.desc.options)


def load_or_build(exe) -> list[GraphPlan]:
    """The plan of every device segment, in order: from the plan cache, or built (and
    written to it)."""
    cache = plan_cache.default()
    key = exe.cache_key()
    segments = exe.device_segments()
    entry = cache.load(key) if cache else None
    if entry is not None:
        try:
            plans = _from_entry(exe, entry, segments)
            stats["plans_loaded"] += len(plans)
            return plans
        except (SpyreError, ValueError) as e:
            cache.reject(key, str(e))
    blocks = [build_block(exe, seg) for seg in segments]
    plans = [GraphPlan(exe.card, block) for block in blocks]
    stats["plans_built"] += len(plans)
    if cache:
        names = [list(seg.kernels) for seg in segments]
        header = {"kernels": sum(len(n) for n in names), "names": names,
                  "step": exe.step.family[0][:16], "sizes": exe.step.family[1],
                  "profile": exe.card.profile.name, "options": exe.desc.options,
                  "arena_bytes": exe.arena_bytes, "created": time.time(),
                  "kernel_info": {exe.job_name(k): info for n in names for k in n
                                  if (info := kernel_info.lookup(exe.job_name(k))) is not None}}
        cache.store(key, header, blocks)
    return plans


def _from_entry(exe, entry, segments) -> list[GraphPlan]:
    if len(entry.blocks) != len(segments):
        raise SpyreError(f"{len(entry.blocks)} plans for {len(segments)} segments")
    names = entry.header.get("names")
    if (not isinstance(names, list) or len(names) != len(entry.blocks)
            or not all(isinstance(n, list) and all(isinstance(x, str) for x in n) for n in names)):
        raise SpyreError("the plan file does not name its jobs")
    for block, segment_names in zip(entry.blocks, names, strict=True):
        set_job_names(block, [exe.job_name(n) for n in segment_names], exe.card.intern)
    plans = [GraphPlan(exe.card, block) for block in entry.blocks]
    if any(p.nbindings != len(exe.binding_names) for p in plans):
        raise SpyreError("plans bind a different number of buffers")
    _check_extents(exe, plans)
    want = layout_table(binding_layouts_of(exe))
    if any(not np.array_equal(binding_layouts(p.block), want) for p in plans):
        raise SpyreError("plans bind storages of other stick layouts than this step's")
    infos = entry.header.get("kernel_info")
    if isinstance(infos, dict):  # a warm start builds nothing: what the kernels compute comes from the file
        for job, info in infos.items():
            if isinstance(job, str) and isinstance(info, dict) and kernel_info.lookup(job) is None:
                kernel_info.register(job, info)
    return plans


def _check_extents(exe, plans: list[GraphPlan]) -> None:
    """Every binding of every plan fits the memory a call binds there: the arena, each
    input's and constant's storage, each fresh output. The card accepts a plan whose
    extents exceed them (it checks them against the allocations at each launch), so a
    cached plan that needs more would have every launch refused."""
    limits = [exe.arena_bytes] + [exe.layouts[n].nbytes for n in exe.binding_names[1:]]
    for plan in plans:
        for b, limit in enumerate(limits):
            need = plan.extent(b)
            if need > limit:
                raise SpyreError(f"a plan needs {need} bytes of {exe.binding_names[b]} (binding {b}); "
                                 f"a call binds {limit}")


def build_block(exe, segment):
    """The plan block of one device segment, built from its kernels' descriptions."""
    jobs = []
    for name in segment.kernels:
        blob, bufs = exe.build(name)
        jobs.append(PlanJob(blob, tuple(exe.relocs[b] for b in bufs), exe.job_name(name)))
    return encode_plan(jobs, binding_layouts_of(exe), exe.card.intern)


def binding_layouts_of(exe) -> list:
    """The stick layout a call binds at each binding: none for the arena (binding 0, which
    records none), the storage's for every input, constant and output."""
    return [None] + [exe.layouts[n] for n in exe.binding_names[1:]]
