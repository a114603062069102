"""A compiled step on one card for one input geometry: its memory, segments and plans.

Bindings (:mod:`.bindings`): a call binds the arena of intermediates (binding 0), every
input and constant, and a buffer per output; each kernel's buffers are relocated against
them. Where every buffer is, is one frozen value made when the executable is, which the
helpers below are given. The arena and output buffers of a call are a slot
(:class:`_Slot`), pooled and reused once its outputs are released.

Inputs a step mutates are all-or-nothing. The step's first jobs save what it will write
into the arena (:mod:`.undo`: the elements each scatter into an input will write, or an
input's whole byte range, on the card through the scratchpads); if anything fails after
them (a card fault, a CPU op), restore jobs copy it back before the error reaches the
caller, so a failed call leaves every mutated input as it was. Save-and-restore costs one
device copy of what the step writes per call; the alternative, computing into step-owned
shadows and committing them with a final copy, costs two, and a fault inside the commit
copy would still leave an input half-written.

Every kernel is constructed before the first call of an executable runs any
(:meth:`Executable.prepare`): in the modes with plans by building them (or loading them
from the plan cache), in the others by constructing each kernel once. A kernel that
construction refuses for this card and geometry (a pattern it cannot express, tiles that
do not fit) then runs on the host from its description (:mod:`.host_kernels`), warned
once; the compiler has done the same at compile time for the geometry it foresaw, so this
is the rare case of a geometry or a size it did not.

Arenas and graph plans belong to the card's reset epoch they were made in: after a reset
(:func:`spyre_rt.reset_device`) the next call drops them and makes new ones (plans from
the plan cache when it has them), never touching the addresses the old ones had.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch

from .. import card as cards
from .. import construct, job_facts, jobs, tensors
from ..construct import Refused, copy, loops
from ..construct.context import BuildContext
from ..construct.facts import kernel_facts, program_facts
from ..cost import CostModel
from ..dispatch import DispatchMode, named
from ..dtypes import torch_dtype
from ..errors import SpyreError, SpyreRefusedError
from ..ir import Buffer
from ..layout import StickLayout, layout_for, storage_numel
from ..native import ffi
from . import memory, plans, undo
from .bindings import ARENA, Bindings
from .collectives import Collectives
from .cpu_ops import CpuOps
from .distinct import DistinctBuilds
from .host_kernels import HostKernels
from .segments import Call, DeviceSegment, cut
from .stats import stats

POOLED = 4  # slots an executable keeps for reuse (a loop that holds its last output needs 2)
SNAPSHOT = "<snapshot>"  # the job that saves inputs whole (see the module docstring)
RESTORE = "<restore>"


class Executable:
    def __init__(self, step, card: cards.Card, geometry: tuple):
        desc = step.desc
        self.step = step
        self.desc = desc
        self.card = card
        self.target = CostModel.of_figures(card.profile)
        mem = step.memory_plan(card.profile.stick_bytes)
        names_in = [b.name for b, _ in desc.inputs] + list(desc.constants)
        layouts: dict[str, StickLayout] = dict(mem.layouts)
        offsets: dict[str, int] = dict.fromkeys(desc.buffers, 0)
        for name, (layout, off) in zip(names_in, geometry, strict=True):
            layouts[name], offsets[name] = layout, off
        for name, (_, off, _, _) in desc.aliases.items():
            root = memory.base_of(desc, name)
            layouts[name] = layouts[root]
            offsets[name] = offsets[root] + off
        self.output_bases = mem.output_bases
        binding_names = ["<arena>"] + names_in + list(mem.output_bases)
        relocs: dict[str, tuple[int, int]] = {n: (i, 0) for i, n in enumerate(binding_names) if i}
        relocs.update((name, (ARENA, off)) for name, off in mem.arena.items())
        # tile choices per kernel: decided at the first construction (compile time), not
        # again at every launch; what construct mode repeats is building the job graph
        self._tilings: dict[str, object] = {}
        arena_bytes = self._plan_saves(step.undo(), layouts, offsets, relocs, mem.arena_bytes)
        if self.row_saves and not self._decide_row_saves(layouts, offsets):
            self._forget_saves(layouts, offsets, relocs)
            arena_bytes = self._plan_saves(undo.plan(desc, rows_allowed=False), layouts, offsets, relocs,
                                           mem.arena_bytes)
        # the step's kernels and the row saves' and restores'
        self.kernels = {**desc.kernels, **{k.name: k for r in self.row_saves for k in (r.save, r.restore)}}
        self.save_jobs = (SNAPSHOT,) * bool(self.snapshots) + tuple(r.save.name for r in self.row_saves)
        for name in desc.aliases:
            relocs[name] = relocs[memory.base_of(desc, name)]
        self.bindings = Bindings.of(binding_names, layouts, offsets, relocs, arena_bytes,
                                    _buffers_by_name(desc), desc.aliases)
        self.host = HostKernels(card, self.bindings, self.kernels, desc.sources)  # refused kernels, on the host
        self.collectives = Collectives(card, self.bindings, desc, self.job_name)  # between cards: plan jobs
        self.segments = self.cut_for(())
        self.cpu = CpuOps(card, self.bindings)
        self._outputs = self._output_sources(names_in)
        # each output storage with the layout the memory plan gave it, which its plans declare
        self._out_specs = [(mem.layouts[n], desc.buffers[n].sizes, desc.buffers[n].strides,
                            torch_dtype_of(desc.buffers[n])) for n in mem.output_bases]
        self._registered: set[str] = set()  # the kernels and copies whose facts are registered
        self._plans: tuple[int, list] | None = None  # (reset epoch, plans)
        self._slots: list[_Slot] = []  # the memory of calls, pooled (see take_slot)
        self._slot_lock = threading.Lock()
        self._all_fresh = all(isinstance(o, tuple) and o[0] for o in self._outputs)
        self._one_plan = len(self.segments) == 1 and isinstance(self.segments[0], DeviceSegment)
        self._plan_lock = threading.Lock()
        self._prepared = False  # every kernel constructed once (see prepare)

    # ---- names ----
    def job_name(self, kernel: str) -> str:
        """The name a kernel's job runs under in the trace: unique across steps."""
        return f"{kernel}@{self.step.digest[:8]}"

    def _output_sources(self, names_in: list[str]) -> list:
        """Where each output comes from: (a fresh output buffer?, which, offset, sizes,
        strides), or the int a size output is."""
        index_in = {n: i for i, n in enumerate(names_in)}
        offsets = self.bindings.offsets
        out = []
        for output in self.desc.outputs:
            if isinstance(output, dict):  # a size the graph returns, or None
                out.append(int(output["int"]) if "int" in output else None)
                continue
            name, off, sizes, strides = output
            base = self.bindings.base_of(name)
            delta = offsets.get(name, 0) - offsets.get(base, 0) + off
            if base in self.output_bases:
                out.append((True, self.output_bases.index(base), delta, sizes, strides))
            else:
                out.append((False, index_in[base], delta, sizes, strides))
        return out

    def _plan_saves(self, saves: undo.Undo, layouts: dict, offsets: dict, relocs: dict, arena_bytes: int) -> int:
        """Arena space for what the step saves (see :meth:`_plan_snapshots`): the arena's
        size with it."""
        self.row_saves = saves.rows
        self.snapshots, arena_bytes = self._plan_snapshots(saves.whole, layouts, offsets, relocs, arena_bytes)
        return arena_bytes

    def _decide_row_saves(self, layouts: dict, offsets: dict) -> bool:
        """Decide how the row saves and restores are built, now: they run before every
        kernel and on every failure, so unlike the step's kernels they cannot run on the
        host. False when construction refuses one (the step then saves inputs whole)."""
        ctx = BuildContext(self.target, layouts, offsets=offsets)
        try:
            for r in self.row_saves:
                for k in (r.save, r.restore):
                    self._tilings[k.name] = loops.decide(ctx, k)
        except Refused:
            for r in self.row_saves:
                for k in (r.save, r.restore):
                    self._tilings.pop(k.name, None)
            return False
        return True

    def _forget_saves(self, layouts: dict, offsets: dict, relocs: dict) -> None:
        """Drop the arena buffers the saves were given (before planning them again)."""
        for name in [c.dst for c in self.snapshots] + [r.buffer.name for r in self.row_saves]:
            del layouts[name], relocs[name]
            offsets.pop(name, None)

    def _plan_snapshots(self, whole, layouts: dict, offsets: dict, relocs: dict,
                        arena_bytes: int) -> tuple[list[copy.Copy], int]:
        """Arena space for what the step saves: the bytes each input saved whole covers (the
        copies the snapshot job makes; their reverse restores them) and the row saves'
        buffers."""
        out = []
        stick = self.card.profile.stick_bytes
        for b in whole:
            lo, hi = memory.byte_range(layouts[b.name], offsets[b.name] + b.offset, b.sizes, b.strides)
            if hi <= lo:
                continue
            name = f"{SNAPSHOT}{len(out)}"
            size = memory.align(hi - lo)
            layouts[name] = StickLayout(1, size, 1, stick)
            relocs[name] = (ARENA, arena_bytes)
            arena_bytes += size
            out.append(copy.Copy(b.name, lo, name, 0, hi - lo))
        for r in self.row_saves:
            b = r.buffer
            layout = layout_for(b.sizes, b.strides, storage_numel(b.sizes, b.strides, 0),
                                torch_dtype(b.dtype).itemsize, stick)
            layouts[b.name], offsets[b.name] = layout, 0
            relocs[b.name] = (ARENA, arena_bytes)
            arena_bytes += memory.align(layout.nbytes)
        return out, arena_bytes

    def cut_for(self, on_host) -> list:
        """The step's segments with the kernels `on_host` run on the host."""
        return cut(self.desc.sequence, self.save_jobs, frozenset(on_host))

    def run_on_host(self, refused: dict[str, str]) -> None:
        """Run the kernels `refused` (name -> what construction said) on the host."""
        for name, reason in refused.items():
            self.host.add(name, reason)
        self.segments = self.cut_for(self.host.reasons)
        self._one_plan = len(self.segments) == 1 and isinstance(self.segments[0], DeviceSegment)

    def card_kernels(self) -> list[str]:
        """The step's kernels (not the snapshot), in order: each runs on the card unless
        construction refused it."""
        return [x for kind, x in self.desc.sequence if kind == "run"]

    def device_segments(self) -> list[DeviceSegment]:
        return [s for s in self.segments if isinstance(s, DeviceSegment)]

    def host_segments(self) -> list:
        """The segments that run on the host (CPU ops and their picks)."""
        return [s for s in self.segments if not isinstance(s, DeviceSegment)]

    # ---- construction ----
    def build(self, kernel_name: str) -> tuple[np.ndarray, list[str]]:
        """Construct one kernel's program: the work the dispatch modes move."""
        stats["kernels_built"] += 1
        ctx = BuildContext(self.target, self.bindings.layouts, offsets=self.bindings.offsets)
        if kernel_name in (SNAPSHOT, RESTORE):
            copies = self.snapshots if kernel_name == SNAPSHOT else [
                copy.Copy(c.dst, c.dst_off, c.src, c.src_off, c.nbytes) for c in self.snapshots]
            copy.build(ctx, copies)
            if kernel_name not in self._registered:  # once, as a kernel's at its first construction
                self._registered.add(kernel_name)
                job_facts.register(self.job_name(kernel_name), {
                    "kind": "copy", "op": [kernel_name.strip("<>")], "module": "", "flops": 0,
                    "dram_bytes_min": 2 * sum(c.nbytes for c in copies), **program_facts(ctx)})
        elif self.kernels[kernel_name].kind == "collective":  # a job of the ring, not a program
            return self.collectives.job(self.kernels[kernel_name])
        else:
            kernel = self.kernels[kernel_name]
            first = kernel_name not in self._registered
            # the row saves are the runtime's own kernels, decided when the executable was made
            builder = loops.build if kernel_name.startswith((undo.SAVE, undo.RESTORE)) else construct.build
            self._tilings[kernel_name] = builder(ctx, kernel, self._tilings.get(kernel_name))
            if first:
                self._registered.add(kernel_name)  # what it computes and moves, for the trace and the profiler
                job_facts.register(self.job_name(kernel_name), kernel_facts(kernel, ctx))
        return ctx.encode(), ctx.buffers()

    def construct_all(self, fallback: bool = True, distinct: bool = False) -> dict[str, tuple[np.ndarray, list[str]]]:
        """Construct every kernel of the device segments once: their programs by name. A
        kernel construction refuses runs on the host from then on (with `fallback` false,
        or CPU fallback off in the step's options, a SpyreRefusedError names them). With
        `distinct` (a plan build), kernels of one form share the first one's program
        (:mod:`.distinct`)."""
        built, refused, indirect = {}, {}, set()
        build = DistinctBuilds(self).build if distinct else self.build
        for seg in self.device_segments():
            for name in seg.kernels:
                try:
                    built[name] = build(name)
                except Refused as e:
                    refused[name] = str(e) or type(e).__name__
                    if getattr(e, "indirect", False):
                        indirect.add(name)
        if refused:
            if not fallback or not self.desc.options.get("cpu_fallback", True):
                lines = "; ".join(f"{self.host_source(k)}: {why}" for k, why in refused.items())
                raise SpyreRefusedError(f"the card's construction refused {len(refused)} kernel(s) of the step "
                                        f"({lines}) and CPU fallback is off", refused, indirect)
            self.run_on_host(refused)
        return built

    @property
    def prepared(self) -> bool:
        """Whether every kernel was constructed once (and which run on the host decided)."""
        return self._prepared

    def host_source(self, kernel_name: str) -> str:
        """What a kernel came from: its ops and model line."""
        return self.host.source_of(kernel_name)

    def prepare(self, mode: DispatchMode, fallback: bool = True) -> None:
        """Make every kernel's program before the first call runs any kernel: a mode with
        plans builds them (or loads them from the plan cache), another constructs every
        kernel once (each launch constructs it again, as that mode does). What construction
        refuses runs on the host (see :meth:`construct_all`)."""
        if self._prepared:
            return
        if mode.plans:
            self.plans(fallback=fallback)
            return
        with self._plan_lock:
            if not self._prepared:
                self.construct_all(fallback)
                self._prepared = True

    def construct_and_run(self, kernels, table, mode: DispatchMode) -> None:
        """The modes without plans: build each kernel's program at its launch, upload (a
        transfer graph built per upload unless `mode` has prebuilt transfers), run."""
        card = self.card
        tracing = card.tracing
        for position, name in enumerate(kernels):
            t0 = card.host_clock_ns() if tracing else 0
            blob, bufs = self.build(name)
            if tracing:
                card.trace_host_span(f"construct {name}", t0, card.host_clock_ns())
            slots = [self.bindings.address(table, n) for n in bufs]
            try:
                kernel = self.kernels.get(name)
                if kernel is not None and kernel.kind == "collective":
                    self.collectives.launch(kernel, blob, slots)
                else:
                    jobs.run_once(card, blob, slots, self.job_name(name), prebuilt_transfer=mode.prebuilt_transfers)
            except SpyreError as e:
                e.job = position  # as a plan launch names its failing job
                raise

    # ---- plans ----
    def cache_key(self) -> str:
        return plans.cache_key(self.bindings, self.card.profile.digest, self.step.digest, self.desc.options)

    def plans(self, epoch: int | None = None, fallback: bool = True) -> list:
        """The plans of the device segments, made in the card's current reset epoch (`epoch`
        when the caller has read it): plans of an older epoch are gone from the card.
        Making the first ones prepares the executable (see :meth:`prepare`)."""
        if epoch is None:
            epoch = self.card.epoch
        made = self._plans
        if made is None or made[0] != epoch:
            with self._plan_lock:
                if self._plans is None or self._plans[0] != epoch:
                    self._plans = (epoch, plans.load_or_build(self, fallback))
                    self._prepared = True
                made = self._plans
        return made[1]

    # ---- running ----
    def one_plan(self, mode: DispatchMode) -> bool:
        """Whether a call in `mode` is one plan launch (and nothing else)."""
        return self._one_plan and mode.plans

    def new_slot(self, epoch: int) -> _Slot:
        """The memory of one call, made in the card's reset epoch `epoch`: the arena, the
        output storages (one native call for all of them) and the binding table that
        points at them, with the output tensors handed to the caller made once."""
        slot = self._make_slot(epoch)
        slot.seal()  # here, where the slot alone refers to its tensors
        return slot

    def _make_slot(self, epoch: int) -> _Slot:
        card = self.card
        arena = card.malloc(max(self.bindings.arena_bytes, 1))
        try:
            outputs = tensors.empty_many(card, self._out_specs)
        except BaseException:
            card.free(arena, epoch)
            raise
        nbindings = len(self.bindings.names)
        table = ffi.new("uint64_t[]", nbindings)
        table[0] = arena
        first = nbindings - len(outputs)
        for k, t in enumerate(outputs):
            table[first + k] = t.untyped_storage().data_ptr()
        fresh = []
        for i, source in enumerate(self._outputs):
            if isinstance(source, tuple) and source[0]:
                _, k, delta, sizes, strides = source
                t = outputs[k]
                if tuple(t.shape) != tuple(sizes) or t.stride() != tuple(strides) or delta:
                    t = torch.as_strided(t, sizes, strides, delta)
                fresh.append((i, t))
        return _Slot(card, epoch, arena, table, outputs, fresh)

    def take_slot(self, epoch: int) -> _Slot:
        """A pooled slot of epoch `epoch` whose outputs nobody holds any more, or a new one.
        Slots of an older epoch were dropped by the reset: forgotten, never freed."""
        with self._slot_lock:
            slots = self._slots
            for i in range(len(slots) - 1, -1, -1):  # the last given back first
                slot = slots[i]
                if slot.epoch == epoch and slot.released():
                    return slots.pop(i)
            if slots and any(slot.epoch != epoch for slot in slots):
                self._slots = [slot for slot in slots if slot.epoch == epoch]
        return self.new_slot(epoch)

    def give_slot(self, slot: _Slot) -> None:
        """Back to the pool, to be reused once the caller lets go of its outputs. The pool
        keeps POOLED slots: past that, the oldest leaves it (its outputs stay the caller's,
        and their memory goes when they die)."""
        with self._slot_lock:
            self._slots.append(slot)
            if len(self._slots) > POOLED:
                self._slots.pop(0)

    def run(self, inputs: list[torch.Tensor], mode: str | DispatchMode, bases: list[int] | None = None,
            slot: _Slot | None = None, binding=None, dynamic=()) -> list[torch.Tensor]:
        """One call: binds `inputs` and the memory of a slot, runs the segments and returns
        the outputs. The inputs' storage addresses are `bases` when the caller has them;
        or, from a step's fast path, `binding` (an object whose ``bases`` are the addresses
        of its calls, static inputs included) with the (index, address) of the inputs that
        change per call in `dynamic`: a slot last bound by the same `binding` only has those
        written. With a `slot` given (a graph capture), that slot is used and kept by the
        caller. `mode` is a dispatch mode or its name."""
        mode = named(mode)
        epoch = self.card.epoch
        pooled = slot is None
        if pooled:
            slot = self.take_slot(epoch)
        try:
            table = slot.table
            if binding is None:
                if bases is None:
                    bases = [t.untyped_storage().data_ptr() for t in inputs]
                table[1: 1 + len(bases)] = bases
                slot.bound = None
            else:
                if slot.bound is not binding:
                    table[1: 1 + len(binding.bases)] = binding.bases
                    slot.bound = binding
                for i, base in dynamic:
                    table[1 + i] = base
            made = self._plans
            if self.one_plan(mode) and made is not None and made[0] == epoch:
                self._launch_one(made[1][0], table, mode)
            else:
                if not self._prepared:
                    self.prepare(mode)
                self._run_segments(Call(self, table, mode, epoch))
            # made before the slot goes back: the references in it mark the outputs held
            result = list(slot.results) if self._all_fresh else self._results(slot, inputs)
        finally:
            if pooled:
                self.give_slot(slot)
        return result

    def _results(self, slot: _Slot, inputs: list) -> list:
        result = [None] * len(self._outputs)
        for i, t in slot.fresh:
            result[i] = t
        for i, source in enumerate(self._outputs):
            if source is None or isinstance(source, int):  # None, or a size the graph returns
                result[i] = source
            elif not source[0]:  # a view of an input
                _, k, delta, sizes, strides = source
                t = inputs[k]
                result[i] = torch.as_strided(t, sizes, strides, delta + t.storage_offset())
        return result

    def _launch_one(self, plan, table, mode: DispatchMode) -> None:
        """The whole step as one plan launch (a step of one device segment whose plan
        exists): what `_run_segments` does for it, without its bookkeeping."""
        try:
            plan.launch(table)
        except SpyreError as e:
            err = self.segments[0].named(self, e)
            # the first jobs save the mutated inputs: a failure after them restores them
            if self.save_jobs and err.job >= len(self.save_jobs):
                self._restore(table, mode)
            if err is e:
                raise
            raise err from None

    def _run_segments(self, call: Call) -> None:
        saved = not self.save_jobs  # the mutated inputs are saved in the arena
        try:
            for seg in self.segments:
                try:
                    seg.run(call)
                except SpyreError as e:  # the first jobs of the first device segment save
                    saved = saved or getattr(e, "segment", -1) != 0 or e.job >= len(self.save_jobs)
                    raise
                saved = True
        except BaseException:
            if saved and self.save_jobs:
                self._restore(call.table, call.mode)
            raise

    def _restore(self, table, mode: DispatchMode) -> None:
        """Copy what the saves kept back into the mutated inputs after a failed call: the
        whole inputs first (an index input among them: the row restores compute their
        indices from it), then the rows. On a lost card there is nothing to restore: the
        caller gets the original error."""
        try:
            restores = (RESTORE,) * bool(self.snapshots) + tuple(r.restore.name for r in self.row_saves)
            self.construct_and_run(restores, table, mode)
        except SpyreError:
            pass


def _buffers_by_name(desc) -> dict[str, Buffer]:
    """The description of every buffer, input, constant and alias of a step."""
    named = {b.name: b for b, _ in desc.inputs}
    named.update(desc.constants)
    named.update(desc.buffers)
    for name, (_, off, sizes, strides) in desc.aliases.items():
        named[name] = Buffer(name, named[memory.base_of(desc, name)].dtype, tuple(sizes), tuple(strides), off)
    return named


def torch_dtype_of(b: Buffer) -> torch.dtype:
    return torch_dtype(b.dtype)


_use_count = torch._C._storage_Use_Count


class _Slot:
    """The device memory of one call of an executable: its arena of intermediates, its
    output storages and the binding table pointing at them; and the output tensors it
    hands out, the same objects at every call that reuses it.

    A slot is reused only once nobody outside it holds its outputs. That is detected the
    way CUDA graph trees detect a released output, by reference counts, checked before
    each reuse: every tensor handed out has the Python reference count it had when the
    slot was made (the caller kept no reference to it); every output storage has the use
    count it had then (no other tensor or view refers to it; torch's
    ``_storage_Use_Count``); and the Python object of every output storage (torch keeps
    one per storage, and ``t.untyped_storage()`` returns it) has its reference count.
    Each tensor handed out must also still have the geometry it was made with (an
    in-place metadata op such as ``t_()`` on a dropped output changes the object)."""

    __slots__ = ("card", "epoch", "arena", "table", "outputs", "fresh", "results", "bound", "_storages", "_uses",
                 "_refs", "_geometry", "__weakref__")

    def __init__(self, card, epoch: int, arena: int, table, outputs: list, fresh: list):
        self.card, self.epoch, self.arena, self.table = card, epoch, arena, table
        self.outputs = outputs  # the base tensor of each output storage
        self.fresh = fresh      # (output index, tensor handed out)
        self.results = [t for _, t in fresh]
        self.bound = None  # what bound the inputs in the table last (Executable.run)
        self._storages = [t.untyped_storage() for t in outputs]  # keeps each _cdata valid
        self._geometry = [(t.shape, t.stride(), t.storage_offset()) for t in self.results]

    def seal(self) -> None:
        """Record the reference counts of an unheld slot: call it where nothing but the slot
        refers to its tensors."""
        self._uses = [(s._cdata, _use_count(s._cdata)) for s in self._storages]
        self._refs = self._refcounts()

    def _refcounts(self) -> list[int]:
        # torch keeps one Python object per storage: a caller holding `t.untyped_storage()`
        # holds the object the slot keeps, so it shows in that object's count, not in uses
        return [sys.getrefcount(t) for t in self.results] + [sys.getrefcount(s) for s in self._storages]

    def released(self) -> bool:
        """Whether the caller let go of every output handed out (see the class docstring)."""
        if self._refcounts() != self._refs:
            return False
        for cdata, uses in self._uses:
            if _use_count(cdata) != uses:
                return False
        for t, (shape, stride, offset) in zip(self.results, self._geometry, strict=True):
            if t.shape != shape or t.stride() != stride or t.storage_offset() != offset:
                return False
        return True

    def __del__(self):
        try:
            self.card.free(self.arena, self.epoch)
        except Exception:
            pass
