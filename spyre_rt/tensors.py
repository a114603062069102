"""Device tensors: allocation, copies and fills.

A spyre tensor is a plain ``torch.Tensor`` on ``spyre:N`` whose storage is a device
allocation: the DLPack import hands torch the device address and a deleter that frees the
allocation when the last view dies. Torch sees logical strided storage; the stick layout
behind it lives in :data:`spyre_rt.layout.registry`. Every copy between host and device
goes through the transfer path (:mod:`spyre_rt.transfer`).
"""

from __future__ import annotations

import ctypes
import threading
import warnings

import torch

from . import card as cards
from . import config, dispatch, dtypes
from .errors import SpyreError
from .layout import StickLayout, layout_for, registry, storage_numel
from .native import error_for, ffi, lib
from .transfer import ViewGeometry, from_device, to_device

KDL_EXT_DEV = 12

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_state = threading.local()


def current_device() -> int:
    return getattr(_state, "device", 0)


def set_current_device(index: int) -> None:
    cards.get(index)  # validates the index
    _state.device = index


def device_index(device) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "spyre":
        raise SpyreError(f"expected a spyre device, got {device}")
    return current_device() if device.index is None else device.index


def empty_strided(sizes, strides, dtype: torch.dtype | None = None, device=None, card=None) -> torch.Tensor:
    """A new device tensor with the given geometry (uninitialised), on `card` if given (a
    card of any card set) or else on `device` of the current card set."""
    dtype = dtype or torch.get_default_dtype()
    dtypes.of(dtype)  # rejects unsupported dtypes with a clear error
    if card is None:
        card = cards.get(device_index(device))
    sizes, strides = [int(s) for s in sizes], [int(s) for s in strides]
    layout = layout_for(sizes, strides, storage_numel(sizes, strides), dtype.itemsize, card.profile.stick_bytes)
    return wrap_allocation(card, layout, sizes, strides, dtype)


def wrap_allocation(card, layout: StickLayout, sizes, strides, dtype: torch.dtype) -> torch.Tensor:
    epoch = card.epoch  # before the allocation: a reset in between makes it stale
    addr = card.malloc(layout.nbytes)
    registry.register(addr, layout)
    ndim = len(sizes)
    shape = ffi.new("int64_t[]", sizes or [0])
    stride = ffi.new("int64_t[]", strides or [0])
    out = ffi.new("void **")
    code, bits = dtypes.of(dtype).dlpack
    status = lib.spy_dlpack_wrap(card.handle, addr, ndim, shape, stride, code, bits, KDL_EXT_DEV, out)
    if status != lib.SPY_OK:
        err = error_for(status, "wrapping a device allocation")  # before free() clears the error
        card.free(addr, epoch)
        raise err
    managed = out[0]
    try:
        capsule = _capsule_new(int(ffi.cast("uintptr_t", managed)), b"dltensor", None)
        return torch._C._from_dlpack(capsule)
    except BaseException:
        lib.spy_dlpack_release(managed)
        raise


def geometry(t: torch.Tensor) -> tuple[cards.Card, ViewGeometry, int]:
    """The card, view geometry and storage base address of a spyre tensor. The card is
    the one that allocated the storage, whichever card set it belongs to."""
    base = t.untyped_storage().data_ptr()
    layout = registry.get(base)
    card = cards.owner(base)
    if layout is None or card is None:
        raise SpyreError(
            f"spyre tensor at 0x{base:x} has no known layout; it was not allocated by spyre_rt"
        )
    return card, ViewGeometry(layout, t.storage_offset(), tuple(t.shape), tuple(t.stride())), base


def card_of(t: torch.Tensor) -> cards.Card:
    """The card holding a spyre tensor's storage (of whichever card set)."""
    return geometry(t)[0]


def to_card(src: torch.Tensor, card: cards.Card) -> torch.Tensor:
    """A copy of a CPU tensor on `card` (of any card set), with the strides ``src.to()``
    would give it."""
    strides = torch.empty_like(src, device="meta").stride()
    dst = empty_strided(src.shape, strides, src.dtype, card=card)
    upload(src, dst)
    return dst


def _prebuilt_transfers() -> bool:
    """Whether eager copies use cached transfer graphs: in the dispatch mode of the
    enclosing :func:`~spyre_rt.dispatch.dispatch_mode` block, else the configured one."""
    return (dispatch.override() or config.settings().dispatch) != "construct"


class SpyreTimingModeWarning(UserWarning):
    """Values were read from a timing-mode card, which keeps no data: they are zeros."""


_warned_timing = False


def to_host(t: torch.Tensor) -> torch.Tensor:
    """The values of a spyre tensor as a new CPU tensor of the same shape and dtype.

    A timing-mode card keeps no data: the transfer is still made (and timed) and the
    values are zeros, with a one-time SpyreTimingModeWarning."""
    global _warned_timing
    card, view, base = geometry(t)
    if view.layout.itemsize != t.element_size():
        out = _reinterpreted(t, _storage_to_host(card, view.layout, base)).clone()
    else:
        out = from_device(card, view, base, t.dtype, _prebuilt_transfers())
    if not card.functional:
        if not _warned_timing:
            _warned_timing = True
            warnings.warn(f"{card!r} runs in timing mode and keeps no tensor data: values read from it "
                          "are zeros (use a functional-mode card for numbers)", SpyreTimingModeWarning,
                          stacklevel=3)
        out.zero_()
    return out


def upload(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy a CPU tensor into a spyre tensor (broadcasting and converting like copy_)."""
    card, view, base = geometry(dst)
    if src.dtype != dst.dtype:
        src = src.to(dst.dtype)
    if tuple(src.shape) != tuple(dst.shape):
        src = src.expand(dst.shape)
    if view.layout.itemsize != dst.element_size():
        # a view of other-sized elements (the storage's bytes, say): rewrite its elements in
        # a host copy of the whole storage and put that back
        whole = _storage_to_host(card, view.layout, base)
        _reinterpreted(dst, whole).copy_(src)
        to_device(card, whole, _whole(view.layout), base, _prebuilt_transfers())
        return
    to_device(card, src, view, base, _prebuilt_transfers())


# Element types to move a storage's elements with, bit for bit, by their size.
_BITS = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}  # copies move bits, never convert


def _whole(layout: StickLayout) -> ViewGeometry:
    return ViewGeometry(layout, 0, (layout.rows, layout.row_len), (layout.row_len, 1))


def _storage_to_host(card, layout: StickLayout, base: int) -> torch.Tensor:
    """Every element of a storage, in order, as a host tensor of the storage's element size."""
    return from_device(card, _whole(layout), base, _BITS[layout.itemsize], _prebuilt_transfers())


def _reinterpreted(t: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The view `t` makes of its storage, made of the host copy `whole` of that storage."""
    flat = whole.reshape(-1).view(torch.uint8).view(t.dtype)
    return torch.as_strided(flat, t.shape, t.stride(), t.storage_offset())


def copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` where at least one side is on spyre."""
    src_spyre, dst_spyre = src.device.type == "spyre", dst.device.type == "spyre"
    if src_spyre and dst_spyre:
        # Device to device: through host staging, which also makes overlapping views safe.
        upload(to_host(src), dst)
    elif dst_spyre:
        upload(src, dst)
    else:
        dst.copy_(to_host(src))
    return dst


def fill(dst: torch.Tensor, value) -> torch.Tensor:
    upload(torch.full((), value, dtype=dst.dtype), dst)
    return dst
