"""The graph plans of an executable: loaded from the plan cache, or built and cached.

A plan file holds one plan block per device segment, keyed by everything that changes
their commands (:func:`cache_key`), and names the kernels construction refused (which run
on the host, and so cut the step into other segments). A file that does not fit this
executable (another count of segments or bindings, jobs it does not name, refused kernels
that are not the step's, extents beyond the memory a call binds, bindings of other stick
layouts) is rejected and rebuilt.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np
import torch

from .. import job_facts, plan_cache
from ..errors import SpyreError
from ..native import lib
from ..plan import (
    COLLECTIVE,
    PROGRAM,
    GraphPlan,
    PlanJob,
    binding_layouts,
    layout_table,
    program_offsets,
    set_job_names,
)
from ..plan import encode as encode_plan
from ..version import __version__, runtime_version
from .bindings import Bindings
from .collectives import Collectives
from .host_kernels import HostKernels
from .segments import DeviceSegment
from .stats import stats


class Planned(Protocol):
    """What loading and building plans needs of the executable they are for
    (:class:`.executable.Executable`): where its buffers are, its kernels and how they are
    named, built and cut into segments, and where a plan file's refused kernels go."""

    card: Any                  # the card the plans are for (spyre_rt.card.Card)
    step: Any                  # the compiled step: its settings (the plan cache) and family
    desc: Any                  # the step's description: its options
    bindings: Bindings
    kernels: dict              # name -> the kernel's description
    host: HostKernels
    collectives: Collectives

    @property
    def prepared(self) -> bool: ...

    def cache_key(self) -> str: ...

    def job_name(self, kernel: str) -> str: ...

    def build(self, kernel_name: str) -> tuple[np.ndarray, list[str]]: ...

    def construct_all(self, fallback: bool = True, distinct: bool = False) -> dict: ...

    def card_kernels(self) -> list[str]: ...

    def device_segments(self) -> list[DeviceSegment]: ...

    def cut_for(self, on_host) -> list: ...

    def run_on_host(self, refused: dict[str, str]) -> None: ...


def cache_key(bindings: Bindings, profile_digest: str, step_digest: str, options: dict) -> str:
    """Everything that changes the commands of a step's plans on a card (the compiler's
    identity is among the step's options)."""
    geometry = [(tuple(bindings.layouts[n]), bindings.offsets[n]) for n in bindings.names[1:]]
    # The memory plan too: CPU ops and restores address the arena through this process's
    # offsets, which must be the ones the plan's jobs were built with.
    memory = [bindings.arena_bytes, sorted(bindings.relocs.items())]
    return plan_cache.digest("spyre_rt plans", __version__, runtime_version(), torch.__version__,
                             int(lib.SPY_JOB_VERSION), int(lib.SPY_PLAN_VERSION), profile_digest,
                             step_digest, geometry, memory, options)


def load_or_build(exe: Planned, fallback: bool = True) -> list[GraphPlan]:
    """The plan of every device segment, in order: from the plan cache, or built (and
    written to it). Building constructs every kernel first: what construction refuses runs
    on the host (with `fallback` false, a SpyreRefusedError names it)."""
    cache = plan_cache.of(exe.step.settings)
    key = exe.cache_key()
    entry = cache.load(key) if cache else None
    if entry is not None:
        try:
            plans, host = _from_entry(exe, entry)
            if host:
                exe.run_on_host(host)
            stats["plans_loaded"] += len(plans)
            return plans
        except (SpyreError, ValueError) as e:
            cache.reject(key, str(e))
    built = exe.construct_all(fallback, distinct=True)
    segments = exe.device_segments()
    blocks = [build_block(exe, seg, built) for seg in segments]
    rings = exe.collectives.rings()
    plans = [GraphPlan(exe.card, block, groups=rings) for block in blocks]
    stats["plans_built"] += len(plans)
    if cache:
        names = [list(seg.kernels) for seg in segments]
        header = {"kernels": sum(len(n) for n in names), "names": names, "host_kernels": dict(exe.host.reasons),
                  "step": exe.step.family[0][:16], "sizes": exe.step.family[1],
                  "profile": exe.card.profile.name, "options": exe.desc.options,
                  "arena_bytes": exe.bindings.arena_bytes, "created": time.time(),
                  "kernel_info": {exe.job_name(k): info for n in names for k in n
                                  if (info := job_facts.lookup(exe.job_name(k))) is not None}}
        cache.store(key, header, blocks, [program_offsets(b) for b in blocks])
    return plans


def _from_entry(exe: Planned, entry) -> tuple[list[GraphPlan], dict[str, str]]:
    """The plans of a cache entry, and the kernels it runs on the host (name -> reason)."""
    host = _host_kernels(exe, entry.header.get("host_kernels", {}))
    segments = [s for s in exe.cut_for(host) if isinstance(s, DeviceSegment)]
    if len(entry.blocks) != len(segments):
        raise SpyreError(f"{len(entry.blocks)} plans for {len(segments)} segments")
    names = entry.header.get("names")
    if (not isinstance(names, list) or len(names) != len(entry.blocks)
            or not all(isinstance(n, list) and all(isinstance(x, str) for x in n) for n in names)):
        raise SpyreError("the plan file does not name its jobs")
    if names != [list(seg.kernels) for seg in segments]:
        raise SpyreError("the plan file names other jobs than this step's segments run")
    for block, segment_names in zip(entry.blocks, names, strict=True):
        set_job_names(block, [exe.job_name(n) for n in segment_names], exe.card.intern)
    rings = exe.collectives.rings()
    plans = [GraphPlan(exe.card, block, groups=rings) for block in entry.blocks]
    if any(p.nbindings != len(exe.bindings.names) for p in plans):
        raise SpyreError("plans bind a different number of buffers")
    _check_extents(exe.bindings, plans)
    want = layout_table(exe.bindings.stick_layouts())
    if any(not np.array_equal(binding_layouts(p.block), want) for p in plans):
        raise SpyreError("plans bind storages of other stick layouts than this step's")
    infos = entry.header.get("kernel_info")
    if isinstance(infos, dict):  # a warm start builds nothing: what the kernels compute comes from the file
        for job, info in infos.items():
            if isinstance(job, str) and isinstance(info, dict) and job_facts.lookup(job) is None:
                job_facts.register(job, info)
    return plans, host


def _host_kernels(exe: Planned, host) -> dict[str, str]:
    """The refused kernels a plan file names, checked: kernels of this step, and the ones
    this executable already runs on the host when it has decided (after a reset)."""
    if not isinstance(host, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in host.items()):
        raise SpyreError("the plan file's refused kernels are not a table of names")
    unknown = set(host) - set(exe.card_kernels())
    if unknown:
        raise SpyreError(f"the plan file runs kernels on the host that the step does not have ({sorted(unknown)[:3]})")
    if exe.prepared and set(host) != set(exe.host.reasons):
        raise SpyreError("the plan file runs other kernels on the host than this executable does")
    return host


def _check_extents(bindings: Bindings, plans: list[GraphPlan]) -> None:
    """Every binding of every plan fits the memory a call binds there: the arena, each
    input's and constant's storage, each fresh output. The card accepts a plan whose
    extents exceed them (it checks them against the allocations at each launch), so a
    cached plan that needs more would have every launch refused."""
    limits = bindings.limits()
    for plan in plans:
        for b, limit in enumerate(limits):
            need = plan.extent(b)
            if need > limit:
                raise SpyreError(f"a plan needs {need} bytes of {bindings.names[b]} (binding {b}); "
                                 f"a call binds {limit}")


def build_block(exe: Planned, segment: DeviceSegment, built: dict | None = None):
    """The plan block of one device segment, built from its kernels' descriptions (or
    from their programs in `built`, by name, when they were just constructed)."""
    jobs = []
    for name in segment.kernels:
        blob, bufs = built[name] if built and name in built else exe.build(name)
        kernel = exe.kernels.get(name)
        kind = COLLECTIVE if kernel is not None and kernel.kind == "collective" else PROGRAM
        jobs.append(PlanJob(blob, tuple(exe.bindings.relocs[b] for b in bufs), exe.job_name(name), kind))
    return encode_plan(jobs, exe.bindings.stick_layouts(), exe.card.intern, len(exe.collectives.names))
