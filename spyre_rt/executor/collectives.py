"""The collectives of a compiled step: jobs of its graph plans between the cards of a group.

The compiler describes a graph's functional collectives (``_c10d_functional.all_reduce_``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``broadcast_``: what DTensor and
Hugging Face's tensor-parallel layers trace to) as :class:`~spyre_rt.ir.CollectiveKernel`.
Each becomes one job of its device segment's plan: not a program of the card's commands
but a ``spy_collective`` the plan launcher runs through the process group's native ring,
on the card's memory in place, with its time on the interconnect. So a prebuilt
tensor-parallel step is still one native call, and a ``torch.spyre.graph`` replay covers its
collectives. (Cutting the step at each collective and running it from Python between plans
would cost a Python collective call and a plan launch per collective, two per layer, and
leave nothing for a replay to capture.)

A plan names its groups by index; the rings are attached when the plan is made or loaded
from the plan cache, resolved by the groups' names through ``torch.distributed``. A
collective whose storages do not line up for the ring (a view of a storage, rows of other
lengths) is refused like a kernel construction cannot build, and runs on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch.distributed as dist

from .. import job_facts
from ..construct import Refused
from ..distributed import interconnect
from ..distributed.ring import card_collective
from ..dtypes import torch_dtype
from ..errors import SpyreCollectiveError
from ..ir import CollectiveKernel, StepDesc
from ..native import check, ffi, lib
from .bindings import Bindings

KIND = "collective"


def group_names(desc) -> list[str]:
    """The process groups a step's collectives run in, in the order its plans number them."""
    names: list[str] = []
    for kernel in desc.kernels.values():
        if isinstance(kernel, CollectiveKernel) and kernel.group not in names:
            names.append(kernel.group)
    return names


def ring_of(name: str):
    """The native ring of the ``spyreccl`` group named `name`."""
    try:
        pg = dist.distributed_c10d._resolve_process_group(name)
    except (ValueError, RuntimeError, KeyError) as e:
        raise SpyreCollectiveError(f"a compiled step's collective runs in process group {name!r}, which this "
                                   f"process does not have ({e})") from None
    ring = getattr(pg, "ring", None)
    if ring is None:
        raise SpyreCollectiveError(f"process group {name!r} is a {pg.getBackendName()!r} group: a compiled step's "
                                   "collectives between cards run in spyreccl groups")
    return ring


class Collectives:
    """The collectives of one executable: their plan jobs, and their runs outside plans."""

    def __init__(self, card, bindings: Bindings, desc: StepDesc, job_name: Callable[[str], str]):
        self.card, self.bindings, self.job_name = card, bindings, job_name
        self.names = group_names(desc)
        self._facts: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.names)

    def rings(self) -> list:
        """The ring of each group, by the index the plans give it."""
        return [ring_of(name) for name in self.names]

    def job(self, kernel: CollectiveKernel) -> tuple[np.ndarray, list[str]]:
        """The plan job of a collective: its ``spy_collective`` and the buffers of its two
        slots (input, output). Refused unless both views are whole storages that line up."""
        bindings = self.bindings
        layouts = []
        for view in (kernel.inp, kernel.out):
            name, offset, sizes, strides = view
            base = bindings.base_of(name)
            layout = bindings.layouts[base]
            numel = 1
            for n in sizes:
                numel *= n
            if bindings.offsets[name] + offset or numel != layout.numel or not _row_major(sizes, strides):
                raise Refused(f"{kernel.collective} of a view of a storage ({tuple(sizes)} at {offset}); the ring "
                              "moves whole storages")
            layouts.append(layout)
        dtype = torch_dtype(kernel.dtype)
        nbytes = _logical_bytes(kernel, dtype.itemsize)
        cost = interconnect.cost(self.card.profile, kernel.collective, nbytes, kernel.ranks,
                                 ring_of(kernel.group).between_machines)
        try:
            coll = card_collective(kernel.collective, dtype, kernel.op, kernel.ranks, layouts[0], layouts[1],
                                   root=kernel.root, group=self.names.index(kernel.group),
                                   duration_ns=cost.ns if cost else 0.0)
        except ValueError as e:
            raise Refused(str(e)) from None
        job = self.job_name(kernel.name)
        if job not in self._facts:
            self._facts.add(job)
            job_facts.register(job, {"kind": KIND, "op": list(kernel.origins) or [kernel.collective],
                                     "module": kernel.module, "flops": 0, "collective": kernel.collective,
                                     "bytes": nbytes, "ranks": kernel.ranks})
        return coll.view(np.uint8), [kernel.inp[0], kernel.out[0]]

    def launch(self, kernel: CollectiveKernel, blob: np.ndarray, slots: list[int]) -> None:
        """Run one collective outside a plan (the dispatch modes without plans)."""
        card = self.card
        ring = ring_of(kernel.group)
        check(lib.spy_collective_launch(card.handle, ring.handle, ffi.from_buffer("spy_collective *", blob),
                                        slots[0], slots[1], card.intern(self.job_name(kernel.name)), ffi.NULL),
              f"{kernel.collective} of {kernel.name} in process group {kernel.group!r}")


def _row_major(sizes, strides) -> bool:
    expect = 1
    for n, s in zip(reversed(sizes), reversed(strides), strict=True):
        if n > 1 and s != expect:
            return False
        expect *= n
    return True


def _logical_bytes(kernel: CollectiveKernel, itemsize: int) -> int:
    """The bytes of the tensor the collective is about, as its time model counts them: the
    gathered whole for a gather, the scattered whole for a reduce-scatter."""
    view = kernel.out if kernel.collective == "all_gather" else kernel.inp
    numel = 1
    for n in view[2]:
        numel *= n
    return numel * itemsize
