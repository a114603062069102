"""What ``"spyre"`` without an index means: the current card, as ``"cuda"`` means the current
CUDA device.

- A process launched by ``torchrun`` starts on the card of its ``LOCAL_RANK`` (one card per
  process); any other starts on ``spyre:0``. :func:`torch.spyre.set_device` and
  ``torch.spyre.device(...)`` change it for the calling thread.
- Factory functions already follow it (their device reaches the card's ``empty`` kernels
  without an index). ``Tensor.to("spyre")`` does not by itself: torch fills the missing
  index from the device guard before dispatch, and the guard a Python backend registers
  reports device 0 (its trampoline forwards only ``type_``). :func:`install` therefore
  gives ``Tensor.to`` the current index for an index-less spyre device, before torch sees
  it; ``Module.to`` goes through it. ``torch.tensor``, ``torch.as_tensor`` and
  ``torch.asarray`` with ``device="spyre"`` make their tensor in C++ and ask the same guard,
  so they are given the index the same way. A device context (``with torch.device("meta")``,
  ``torch.set_default_device``) still gives them its device: torch recognises its factory
  functions by identity (:func:`_keep_device_context`); a context of ``"spyre"`` without an
  index gives them the current card (:func:`_context_device`).
- ``Tensor.new_tensor`` and ``Tensor.new`` make their tensor in C++ from the tensor's
  dispatch key (a device type without an index): they are given the tensor's own card.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

import torch

_first: int | None = None


def first_device(count) -> int:
    """The card a thread starts on: LOCAL_RANK's under torchrun (spyre:0 if the machine's
    profile has fewer cards, with a warning), else spyre:0. `count()` gives the number of
    cards; it is asked (opening the cards) only for a LOCAL_RANK above 0."""
    global _first
    if _first is None:
        local = os.environ.get("LOCAL_RANK", "")
        index = int(local) if local.isdigit() else 0
        if index and index >= (n := count()):
            warnings.warn(f"LOCAL_RANK={index} but the machine has {n} card(s): this process uses spyre:0 "
                          "(one card per process: SPYRE_RT_DEVICE_COUNT, or the profile's [device] count)",
                          stacklevel=3)
            index = 0
        _first = index
    return _first


def _indexed(device):
    """`device` with the current card's index when it names spyre without one."""
    if isinstance(device, str):
        if device != "spyre":
            return device
    elif not isinstance(device, torch.device) or device.type != "spyre" or device.index is not None:
        return device
    return torch.device("spyre", torch.spyre.current_device())


_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    to = torch.Tensor.to

    @functools.wraps(to)
    def to_current(self, *args, **kwargs):
        if args:
            args = (_indexed(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _indexed(kwargs["device"])
        return to(self, *args, **kwargs)

    torch.Tensor.to = to_current
    for name in ("new_tensor", "new"):
        setattr(torch.Tensor, name, _on_own_card(getattr(torch.Tensor, name)))
    originals, wrappers = [], []
    for name in ("tensor", "as_tensor", "asarray"):
        originals.append(getattr(torch, name))
        wrappers.append(_with_current_device(originals[-1]))
        setattr(torch, name, wrappers[-1])
    _keep_device_context(originals)
    _keep_script_builtins(originals, wrappers)
    _installed = True


def _with_current_device(make):
    """`make` (a torch function whose ``device`` is a keyword) with an index-less spyre
    device given the current card's index."""

    @functools.wraps(make)
    def on_current(*args, **kwargs):
        device = kwargs.get("device")
        if device is None:
            device = _context_device()
        if device is not None:
            kwargs["device"] = _indexed(device)
        return make(*args, **kwargs)

    return on_current


def _on_own_card(make):
    """A ``Tensor.new_*`` method that makes its tensor in C++ from the tensor's dispatch key,
    which names the device type without its index (so the guard's device 0), given the
    tensor's own card. ``new`` of a single tensor aliases it and is left alone."""

    legacy_new = make.__name__ == "new"

    @functools.wraps(make)
    def on_own_card(self, *args, **kwargs):
        if self.device.type == "spyre" and kwargs.get("device") is None:
            if legacy_new and not args and not kwargs:
                return self.new_empty((0,))  # new() ignores a device given with no sizes
            if not (legacy_new and len(args) == 1 and isinstance(args[0], torch.Tensor)):
                kwargs["device"] = self.device
        return make(self, *args, **kwargs)

    return on_own_card


def _context_device():
    """The device an active device context (``with torch.device(...)``,
    ``torch.set_default_device``) would give a factory function, if it is spyre without an
    index: the context would hand it on as it is, and the C++ constructor would then ask the
    guard (device 0). Any other context's device is left for the context to give."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            device = mode.device
            return device if device.type == "spyre" and device.index is None else None
    return None


def _keep_script_builtins(originals, wrappers) -> None:
    """TorchScript also recognises torch's functions by identity (``torch.jit._builtins``'
    table, built once): a scripted function that calls ``torch.tensor`` (Hugging Face's
    DeBERTa-v2 scripts one at import) must find the wrapper there as the aten op, or it
    tries to compile the wrapper's Python. A table built after this holds the wrappers
    already: it is made from the functions ``torch`` then holds."""
    builtins = sys.modules.get("torch.jit._builtins")
    table = getattr(builtins, "_builtin_table", None)
    if table is None:
        return
    for original, wrapper in zip(originals, wrappers, strict=True):
        op = table.get(id(original))
        if op is not None:
            table[id(wrapper)] = op


def _keep_device_context(originals) -> None:
    """A device context gives its device to the factory functions in
    ``torch.utils._device._device_constructors()``, a set torch builds on first use from the
    functions ``torch`` then holds (once :func:`install` ran, the wrappers) and tests by
    identity against the function torch dispatches: the C++ original the wrapper calls.
    Without the originals in the set, ``torch.tensor([])`` under ``torch.device("meta")``
    lands on the CPU (and Hugging Face, which asks exactly that to learn whether a model is
    built on the meta device, initialises the meta model and then never its buffers)."""
    import torch.utils._device as device_context

    constructors = device_context._device_constructors

    @functools.lru_cache(1)
    def with_originals():
        return constructors() | set(originals)

    device_context._device_constructors = with_originals
