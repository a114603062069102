"""Grouped matmuls over experts, as the card runs them: every expert's product, then a select.

A mixture-of-experts layer sorts its token-expert pairs by expert and multiplies each
expert's run of rows by that expert's weights: ``torch._grouped_mm`` or transformers'
``grouped_mm_fallback`` custom op (which transformers calls under ``torch.compile`` for
dtypes other than bf16), given the runs' ends as offsets. The offsets are data on the card
(a cumulative sum of the router's counts), not sizes a kernel can be built for, so the step
computes every expert's product of every row as one batched matmul and keeps, for each row,
the product of the expert whose run holds it. A row past the last offset (a token dropped
by capacity or sent to another rank) gets zeros, as the fallback op gives it.

The products of the other experts are computed and dropped: E times the multiply-adds of a
grouped kernel, E / top_k times the weight traffic of a decode step. It keeps the experts
on the card with static kernels, exact (a select, not a masked sum, so an inf in a dropped
product cannot become a NaN); a kernel whose row ranges are read from the card is what
would remove the excess.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def grouped_mm_by_select(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(S, K) rows, (E, K, N) weights, (E,) run ends -> (S, N)."""
    experts = weight.shape[0]
    rows = torch.arange(input.shape[0], device=input.device, dtype=offs.dtype)
    # the expert of a row: how many runs end at or before it (E past the last run)
    expert = (rows.unsqueeze(1) >= offs.unsqueeze(0)).sum(1)
    every = torch.bmm(input.to(weight.dtype).unsqueeze(0).expand(experts, -1, -1), weight)  # (E, S, N)
    mine = expert.unsqueeze(0) == torch.arange(experts, device=input.device).unsqueeze(1)  # (E, S)
    kept = torch.where(mine.unsqueeze(2), every, torch.zeros((), dtype=every.dtype, device=every.device))
    return kept.sum(0)


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
    if offs is None or mat_a.dim() != 2 or mat_b.dim() != 3 or bias is not None:
        return NotImplemented  # the other forms of torch._grouped_mm: not decomposed here
    out = grouped_mm_by_select(mat_a, mat_b, offs)
    return out if out_dtype is None else out.to(out_dtype)


def grouped_decompositions() -> dict:
    """The grouped-matmul ops of this torch and of the libraries loaded, to their
    decomposition (transformers registers its op when its MoE integration is imported)."""
    table = {aten._grouped_mm.default: _grouped_mm}
    transformers_ops = torch.ops.transformers
    if hasattr(transformers_ops, "grouped_mm_fallback"):
        table[transformers_ops.grouped_mm_fallback.default] = grouped_mm_by_select
    return table
