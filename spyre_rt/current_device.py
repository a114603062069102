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
  so they are given the index the same way.
"""

from __future__ import annotations

import functools
import os
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
            warnings.warn(f"LOCAL_RANK={index} but the device profile declares {n} card(s): this process "
                          "uses spyre:0 (declare one card per process in the profile's [device] count)",
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
    for name in ("tensor", "as_tensor", "asarray"):
        setattr(torch, name, _with_current_device(getattr(torch, name)))
    _installed = True


def _with_current_device(make):
    """`make` (a torch function whose ``device`` is a keyword) with an index-less spyre
    device given the current card's index."""

    @functools.wraps(make)
    def on_current(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _indexed(kwargs["device"])
        return make(*args, **kwargs)

    return on_current
