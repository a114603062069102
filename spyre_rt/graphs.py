"""Graph capture and replay, shaped like ``torch.cuda``'s (``torch.spyre.SpyreGraph``).

::

    g = torch.spyre.SpyreGraph()
    with torch.spyre.graph(g):
        static_out = compiled(*static_inputs)   # runs once, and is recorded
    static_inputs[0].copy_(new_values)
    g.replay()                                  # refills static_out: one native call

What a capture records: every compiled step's launch (its graph plans, with the memory
the call bound: the inputs' storages, an arena and output storages the graph owns from
then on) and every device-to-device copy. Replay runs them all, in order, with one native
call (``spy_plan_launch_many``): no Dynamo, no guard, no allocation, no binding work.
Compiled steps run in ``prebuilt`` dispatch inside a capture, whatever the mode.

A capture refuses, with :class:`~spyre_rt.SpyreGraphError`, what a replay could not
repeat: eager work on the card (an allocation, a copy to or from the host, an op that
falls back to the CPU, reading a value), a compiled step with an op on the CPU, and a
compiled step called with CPU tensors. A compiled function may compile inside a capture
(the compile is not recorded), but warming it up first, as CUDA graphs ask, keeps compile
time out of the capture. A replay refuses to run after the
card was reset, or after a tensor it reads or writes was pointed at other memory
(``set_``, ``.data =``, a growing ``resize_``): its bound addresses would be wrong.

The graph keeps every tensor it bound alive, so their memory stays theirs; a static
output is overwritten by every replay (hold a copy to keep a value), as with CUDA graphs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from . import capture, torch_ranges
from .dispatch import MODES
from .errors import SpyreGraphError
from .native import error_for, ffi, lib
from .tensors import copy_plan


def compiling():
    """A block of compile-time work (the backend compiling a graph, which may touch the
    card once), neither recorded by a capture under way nor refused by it."""
    return capture.inside()


class _Launch:
    """One recorded plan launch: a plan, the binding table it runs with, and the step it
    belongs to (to restore the step's mutated inputs if the replay fails inside it)."""

    __slots__ = ("plan", "table", "exe", "first")

    def __init__(self, plan, table, exe, first: bool):
        self.plan, self.table, self.exe, self.first = plan, table, exe, first


class SpyreGraph:
    """A captured sequence of compiled steps and device copies, replayed with one native
    call. See the module docstring."""

    def __init__(self) -> None:
        self._reset_state()

    def _reset_state(self) -> None:
        self._state = "empty"
        self._card = None
        self._epoch = -1
        self._launches: list[_Launch] = []
        self._bound: list[tuple[torch.Tensor, int]] = []  # (tensor, storage address at capture)
        self._keep: list = []  # slots and plans the launches use
        self._swaps = -1
        self._failed = False
        self._native = None

    # ---- capture ----
    def capture_begin(self) -> None:
        if self._state != "empty":
            raise SpyreGraphError("this graph was captured already; reset() it to capture again")
        if capture.current() is not None:
            raise SpyreGraphError("a capture is already under way on this thread")
        self._state = "capturing"
        capture.begin(self)

    def capture_end(self) -> None:
        if self._state != "capturing" or not capture.end(self):
            raise SpyreGraphError("capture_end() without capture_begin() on this thread")
        if self._failed:
            self._reset_state()
            self._state = "failed"
            return
        self._state = "captured"
        self._swaps = capture.storage_swaps
        if self._launches:
            n = len(self._launches)
            plans = ffi.new("spy_plan *[]", [x.plan.handle for x in self._launches])
            tables = ffi.new("uint64_t *[]", [x.table for x in self._launches])
            nbind = ffi.new("uint32_t[]", [x.plan.nbindings for x in self._launches])
            names = ffi.new("uint32_t[]", [x.plan.name for x in self._launches])
            self._native = (n, plans, tables, nbind, names, ffi.new("uint32_t *"), ffi.new("double *"))

    def _bind(self, card, epoch: int, tensors_bound) -> None:
        if self._card is None:
            self._card, self._epoch = card, epoch
        elif card is not self._card:
            raise SpyreGraphError(f"a capture uses one card: {self._card!r} and {card!r}")
        elif epoch != self._epoch:
            raise SpyreGraphError(f"{card!r} was reset during the capture")
        for t in tensors_bound:
            self._bound.append((t, t.untyped_storage().data_ptr()))

    def record_step(self, exe, inputs: list, bases: list[int]) -> list:
        """Run a compiled step's executable once in ``prebuilt`` dispatch with memory the
        graph keeps, and record its launches."""
        try:
            exe.prepare(MODES["prebuilt"])  # what construction refuses runs on the host: known first
            cpu = exe.host_segments()
            if cpu:
                raise SpyreGraphError(
                    f"a compiled step runs {', '.join(_op_name(s) for s in cpu)} on the CPU and cannot be "
                    "captured (a replay makes one call to the card)")
            card = exe.card
            epoch = card.epoch
            self._bind(card, epoch, [t for t in inputs if isinstance(t, torch.Tensor)])
            with capture.inside():
                slot = exe.new_slot(epoch)
                outs = exe.run(inputs, "prebuilt", bases, slot=slot)
                plans = exe.plans(epoch)
        except BaseException:
            self._failed = True
            raise
        self._keep += [slot, plans, exe]
        self._bound += [(t, t.untyped_storage().data_ptr()) for t in slot.outputs]
        self._launches += [_Launch(p, slot.table, exe, i == 0) for i, p in enumerate(plans)]
        return outs

    def record_copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """A device-to-device copy inside a capture: run now and at every replay."""
        try:
            card, plan, table = copy_plan(dst, src)
            self._bind(card, card.epoch, [dst, src])
            with capture.inside():
                plan.launch(table)
        except BaseException:
            self._failed = True
            raise
        self._keep += [plan, table]
        self._launches.append(_Launch(plan, table, None, True))
        return dst

    # ---- replay ----
    def replay(self) -> None:
        """Run everything the capture recorded again, with one native call."""
        native = self._native
        if native is None:
            if self._state == "captured":
                return  # an empty capture
            raise SpyreGraphError(f"replay() of a graph that is {self._state} (capture it first)"
                                  if self._state != "failed" else
                                  "replay() of a graph whose capture failed (reset() it and capture again)")
        if capture.storage_swaps != self._swaps:
            self._check_bound()
        if self._card.epoch != self._epoch:
            raise SpyreGraphError(f"{self._card!r} was reset after this graph was captured: its memory and plans "
                                  "are gone; capture it again (reset() the graph first)")
        if torch_ranges.active():
            with torch_ranges.launch_range(self._card, self._card.intern("graph replay")):
                self._launch(native)
        else:
            self._launch(native)

    def _launch(self, native) -> None:
        n, plans, tables, nbind, names, failed, end = native
        status = lib.spy_plan_launch_many(n, plans, tables, nbind, names, failed, end)
        if status != lib.SPY_OK:
            self._fail(status, int(failed[0]))

    def _fail(self, status: int, index: int) -> None:
        err = error_for(status, "replaying a spyre graph")
        launch = self._launches[index]
        exe = launch.exe
        # the failing step's mutated inputs, unless it failed inside its save jobs
        if exe is not None and exe.save_jobs and not (launch.first and 0 <= getattr(err, "job", -1) < len(exe.save_jobs)):
            exe._restore(launch.table, MODES["prebuilt"])
        raise err

    def _check_bound(self) -> None:
        for i, (t, base) in enumerate(self._bound):
            if t.untyped_storage().data_ptr() != base:
                raise SpyreGraphError(
                    f"a tensor this graph reads or writes (bound tensor {i}, {tuple(t.shape)} {t.dtype}) was pointed "
                    "at other memory since the capture (set_, .data =, resize_); copy_() new values into it "
                    "instead, or capture again")
        self._swaps = capture.storage_swaps

    def stale(self) -> bool:
        """Whether replay() would refuse to run: nothing captured, the card reset since, or
        a bound tensor pointed at other memory."""
        if self._state != "captured":
            return True
        if self._card is not None and self._card.epoch != self._epoch:
            return True
        return any(t.untyped_storage().data_ptr() != base for t, base in self._bound)

    def reset(self) -> None:
        """Drop what was captured (its memory goes when its outputs die)."""
        if self._state == "capturing":
            raise SpyreGraphError("reset() during the capture")
        self._reset_state()

    @property
    def launches(self) -> int:
        """Plan launches a replay makes (in its one native call)."""
        return len(self._launches)


def _op_name(segment) -> str:
    kernel = getattr(segment, "kernel", None)
    if kernel is not None:  # a kernel construction refused
        return f"kernel {kernel}"
    op = getattr(segment, "op", None)
    return getattr(op, "target", None) or getattr(op, "name", None) or "an op"


@contextlib.contextmanager
def graph(g: SpyreGraph) -> Iterator[SpyreGraph]:
    """Capture into `g` the compiled steps and device copies run in the block."""
    if not isinstance(g, SpyreGraph):
        raise TypeError(f"torch.spyre.graph() takes a SpyreGraph, not {type(g).__name__}")
    g.capture_begin()
    try:
        yield g
    finally:
        g.capture_end()


class GraphedCallable:
    """A callable replaying a captured graph: each call copies its tensor arguments into
    the static inputs (when they are other tensors), replays, and returns the static
    outputs, which the next call overwrites."""

    def __init__(self, fn: Callable, g: SpyreGraph, static_inputs: tuple, static_outputs):
        self.fn, self.graph = fn, g
        self.static_inputs, self.static_outputs = static_inputs, static_outputs

    def __call__(self, *args):
        static = self.static_inputs
        if len(args) != len(static):
            raise TypeError(f"the graphed callable takes {len(static)} arguments, {len(args)} given")
        for i, (s, a) in enumerate(zip(static, args, strict=True)):
            if isinstance(s, torch.Tensor):
                if a is s:
                    continue
                if not isinstance(a, torch.Tensor) or a.shape != s.shape or a.dtype != s.dtype:
                    got = f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else type(a).__name__
                    raise SpyreGraphError(f"argument {i}: the graph was captured with a {tuple(s.shape)} {s.dtype} "
                                          f"tensor, not {got}")
                s.copy_(a)
            elif a != s:
                raise SpyreGraphError(f"argument {i}: the graph was captured with {s!r}, not {a!r}")
        self.graph.replay()
        return self.static_outputs


def make_graphed_callables(callables, sample_args, num_warmup_iters: int = 1):
    """Capture each callable (compiled with the ``spyre_rt`` backend) with its sample
    arguments, spyre tensors that become its static inputs, and return callables that
    replay the captures (:class:`GraphedCallable`). A tuple of callables takes a tuple of
    argument tuples and returns a tuple. `num_warmup_iters` calls run first (the first
    compiles)."""
    single = callable(callables) and not isinstance(callables, tuple)
    fns = (callables,) if single else tuple(callables)
    args_of = (tuple(sample_args),) if single else tuple(tuple(a) for a in sample_args)
    if len(fns) != len(args_of):
        raise ValueError(f"{len(fns)} callables and {len(args_of)} sample argument tuples")
    if num_warmup_iters < 1:
        raise ValueError("make_graphed_callables needs at least one warm-up call (it compiles)")
    out = []
    for fn, args in zip(fns, args_of, strict=True):
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.device.type != "spyre":
                raise SpyreGraphError(f"sample argument {i} is on {a.device}: static inputs are spyre tensors")
        for _ in range(num_warmup_iters):
            fn(*args)
        g = SpyreGraph()
        with graph(g):
            static_out = fn(*args)
        out.append(GraphedCallable(fn, g, args, static_out))
    return out[0] if single else tuple(out)


__all__ = ["SpyreGraph", "graph", "make_graphed_callables", "GraphedCallable"]
