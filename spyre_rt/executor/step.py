"""A compiled step: what a compiled module's ``call(args)`` runs.

Per input geometry (the card, the stick layouts and storage offsets of the inputs) it keeps
an :class:`~spyre_rt.executor.executable.Executable`. A call that repeats the last geometry
takes a fast path: static inputs (parameters, static caches) are checked by identity, the
others by offset and card here and by stick layout on the card (a plan launch checks each
binding against the layout its allocation records), so the fast path's one native call is
the launch.

Outputs come from memory the executable pools (its slots), reused only once the caller has
let go of them, so a later call never overwrites what an earlier one returned and is still
held. Inside a graph capture (:mod:`spyre_rt.graphs`) a call is recorded instead.

A step carries the settings its compile resolved (:func:`spyre_rt.config.for_step`): the
plan cache its executables use, and whether its calls are recorded in the card's trace.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import threading
import weakref
from collections import OrderedDict

import torch

from .. import capture, config, tensors, trace
from .. import card as cards
from ..dispatch import named, override
from ..errors import SpyreError, SpyreGraphError, SpyreLayoutError
from ..ir import StepDesc, from_json, to_json
from . import memory, undo
from .executable import Executable

# keyed by a count taken at creation, so listed in that order: a weak set would list them
# in the order of their ids, which differs from one run to the next
_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_made = itertools.count()


def live_steps() -> list[CompiledStep]:
    """The compiled steps alive in this process, oldest first (for tools and tests that
    inspect them)."""
    return list(_live.values())


# Steps the compiler prepared for the module it is generating (see adopt), by the digest
# of their JSON; a few at most: each is taken by the module's load right after.
_adopted: OrderedDict[str, object] = OrderedDict()
_ADOPTED = 8
_adopted_lock = threading.Lock()


def adopt(digest: str, step) -> None:
    """Hand the step the compiler made (and prepared) from a module's JSON to that module's
    load, so that its first call finds the work done."""
    with _adopted_lock:
        _adopted[digest] = step
        while len(_adopted) > _ADOPTED:
            _adopted.popitem(last=False)


def adopted(digest: str):
    """The step :func:`adopt` handed over for this digest, once; else None."""
    with _adopted_lock:
        return _adopted.pop(digest, None)


def load_step(text: str, settings: dict | None = None) -> CompiledStep:
    """The step a compiled module embeds as JSON, with the settings its compile resolved
    (the one the compiler prepared, if any)."""
    digest = hashlib.sha256(text.encode()).hexdigest()
    resolved = config.for_step(settings)
    step = adopted(digest)
    if isinstance(step, CompiledStep) and step.settings == resolved:
        return step
    return CompiledStep(from_json(text), digest, settings=resolved)


class CompiledStep:
    def __init__(self, desc: StepDesc, digest: str | None = None, family: tuple[str, dict] | None = None,
                 settings: config.Settings | None = None):
        _live[next(_made)] = self
        self.desc = desc
        self.settings = settings or config.for_step(None)
        # the description's identity in plan-cache keys: hashing its JSON once, not per load
        self.digest = digest or hashlib.sha256(to_json(desc).encode()).hexdigest()
        # (the compiled graph it belongs to, its sizes): a dynamic-shape graph makes a step
        # per distinct size; the plan cache counts plans per graph
        self.family = family or (self.digest, {})
        self.default_mode = desc.options.get("dispatch") or self.settings.dispatch
        self._executables: dict[tuple, Executable] = {}
        self._memory: dict[int, memory.MemoryPlan] = {}  # by stick size
        self._undo: undo.Undo | None = None
        self._lock = threading.Lock()
        self._fast: _FastPath | None = None

    def executables(self) -> list[Executable]:
        return list(self._executables.values())

    def memory_plan(self, stick_bytes: int) -> memory.MemoryPlan:
        """The step's static memory plan (the same for every input geometry)."""
        plan = self._memory.get(stick_bytes)
        if plan is None:
            plan = self._memory[stick_bytes] = memory.plan(self.desc, stick_bytes)
        return plan

    def undo(self) -> undo.Undo:
        """How the step saves the inputs it mutates (the same for every input geometry)."""
        if self._undo is None:
            self._undo = undo.plan(self.desc)
        return self._undo

    def executable(self, card: cards.Card, geometry: tuple) -> Executable:
        key = (card.instance, geometry)
        exe = self._executables.get(key)
        if exe is None:
            with self._lock:
                exe = self._executables.get(key)
                if exe is None:
                    exe = self._executables[key] = Executable(self, card, geometry)
        return exe

    def __call__(self, args: list, module_globals: dict):
        inputs = list(args)
        args.clear()  # boxed calling convention: drop the caller's references early
        if self.desc.constants:
            inputs += [module_globals[name] for name in self.desc.constants]
        if capture.capturing and (g := capture.recording()) is not None:
            return self._capture(g, inputs)
        fast = self._fast
        if fast is not None:
            outs = fast.run(inputs, override() or self.default_mode)
            if outs is not None:
                return outs
        return self._call(inputs)

    def _capture(self, g, inputs: list):
        """A call inside a graph capture: run in ``prebuilt`` dispatch with memory the
        graph keeps, and recorded for its replays."""
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor) and t.device.type != "spyre":
                g._failed = True
                raise SpyreGraphError(
                    f"input {i} of a compiled step inside a spyre graph capture is on {t.device}: a replay reads "
                    "static spyre tensors (copy the values into one before capturing, and copy_() new ones into it)")
        try:
            card, geometry = self._geometry(inputs)
        except BaseException:
            g._failed = True
            raise
        exe = self.executable(card, tuple(geometry))
        return g.record_step(exe, inputs, [t.untyped_storage().data_ptr() for t in inputs])

    def _geometry(self, inputs: list, card: cards.Card | None = None) -> tuple:
        """The card of a call whose inputs are all on it (`card` when the caller knows it),
        and their geometry."""
        device = inputs[0].device if inputs else torch.device("spyre", tensors.current_device())
        if card is None:
            card = tensors.card_of(inputs[0]) if inputs else cards.get(device.index)
        geometry = []
        for t in inputs:
            if t.device != device:
                raise SpyreError(f"compiled step inputs are on {device} and {t.device}; use one card")
            base = t.untyped_storage().data_ptr()
            if cards.owner(base) is not card:
                raise SpyreError(f"compiled step inputs are on two different {device} cards (of two card "
                                 "sets, spyre_rt.configure); use one card")
            layout = card.layout_of(base)
            if layout is None:
                raise SpyreError("an input of a compiled step was not allocated by spyre_rt")
            geometry.append((layout, t.storage_offset()))
        return card, geometry

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
        _, geometry = self._geometry(inputs, card)
        exe = self.executable(card, tuple(geometry))
        if not host_inputs and not self.desc.host_outputs:
            self._fast = _FastPath(self, exe, inputs, geometry)
        if self.settings.trace:
            with trace.recording(card, self.settings.trace_commands):
                outs = exe.run(inputs, override() or self.default_mode)
        else:
            outs = exe.run(inputs, override() or self.default_mode)
        for i, t in host_inputs.items():
            if i < len(self.desc.inputs) and self.desc.inputs[i][1]:
                t.copy_(inputs[i])  # a mutated host input: write the new values back
        if host_inputs and len(host_inputs) == len(inputs):
            outs = [o.cpu() if isinstance(o, torch.Tensor) else o for o in outs]
        for i in self.desc.host_outputs:
            if isinstance(outs[i], torch.Tensor):
                outs[i] = outs[i].cpu()
        return outs


class _FastPath:
    """The last input geometry of a step, to skip the full checks when a call repeats it:
    static inputs are checked by identity (and a global count of storage swaps), the others
    by storage offset and address window, and by stick layout: on the card, when the call is
    one plan launch (the launch refuses a binding whose allocation records another layout
    before any job runs), else here with the card's records."""

    def __init__(self, step: CompiledStep, exe: Executable, inputs: list, geometry: list):
        static = set(step.desc.static_inputs)
        self.exe = exe
        # None: untraced; else whether the card's trace records the commands of each call
        self.traced = step.settings.trace_commands if step.settings.trace else None
        self.card_set = id(cards.card_set())
        self.window = exe.card.instance  # dynamic inputs must be in the card's address window
        self.device = inputs[0].device if inputs else None
        self.n = len(inputs)
        static_idx = [i for i in range(len(inputs)) if i in static]
        # Holding the static tensors keeps their storages alive (and their ids unique): the
        # same objects with no storage swap since (capture.storage_swaps) have the same memory.
        self.statics = tuple(inputs[i] for i in static_idx)
        self.pick = _picker(static_idx)
        self.swaps = capture.storage_swaps
        self.dynamic = [(i, geometry[i][1]) for i in range(len(inputs)) if i not in static]
        self.layouts = [geometry[i][0] for i in range(len(inputs)) if i not in static]
        # every input's address at this call: the static ones stay (Executable.run binds
        # them once per slot), the dynamic ones are replaced at each call
        self.bases = [t.untyped_storage().data_ptr() for t in inputs]

    def run(self, inputs: list, mode: str):
        if id(cards.card_set()) != self.card_set or len(inputs) != self.n or capture.storage_swaps != self.swaps:
            return None
        if not all(map(operator.is_, self.pick(inputs), self.statics)):
            return None
        dynamic = []
        window = self.window
        for i, offset in self.dynamic:
            t = inputs[i]
            if t.device != self.device:
                return None
            base = t.untyped_storage().data_ptr()
            if t.storage_offset() != offset or cards.window_of(base) != window:
                return None
            dynamic.append((i, base))
        exe, mode = self.exe, named(mode)
        if not exe.one_plan(mode):
            layout_of = exe.card.layout_of
            if any(layout_of(base) != layout for (_, base), layout in zip(dynamic, self.layouts, strict=True)):
                return None
        try:
            if self.traced is not None:
                with trace.recording(exe.card, self.traced):
                    return exe.run(inputs, mode, binding=self, dynamic=dynamic)
            return exe.run(inputs, mode, binding=self, dynamic=dynamic)
        except SpyreLayoutError:
            return None  # an input's storage was made again with another layout: the full checks


def _picker(idx: list[int]):
    """A function from a list to the tuple of its elements at `idx`."""
    if len(idx) >= 2:
        return operator.itemgetter(*idx)
    if idx:
        i = idx[0]
        return lambda seq: (seq[i],)
    return lambda seq: ()
