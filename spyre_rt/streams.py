"""Streams and events of the card, shaped like ``torch.cuda``'s (``torch.spyre.Stream``,
``torch.spyre.Event``, ``torch.spyre.stream(s)``, ``current_stream``...).

A card runs its jobs in order on one queue, so every stream of a card is a name for that
queue: work runs in the order it was launched whatever stream is current, a stream waits
for a stream or an event of its own card without doing anything, and synchronizing a
stream waits for the card. Streams exist so that device-generic code (``with
torch.spyre.stream(s)``, ``torch.Stream(device="spyre")``, ``torch.accelerator``'s stream
calls) runs unchanged; each keeps its own identity (``stream_id``) as CUDA's do.

An event is a mark in the queue. It completes when the card has run everything launched
before it was recorded: ``query`` compares that point of the device timeline with the host
clock, ``synchronize`` moves the host clock to it (the host waits). ``elapsed_time``
measures the card's own clock (``spy_clock.work_ns``): the time the card spent on the work
launched between the two events — each job's launch latency and run, each plan upload —
and not the stretches it sat idle because the host had not launched anything yet. Those
belong to the host's speed (``spyre-profile`` reports them as "device waits for host"); on
a real GPU an event pair includes them. So the same work times the same on any host, in
either simulation mode.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import torch

from . import capture, tensors
from . import card as cards
from .errors import SpyreError

# c10::DeviceType of the card: torch.Stream records its device type as this number
DEVICE_TYPE = int(torch._C._autograd.DeviceType.PrivateUse1)
_ids = itertools.count(1)  # stream ids; 0 is each card's default stream
_local = threading.local()  # .current: {card index: Stream}, .entered: [(index, Stream, int)]


class Stream(torch._C.Stream):
    """A stream of a card (``torch.spyre.Stream(device=None, priority=0)``): a name for the
    card's one in-order queue (see the module's docstring). `priority` is accepted for
    compatibility with ``torch.cuda.Stream``; one queue has no priorities.

    It is a ``torch.Stream``, so ``torch.accelerator.set_stream`` and Dynamo accept it."""

    def __new__(cls, device=None, priority: int = 0, *, stream_id: int | None = None):
        index = tensors.device_index(device)
        cards.get(index)  # validates the index
        sid = next(_ids) if stream_id is None else int(stream_id)
        self = super().__new__(cls, stream_id=sid, device_index=index, device_type=DEVICE_TYPE)
        self.priority = int(priority)
        return self

    def __init__(self, device=None, priority: int = 0, *, stream_id: int | None = None):
        pass  # built by __new__ (torch.Stream's constructor takes the identity)

    @property
    def _card(self) -> cards.Card:
        return cards.get(self.device_index)

    def query(self) -> bool:
        """Whether the card has run all the work launched on it (by the host clock now)."""
        clock = self._card.clock()
        return clock.host_ns >= clock.finish_ns

    def synchronize(self) -> None:
        """Wait for the card: the host clock moves to the end of its last job."""
        self._card.synchronize()

    def wait_event(self, event) -> None:
        """Work launched after this call runs after `event` (a no-op on the event's card)."""
        event.wait(self)

    def wait_stream(self, stream) -> None:
        """Work launched after this call runs after the work launched on `stream` so far."""
        other = as_stream(stream)
        if other.device_index != self.device_index:
            self.wait_event(other.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        """Record `event` (a new one if None) at this point of the queue, and return it."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def is_capturing(self) -> bool:
        """Whether this thread is capturing a spyre graph (``torch.spyre.graph``)."""
        return capture.current() is not None

    def __enter__(self) -> Stream:
        _enter(self)
        return self

    def __exit__(self, *exc_info) -> None:
        _exit()

    def __repr__(self) -> str:
        return f"<torch.spyre.Stream spyre:{self.device_index} stream_id={self.stream_id}>"


def as_stream(stream) -> Stream:
    """`stream` as a :class:`Stream`: a ``torch.Stream`` of a card made by torch itself
    (``torch.Stream.__new__`` with spyre's device type) names the same queue."""
    if isinstance(stream, Stream):
        return stream
    if isinstance(stream, torch._C.Stream) and stream.device_type == DEVICE_TYPE:
        return Stream(stream.device_index, stream_id=stream.stream_id)
    raise SpyreError(f"expected a stream of a spyre card, got {stream!r}")


def default_stream(device=None) -> Stream:
    """The card's default stream (``stream_id`` 0)."""
    return Stream(device, stream_id=0)


def current_stream(device=None) -> Stream:
    """This thread's current stream of the card (its default stream unless set)."""
    index = tensors.device_index(device)
    current = getattr(_local, "current", None)
    found = current.get(index) if current else None
    return found if found is not None else default_stream(index)


def set_stream(stream) -> None:
    """Make `stream` this thread's current stream of its card, and its card the current
    device (as ``torch.cuda.set_stream`` does). None does nothing."""
    if stream is None:
        return
    stream = as_stream(stream)
    tensors.set_current_device(stream.device_index)
    if not hasattr(_local, "current"):
        _local.current = {}
    _local.current[stream.device_index] = stream


def _enter(stream: Stream) -> None:
    if not hasattr(_local, "entered"):
        _local.entered = []
    _local.entered.append((stream.device_index, current_stream(stream.device_index), tensors.current_device()))
    set_stream(stream)


def _exit() -> None:
    index, previous_stream, previous_device = _local.entered.pop()
    _local.current[index] = previous_stream
    tensors.set_current_device(previous_device)


@contextlib.contextmanager
def stream(stream):
    """Make `stream` current inside the block (None: do nothing), as ``torch.cuda.stream``."""
    if stream is None:
        yield None
        return
    stream = as_stream(stream)
    _enter(stream)
    try:
        yield stream
    finally:
        _exit()


class Event(torch._C.Event):
    """A mark in a card's queue (``torch.spyre.Event(enable_timing=False, blocking=False,
    interprocess=False, device=None)``), as ``torch.cuda.Event``; ``torch.Event(device="spyre",
    ...)`` makes one too. See the module's docstring for what its times are.

    `blocking` is accepted for compatibility: the host waits for the card by its clock,
    never by spinning, either way. `device` names the card whose current stream
    :meth:`record` uses when given no stream (default: the current device)."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                device=None):
        if interprocess:
            raise SpyreError("spyre events cannot be shared between processes (interprocess=True)")
        index = None if device is None else tensors.device_index(device)
        where = torch.device("spyre", index) if index is not None else torch.device("spyre")
        self = super().__new__(cls, where, enable_timing=bool(enable_timing))
        self.enable_timing = bool(enable_timing)
        self.blocking = bool(blocking)
        self._index = index        # the card it was made for or recorded on
        self._recorded_on = None   # the Card, once recorded
        self._finish_ns = 0.0      # the point of the device timeline where it completes
        self._work_ns = 0.0        # the card's own clock when the card reaches it
        return self

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 device=None):
        pass  # built by __new__

    @property
    def device(self) -> torch.device | None:
        """The card it was recorded on (or made for); None before either."""
        return None if self._index is None else torch.device("spyre", self._index)

    def record(self, stream=None) -> None:
        """Mark the queue of `stream` (default: the current stream) after the work launched
        so far. Recording again moves the mark."""
        capture.refuse("recording an event")
        s = current_stream(self._index) if stream is None else as_stream(stream)
        card = cards.get(s.device_index)
        if self._recorded_on is not None and self._recorded_on is not card:
            raise SpyreError(
                f"the event was recorded on spyre:{self._index}; it cannot be recorded on spyre:{s.device_index}")
        clock = card.clock()
        self._recorded_on, self._index = card, s.device_index
        self._finish_ns, self._work_ns = clock.finish_ns, clock.work_ns

    def query(self) -> bool:
        """Whether the card has reached the event (True if it was never recorded).

        The card's timeline moves with the host clock, which counts host CPU time: a host
        that sleeps between queries does not move it, so wait with :meth:`synchronize`."""
        if self._recorded_on is None:
            return True
        return self._recorded_on.clock().host_ns >= self._finish_ns

    def synchronize(self) -> None:
        """Wait until the card reaches the event: the host clock moves there, no further."""
        if self._recorded_on is not None:
            self._recorded_on.synchronize_until(self._finish_ns)

    def wait(self, stream=None) -> None:
        """Work launched on `stream` (default: the current stream) after this call runs after
        the event. On the event's own card the queue is in order, so this does nothing; on
        another card the host waits for the event before it launches more."""
        if self._recorded_on is None:
            return
        s = current_stream() if stream is None else as_stream(stream)
        if cards.get(s.device_index) is not self._recorded_on:
            self.synchronize()

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds of the card's own time between this event and `end_event`: what the
        card spent on the work launched between them (module docstring). Both events need
        ``enable_timing=True``, to be recorded on one card and to have completed."""
        if not isinstance(end_event, Event):
            raise SpyreError(f"elapsed_time needs another torch.spyre.Event, got {end_event!r}")
        if not (self.enable_timing and end_event.enable_timing):
            raise SpyreError("Both events must be created with argument 'enable_timing=True'.")
        if self._recorded_on is None or end_event._recorded_on is None:
            raise SpyreError("Both events must be recorded before calculating elapsed time.")
        if self._recorded_on is not end_event._recorded_on:
            raise SpyreError(f"the events were recorded on two cards (spyre:{self._index} and "
                             f"spyre:{end_event._index}); their clocks are not one")
        if not (self.query() and end_event.query()):
            raise SpyreError("Both events must be completed before calculating elapsed time "
                             "(synchronize the end event, or the card, first).")
        return (end_event._work_ns - self._work_ns) / 1e6

    def __repr__(self) -> str:
        where = "unrecorded" if self._recorded_on is None else f"recorded on spyre:{self._index}"
        return f"<torch.spyre.Event {where} enable_timing={self.enable_timing}>"
