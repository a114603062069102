"""Sorts, top-k, integer histograms, cumulative sums of short rows, and gathers and scatters of
one element per index in short 1-D tensors, as the card computes them: by comparing every
pair.

The card has no sorting network and no scan; it has wide compares, selects and reductions.
For a row of n elements, the rank of element i is how many elements come before it (its
value, then its index for ties), a reduction over n compares; the r-th output is the
element whose rank is r, another. A histogram counts, for each bin, the elements that
fall in it; a cumulative sum adds, for each position, the elements at or before it. Each
costs n² (bins × n) compares where a sequential algorithm costs n log n or n, so it is
used for rows up to MAX_PAIRS compares in all, which covers what a model routes or counts
per step (a mixture-of-experts layer sorts tokens × top_k expert ids and counts them per
expert, takes their weights in that order and inverts the permutation; a decode step
ranks a handful of router logits). Longer rows, and the forms not
decomposed here, stay torch's ops, which run on the CPU inside the step.

Orders are torch's: NaN is the largest value (last ascending, first descending), ties keep
their index order (a stable sort; for an unstable sort or top-k any order of ties is
torch's answer too). Results are exact: a select then a sum of one value and zeros.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten

MAX_PAIRS = 1 << 22  # compares (rows × n × n) a decomposition may make; beyond it torch's op runs


def _fits(rows, n, m) -> bool:
    return rows * n * m <= MAX_PAIRS


def _rank(x: torch.Tensor, descending: bool) -> torch.Tensor:
    """x (..., n) -> the position of each element in the stable sort of its row (int64)."""
    a, b = x.unsqueeze(-1), x.unsqueeze(-2)  # element i along dim -2, element j along dim -1
    if x.is_floating_point():
        an, bn = torch.isnan(a), torch.isnan(b)
        both = ~an & ~bn
        if descending:  # j before i: j is larger (NaN the largest)
            before = (bn & ~an) | (both & (b > a))
        else:           # j before i: j is smaller (NaN after every number)
            before = (an & ~bn) | (both & (b < a))
        tie = (an & bn) | (a == b)
    else:
        before = b > a if descending else b < a
        tie = a == b
    n = x.shape[-1]
    position = torch.arange(n, device=x.device)
    earlier = position.unsqueeze(0) < position.unsqueeze(1)  # (i, j): j < i
    return (before | (tie & earlier)).sum(-1)


def _pick(x: torch.Tensor, rank: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The elements of ranks 0..k-1 of each row, and their indices."""
    n = x.shape[-1]
    hit = rank.unsqueeze(-2) == torch.arange(k, device=x.device).unsqueeze(-1)  # (..., k, n)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    values = torch.where(hit, x.unsqueeze(-2), zero).sum(-1, dtype=x.dtype)
    index = torch.where(hit, torch.arange(n, device=x.device), 0).sum(-1)
    return values, index


def _rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """x with `dim` last (x has a dimension: the callers refuse 0-d), and `dim` from 0."""
    dim = dim % x.dim()
    return x.movedim(dim, -1), dim


def _sortable(x: torch.Tensor) -> bool:
    return x.dtype != torch.bool and not x.is_complex()


def _topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    if not _sortable(x) or x.dim() == 0:
        return NotImplemented
    rows, d = _rows(x, dim)
    n = rows.shape[-1]
    if not _fits(math.prod(rows.shape[:-1]), n, n) or k > n:
        return NotImplemented
    values, index = _pick(rows, _rank(rows, descending=largest), k)
    return values.movedim(-1, d), index.movedim(-1, d)


def _sort(x: torch.Tensor, dim: int = -1, descending: bool = False):
    """A stable sort: the top-k of every element, in order."""
    if x.dim() == 0:
        return NotImplemented
    return _topk(x, x.shape[dim], dim, largest=descending)


def _sort_stable(x: torch.Tensor, *, stable=None, dim: int = -1, descending: bool = False):
    return _sort(x, dim, descending)


def _histc(x: torch.Tensor, bins: int = 100, min=0, max=0):
    """An integer histogram over a given range with integral ends (the router's counts):
    the bin of each element in integer arithmetic, then a count per bin. Other forms
    (floating point, the data's own range) stay torch's op."""
    if x.is_floating_point() or x.dtype == torch.bool or bins <= 0:
        return NotImplemented
    lo, hi = float(min), float(max)
    if not (lo < hi and lo.is_integer() and hi.is_integer()) or not _fits(1, x.numel(), bins):
        return NotImplemented
    lo, hi = int(lo), int(hi)
    v = x.reshape(-1).to(torch.int64)
    inside = (v >= lo) & (v <= hi)
    # floor((v - lo) * bins / (hi - lo)), exact in integers for v in range; hi is the last bin's
    where = torch.clamp(torch.div((v - lo).clamp(min=0) * bins, hi - lo, rounding_mode="floor"), max=bins - 1)
    hit = inside.unsqueeze(0) & (where.unsqueeze(0) == torch.arange(bins, device=x.device).unsqueeze(1))
    return hit.sum(-1).to(x.dtype)


def _cumsum(x: torch.Tensor, dim: int, dtype=None):
    if x.is_complex() or x.dim() == 0:
        return NotImplemented
    out_dtype = dtype or (torch.int64 if not x.is_floating_point() else x.dtype)
    rows, d = _rows(x, dim)
    n = rows.shape[-1]
    if not _fits(math.prod(rows.shape[:-1]), n, n):
        return NotImplemented
    position = torch.arange(n, device=x.device)
    upto = position.unsqueeze(0) <= position.unsqueeze(1)  # (i, j): j <= i
    compute = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    terms = torch.where(upto, rows.to(compute).unsqueeze(-2), torch.zeros((), dtype=compute, device=x.device))
    return terms.sum(-1).to(out_dtype).movedim(-1, d)


def _short_1d(x: torch.Tensor, index: torch.Tensor) -> bool:
    return x.dim() == 1 and not x.is_complex() and index.dtype in (torch.int64, torch.int32) \
        and _fits(1, index.numel(), x.shape[0])


def _element_index(index: torch.Tensor, n) -> torch.Tensor:
    """An index into n elements with torch's rule for negative ones (from the end)."""
    index = index.to(torch.int64)
    return torch.where(index < 0, index + n, index)


def _index(x: torch.Tensor, indices):
    """``x[index]`` of a short 1-D x (one element per index, as a router's weights are
    taken in the order of the sort by expert): for each index, the element whose position
    equals it."""
    if len(indices) != 1 or indices[0] is None or not _short_1d(x, indices[0]):
        return NotImplemented
    n = x.shape[0]
    index = _element_index(indices[0], n)
    hit = index.unsqueeze(-1) == torch.arange(n, device=x.device)  # (..., n)
    return torch.where(hit, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1, dtype=x.dtype)


def _index_put(x: torch.Tensor, indices, values: torch.Tensor, accumulate: bool = False):
    """``x[index] = values`` of a short 1-D x (the inverse of a permutation, say): each
    position takes the value of the last index that names it, as the CPU's loop leaves it,
    or keeps its own; with `accumulate`, adds every value that names it."""
    if len(indices) != 1 or indices[0] is None or not _short_1d(x, indices[0]) or indices[0].dim() != 1:
        return NotImplemented
    n, index = x.shape[0], indices[0]
    m = index.shape[0]
    values = values.to(x.dtype).expand(m)
    hit = _element_index(index, n).unsqueeze(1) == torch.arange(n, device=x.device)  # (m, n)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if accumulate:
        return x + torch.where(hit, values.unsqueeze(1), zero).sum(0, dtype=x.dtype)
    order = torch.arange(m, device=x.device).unsqueeze(1)
    last = torch.where(hit, order, -1).amax(0)  # (n,): the last index naming each position
    taken = torch.where(order == last, values.unsqueeze(1), zero).sum(0, dtype=x.dtype)
    return torch.where(last >= 0, taken, x)


def _index_put_(x: torch.Tensor, indices, values: torch.Tensor, accumulate: bool = False):
    out = _index_put(x, indices, values, accumulate)
    return out if out is NotImplemented else x.copy_(out)


def ranking_decompositions() -> dict:
    return {
        aten.index.Tensor: _index,
        aten.index_put.default: _index_put,
        aten.index_put_.default: _index_put_,
        aten.topk.default: _topk,
        aten.sort.default: _sort,
        aten.sort.stable: _sort_stable,
        aten.histc.default: _histc,
        aten.cumsum.default: _cumsum,
    }
