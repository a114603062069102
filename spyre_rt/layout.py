"""The stick layout of device tensors, and dtype mappings.

A device storage holds ``rows x row_len`` elements (``row_len`` is the size of the
innermost dimension of the tensor that created it). The innermost dimension is cut into
128-byte sticks, padded to a whole stick, and sticks are stored stick-major: element
``(r, c)`` lives at ``(c // S) * rows * 128 + r * 128 + (c % S) * itemsize`` where
``S = 128 / itemsize``. A (1024, 256) fp16 tensor is thus stored as (4, 1024, 64).

Torch sees ordinary strided tensors over a flat storage of ``rows * row_len`` logical
elements; every piece of code that touches device memory maps logical element offsets
to physical bytes with :meth:`StickLayout.phys`. The layout of each live storage is kept
in a registry keyed by its base address: every card opened in the process has its own
address window, so an address names one storage of one card (:func:`spyre_rt.card.owner`).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np


class StickLayout(NamedTuple):
    rows: int
    row_len: int
    itemsize: int
    stick_bytes: int = 128

    @property
    def stick_elems(self) -> int:
        return self.stick_bytes // self.itemsize

    @property
    def sticks_per_row(self) -> int:
        return max(1, -(-self.row_len // self.stick_elems))

    @property
    def numel(self) -> int:
        return self.rows * self.row_len

    @property
    def nbytes(self) -> int:
        """Physical size: whole sticks for every row."""
        return max(1, self.rows) * self.sticks_per_row * self.stick_bytes

    @property
    def stick_stride(self) -> int:
        """Bytes between consecutive sticks of one row."""
        return max(1, self.rows) * self.stick_bytes

    def phys(self, logical):
        """Physical byte offset of logical element offset(s) (int or numpy array)."""
        rows, row_len, itemsize, stick_bytes = self
        r, c = divmod(logical, row_len)  # np.divmod for an array
        q, m = divmod(c, stick_bytes // itemsize)
        return q * (max(1, rows) * stick_bytes) + r * stick_bytes + m * itemsize


def storage_numel(sizes, strides, offset: int = 0) -> int:
    """Elements of storage a view needs: one past its last element (its offset included),
    or none when it is empty (torch's rule)."""
    if any(n == 0 for n in sizes):
        return 0
    return offset + 1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))


def layout_for(sizes, strides, storage_numel: int, itemsize: int, stick_bytes: int = 128) -> StickLayout:
    """The layout a new storage gets from the tensor it is created for: rows as long as the
    tensor's stride-1 dimension (when that divides the storage), otherwise a single row."""
    row_len = next((size for size, stride in zip(sizes, strides, strict=True) if stride == 1 and size > 1), 0)
    if row_len <= 0 or storage_numel % row_len:
        row_len = max(1, storage_numel)
    return StickLayout(storage_numel // row_len, row_len, itemsize, stick_bytes)


class LayoutRegistry:
    """Device base address -> StickLayout of the storage allocated there. Addresses are
    unique among all the cards of the process (each has its own address window), so two
    card sets never share an entry."""

    def __init__(self) -> None:
        self._map: dict[int, StickLayout] = {}
        self._lock = threading.Lock()

    def register(self, addr: int, layout: StickLayout) -> None:
        with self._lock:
            self._map[addr] = layout

    def get(self, addr: int) -> StickLayout | None:
        return self._map.get(addr)

    def forget(self, addr: int) -> None:
        with self._lock:
            self._map.pop(addr, None)

    def __len__(self) -> int:
        return len(self._map)


registry = LayoutRegistry()
