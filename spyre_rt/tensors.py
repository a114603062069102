"""Device tensors: allocation, copies and fills.

A spyre tensor is a plain ``torch.Tensor`` on ``spyre:N`` whose storage is a device
allocation: the DLPack import hands torch the device address and a deleter that frees the
allocation (and the stick layout the card records with it) when the last view dies. Torch
sees logical strided storage; the stick layout behind it is the card's record of the
allocation (:meth:`spyre_rt.card.Card.layout_of`). Every copy between host and device goes
through the transfer path (:mod:`spyre_rt.transfer`).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from . import capture, config, dispatch, dtypes
from . import card as cards
from .errors import SpyreError, SpyreGraphError, warn_once
from .layout import StickLayout, layout_for, storage_numel
from .native import error_for, ffi, lib
from .transfer import ViewGeometry, from_device, to_device

KDL_EXT_DEV = 12

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_state = threading.local()


def current_device() -> int:
    device = getattr(_state, "device", None)
    if device is None:  # the thread's first question: LOCAL_RANK's card under torchrun
        from .current_device import first_device

        device = _state.device = first_device(cards.count)
    return device


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
    if capture.capturing:
        capture.refuse("allocating a spyre tensor")
    dtype = dtype or torch.get_default_dtype()
    dtypes.of(dtype)  # rejects unsupported dtypes with a clear error
    if card is None:
        card = cards.get(device_index(device))
    sizes, strides = [int(s) for s in sizes], [int(s) for s in strides]
    layout = layout_for(sizes, strides, storage_numel(sizes, strides), dtype.itemsize, card.profile.stick_bytes)
    return wrap_allocation(card, layout, sizes, strides, dtype)


MAX_DIMS = 64  # DLPack's and the card's limit


class _Call(threading.local):
    """One allocation's arguments to ``spy_dlpack_new_many``, made once per thread: every
    eager op allocates, and fresh cffi buffers per call were a tenth of its cost."""

    def __init__(self) -> None:
        self.layout = ffi.new("spy_layout[1]")
        self.desc = ffi.new("spy_dlpack_tensor[1]")
        self.shape = ffi.new("int64_t[]", MAX_DIMS)
        self.strides = ffi.new("int64_t[]", MAX_DIMS)
        self.desc[0].shape, self.desc[0].strides = self.shape, self.strides
        self.addr = ffi.new("uint64_t[1]")
        self.out = ffi.new("void *[1]")


_call = _Call()


def wrap_allocation(card, layout: StickLayout, sizes, strides, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over a new allocation of `layout` on `card`: the allocation, its layout
    record and its DLPack wrapper in one native call (all or nothing)."""
    ndim = len(sizes)
    if ndim > MAX_DIMS:
        raise SpyreError(f"a spyre tensor has at most {MAX_DIMS} dimensions, not {ndim}")
    c = _call
    rec, desc = c.layout[0], c.desc[0]
    rec.rows, rec.row_len, rec.itemsize, rec.stick_bytes = layout
    c.shape[0:ndim], c.strides[0:ndim] = sizes, strides
    desc.ndim = ndim
    desc.code, desc.bits = dtypes.of(dtype).dlpack
    status = lib.spy_dlpack_new_many(card.handle, 1, c.layout, c.desc, KDL_EXT_DEV, c.addr, c.out)
    if status == lib.SPY_E_OOM:
        raise card.out_of_memory(status, layout.nbytes, f"{layout.nbytes} bytes")
    if status != lib.SPY_OK:
        raise error_for(status, f"allocating {layout.nbytes} bytes on spyre:{card.index}")
    managed = c.out[0]
    try:
        return _adopt(managed)
    except BaseException:
        lib.spy_dlpack_release(managed)
        raise


def _adopt(managed) -> torch.Tensor:
    """The torch tensor of a DLPack managed tensor the card made: torch owns it from here
    (its deleter frees the allocation and its layout record)."""
    return torch._C._from_dlpack(_capsule_new(int(ffi.cast("uintptr_t", managed)), b"dltensor", None))


def empty_many(card, specs) -> list[torch.Tensor]:
    """New device tensors on `card`, one per (layout, sizes, strides, dtype) of `specs`: a
    storage of that stick layout seen with those sizes and strides, with one native call
    (``spy_dlpack_new_many``: allocations, layout records and DLPack wrappers together, all
    or nothing)."""
    n = len(specs)
    if not n:
        return []
    layouts = ffi.new("spy_layout[]", n)
    descs = ffi.new("spy_dlpack_tensor[]", n)
    keep = []
    for i, (layout, sizes, strides, dtype) in enumerate(specs):
        sizes, strides = [int(x) for x in sizes], [int(x) for x in strides]
        layouts[i].rows, layouts[i].row_len, layouts[i].itemsize, layouts[i].stick_bytes = layout
        shape, stride = ffi.new("int64_t[]", sizes or [0]), ffi.new("int64_t[]", strides or [0])
        keep += (shape, stride)
        code, bits = dtypes.of(dtype).dlpack
        descs[i].shape, descs[i].strides, descs[i].ndim = shape, stride, len(sizes)
        descs[i].code, descs[i].bits = code, bits
    addrs = ffi.new("uint64_t[]", n)
    out = ffi.new("void *[]", n)
    status = lib.spy_dlpack_new_many(card.handle, n, layouts, descs, KDL_EXT_DEV, addrs, out)
    if status == lib.SPY_E_OOM:
        need = sum(spec[0].nbytes for spec in specs)
        raise card.out_of_memory(status, need, f"{need} bytes in {n} tensors")
    if status != lib.SPY_OK:
        raise error_for(status, f"allocating {n} tensors on spyre:{card.index}")
    result = []
    try:
        for i in range(n):
            result.append(_adopt(out[i]))
            out[i] = ffi.NULL  # the tensor owns it from here: its deleter frees the allocation
    finally:
        for i in range(n):
            if out[i] != ffi.NULL:
                lib.spy_dlpack_release(out[i])
    return result


def geometry(t: torch.Tensor) -> tuple[cards.Card, ViewGeometry, int]:
    """The card, view geometry and storage base address of a spyre tensor. The card is
    the one that allocated the storage, whichever card set it belongs to."""
    base = t.untyped_storage().data_ptr()
    card = cards.owner(base)
    layout = card.layout_of(base) if card is not None else None
    if layout is None:
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
    return dispatch.named(dispatch.override() or config.settings().dispatch).prebuilt_transfers


class SpyreTimingModeWarning(UserWarning):
    """Values were read from a timing-mode card, which keeps no data: they are zeros."""


def to_host(t: torch.Tensor, leaves_card: bool = True) -> torch.Tensor:
    """The values of a spyre tensor as a new CPU tensor of the same shape and dtype.

    A timing-mode card keeps no data: the transfer is still made (and timed) and the
    values are zeros, with a one-time SpyreTimingModeWarning when they leave the card
    (not for a device-to-device copy staged through the host: its values stay there)."""
    if capture.capturing:
        capture.refuse("reading a spyre tensor on the host")
    card, view, base = geometry(t)
    if view.layout.itemsize != t.element_size():
        out = _reinterpreted(t, _storage_to_host(card, view.layout, base)).clone()
    else:
        out = from_device(card, view, base, t.dtype, _prebuilt_transfers())
    if not card.functional:
        if leaves_card:
            warn_once(f"{card!r}", "runs in timing mode and keeps no tensor data: values read from it are "
                      "zeros (use a functional-mode card for numbers)", SpyreTimingModeWarning)
        out.zero_()
    return out


def upload(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy a CPU tensor into a spyre tensor (broadcasting and converting like copy_)."""
    if capture.capturing:
        capture.refuse("copying host data to a spyre tensor")
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
    if capture.capturing and (g := capture.recording()) is not None:
        return g.record_copy(dst, src)
    src_spyre, dst_spyre = src.device.type == "spyre", dst.device.type == "spyre"
    if src_spyre and dst_spyre:
        # Device to device: through host staging, which also makes overlapping views safe.
        upload(to_host(src, leaves_card=False), dst)
    elif dst_spyre:
        upload(src, dst)
    else:
        dst.copy_(to_host(src))
    return dst


def _dense(sizes, strides) -> bool:
    """Whether a view with these sizes and strides covers its elements once each, densely."""
    expect = 1
    for size, stride in sorted((d for d in zip(sizes, strides, strict=True) if d[0] != 1), key=lambda d: d[1]):
        if stride != expect:
            return False
        expect *= size
    return True


def copy_plan(dst: torch.Tensor, src: torch.Tensor):
    """A device-to-device copy as a graph plan (for a graph capture): (card, plan, binding
    table). The card copies bytes, so both sides must be whole storages of one layout seen
    the same way; anything else is a clear error."""
    from .construct import copy as copies
    from .construct.context import BuildContext
    from .cost import CostModel
    from .plan import GraphPlan, PlanJob, encode

    if src.device.type != "spyre" or dst.device.type != "spyre":
        host = src if src.device.type != "spyre" else dst
        raise SpyreGraphError(f"a copy between {host.device} and spyre inside a spyre graph capture: a capture "
                              "records device-to-device copies only (copy host data in before capturing)")
    card, view_d, base_d = geometry(dst)
    card_s, view_s, base_s = geometry(src)
    if card_s is not card:
        raise SpyreGraphError(f"a copy between {src.device} and {dst.device} inside a spyre graph capture: a capture "
                              "uses one card")
    if (src.dtype != dst.dtype or view_s != view_d or view_d.offset or dst.numel() != view_d.layout.numel
            or not _dense(view_d.sizes, view_d.strides)):
        raise SpyreGraphError(
            "a capture records copies between whole tensors of one dtype, shape, strides and storage layout "
            f"(here {tuple(src.shape)} {src.dtype} -> {tuple(dst.shape)} {dst.dtype}); copy into a tensor "
            "made like the source (torch.empty_like) before capturing")
    layout = view_d.layout
    ctx = BuildContext(CostModel.of_figures(card.profile), {"src": layout, "dst": layout})
    copies.build(ctx, [copies.Copy("src", 0, "dst", 0, layout.nbytes)])
    relocs = tuple((0 if name == "src" else 1, 0) for name in ctx.buffers())
    name = f"graph copy {tuple(dst.shape)}"
    plan = GraphPlan(card, encode([PlanJob(ctx.encode(), relocs, name)], [layout, layout], card.intern), name)
    return card, plan, ffi.new("uint64_t[]", [base_s, base_d])


def fill(dst: torch.Tensor, value) -> torch.Tensor:
    upload(torch.full((), value, dtype=dst.dtype), dst)
    return dst
