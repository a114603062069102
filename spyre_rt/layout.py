"""The stick layout of device tensors.

A device storage holds ``rows x row_len`` elements (``row_len`` is the size of the
innermost dimension of the tensor that created it). The innermost dimension is cut into
128-byte sticks, padded to a whole stick, and sticks are stored stick-major: element
``(r, c)`` lives at ``(c // S) * rows * 128 + r * 128 + (c % S) * itemsize`` where
``S = 128 / itemsize``. A (1024, 256) fp16 tensor is thus stored as (4, 1024, 64).

Torch sees ordinary strided tensors over a flat storage of ``rows * row_len`` logical
elements; every piece of code that touches device memory maps logical element offsets
to physical bytes with :meth:`StickLayout.phys`. The card records the layout of each
storage with its allocation (``spy_malloc_layout``; :meth:`spyre_rt.card.Card.layout_of`
reads it back), and forgets it when the allocation is freed.
"""

from __future__ import annotations

from typing import NamedTuple


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
