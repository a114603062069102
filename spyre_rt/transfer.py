"""The data-transfer path: host <-> device copies through transfer graphs.

A transfer graph is a DMA program with one scatter-gather descriptor per stick: it moves a
strided device view to or from a contiguous host staging buffer laid out in the view's
memory order, converting between the host's row-major layout and the device's stick
layout on the way. Building one (native/construct.c) costs host time proportional to the
sticks it moves.

In a dispatch mode without prebuilt transfers (``construct``, ``prebuilt-compute``) every
copy builds, validates and submits its graph. With prebuilt transfer graphs
(``prebuilt-transfer`` and ``prebuilt``) a graph is built once per (card, direction,
layout, view geometry) and kept: a copy then only binds the two addresses and submits.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch

from .errors import SpyreError
from .layout import StickLayout
from .native import check, ffi, lib
from .program import JOB_HEADER, built_block

H2D = "h2d"
D2H = "d2h"


class ViewGeometry(NamedTuple):
    """A strided view of a device storage, in logical elements (a tuple: it keys the
    transfer cache on every copy, and tuples are cheap to make and hash)."""

    layout: StickLayout
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]


@functools.lru_cache(maxsize=1024)
def memory_order(sizes: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """Dimensions from outermost to innermost in device memory (size-1 dims first). Every
    copy asks (views repeat, so the answers are kept); `sizes` and `strides` are tuples."""
    return tuple(sorted(range(len(sizes)), key=lambda i: (sizes[i] > 1, -strides[i])))


def _identity(order: tuple[int, ...]) -> bool:
    return all(i == d for i, d in enumerate(order))


def transfer_program(direction: str, view: ViewGeometry) -> np.ndarray:
    """The encoded transfer program of one direction and view geometry: slot 0 is the host
    staging buffer (the view in :func:`memory_order`), slot 1 the device storage; one
    descriptor per stick piece. Built natively (``spy_build_transfer``,
    native/construct.c) from the view, its unit dimensions dropped."""
    dims = [(n, st) for n, st in zip(view.sizes, view.strides, strict=True) if n != 1]
    if len(dims) > lib.SPY_TRANSFER_MAX_DIMS:
        raise SpyreError(f"a transfer of a view with {len(dims)} dimensions longer than 1 (at most "
                         f"{lib.SPY_TRANSFER_MAX_DIMS}): {view.sizes}")
    lay = view.layout
    rec = ffi.new("spy_transfer_record *", {
        "direction": lib.SPY_OP_H2D if direction == H2D else lib.SPY_OP_D2H, "ndims": len(dims),
        "layout": {"rows": lay.rows, "row_len": lay.row_len, "itemsize": lay.itemsize,
                   "stick_bytes": lay.stick_bytes},
        "offset": view.offset, "sizes": [n for n, _ in dims], "strides": [st for _, st in dims]})
    return built_block(lib.spy_build_transfer, rec, f"transfer graph for {direction} of {view.sizes}")


class TransferGraph:
    """A validated transfer program for one direction and view geometry.

    Slot 0 is the host staging buffer, slot 1 the device storage base."""

    __slots__ = ("card", "direction", "handle", "host_nbytes", "ndescs", "name")

    def __init__(self, card, direction: str, view: ViewGeometry):
        self.card = card
        self.direction = direction
        self.host_nbytes = int(math.prod(view.sizes)) * view.layout.itemsize
        blob = transfer_program(direction, view)
        self.ndescs = int(blob[: JOB_HEADER.itemsize].view(JOB_HEADER)["ndescs"][0])
        out = ffi.new("spy_transfer **")
        check(lib.spy_transfer_create(card.handle, ffi.from_buffer(blob), blob.size, out),
              f"transfer graph for {direction} of {view.sizes}")
        self.handle = ffi.gc(out[0], lib.spy_transfer_destroy)
        self.name = card.intern(direction)

    def run(self, host_ptr: int, dev_base: int) -> float:
        end = ffi.new("double *")
        check(lib.spy_transfer_run(self.handle, ffi.new("uint64_t[2]", [host_ptr, dev_base]), 2,
                                   self.name, end), f"{self.direction} copy")
        return end[0]


class TransferCache:
    """Prebuilt transfer graphs of one card, bounded LRU."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._graphs: OrderedDict[tuple, TransferGraph] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, card, direction: str, view: ViewGeometry) -> TransferGraph:
        key = (direction, view)
        with self._lock:
            g = self._graphs.get(key)
            if g is not None:
                self._graphs.move_to_end(key)
                self.hits += 1
                return g
        g = TransferGraph(card, direction, view)
        with self._lock:
            self.misses += 1
            self._graphs[key] = g
            while len(self._graphs) > self.capacity:
                self._graphs.popitem(last=False)
        return g

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()


def graph_for(card, direction: str, view: ViewGeometry, prebuilt: bool) -> TransferGraph:
    if prebuilt:
        return card.transfers.get(card, direction, view)
    return TransferGraph(card, direction, view)


def staging_for(view: ViewGeometry, dtype: torch.dtype) -> tuple[tuple[int, ...], torch.Tensor]:
    """An empty host buffer holding `view` in device memory order, and that order."""
    order = memory_order(view.sizes, view.strides)
    return order, torch.empty([view.sizes[i] for i in order], dtype=dtype)


def to_device(card, src: torch.Tensor, view: ViewGeometry, dev_base: int, prebuilt: bool) -> None:
    """Copy a CPU tensor (already of the destination dtype and shape) into a device view."""
    if not view.sizes or 0 not in view.sizes:
        order = memory_order(view.sizes, view.strides)
        staged = src if _identity(order) else src.permute(order)
        if not staged.is_contiguous():
            staged = staged.contiguous()
        graph_for(card, H2D, view, prebuilt).run(staged.data_ptr(), dev_base)


def from_device(card, view: ViewGeometry, dev_base: int, dtype: torch.dtype, prebuilt: bool) -> torch.Tensor:
    """A new CPU tensor with the values of a device view (waits for the device)."""
    order, staging = staging_for(view, dtype)
    if staging.numel():
        graph_for(card, D2H, view, prebuilt).run(staging.data_ptr(), dev_base)
        card.synchronize()
    return _in_view_order(staging, order)


def empty_host(view: ViewGeometry, dtype: torch.dtype) -> torch.Tensor:
    """A new, unfilled CPU tensor shaped as `view`, its memory in the view's memory order:
    what :func:`from_device` returns, for a tensor that is only to be written."""
    order, staging = staging_for(view, dtype)
    return _in_view_order(staging, order)


def _in_view_order(staging: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    if _identity(order):
        return staging
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return staging.permute(inverse)
