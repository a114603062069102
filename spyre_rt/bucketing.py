"""Prompt lengths rounded up to buckets, as serving systems do.

A compiled model makes a concrete step, with its plans, for every distinct size it runs at
(see :mod:`spyre_rt.compiler.specialize`). Padding each prompt up to a bucket bounds the
number of sizes, and so of plans, however many prompt lengths arrive. The padding goes on
the left with a zero attention mask, which is how Hugging Face models take ragged batches:
the last position is the prompt's own, position ids follow the mask, and padded positions
are never attended to, so the greedy tokens are those of the unpadded prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

STICK_ELEMENTS = 64  # a 128-byte stick of fp16 values: the card's unit of a row


def bucket_length(n: int, buckets: Sequence[int] | None = None, multiple: int = STICK_ELEMENTS) -> int:
    """The length a prompt of `n` tokens is padded to: the smallest bucket that holds it, or
    (without buckets, or past the largest) the next multiple of `multiple`."""
    if n < 0:
        raise ValueError(f"a prompt of {n} tokens")
    for b in sorted(buckets or ()):
        if b >= n:
            return b
    return max(multiple, -(-n // multiple) * multiple)


def pad_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
               buckets: Sequence[int] | None = None, multiple: int = STICK_ELEMENTS,
               pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` (batch, length) and its attention mask, left-padded to the bucket length."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), not {tuple(input_ids.shape)}")
    batch, n = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    extra = bucket_length(n, buckets, multiple) - n
    if not extra:
        return input_ids, attention_mask
    pad_ids = torch.full((batch, extra), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    pad_mask = torch.zeros((batch, extra), dtype=attention_mask.dtype, device=attention_mask.device)
    return torch.cat([pad_ids, input_ids], 1), torch.cat([pad_mask, attention_mask], 1)
