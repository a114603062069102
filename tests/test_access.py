"""DMA patterns of strided accesses in the stick layout, checked element by element."""

import itertools
import random

import numpy as np
import pytest

from spyre_rt.construct.access import NotAffine, descriptor_runs, element_offsets, pattern
from spyre_rt.layout import StickLayout


def expand(p):
    """(scratchpad byte, device byte) of every byte the pattern moves."""
    moved = {}
    for b, x in p.bases:
        for idx in itertools.product(*[range(d.count) for d in p.dims]):
            src = b + sum(k * d.src for k, d in zip(idx, p.dims, strict=True))
            dst = x + sum(k * d.dst for k, d in zip(idx, p.dims, strict=True))
            for j in range(p.run):
                moved[dst + j] = src + j
    return moved


def check(layout, base, counts, strides, lx_strides):
    p = pattern(layout, base, counts, strides, lx_strides)
    moved = expand(p)
    phys = element_offsets(layout, base, counts, strides)
    e = layout.itemsize
    lx = np.array([0], dtype=np.int64)
    for c, s in zip(counts, lx_strides, strict=True):
        lx = (lx[:, None] + np.arange(c) * s).ravel()
    for x, d in zip(lx.tolist(), phys.tolist(), strict=True):
        for j in range(e):
            assert moved.get(x + j) == d + j, (counts, strides, x, d)
    return p


CASES = [
    # layout (rows, N, itemsize), base, counts, strides -> (compact, dims)
    ((16, 256, 2), 0, (16, 256), (256, 1)),            # whole tensor
    ((16, 256, 2), 4 * 256, (4, 128), (256, 1)),       # a row block, half the columns
    ((16, 100, 4), 0, (16, 100), (100, 1)),            # inner size off the 64 grid
    ((64, 32, 4), 0, (2, 32, 32), (1024, 32, 1)),      # KV cache rows
    ((8, 256, 4), 0, (8, 8, 32), (256, 32, 1)),        # heads of 32 in a row of 256 (fp32: 1 stick)
    ((8, 256, 2), 0, (8, 8, 32), (256, 32, 1)),        # heads of 32 in a 64-element stick
    ((8, 256, 2), 16, (8, 8, 16), (256, 32, 1)),       # the second half of each head
    ((32, 128, 2), 0, (4, 8, 128), (1024, 128, 1)),    # 3-d box of whole rows
    ((10, 64, 2), 0, (10, 1), (64, 1)),                # one value per row
    ((1, 512, 2), 64, (300,), (1,)),                   # a 1-row storage
    ((4, 64, 2), 0, (4, 64), (0, 1)),                  # broadcast over rows (stride 0)
    ((6, 64, 2), 0, (64, 6), (1, 64)),                 # transposed: one element per run
    ((2, 4096, 2), 0, (2, 32, 128), (4096, 128, 1)),   # 32 heads of 128
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_patterns_move_exactly_the_box(case):
    (rows, n, e), base, counts, strides = case
    layout = StickLayout(rows, n, e)
    # the scratchpad tile is row-major with rows padded to whole sticks
    s = layout.stick_elems
    inner = -(-counts[-1] // s) * s if strides[-1] == 1 else counts[-1]
    lx = [e]
    acc = inner * e
    for c in reversed(counts[:-1]):
        lx.insert(0, acc)
        acc *= c
    check(layout, base, counts, strides, lx)


def test_compact_when_the_access_is_regular():
    p = pattern(StickLayout(16, 256, 2), 0, (16, 256), (256, 1), (512, 2))
    assert p.run == 128 and len(p.bases) == 1 and [d.count for d in p.dims] == [4, 16]


def test_unexpressible_accesses_say_so():
    with pytest.raises(NotAffine):  # a run crossing a stick at an unaligned column
        pattern(StickLayout(4, 256, 2), 40, (4, 64), (256, 1), (128, 2))
    with pytest.raises(NotAffine):  # columns wrapping into the next row
        pattern(StickLayout(4, 100, 2), 90, (2, 20), (100, 1), (128, 2))


def check_descriptors(layout, base, counts, strides, lx_strides):
    """The descriptor-list fallback of a box with no compact pattern moves every byte."""
    dev, lx0, nbytes = descriptor_runs(layout, base, counts, strides, 0, lx_strides)
    moved = {}
    for d, x, n in zip(dev.tolist(), lx0.tolist(), nbytes.tolist(), strict=True):
        for j in range(n):
            moved[x + j] = d + j
    phys = element_offsets(layout, base, counts, strides)
    lx = np.array([0], dtype=np.int64)
    for c, s in zip(counts, lx_strides, strict=True):
        lx = (lx[:, None] + np.arange(c) * s).ravel()
    for x, d in zip(lx.tolist(), phys.tolist(), strict=True):
        for j in range(layout.itemsize):
            assert moved.get(x + j) == d + j, (counts, strides, x, d)


# Random views are often not affine in the stick layout (a row split at an offset inside a
# stick); those go through descriptor lists, checked too. At most this share may be.
MAX_NOT_AFFINE = 0.5


def test_random_boxes():
    rng = random.Random(7)
    compact = descriptors = 0
    while compact < 60:
        e = rng.choice([1, 2, 4, 8])
        n = rng.choice([16, 32, 48, 64, 96, 128, 200, 256, 512])
        rows = rng.randint(1, 12)
        layout = StickLayout(rows, n, e)
        # a view: pick a box inside a (rows, n) tensor, optionally splitting the row
        r0, r1 = sorted(rng.sample(range(rows + 1), 2))
        c0 = rng.randrange(0, n)
        c1 = rng.randrange(c0 + 1, n + 1)
        split = rng.choice([1, 2, 4, 8])
        width = c1 - c0
        if width % split:
            continue
        counts = (r1 - r0, split, width // split)
        strides = (n, width // split, 1)
        s = layout.stick_elems
        inner = -(-counts[-1] // s) * s
        lx = (split * inner * e, inner * e, e)
        try:
            check(layout, r0 * n + c0, counts, strides, lx)
            compact += 1
        except NotAffine:
            check_descriptors(layout, r0 * n + c0, counts, strides, lx)
            descriptors += 1
    share = descriptors / (compact + descriptors)
    assert share <= MAX_NOT_AFFINE, f"{descriptors} of {compact + descriptors} random boxes had no compact pattern"
