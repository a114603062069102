"""Ops whose CPU kernel refuses a dtype that accelerators accept, answered exactly on the host.

An op that runs on the CPU for the card (eagerly, or inside a compiled step) runs torch's
CPU kernel, and the CPU build lacks some dtypes that CUDA's kernels take and that models
written for an accelerator pass: transformers counts the tokens routed to each expert with
``torch.histc`` on int32 when the device is not the CPU, and the CPU's histc takes floating
point only. Each entry here is the same op computed from what the CPU has, with the same
result (values and dtype) that the accelerator's kernel gives.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """histc of an integer tensor, as a bincount of each element's bin. torch's rule: with
    min == max the data's own range is used, widened by one each way if it is one value;
    elements outside [min, max] are not counted; max falls in the last bin. Bin positions
    are computed in float64, exact for every int32 (and every int64 below 2**53)."""
    if x.is_floating_point():
        return aten.histc.default(x, bins, min, max)
    if bins <= 0:
        raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")
    lo, hi = float(min), float(max)
    if lo == hi and x.numel() > 0:
        lo, hi = float(x.min()), float(x.max())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    if lo > hi:
        raise RuntimeError("torch.histc: max must be larger than min")
    v = x.reshape(-1).double()
    v = v[(v >= lo) & (v <= hi)]
    index = ((v - lo) * bins / (hi - lo)).floor().long().clamp_(max=bins - 1)
    return torch.bincount(index, minlength=bins).to(x.dtype)


def _histc_out(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, *, out: torch.Tensor) -> torch.Tensor:
    result = _histc(x, bins, min, max)
    out.resize_(result.shape).copy_(result)
    return out


SUBSTITUTES = {
    aten.histc.default: _histc,
    aten.histc.out: _histc_out,
}


def cpu_kernel(op):
    """The host callable for `op`: its substitute if it has one, else the op itself."""
    return SUBSTITUTES.get(op, op)
