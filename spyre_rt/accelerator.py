"""``torch.accelerator``, ``torch.Stream`` and ``torch.Event`` for the card.

torch 2.13 lets a Python backend register a device module, hooks and a device guard
(``_setup_privateuseone_for_python_backend``), but its guard trampoline forwards only
``type_`` to Python and its hooks only ``is_available``, ``is_built`` and
``has_primary_context``; a C++ ``DeviceAllocator`` cannot be registered from Python at
all. So the device-generic calls that end in those C++ interfaces fail for a Python
backend: ``torch.accelerator.synchronize`` raises, the memory calls hit an internal assert
("Allocator for spyre is not a DeviceAllocator"), ``empty_host_cache`` reaches an entry of
the host-allocator registry that only C++ can fill and kills the process (SIGSEGV),
pinning host memory raises, and a ``torch.Event`` of the device cannot be synchronized or
timed.

This module answers them at the narrowest points torch calls through:

- :class:`Hooks`, registered as torch's PrivateUse1 hooks: what the trampoline forwards.
- The ``torch._C._accelerator_*`` entry points that reach the guard or the allocator
  (:data:`ANSWERS`): when the current accelerator is the card, the card answers (the
  allocator's figures, its clock, :mod:`spyre_rt.streams`); for any other accelerator
  torch's own function runs. torch's Python layer above them (argument checks, the
  flattening of ``memory_stats``) is left as it is.
- ``aten::_pin_memory`` of CPU tensors (``pin_memory()``, a ``DataLoader(pin_memory=True)``)
  for the card, whose pinned allocator torch asks the hooks for.
- ``torch.Event`` and ``torch.Stream`` become classes whose call makes a
  :class:`spyre_rt.streams.Event` / ``Stream`` when it names (or defaults to) a spyre
  device, and torch's own object otherwise; ``isinstance`` and ``issubclass`` answer as for
  torch's classes (``torch._C.Event`` / ``torch._C.Stream`` stay torch's).
"""

from __future__ import annotations

import logging

import torch
from torch._C import DispatchKey

from . import card as cards
from . import device_module, dtypes, streams, tensors

_C = torch._C
_log = logging.getLogger("spyre_rt.accelerator")
_get_accelerator = _C._accelerator_getAccelerator


def _card_is_accelerator() -> bool:
    acc = _get_accelerator()
    return acc is not None and acc.type == "spyre"


class Hooks(torch._C._acc.PrivateUse1Hooks):
    """torch's PrivateUse1 hooks for the card (what the pybind trampoline forwards)."""

    def is_available(self) -> bool:
        try:
            return cards.count() > 0
        except Exception as e:  # called from C++: a bad profile means "not available", not a crash
            _log.warning("spyre: the card is not available: %s", e)
            return False

    def has_primary_context(self, dev_id) -> bool:
        return cards.is_open() and 0 <= int(dev_id) < cards.count()

    def is_built(self) -> bool:
        return True


# ---- the torch._C._accelerator_* answers ----

def _is_allocator_initialized() -> bool:
    return cards.is_open()


def _empty_cache() -> None:
    device_module.empty_cache()


def _empty_host_cache() -> None:
    """Nothing to empty: copies read and write the host tensors' own memory; the card keeps
    no cache of host (pinned) memory."""


def _device_stats(device_index: int) -> dict:
    return device_module._allocator_stats(device_index)


def _reset_accumulated(device_index: int) -> None:
    device_module.reset_accumulated_memory_stats(device_index)


def _reset_peak(device_index: int) -> None:
    device_module.reset_peak_memory_stats(device_index)


def _memory_info(device_index: int) -> tuple[int, int]:
    return device_module.mem_get_info(device_index)


def _synchronize(device_index: int) -> None:
    if cards.is_open():  # torch: a no-op before the accelerator is initialised
        device_module.synchronize(device_index)


def _device_capability(device_index: int) -> dict:
    cards.get(device_index)  # validates the index
    return {"supported_dtypes": {d.torch for d in dtypes.TABLE}}


def _get_device_index() -> int:
    return tensors.current_device()


def _set_device_index(device_index: int) -> None:
    if device_index >= 0:
        tensors.set_current_device(device_index)


def _exchange_device(device_index: int) -> int:
    if device_index < 0:
        return -1
    previous = tensors.current_device()
    if device_index != previous:
        tensors.set_current_device(device_index)
    return previous


def _get_stream(device_index: int) -> torch.Stream:
    return streams.current_stream(device_index)


# entry point -> the card's answer, used while the card is the current accelerator
ANSWERS = {
    "_accelerator_isAllocatorInitialized": _is_allocator_initialized,
    "_accelerator_emptyCache": _empty_cache,
    "_accelerator_emptyHostCache": _empty_host_cache,
    "_accelerator_getDeviceStats": _device_stats,
    "_accelerator_resetAccumulatedStats": _reset_accumulated,
    "_accelerator_resetPeakStats": _reset_peak,
    "_accelerator_getMemoryInfo": _memory_info,
    "_accelerator_synchronizeDevice": _synchronize,
    "_accelerator_getDeviceCapability": _device_capability,
    "_accelerator_getDeviceIndex": _get_device_index,
    "_accelerator_setDeviceIndex": _set_device_index,
    "_accelerator_exchangeDevice": _exchange_device,
    "_accelerator_maybeExchangeDevice": _exchange_device,
    "_accelerator_getStream": _get_stream,
}


def _answering(name: str, ours, theirs):
    def entry(*args, **kwargs):
        if _card_is_accelerator():
            return ours(*args, **kwargs)
        return theirs(*args, **kwargs)

    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = theirs.__doc__
    entry.__wrapped__ = theirs
    return entry


def _set_stream_entry(theirs):
    def _accelerator_setStream(stream):
        # by the stream's device, not the accelerator: torch refuses a foreign stream itself
        if isinstance(stream, torch._C.Stream) and stream.device_type == streams.DEVICE_TYPE:
            return streams.set_stream(stream)
        return theirs(stream)

    _accelerator_setStream.__doc__ = theirs.__doc__
    _accelerator_setStream.__wrapped__ = theirs
    return _accelerator_setStream


# ---- pinned host memory ----

def _pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    """aten._pin_memory for CPU tensors. Pinning for the card asks torch for the hooks'
    pinned allocator, which the trampoline does not forward: the card's copies read and write
    any host memory, so the pinned copy of a tensor is a copy in ordinary host memory
    (``is_pinned()`` says False). For another device, torch's own kernel runs."""
    target = _device_named(device)
    if target.type != "spyre":
        return torch.ops.aten._pin_memory.default._op_dk(DispatchKey.CompositeExplicitAutograd, self, device)
    out = torch.empty_strided(self.size(), self.stride(), dtype=self.dtype, device="cpu")
    return out.copy_(self)


_library: torch.library.Library | None = None


# ---- torch.Event and torch.Stream ----

def _device_named(device) -> torch.device:
    if device is None:
        acc = _get_accelerator()
        return acc if acc is not None else torch.device("cpu")
    return torch.device(device)


def _spyre_event(args, kwargs):
    """A device_module.Event for a torch.Event(...) call that names a spyre device, or None."""
    if len(args) > 1:
        return None
    try:
        device = _device_named(args[0] if args else kwargs.get("device"))
    except (RuntimeError, TypeError):
        return None  # torch's own constructor reports the bad argument
    if device.type != "spyre" or set(kwargs) - {"device", "enable_timing", "blocking", "interprocess"}:
        return None
    return streams.Event(enable_timing=kwargs.get("enable_timing", False), blocking=kwargs.get("blocking", False),
                         interprocess=kwargs.get("interprocess", False), device=device)


def _spyre_stream(args, kwargs):
    """A device_module.Stream for a torch.Stream(...) call that names a spyre device, or None."""
    names = ("stream_id", "device_index", "device_type")
    if len(args) == 3 or any(n in kwargs for n in names):  # Stream(stream_id, device_index, device_type)
        ident = dict(zip(names, args, strict=False)) | {n: kwargs[n] for n in names if n in kwargs}
        if ident.get("device_type") != streams.DEVICE_TYPE or len(ident) != 3:
            return None
        return streams.Stream(int(ident["device_index"]), kwargs.get("priority", 0),
                              stream_id=int(ident["stream_id"]))
    if len(args) > 2 or set(kwargs) - {"device", "priority"}:
        return None
    try:
        device = _device_named(args[0] if args else kwargs.get("device"))
    except (RuntimeError, TypeError):
        return None
    if device.type != "spyre":
        return None
    return streams.Stream(device, args[1] if len(args) > 1 else kwargs.get("priority", 0))


def _by_device(torch_type: type, make_spyre) -> type:
    """A subclass of `torch_type` whose call returns make_spyre(args, kwargs) when that is
    not None and torch's own object otherwise; isinstance and issubclass answer as for
    `torch_type`. Subclasses of it are made as classes are."""

    class ByDevice(type):
        def __call__(cls, *args, **kwargs):
            if cls is facade:
                made = make_spyre(args, kwargs)
                return made if made is not None else torch_type(*args, **kwargs)
            return super().__call__(*args, **kwargs)

        def __instancecheck__(cls, obj) -> bool:
            return isinstance(obj, torch_type) if cls is facade else super().__instancecheck__(obj)

        def __subclasscheck__(cls, sub) -> bool:
            return issubclass(sub, torch_type) if cls is facade else super().__subclasscheck__(sub)

    facade = ByDevice(torch_type.__name__, (torch_type,), {
        "__module__": "torch", "__qualname__": torch_type.__name__, "__doc__": torch_type.__doc__,
        "__slots__": (),
    })
    return facade


_installed = False


def _invisible_to_dynamo(*entries) -> None:
    """Dynamo calls ``torch.accelerator.current_stream()`` while it traces a frame, with its
    frame hook on; torch's own entry points are C and never reach that hook, ours are Python
    and would each be traced as a frame of their own (a frame compile per code object,
    and in ``counters["frames"]``). Skip them and what they call, as for C. Set on the code
    objects through the C module, so that importing spyre_rt need not import Dynamo."""
    from torch._C._dynamo import eval_frame

    skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP, eval_frame._FrameAction.SKIP)
    for entry in entries:
        eval_frame.set_code_exec_strategy(entry.__code__, skip)


def install() -> None:
    """Answer torch.accelerator's C++-bound calls for the card and rebind torch.Event and
    torch.Stream (idempotent)."""
    global _installed
    if _installed:
        return
    for name, ours in ANSWERS.items():
        setattr(_C, name, _answering(name, ours, getattr(_C, name)))
    _C._accelerator_setStream = _set_stream_entry(_C._accelerator_setStream)
    _invisible_to_dynamo(*(getattr(_C, name) for name in ANSWERS), _C._accelerator_setStream)
    torch.Event = _by_device(_C.Event, _spyre_event)
    torch.Stream = _by_device(_C.Stream, _spyre_stream)
    global _library
    _library = torch.library.Library("aten", "IMPL", "CPU")
    _library.impl("_pin_memory", _pin_memory)
    _installed = True
