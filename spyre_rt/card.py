"""Cards: the simulated devices behind ``spyre:0 .. spyre:N-1``.

A :class:`Card` owns one native device. Cards are opened lazily from the configured
device profile and simulation mode, and are never closed while the process lives: the
deleters of device tensors refer to them. Reconfiguring (:func:`configure`) opens a new
set of cards; the old set stays alive for the tensors that still use it.

Every card opened in the process has an address window of its own (spyre.h), so a device
address names its card (:func:`owner`) even when several sets have a ``spyre:0``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np

from . import config
from .device_profile import DeviceProfile
from .device_profile import load as load_profile
from .errors import SpyreError, SpyreOutOfMemoryError
from .layout import StickLayout
from .native import check, error_for, ffi, lib
from .transfer import TransferCache

MEM_DATA = 0
MEM_CONTROL = 1

# One recorded trace event (spy_trace_event in spyre.h).
TRACE_EVENT = np.dtype([("kind", "u4"), ("core", "u2"), ("engine", "u2"), ("start_ns", "f8"),
                        ("end_ns", "f8"), ("job", "u8"), ("a", "u8"), ("b", "u8")])
EV_JOB, EV_CMD, EV_HOST, EV_LAUNCH, EV_COMPUTE = 1, 2, 3, 4, 5  # EV_COMPUTE: a job's compute span
# The name prefix of a traced host span in which the CPU does the card's work (an op with no
# card kernel, eagerly or inside a step; a kernel run on the host): a step's CPU share.
CPU_SPAN = "cpu "
ENGINE_NAMES = ("load", "store", "pt", "sfu", "ring")
CARD_ENGINE_NAMES = ("pcie-h2d", "pcie-d2h", "ctrl")
CORE_CARD = 0xFFFF
ADDRESS_BASE = int(lib.SPY_ADDRESS_BASE)
WINDOW_SHIFT = int(lib.SPY_ADDRESS_WINDOW_SHIFT)

_by_instance: dict = {}  # instance number (address window) -> Card, for every card opened


class Clock(NamedTuple):
    """A card's clocks at one instant, in ns (spy_clock in spyre.h)."""

    host_ns: int      # the host clock: CPU time of the threads calling into the card, the
                      # card's own work (simulating, walking plans) left out, waits added
    host_wall_ns: int  # the same in wall time (sleeps and load included): reported beside
    finish_ns: float  # end of the last job on the device timeline: where new work queues
    work_ns: float    # the card's own time: the timeline less its idle waits for the host


class Card:
    """One simulated card. Thread-safe: the native device serialises its calls."""

    def __init__(self, profile: DeviceProfile, sim_mode: str, index: int):
        self.profile = profile
        self.sim_mode = sim_mode
        self.index = index
        native_profile = ffi.new("spy_profile *")
        for field, value in profile.native_fields().items():
            setattr(native_profile, field, value)
        out = ffi.new("spy_device **")
        mode = lib.SPY_MODE_TIMING if sim_mode == "timing" else lib.SPY_MODE_FUNCTIONAL
        check(lib.spy_device_open(native_profile, mode, index, out), f"opening spyre:{index}")
        self.handle = out[0]
        self.instance = int(lib.spy_device_instance(self.handle))  # its address window
        self._epoch = int(lib.spy_device_epoch(self.handle))
        _by_instance[self.instance] = self
        self.transfers = TransferCache()
        self.tracing = False  # host spans are recorded only while tracing
        self._names: dict[str, int] = {}
        self._names_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Card spyre:{self.index} {self.profile.name} {self.sim_mode}>"

    @property
    def functional(self) -> bool:
        return self.sim_mode == "functional"

    # ---- memory ----
    def malloc(self, nbytes: int, kind: int = MEM_DATA, layout: StickLayout | None = None) -> int:
        """A new allocation; with a `layout`, the card records it as the stick layout of the
        tensor storage it holds (:meth:`layout_of`), and forgets it when it is freed."""
        out = ffi.new("uint64_t *")
        if layout is None:
            status = lib.spy_malloc(self.handle, nbytes, kind, out)
        else:
            record = ffi.new("spy_layout *", (layout.rows, layout.row_len, layout.itemsize, layout.stick_bytes))
            status = lib.spy_malloc_layout(self.handle, nbytes, kind, record, out)
        if status == lib.SPY_E_OOM:
            raise self.out_of_memory(status, nbytes, f"{nbytes} bytes")
        check(status, f"allocating {nbytes} bytes on spyre:{self.index}")
        return int(out[0])

    def out_of_memory(self, status: int, requested: int, what: str) -> SpyreOutOfMemoryError:
        """The error for an allocation of `requested` bytes (`what`, in words) that did not
        fit: what was asked, what is free, and what to do."""
        err = error_for(status, f"spyre:{self.index}")
        free = self.mem_stats()["free"]
        return SpyreOutOfMemoryError(
            f"{err} (requested {what}, {free} bytes free on spyre:{self.index}; free tensors or call "
            "torch.spyre.empty_cache())", requested=requested, free=free)

    def layout_of(self, addr: int) -> StickLayout | None:
        """The stick layout recorded for the allocation starting at `addr`, or None (no
        allocation starts there, or it records no layout)."""
        out = ffi.new("spy_layout *")
        if lib.spy_layout_of(self.handle, addr, out) != lib.SPY_OK:
            return None
        return StickLayout(out.rows, out.row_len, out.itemsize, out.stick_bytes)

    def free(self, addr: int, epoch: int | None = None) -> None:
        """Free an allocation. With the `epoch` it was made in (:attr:`epoch` read before
        :meth:`malloc`), nothing is freed if the card was reset since: the reset dropped it,
        and the address may now belong to a newer allocation."""
        if epoch is None:
            check(lib.spy_free(self.handle, addr), f"spyre:{self.index}")
        else:
            check(lib.spy_free_epoch(self.handle, addr, epoch), f"spyre:{self.index}")

    @property
    def epoch(self) -> int:
        """The reset epoch: one more after every :meth:`reset`. Addresses, programs and
        plans of an older epoch are gone. Kept here (a card is reset only through
        :meth:`reset`), so that a compiled step's one native call is its launch."""
        return self._epoch

    def empty_cache(self) -> None:
        check(lib.spy_empty_cache(self.handle))

    def mem_stats(self) -> dict[str, float]:
        st = ffi.new("spy_mem_stats *")
        check(lib.spy_mem_stats_get(self.handle, st))
        return {
            name: getattr(st, name)
            for name in (
                "capacity", "allocated", "peak_allocated", "reserved", "peak_reserved", "control", "data_allocated",
                "data_peak", "free",
                "largest_free", "num_allocs", "total_allocs", "total_frees", "num_ooms",
                "fragmentation",
            )
        }

    def reset_peak(self) -> None:
        """Peaks (``peak_allocated``, ``data_peak``, ``peak_reserved``) start again from now."""
        check(lib.spy_mem_reset_peak(self.handle))

    def reset_accumulated(self) -> None:
        """The accumulated counts (``total_allocs``, ``total_frees``, ``num_ooms``) start again."""
        check(lib.spy_mem_reset_accumulated(self.handle))

    def read(self, addr: int, nbytes: int) -> bytes:
        buf = ffi.new("uint8_t[]", nbytes)
        check(lib.spy_mem_read(self.handle, addr, buf, nbytes))
        return bytes(ffi.buffer(buf, nbytes))

    def write(self, addr: int, data: bytes) -> None:
        check(lib.spy_mem_write(self.handle, addr, ffi.from_buffer(data), len(data)))

    # ---- clocks ----
    def host_clock_ns(self) -> int:
        """The host clock: CPU time of the threads calling into the card, less the card's own
        work, plus the waits for it (spy_host_clock_ns; its wall twin is in :meth:`clock`)."""
        return int(lib.spy_host_clock_ns(self.handle))

    def on_cpu(self, name: str, fn, *args):
        """fn(*args): work the CPU does for the card (an op it has no kernel for, with its
        copies), traced while the card traces as a host span named ``CPU_SPAN + name``. The
        span starts when the work can: now, or the card's finish if later (the copy down
        waits for it), so that it does not count the card's time again."""
        if not self.tracing:
            return fn(*args)
        c = self.clock()
        t0 = max(c.host_ns, math.ceil(c.finish_ns))
        try:
            return fn(*args)
        finally:
            self.trace_host_span(CPU_SPAN + name, t0, self.host_clock_ns())

    def device_finish_ns(self) -> float:
        return float(lib.spy_device_finish_ns(self.handle))

    def synchronize(self) -> None:
        check(lib.spy_synchronize(self.handle), f"synchronizing spyre:{self.index}")

    def synchronize_until(self, t_ns: float) -> None:
        """The host waits until the device timeline reaches `t_ns` (no further than its finish)."""
        check(lib.spy_synchronize_until(self.handle, t_ns), f"synchronizing spyre:{self.index}")

    def clock(self) -> Clock:
        """The card's clocks, read at one instant (see :class:`Clock`)."""
        out = ffi.new("spy_clock *")
        check(lib.spy_clock_read(self.handle, out), f"reading the clocks of spyre:{self.index}")
        return Clock(int(out.host_ns), int(out.host_wall_ns), float(out.finish_ns), float(out.work_ns))

    # ---- counters and trace ----
    def counters(self) -> dict[str, float]:
        c = ffi.new("spy_counters *")
        check(lib.spy_counters_get(self.handle, c))
        return {name: getattr(c, name) for name, _ in ffi.typeof("spy_counters").fields}

    def reset_counters(self) -> None:
        check(lib.spy_counters_reset(self.handle))

    def intern(self, name: str) -> int:
        """A small integer naming `name` in the trace (stable for the card's life)."""
        nid = self._names.get(name)
        if nid is None:
            with self._names_lock:
                nid = self._names.get(name)
                if nid is None:
                    nid = int(lib.spy_trace_intern(self.handle, name.encode()))
                    self._names[name] = nid
        return nid

    def name_of(self, nid: int) -> str:
        p = lib.spy_trace_name(self.handle, nid)
        return ffi.string(p).decode() if p != ffi.NULL else ""

    def trace_enable(self, enabled: bool = True, commands: bool = True) -> None:
        """Record jobs, launches and host spans (and every command when `commands`)."""
        check(lib.spy_trace_enable(self.handle, int(enabled), int(commands)))
        self.tracing = enabled

    def trace_host_span(self, name: str, start_ns: int, end_ns: int) -> None:
        check(lib.spy_trace_host_span(self.handle, self.intern(name), start_ns, end_ns))

    def trace_events(self, first: int = 0) -> np.ndarray:
        """The recorded events from `first` on, as a numpy structured array (TRACE_EVENT)."""
        n = int(lib.spy_trace_count(self.handle))
        count = max(0, n - first)
        out = np.zeros(count, dtype=TRACE_EVENT)
        if count:
            got = ffi.new("uint64_t *")
            check(lib.spy_trace_read(self.handle, first, ffi.cast("spy_trace_event *", out.ctypes.data),
                                     count, got))
            out = out[: got[0]]
        return out

    def trace_count(self) -> int:
        return int(lib.spy_trace_count(self.handle))

    def trace_clear(self) -> None:
        check(lib.spy_trace_clear(self.handle))

    def fault_inject(self, kind: str, after: int = 0) -> None:
        kinds = {"none": 0, "command": 1, "dma": 2, "lost": 3}
        check(lib.spy_fault_inject(self.handle, kinds[kind], after))

    def reset(self) -> None:
        """Recover a lost card: every allocation, program and plan on it is dropped and a
        new :attr:`epoch` begins (holders of older addresses free nothing)."""
        try:
            check(lib.spy_device_reset(self.handle))
        finally:
            self._epoch = int(lib.spy_device_epoch(self.handle))


class CardSet:
    def __init__(self, profile: DeviceProfile, sim_mode: str, count: int = 0):
        """`count` cards of `profile` (0: as many as the profile declares)."""
        self.profile = profile
        self.sim_mode = sim_mode
        self.cards = [Card(profile, sim_mode, i) for i in range(count or profile.count)]


_lock = threading.RLock()
_current: CardSet | None = None
_retired: list[CardSet] = []  # every set opened, kept alive: their tensors' deleters refer to them


def _open_default() -> CardSet:
    s = config.settings()
    return CardSet(load_profile(s.device_profile), s.sim_mode, s.device_count)


def card_set() -> CardSet:
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = _open_default()
    return _current


def is_open() -> bool:
    """Whether the current set of cards has been opened (:func:`card_set` opens it)."""
    return _current is not None


def open_set(device_profile: str | None = None, sim_mode: str | None = None) -> CardSet:
    """Open a new set of cards from a profile and simulation mode (defaults: settings),
    without making it current (see :func:`using`). Every set stays open for the tensors
    that use it."""
    s = config.settings()
    profile = load_profile(device_profile or s.device_profile)
    mode = sim_mode or s.sim_mode
    if mode not in config.SIM_MODES:
        raise ValueError(f"sim_mode must be one of {config.SIM_MODES}, not {mode!r}")
    cs = CardSet(profile, mode)
    with _lock:
        _retired.append(cs)
    return cs


def configure(device_profile: str | None = None, sim_mode: str | None = None) -> CardSet:
    """Open a new set of cards and make it current: new ``spyre:N`` tensors go to it.

    Tensors on the previous cards stay valid on those cards."""
    global _current
    cs = open_set(device_profile, sim_mode)
    with _lock:
        _current = cs
    return cs


@contextmanager
def using(cs: CardSet) -> Iterator[CardSet]:
    """Make an open card set current for the duration of a block, then give back the one
    that was current before it."""
    global _current
    with _lock:
        previous = _current
        _current = cs
    try:
        yield cs
    finally:
        with _lock:
            _current = previous


@contextmanager
def configured(device_profile: str | None = None, sim_mode: str | None = None) -> Iterator[CardSet]:
    """Use another profile or simulation mode for the duration of a block."""
    with using(open_set(device_profile, sim_mode)) as cs:
        yield cs


def window_of(addr: int) -> int:
    """The address window (:attr:`Card.instance`) a device address lies in."""
    return (addr - ADDRESS_BASE) >> WINDOW_SHIFT


def owner(addr: int) -> Card | None:
    """The card whose memory `addr` is (of whichever card set), or None."""
    return _by_instance.get(window_of(addr))


def get(index: int) -> Card:
    cs = card_set()
    if not 0 <= index < len(cs.cards):
        raise SpyreError(
            f"spyre:{index} does not exist: the profile {cs.profile.name!r} declares "
            f"{len(cs.cards)} card(s) (spyre:0..spyre:{len(cs.cards) - 1})"
        )
    return cs.cards[index]


def count() -> int:
    return len(card_set().cards)
