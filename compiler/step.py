"""Running a compiled step on a card, in any dispatch mode.

A :class:`CompiledStep` is what a compiled graph's ``call(args)`` runs. For every input
geometry (the stick layouts and storage offsets of the inputs it is called with) it keeps
an :class:`Executable`: the static buffer plan (intermediates at fixed offsets of an arena
allocated once), the relocation of every kernel's buffers against a few bindings
(arena, inputs, constants, outputs) and, in ``prebuilt`` mode, the graph plans.

Outputs are fresh device tensors on every call, so a later call never overwrites what an
earlier one returned; intermediates live in the arena, which a call takes from a small
pool (several threads may run one step at once).

Arenas and graph plans belong to the card's reset epoch they were made in: after a reset
(:func:`spyre_rt.reset_device`) the next call drops them and makes new ones (plans from
the plan cache when it has them), never touching the addresses the old ones had.

Inputs a step mutates are all-or-nothing. The step's first job copies every byte range a
mutated input covers into the arena (a snapshot, on the card: load and store through the
scratchpads); if anything fails after that job completed (a card fault, a CPU op), a
restore job copies the snapshots back before the error reaches the caller, so a failed
call leaves every mutated input as it was. Snapshot-and-restore costs one device copy of
the mutated inputs per call; the alternative, computing into step-owned shadows and
committing them with a final copy, costs two, and a fault inside the commit copy would
still leave an input half-written.
"""

from __future__ import annotations

import hashlib
import json
import operator
import threading
import time
import warnings
import weakref

import numpy as np
import torch

from spyre_rt import aten, config, jobs, plan_cache, tensors
from spyre_rt import card as cards
from spyre_rt.dispatch import override
from spyre_rt.errors import SpyreError
from spyre_rt.layout import StickLayout, layout_for, registry
from spyre_rt.native import ffi
from spyre_rt.plan import GraphPlan, PlanJob, set_job_names
from spyre_rt.plan import encode as encode_plan
from spyre_rt.transfer import ViewGeometry, from_device, to_device

from .build import copy, loops, matmul
from .build.context import BuildContext, Target
from .kernels import Buffer, CpuOp, LoopKernel, MatmulKernel, StepDesc, from_json, to_json
from .version import compiler_version

ARENA = 0  # binding 0 is the arena of intermediates
ALIGN = 128
SNAPSHOT = "<snapshot>"  # the job that saves the mutated inputs (see the module docstring)
RESTORE = "<restore>"

# Construction done by this process: a warm start from the plan cache builds nothing.
stats = {"kernels_built": 0, "plans_built": 0, "plans_loaded": 0}


def load_step(text: str) -> CompiledStep:
    return CompiledStep(from_json(text), hashlib.sha256(text.encode()).hexdigest())


def _storage_numel(b: Buffer) -> int:
    if any(s == 0 for s in b.sizes):
        return b.offset
    return b.offset + 1 + sum((s - 1) * st for s, st in zip(b.sizes, b.strides, strict=True))


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


_live_steps: weakref.WeakSet = weakref.WeakSet()  # for tools and tests that inspect steps


class CompiledStep:
    def __init__(self, desc: StepDesc, digest: str | None = None):
        _live_steps.add(self)
        self.desc = desc
        # the description's identity in plan-cache keys: hashing its JSON once, not per load
        self.digest = digest or hashlib.sha256(to_json(desc).encode()).hexdigest()
        self.default_mode = desc.options.get("dispatch") or config.settings().dispatch
        self._executables: dict[tuple, Executable] = {}
        self._lock = threading.Lock()
        self._fast: _FastPath | None = None

    def executable(self, card: cards.Card, geometry: tuple) -> Executable:
        key = (card.instance, geometry)
        exe = self._executables.get(key)
        if exe is None:
            with self._lock:
                exe = self._executables.get(key)
                if exe is None:
                    exe = self._executables[key] = Executable(self.desc, card, geometry, self.digest)
        return exe

    def __call__(self, args: list, module_globals: dict):
        inputs = list(args)
        args.clear()  # boxed calling convention: drop the caller's references early
        if self.desc.constants:
            inputs += [module_globals[name] for name in self.desc.constants]
        fast = self._fast
        if fast is not None:
            outs = fast.run(inputs, override() or self.default_mode)
            if outs is not None:
                return outs
        return self._call(inputs)

    def _call(self, inputs: list):
        spyre_in = [t for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "spyre"]
        if spyre_in:  # the card that holds the first input, of whichever card set
            device, card = spyre_in[0].device, tensors.card_of(spyre_in[0])
        else:
            device = torch.device("spyre", tensors.current_device())
            card = cards.get(device.index)
        host_inputs = {}
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor) and t.device.type != "spyre":
                host_inputs[i] = t
                inputs[i] = tensors.to_card(t, card)
            elif t.device != device:
                raise SpyreError(f"compiled step inputs are on {device} and {t.device}; use one card")
        geometry = []
        for t in inputs:
            base = t.untyped_storage().data_ptr()
            layout = registry.get(base)
            if layout is None:
                raise SpyreError("an input of a compiled step was not allocated by spyre_rt")
            if cards.owner(base) is not card:
                raise SpyreError(f"compiled step inputs are on two different {device} cards (of two card "
                                 "sets, spyre_rt.configure); use one card")
            geometry.append((layout, t.storage_offset()))
        exe = self.executable(card, tuple(geometry))
        if not host_inputs:
            self._fast = _FastPath(self, exe, inputs, geometry)
        outs = exe.run(inputs, override() or self.default_mode)
        for i, t in host_inputs.items():
            if i < len(self.desc.inputs) and self.desc.inputs[i][1]:
                t.copy_(inputs[i])  # a mutated host input: write the new values back
        if host_inputs and len(host_inputs) == len(inputs):
            outs = [o.cpu() for o in outs]
        return outs


class _FastPath:
    """The last input geometry of a step, to skip the full checks when a call repeats it:
    static inputs (parameters, static caches) are checked by data pointer in one C++ call;
    the others by storage layout and offset."""

    def __init__(self, step: CompiledStep, exe: Executable, inputs: list, geometry: list):
        static = set(step.desc.static_inputs)
        self.exe = exe
        self.card_set = id(cards.card_set())
        self.window = exe.card.instance  # dynamic inputs must be in the card's address window
        self.device = inputs[0].device if inputs else None
        self.n = len(inputs)
        self.static_idx = [i for i in range(len(inputs)) if i in static]
        # Holding the static tensors keeps their storages alive (and their ids unique): the
        # same objects with no storage swap since (aten.storage_swaps) have the same memory.
        self.statics = [inputs[i] for i in self.static_idx]
        self.swaps = aten.storage_swaps
        self.dynamic = [(i, geometry[i]) for i in range(len(inputs)) if i not in static]
        self.bases = [t.untyped_storage().data_ptr() for t in inputs]

    def run(self, inputs: list, mode: str):
        if id(cards.card_set()) != self.card_set or len(inputs) != self.n or aten.storage_swaps != self.swaps:
            return None
        if not all(map(operator.is_, [inputs[i] for i in self.static_idx], self.statics)):
            return None
        bases = list(self.bases)
        window = self.window
        for i, geo in self.dynamic:
            t = inputs[i]
            if t.device != self.device:
                return None
            base = t.untyped_storage().data_ptr()
            if (registry.get(base), t.storage_offset()) != geo or cards.window_of(base) != window:
                return None
            bases[i] = base
        return self.exe.run(inputs, mode, bases)


class Executable:
    """A compiled step for one card and one input geometry."""

    def __init__(self, desc: StepDesc, card: cards.Card, geometry: tuple, digest: str):
        self.desc = desc
        self.desc_digest = digest  # CompiledStep.digest: the description's identity in cache keys
        self.card = card
        self.target = Target.from_profile(card.profile)
        stick = card.profile.stick_bytes
        names_in = [b.name for b, _ in desc.inputs] + list(desc.constants)
        self.layouts: dict[str, StickLayout] = {}
        self.offsets: dict[str, int] = {}
        for name, (layout, off) in zip(names_in, geometry, strict=True):
            self.layouts[name], self.offsets[name] = layout, off
        output_bases = []
        for name, *_ in desc.outputs:
            base = self._base(name)
            if base in desc.buffers and base not in output_bases:
                output_bases.append(base)
        self.output_bases = output_bases
        views = self._views()
        for name, b in desc.buffers.items():
            layout = layout_for(b.sizes, b.strides, _storage_numel(b), _torch_dtype(b.dtype).itemsize, stick)
            if name not in output_bases:  # the step's own buffers: a layout every view suits
                layout = choose_layout(layout, views.get(name, []))
            self.layouts[name] = layout
            self.offsets[name] = 0
        for name, (base, off, _, _) in desc.aliases.items():
            root = self._base(base)
            self.layouts[name] = self.layouts[root]
            self.offsets[name] = self.offsets[root] + off
        # bindings: arena, inputs, constants, outputs
        self.binding_names = ["<arena>"] + names_in + output_bases
        self.relocs: dict[str, tuple[int, int]] = {n: (i, 0) for i, n in enumerate(self.binding_names) if i}
        self.arena_bytes = self._plan_arena()
        self.snapshots = self._plan_snapshots(names_in)
        for name, (base, _, _, _) in desc.aliases.items():
            self.relocs[name] = self.relocs[self._base(base)]
        self.segments = self._segments()
        # where each output comes from: a fresh output buffer or an input, and its offset
        index_in = {n: i for i, n in enumerate(names_in)}
        self._outputs = []
        for name, off, sizes, strides in desc.outputs:
            base = self._base(name)
            delta = self.offsets.get(name, 0) - self.offsets.get(base, 0) + off
            if base in output_bases:
                self._outputs.append((True, output_bases.index(base), delta, sizes, strides))
            else:
                self._outputs.append((False, index_in[base], delta, sizes, strides))
        self._out_specs = [(desc.buffers[n].sizes, desc.buffers[n].strides, _torch_dtype(desc.buffers[n].dtype))
                           for n in output_bases]
        # graph plans and pooled arenas, each with the card's reset epoch they were made in
        self._plans: tuple[int, dict[int, GraphPlan]] | None = None
        # Tile choices per kernel: decided at the first construction (compile time), not
        # again at every launch; what construct mode repeats is building the job graph.
        self._tilings: dict[str, object] = {}
        self._arenas: list[tuple[int, object, int]] = []
        self._arena_lock = threading.Lock()
        self._plan_lock = threading.Lock()

    def _views(self) -> dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]]:
        """Every (offset, sizes, strides) through which some kernel touches each buffer."""
        out: dict[str, list] = {}
        for k in self.desc.kernels.values():
            if isinstance(k, MatmulKernel):
                for v in (k.a, k.b, k.out, k.bias):
                    if v is not None:
                        out.setdefault(self._base(v[0]), []).append((v[1], tuple(v[2]), tuple(v[3])))
                continue
            for op in k.ops:
                acc = op.access
                if acc is None or not acc.buf:
                    continue
                dims = [(n, c) for n, c in zip(k.sizes, acc.coeffs, strict=True) if c and n > 1]
                dims += [(2, c) for _, c in acc.ind]  # an indirect row moves by whole rows
                out.setdefault(self._base(acc.buf), []).append(
                    (acc.const, tuple(n for n, _ in dims), tuple(c for _, c in dims)))
        return out

    def _base(self, name: str) -> str:
        while name in self.desc.aliases:
            name = self.desc.aliases[name][0]
        return name

    # ---- static buffer plan ----
    def _uses(self, item) -> set[str]:
        kind, x = item
        if kind == "run":
            k = self.desc.kernels[x]
            return {self._base(b.name) for b in k.buffers}
        if kind == "cpu":
            names = {self._base(o.name) for o in x.outputs}
            for ref in _buffer_refs(json.loads(x.args)) + _buffer_refs(json.loads(x.kwargs)):
                names.add(self._base(ref[0]))
            return names
        src, _, out = x
        return {self._base(src), self._base(out)}

    def _plan_arena(self) -> int:
        """Offsets of intermediates in one arena: a buffer lives from its first to its last
        use and takes the lowest offset free over that interval (first fit)."""
        first, last = {}, {}
        for i, item in enumerate(self.desc.sequence):
            for name in sorted(self._uses(item)):  # a set: its order differs between processes
                if name in self.desc.buffers and name not in self.output_bases:
                    first.setdefault(name, i)
                    last[name] = i
        placed: list[tuple[int, int, int, int]] = []  # (start, end, offset, size)
        top = 0
        for name in sorted(first, key=lambda n: (first[n], -self.layouts[n].nbytes, n)):
            size = -(-self.layouts[name].nbytes // ALIGN) * ALIGN
            lo, hi = first[name], last[name]
            busy = sorted((o, o + s) for a, b, o, s in placed if not (b < lo or a > hi))
            off = 0
            for b0, b1 in busy:
                if off + size <= b0:
                    break
                off = max(off, b1)
            placed.append((lo, hi, off, size))
            self.relocs[name] = (ARENA, off)
            top = max(top, off + size)
        return top

    def _plan_snapshots(self, names_in: list[str]) -> list[copy.Copy]:
        """Arena space for the bytes each mutated input covers: the copies the snapshot
        job makes (their reverse restores them)."""
        out = []
        stick = self.card.profile.stick_bytes
        for b, mutated in self.desc.inputs:
            if not mutated:
                continue
            lo, hi = _byte_range(self.layouts[b.name], self.offsets[b.name] + b.offset, b.sizes, b.strides)
            if hi <= lo:
                continue
            name = f"{SNAPSHOT}{len(out)}"
            size = -(-(hi - lo) // ALIGN) * ALIGN
            self.layouts[name] = StickLayout(1, size, 1, stick)
            self.relocs[name] = (ARENA, self.arena_bytes)
            self.arena_bytes += size
            out.append(copy.Copy(b.name, lo, name, 0, hi - lo))
        return out

    def _segments(self) -> list:
        segs, run = [], []
        for kind, x in self.desc.sequence:
            if kind == "run":
                run.append(x)
                continue
            if run:
                segs.append(("device", tuple(run)))
                run = []
            segs.append((kind, x))
        if run:
            segs.append(("device", tuple(run)))
        if self.snapshots:  # the snapshot job runs first, in the first device segment
            if segs and segs[0][0] == "device":
                segs[0] = ("device", (SNAPSHOT,) + segs[0][1])
            else:
                segs.insert(0, ("device", (SNAPSHOT,)))
        return segs

    # ---- construction ----
    def build(self, kernel_name: str) -> tuple[np.ndarray, list[str]]:
        """Construct one kernel's program: the work the dispatch modes move."""
        stats["kernels_built"] += 1
        ctx = BuildContext(self.target, self.layouts, offsets=self.offsets)
        if kernel_name in (SNAPSHOT, RESTORE):
            copies = self.snapshots if kernel_name == SNAPSHOT else [
                copy.Copy(c.dst, c.dst_off, c.src, c.src_off, c.nbytes) for c in self.snapshots]
            copy.build(ctx, copies)
            return ctx.encode(), ctx.buffers()
        k = self.desc.kernels[kernel_name]
        tiling = self._tilings.get(kernel_name)
        if isinstance(k, MatmulKernel):
            self._tilings[kernel_name] = matmul.build_kernel(ctx, k, tiling)
        elif isinstance(k, LoopKernel):
            self._tilings[kernel_name] = loops.build(ctx, k, tiling)
        else:
            raise SpyreError(f"unknown kernel description {type(k).__name__}")
        return ctx.encode(), ctx.buffers()

    def plan(self, segment: int, epoch: int | None = None) -> GraphPlan:
        """The plan of a device segment, made in the card's current reset epoch (`epoch`
        when the caller has read it): plans of an older epoch are gone from the card."""
        if epoch is None:
            epoch = self.card.epoch
        plans = self._plans
        if plans is None or plans[0] != epoch:
            with self._plan_lock:
                if self._plans is None or self._plans[0] != epoch:
                    self._plans = (epoch, self._load_or_build_plans())
                plans = self._plans
        return plans[1][segment]

    def cache_key(self) -> str:
        """Everything that changes the commands of this step's plans."""
        from spyre_rt import __version__
        from spyre_rt.native import lib

        geometry = [(tuple(self.layouts[n]), self.offsets[n]) for n in self.binding_names[1:]]
        # The memory plan too: CPU ops and restores address the arena through this
        # process's offsets, which must be the ones the plan's jobs were built with.
        memory = [self.arena_bytes, sorted(self.relocs.items())]
        return plan_cache.digest("spyre_rt plans", __version__, compiler_version(), torch.__version__,
                                 int(lib.SPY_JOB_VERSION), int(lib.SPY_PLAN_VERSION), self.card.profile.digest,
                                 self.desc_digest, geometry, memory, self.desc.options)

    def _device_segments(self) -> list[int]:
        return [i for i, (kind, _) in enumerate(self.segments) if kind == "device"]

    def _load_or_build_plans(self) -> dict[int, GraphPlan]:
        """Every device segment's plan: from the plan cache, or built (and cached)."""
        cache = plan_cache.default()
        key = self.cache_key()
        segments = self._device_segments()
        entry = cache.load(key) if cache else None
        if entry is not None:
            try:
                if len(entry.blocks) != len(segments):
                    raise SpyreError(f"{len(entry.blocks)} plans for {len(segments)} segments")
                names = entry.header.get("names")
                if (not isinstance(names, list) or len(names) != len(entry.blocks)
                        or not all(isinstance(n, list) and all(isinstance(x, str) for x in n) for n in names)):
                    raise SpyreError("the plan file does not name its jobs")
                for block, segment_names in zip(entry.blocks, names, strict=True):
                    set_job_names(block, segment_names, self.card.intern)
                plans = [GraphPlan(self.card, block) for block in entry.blocks]
                if any(p.nbindings != len(self.binding_names) for p in plans):
                    raise SpyreError("plans bind a different number of buffers")
                self._check_extents(plans)
                stats["plans_loaded"] += len(plans)
                return dict(zip(segments, plans, strict=True))
            except (SpyreError, ValueError) as e:
                cache.reject(key, str(e))
        blocks = [self._build_plan_block(i) for i in segments]
        plans = [GraphPlan(self.card, block) for block in blocks]
        stats["plans_built"] += len(plans)
        if cache:
            header = {"kernels": sum(len(self.segments[i][1]) for i in segments),
                      "names": [list(self.segments[i][1]) for i in segments],
                      "profile": self.card.profile.name, "options": self.desc.options,
                      "arena_bytes": self.arena_bytes, "created": time.time()}
            cache.store(key, header, blocks)
        return dict(zip(segments, plans, strict=True))

    def _check_extents(self, plans: list[GraphPlan]) -> None:
        """Every binding of every plan fits the memory a call binds there: the arena, each
        input's and constant's storage, each fresh output. The card accepts a plan whose
        extents exceed them (it checks them against the allocations at each launch), so a
        cached plan that needs more would have every launch refused."""
        limits = [self.arena_bytes] + [self.layouts[n].nbytes for n in self.binding_names[1:]]
        for plan in plans:
            for b, limit in enumerate(limits):
                need = plan.extent(b)
                if need > limit:
                    raise SpyreError(f"a plan needs {need} bytes of {self.binding_names[b]} (binding {b}); "
                                     f"a call binds {limit}")

    def _build_plan_block(self, segment: int) -> np.ndarray:
        plan_jobs = []
        for name in self.segments[segment][1]:
            blob, bufs = self.build(name)
            plan_jobs.append(PlanJob(blob, tuple(self.relocs[b] for b in bufs), name))
        return encode_plan(plan_jobs, len(self.binding_names), self.card.intern)

    # ---- running ----
    def _take_arena(self, epoch: int) -> tuple[int, object, int]:
        """An arena of the card's reset epoch `epoch` for one call, with the binding table
        that goes with it. Pooled arenas of an older epoch were dropped by the reset: they
        are forgotten, not freed (their addresses may belong to others now)."""
        with self._arena_lock:
            while self._arenas:
                taken = self._arenas.pop()
                if taken[2] == epoch:
                    return taken
        arena = self.card.malloc(max(self.arena_bytes, 1))
        table = ffi.new("uint64_t[]", len(self.binding_names))
        table[0] = arena
        return arena, table, epoch

    def _give_arena(self, taken: tuple[int, object, int]) -> None:
        with self._arena_lock:
            self._arenas.append(taken)

    def __del__(self):
        for arena, _, epoch in getattr(self, "_arenas", ()):
            try:
                self.card.free(arena, epoch)
            except Exception:
                pass

    def run(self, inputs: list[torch.Tensor], mode: str, bases: list[int] | None = None) -> list[torch.Tensor]:
        card = self.card
        outputs = [tensors.empty_strided(sizes, strides, dtype, card=card) for sizes, strides, dtype in self._out_specs]
        epoch = self.card.epoch
        taken = self._take_arena(epoch)
        table = taken[1]
        cpu_values: dict = {}
        try:
            if bases is None:
                bases = [t.untyped_storage().data_ptr() for t in inputs]
            n = len(bases)
            table[1: 1 + n] = bases
            for k, t in enumerate(outputs):
                table[1 + n + k] = t.untyped_storage().data_ptr()
            addrs = table
            saved = not self.snapshots  # the mutated inputs are in the arena's snapshots
            try:
                for i, (kind, x) in enumerate(self.segments):
                    if kind == "device":
                        try:
                            if mode == "prebuilt":
                                self.plan(i, epoch).launch(table)
                            else:
                                self._construct_and_run(x, addrs, mode)
                        except SpyreError as e:  # job 0 of the first device segment is the snapshot
                            saved = saved or e.job > 0
                            raise
                        saved = True
                    elif kind == "cpu":
                        cpu_values[x.name] = self._run_cpu(x, addrs, mode)
                    else:  # "pick": one element of a CPU op's tuple result into a buffer
                        src, path, out = x
                        value = cpu_values[src]
                        for i in path:
                            value = value[i]
                        self._upload(out, value, addrs, mode)
            except BaseException:
                if saved and self.snapshots:
                    self._restore(addrs, mode)
                raise
        finally:
            self._give_arena(taken)
        result = []
        for fresh, k, delta, sizes, strides in self._outputs:
            t = outputs[k] if fresh else inputs[k]
            result.append(torch.as_strided(t, sizes, strides, delta if fresh else delta + t.storage_offset()))
        return result

    def _restore(self, addrs, mode: str) -> None:
        """Copy the snapshots back into the mutated inputs after a failed call. On a lost
        card there is nothing to restore: the caller gets the original error."""
        try:
            self._construct_and_run((RESTORE,), addrs, mode)
        except SpyreError:
            pass

    def _construct_and_run(self, kernels, addrs, mode: str) -> None:
        """The construct modes: build each kernel's program at its launch, upload, run."""
        card = self.card
        tracing = card.tracing
        for position, name in enumerate(kernels):
            t0 = card.host_clock_ns() if tracing else 0
            blob, bufs = self.build(name)
            if tracing:
                card.trace_host_span(f"construct {name}", t0, card.host_clock_ns())
            slots = [addrs[b] + off for b, off in (self.relocs[n] for n in bufs)]
            try:
                jobs.run_once(card, blob, slots, name, prebuilt_transfer=mode != "construct")
            except SpyreError as e:
                e.job = position  # as a plan launch names its failing job
                raise

    # ---- CPU ops inside a step ----
    def _geometry(self, name: str, view=None) -> tuple[ViewGeometry, int]:
        base = self._base(name)
        b_idx, off = self.relocs[name]
        layout = self.layouts[base]
        if view is None:
            b = self.desc.buffers.get(name) or next(x for x, _ in self.desc.inputs if x.name == name)
            view = (name, b.offset, b.sizes, b.strides)
        _, voff, sizes, strides = view
        return ViewGeometry(layout, self.offsets[name] + voff, tuple(sizes), tuple(strides)), (b_idx, off)

    def _run_cpu(self, op: CpuOp, addrs: list[int], mode: str) -> None:
        from spyre_rt.fallback import SpyreFallbackWarning, in_steps

        in_steps[op.op] += 1
        prebuilt = mode != "construct"
        if not self.card.functional:
            _warn_once(op.op, "runs on zeros in timing mode (values are not simulated)")
        _warn_once(op.op, f"runs on the CPU inside a compiled step ({op.source})", SpyreFallbackWarning)

        def fetch(ref):
            name, off, sizes, strides = ref
            geo, (b, o) = self._geometry(name, ref)
            dtype = _torch_dtype(self._dtype(name))
            if not self.card.functional:
                return torch.zeros(sizes, dtype=dtype).as_strided(sizes, strides) if sizes else torch.zeros((), dtype=dtype)
            return from_device(self.card, geo, addrs[b] + o, dtype, prebuilt)

        def decode(a):
            if isinstance(a, dict) and "buf" in a:
                return fetch(a["buf"])
            if isinstance(a, dict) and "dtype" in a:
                return _torch_dtype(a["dtype"])
            if isinstance(a, dict) and "device" in a:
                return torch.device("cpu")
            if isinstance(a, list):
                return [decode(x) for x in a]
            return a

        args = decode(json.loads(op.args))
        kwargs = {k: decode(v) for k, v in json.loads(op.kwargs).items()}
        fn = _resolve_op(op.op)
        result = fn(*args, **kwargs)
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        for out, value in zip(op.outputs, results, strict=False):
            self._upload(out.name, value, addrs, mode)
        return result

    def _upload(self, name: str, value: torch.Tensor, addrs: list[int], mode: str) -> None:
        geo, (b, o) = self._geometry(name)
        value = value.to(_torch_dtype(self._dtype(name))).expand(geo.sizes)
        to_device(self.card, value, geo, addrs[b] + o, mode != "construct")

    def _dtype(self, name: str) -> str:
        base = self._base(name)
        if base in self.desc.buffers:
            return self.desc.buffers[base].dtype
        if base in self.desc.constants:
            return self.desc.constants[base].dtype
        return next(b.dtype for b, _ in self.desc.inputs if b.name == base)


def _byte_range(layout: StickLayout, offset: int, sizes, strides) -> tuple[int, int]:
    """Physical bytes [lo, hi) of a storage that hold every element of a view: the sticks
    of its rows, of the sticks its columns reach when it stays inside one row."""
    if any(n == 0 for n in sizes):
        return 0, 0
    last = offset + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
    r0, c0 = divmod(offset, layout.row_len)
    r1, c1 = divmod(last, layout.row_len)
    s = layout.stick_elems
    k0, k1 = (c0 // s, c1 // s) if r0 == r1 else (0, layout.sticks_per_row - 1)
    return k0 * layout.stick_stride + r0 * layout.stick_bytes, k1 * layout.stick_stride + (r1 + 1) * layout.stick_bytes


def _fits(row_len: int, view) -> bool:
    """No dimension of the view wraps a row of `row_len` elements: dimensions with strides
    below the row stay inside one row, the others move whole rows."""
    offset, sizes, strides = view
    span = offset % row_len
    for n, s in zip(sizes, strides, strict=True):
        if n <= 1 or s == 0:
            continue
        if s >= row_len:
            if s % row_len:
                return False
        else:
            span += (n - 1) * s
    return span < row_len


def choose_layout(own: StickLayout, views) -> StickLayout:
    """The stick layout for a buffer the step owns: rows as its innermost dimension if every
    view fits them, else the shortest wider row that all views fit (at worst one row)."""
    total = own.numel
    if total == 0 or all(_fits(own.row_len, v) for v in views):
        return own
    candidates = sorted({n for n in (_contiguous_extent(v) for v in views) if n and total % n == 0} | {total})
    for n in candidates:
        if n > own.row_len and all(_fits(n, v) for v in views):
            return StickLayout(total // n, n, own.itemsize, own.stick_bytes)
    return StickLayout(1, total, own.itemsize, own.stick_bytes)


def _contiguous_extent(view) -> int:
    """Elements covered by the view's innermost dimensions that are contiguous together."""
    _, sizes, strides = view
    dims = sorted((s, n) for n, s in zip(sizes, strides, strict=True) if n > 1 and s > 0)
    extent = 1
    for s, n in dims:
        if s != extent:
            break
        extent *= n
    return extent


def _buffer_refs(a) -> list:
    if isinstance(a, dict) and "buf" in a:
        return [a["buf"]]
    if isinstance(a, list):
        return [r for x in a for r in _buffer_refs(x)]
    if isinstance(a, dict):
        return [r for x in a.values() for r in _buffer_refs(x)]
    return []


def _resolve_op(name: str):
    # "aten.cumsum.default" -> torch.ops.aten.cumsum.default
    ns, rest = name.split(".", 1)
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")


_warned: set[tuple[str, str]] = set()


def _warn_once(op: str, what: str, category=UserWarning) -> None:
    if (op, what) not in _warned:
        _warned.add((op, what))
        warnings.warn(f"spyre: {op} {what}", category, stacklevel=3)
