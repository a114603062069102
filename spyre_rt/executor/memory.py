"""The static memory plan of a compiled step: the layouts of the buffers it owns and their
offsets in one arena.

A step's intermediates live in one arena allocated per call (from a small pool); each takes
the lowest offset free over the interval from its first to its last use (first fit). The
plan depends only on the step description and the card's stick size, so it is made once
per step and shared by every input geometry the step is called with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..dtypes import torch_dtype
from ..ir import StepDesc, resolve_alias
from ..layout import StickLayout, layout_for, storage_numel

ALIGN = 128  # arena regions start on a stick


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class MemoryPlan:
    """Layouts of the step-owned buffers (intermediates and outputs), the arena offset of
    each intermediate and the arena's size."""

    layouts: dict[str, StickLayout]
    arena: dict[str, int]
    arena_bytes: int
    output_bases: tuple[str, ...]   # buffers that hold outputs: fresh memory each call


def root_of(aliases: Mapping[str, tuple], name: str) -> str:
    """The buffer an alias finally names, through `aliases` (alias -> (the buffer it views,
    ...)); a buffer names itself."""
    return resolve_alias(aliases, name)[0]


def base_of(desc: StepDesc, name: str) -> str:
    """The buffer an alias of the step finally names."""
    return root_of(desc.aliases, name)


def plan(desc: StepDesc, stick_bytes: int) -> MemoryPlan:
    output_bases: list[str] = []
    for out in desc.outputs:
        if isinstance(out, dict):  # a size, not a tensor
            continue
        base = base_of(desc, out[0])
        if base in desc.buffers and base not in output_bases:
            output_bases.append(base)
    views = views_of(desc)
    layouts = {}
    for name, b in desc.buffers.items():
        layout = layout_for(b.sizes, b.strides, storage_numel(b.sizes, b.strides, b.offset),
                            torch_dtype(b.dtype).itemsize, stick_bytes)
        if name not in output_bases:  # the step's own buffers: a layout every view suits
            layout = choose_layout(layout, views.get(name, []))
        layouts[name] = layout
    arena, top = _first_fit(desc, layouts, set(output_bases))
    return MemoryPlan(layouts, arena, top, tuple(output_bases))


def views_of(desc: StepDesc) -> dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...]]]]:
    """Every (offset, sizes, strides) through which some kernel touches each buffer."""
    out: dict[str, list] = {}
    for k in desc.kernels.values():
        for buf, offset, sizes, strides in k.views():
            out.setdefault(base_of(desc, buf), []).append((offset, tuple(sizes), tuple(strides)))
    return out


def _first_fit(desc: StepDesc, layouts: dict[str, StickLayout], outputs: set[str]) -> tuple[dict[str, int], int]:
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, item in enumerate(desc.sequence):
        for name in sorted(uses(desc, item)):  # a set: its order differs between processes
            if name in desc.buffers and name not in outputs:
                first.setdefault(name, i)
                last[name] = i
    placed: list[tuple[int, int, int, int]] = []  # (start, end, offset, size)
    offsets, top = {}, 0
    for name in sorted(first, key=lambda n: (first[n], -layouts[n].nbytes, n)):
        size = align(layouts[name].nbytes)
        lo, hi = first[name], last[name]
        busy = sorted((o, o + s) for a, b, o, s in placed if not (b < lo or a > hi))
        off = 0
        for b0, b1 in busy:
            if off + size <= b0:
                break
            off = max(off, b1)
        placed.append((lo, hi, off, size))
        offsets[name] = off
        top = max(top, off + size)
    return offsets, top


def uses(desc: StepDesc, item) -> set[str]:
    """The buffers (their bases) one item of the step's sequence touches."""
    kind, x = item
    if kind == "run":
        return {base_of(desc, b.name) for b in desc.kernels[x].buffers}
    if kind == "cpu":
        return {base_of(desc, name) for name in x.buffer_names()}
    src, _, out = x
    return {base_of(desc, src), base_of(desc, out)}


def byte_range(layout: StickLayout, offset: int, sizes, strides) -> tuple[int, int]:
    """Physical bytes [lo, hi) of a storage that hold every element of a view: the sticks
    of its rows, of the sticks its columns reach when it stays inside one row."""
    if any(n == 0 for n in sizes):
        return 0, 0
    last = offset + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
    r0, c0 = divmod(offset, layout.row_len)
    r1, c1 = divmod(last, layout.row_len)
    s = layout.stick_elems
    k0, k1 = (c0 // s, c1 // s) if r0 == r1 else (0, layout.sticks_per_row - 1)
    return k0 * layout.stick_stride + r0 * layout.stick_bytes, k1 * layout.stick_stride + (r1 + 1) * layout.stick_bytes


def _fits(row_len: int, view) -> bool:
    """No dimension of the view wraps a row of `row_len` elements: dimensions with strides
    below the row stay inside one row, the others move whole rows."""
    offset, sizes, strides = view
    span = offset % row_len
    for n, s in zip(sizes, strides, strict=True):
        if n <= 1 or s == 0:
            continue
        if s >= row_len:
            if s % row_len:
                return False
        else:
            span += (n - 1) * s
    return span < row_len


def choose_layout(own: StickLayout, views) -> StickLayout:
    """The stick layout for a buffer the step owns: rows as its innermost dimension if every
    view fits them, else the shortest wider row that all views fit (at worst one row)."""
    total = own.numel
    if total == 0 or all(_fits(own.row_len, v) for v in views):
        return own
    candidates = sorted({n for n in (_contiguous_extent(v) for v in views) if n and total % n == 0} | {total})
    for n in candidates:
        if n > own.row_len and all(_fits(n, v) for v in views):
            return StickLayout(total // n, n, own.itemsize, own.stick_bytes)
    return StickLayout(1, total, own.itemsize, own.stick_bytes)


def _contiguous_extent(view) -> int:
    """Elements covered by the view's innermost dimensions that are contiguous together."""
    _, sizes, strides = view
    dims = sorted((s, n) for n, s in zip(sizes, strides, strict=True) if n > 1 and s > 0)
    extent = 1
    for s, n in dims:
        if s != extent:
            break
        extent *= n
    return extent
