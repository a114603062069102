"""DMA patterns for strided accesses to stick-layout tensors.

A kernel touches a buffer through an affine access: element ``base + sum(i_d * s_d)`` for a
box of loop indices ``i_d < n_d``. The scratchpad side is a row-major tile (the last
dimension contiguous). On the device the buffer is in the stick layout (see
:mod:`spyre_rt.layout`): logical element ``l = r * N + c`` lives at byte
``(c // S) * stick_stride + r * 128 + (c % S) * e``.

That mapping is affine in the loop indices as long as the column never wraps into the next
row and every dimension moves either whole rows, whole sticks, or stays inside one stick.
A dimension that moves a fraction of a stick (a head dimension of 32 fp16 elements in a
64-element stick) is split into an outer part that moves whole sticks and an inner part
inside the stick. The result is a DMA with a contiguous run and up to three outer
dimensions; more dimensions become several DMA commands. Accesses that cannot be put in
this form raise :class:`NotAffine` and the caller uses a descriptor list.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..layout import StickLayout


class NotAffine(Exception):
    """The access has no compact DMA pattern in the stick layout."""


@dataclass(frozen=True)
class Dim:
    count: int
    src: int  # byte stride on the source side
    dst: int  # byte stride on the destination side


@dataclass(frozen=True)
class Pattern:
    """A DMA: `run` contiguous bytes, repeated over `dims` (innermost first), replicated at
    each of `bases` (pairs of (device byte offset, scratchpad byte offset)) when the access
    needed more than three outer dimensions."""

    run: int
    dims: tuple[Dim, ...]
    bases: tuple[tuple[int, int], ...]

    @property
    def bytes(self) -> int:
        n = self.run
        for d in self.dims:
            n *= d.count
        return n * len(self.bases)


MAX_DIMS = 3


def _merge(dims: list[Dim]) -> list[Dim]:
    """Drop unit dims and fuse neighbours that are contiguous on both sides (innermost first)."""
    out: list[Dim] = []
    for d in dims:
        if d.count == 1:
            continue
        if out and d.src == out[-1].src * out[-1].count and d.dst == out[-1].dst * out[-1].count:
            prev = out.pop()
            d = Dim(prev.count * d.count, prev.src, prev.dst)
        out.append(d)
    return out


def _fold_run(run: int, dims: list[Dim]) -> tuple[int, list[Dim]]:
    """Absorb inner dims that continue the run on both sides into the run."""
    while dims and dims[0].src == run and dims[0].dst == run:
        run *= dims[0].count
        dims = dims[1:]
    return run, dims


def pattern(layout: StickLayout, base: int, counts, strides, lx_strides) -> Pattern:
    """The DMA pattern moving the box ``counts`` of an access into (or out of) a tile.

    `base` and `strides` are in logical elements of the buffer; `lx_strides` are byte
    strides of each dimension on the scratchpad side. When the last dimension walks the
    buffer's row contiguously and is contiguous in the scratchpad it forms the run; it is
    then moved in whole sticks, so its scratchpad rows must be padded to whole sticks."""
    e = layout.itemsize
    n_row = layout.row_len
    s = layout.stick_elems
    sb = layout.stick_bytes
    if base < 0 or any(st < 0 for st in strides):
        raise NotAffine("negative strides or offsets")
    counts = [int(c) for c in counts]
    if any(c <= 0 for c in counts):
        raise NotAffine("empty box")
    if layout.rows <= 1:
        return _linear(e, base, counts, strides, lx_strides)
    r0, c0 = divmod(base, n_row)
    items = list(zip(counts, strides, lx_strides, strict=True))
    inner = None
    if items and items[-1][1] == 1 and items[-1][2] == e and items[-1][0] > 1:
        inner = items.pop()[0]
    dims: list[Dim] = []  # innermost first
    col_span = 0          # furthest column reached beyond c0, in elements
    in_stick = 0          # extent used inside one stick by fractional dims
    for count, stride, lx in reversed(items):  # innermost first
        if count == 1:
            continue
        q, m = divmod(stride, n_row)
        col_span += m * (count - 1)
        if m % s == 0:  # whole rows and whole sticks
            dims.append(Dim(count, q * sb + (m // s) * layout.stick_stride, lx))
            continue
        if s % m:
            raise NotAffine(f"stride {stride} moves part of a {s}-element stick")
        f = s // m  # steps of this dim that fill one stick
        if count <= f:
            dims.append(Dim(count, q * sb + m * e, lx))
            in_stick += m * (count - 1)
        elif count % f == 0:
            dims.append(Dim(f, q * sb + m * e, lx))
            dims.append(Dim(count // f, q * sb * f + layout.stick_stride, lx * f))
            in_stick += m * (f - 1)
        else:
            raise NotAffine(f"stride {stride} over {count} steps does not tile the stick")
    if inner is not None:
        col_span += inner - 1
        if c0 % s == 0 and in_stick == 0 and inner > s:
            run = sb  # whole sticks; the sticks of the run form the innermost dimension
            dims.insert(0, Dim(-(-inner // s), layout.stick_stride, s * e))
        elif (c0 % s) + in_stick + inner <= s:
            run = inner * e
        else:
            raise NotAffine("a contiguous run crosses a stick boundary at an unaligned column")
    else:
        run = e
        if (c0 % s) + in_stick >= s:
            raise NotAffine("offsets inside the stick overflow it")
    if c0 + col_span >= n_row:
        raise NotAffine("the columns of the box wrap into the next row")
    start = (c0 // s) * layout.stick_stride + r0 * sb + (c0 % s) * e
    run, merged = _fold_run(run, _merge(dims))
    bases = [(start, 0)]
    while len(merged) > MAX_DIMS:
        outer = merged.pop()
        bases = [(b + k * outer.src, x + k * outer.dst) for k in range(outer.count) for b, x in bases]
    return Pattern(run, tuple(merged), tuple(bases))


def _linear(e: int, base: int, counts, strides, lx_strides) -> Pattern:
    """A one-row storage is linear memory (its sticks follow each other): any box works."""
    items = list(zip(counts, strides, lx_strides, strict=True))
    run = e
    if items and items[-1][1] == 1 and items[-1][2] == e:
        run = items.pop()[0] * e
    dims = [Dim(c, st * e, lx) for c, st, lx in reversed(items)]
    run, merged = _fold_run(run, _merge(dims))
    bases = [(base * e, 0)]
    while len(merged) > MAX_DIMS:
        outer = merged.pop()
        bases = [(b + k * outer.src, x + k * outer.dst) for k in range(outer.count) for b, x in bases]
    return Pattern(run, tuple(merged), tuple(bases))


def element_offsets(layout: StickLayout, base: int, counts, strides) -> np.ndarray:
    """Physical byte offsets of every element of a box, in row-major box order."""
    idx = np.array([base], dtype=np.int64)
    for count, stride in zip(counts, strides, strict=True):
        idx = (idx[:, None] + np.arange(count, dtype=np.int64) * stride).ravel()
    return layout.phys(idx)


def descriptor_runs(layout: StickLayout, base: int, counts, strides, lx_base: int,
                    lx_strides) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A box with no compact pattern as runs contiguous on both sides: (device byte
    offsets, scratchpad byte offsets, bytes) of each run, for a descriptor-list DMA."""
    phys = element_offsets(layout, base, counts, strides)
    lx = np.array([lx_base], dtype=np.int64)
    for c, s in zip(counts, lx_strides, strict=True):
        lx = (lx[:, None] + np.arange(c, dtype=np.int64) * s).ravel()
    e = layout.itemsize
    brk = np.concatenate(([True], (np.diff(phys) != e) | (np.diff(lx) != e)))
    starts = np.flatnonzero(brk)
    lengths = np.diff(starts, append=phys.size) * e
    return phys[starts], lx[starts], lengths
