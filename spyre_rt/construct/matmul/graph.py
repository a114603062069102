"""Distinct rows of an integer array (attention's construction groups its boxes with it)."""

from __future__ import annotations

import numpy as np


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of each distinct row's first occurrence, in sorted row order; the distinct
    row of each row) of a 2-D array of non-negative integers. The columns are packed into
    one integer key where they fit (a one-dimensional unique is many times faster)."""
    a = np.asarray(a, dtype=np.int64)
    if not len(a) or (a == a[0]).all():  # the common case: every row alike
        return np.zeros(min(len(a), 1), dtype=np.int64), np.zeros(len(a), dtype=np.int64)
    radix = a.max(axis=0) + 1
    if a.size and float(np.prod(radix.astype(float))) < 2.0**62:
        key = a @ np.concatenate([np.cumprod(radix[::-1])[::-1][1:], [1]])
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    else:
        _, first, inverse = np.unique(a, axis=0, return_index=True, return_inverse=True)
    return first, inverse.ravel()
