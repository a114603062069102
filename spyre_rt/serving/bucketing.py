"""Sizes rounded up to buckets, as serving systems do.

A compiled model makes a concrete step, with its plans, for every distinct size it runs at
(see :mod:`spyre_rt.compiler.specialize`). Padding each size up to a bucket bounds the
number of sizes, and so of plans, however many arrive.

- A Hugging Face prompt (:func:`pad_prompt`) is padded on the left with a zero attention
  mask, which is how Hugging Face models take ragged batches: the last position is the
  prompt's own, position ids follow the mask, and padded positions are never attended to,
  so the greedy tokens are those of the unpadded prompt.
- A served step (:mod:`spyre_rt.serving.steps`) is a grid of requests by query tokens:
  the requests are padded to :func:`batch_buckets` and the tokens of each to
  :func:`query_buckets`, and :func:`grid_buckets` is every such grid a step can need. The
  context its attention reads, each request's blocks of the KV cache, is padded to
  :func:`context_buckets`: a step reads the context its longest request needs (at most
  twice that, or the ladder's first rung), not the model's longest length.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

STICK_ELEMENTS = 64  # a 128-byte stick of fp16 values: the card's unit of a row
#: A served step's grid has at least two rows (a lone request is padded with one of no
#: token), and its logits two: Dynamo specializes a dimension it first sees at 1 and then
#: compiles the whole model again for the sizes above (minutes, for an 8B model).
MIN_ROWS = 2
#: The first context bucket, in tokens: a request's attention reads at most this much
#: context more than it needs, and the model's longest length costs log2(that / this) more
#: step shapes at start-up (``SPYRE_RT_VLLM_MIN_CONTEXT``; 0: one bucket, the longest length).
MIN_CONTEXT_TOKENS = 1024


def min_context_tokens() -> int:
    """The first context bucket, in tokens (``SPYRE_RT_VLLM_MIN_CONTEXT``; 0: a step's
    attention always reads the model's longest length)."""
    raw = os.environ.get("SPYRE_RT_VLLM_MIN_CONTEXT", "").strip()
    if not raw:
        return MIN_CONTEXT_TOKENS
    try:
        tokens = int(raw)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ValueError(f"SPYRE_RT_VLLM_MIN_CONTEXT must be a number of tokens (0 or more), not {raw!r}")
    return tokens


def bucket_length(n: int, buckets: Sequence[int] | None = None, multiple: int = STICK_ELEMENTS) -> int:
    """The length a prompt of `n` tokens is padded to: the smallest bucket that holds it, or
    (without buckets, or past the largest) the next multiple of `multiple`."""
    if n < 0:
        raise ValueError(f"a prompt of {n} tokens")
    for b in sorted(buckets or ()):
        if b >= n:
            return b
    return max(multiple, -(-n // multiple) * multiple)


def batch_buckets(most: int, least: int = 1) -> list[int]:
    """Padded numbers of requests: `least` times powers of two up to `most`, and `most`
    (at least `least`)."""
    if most < 1 or least < 1:
        raise ValueError(f"at least one request, not {most} (least {least})")
    sizes, b = [], least
    while b < most:
        sizes.append(b)
        b *= 2
    return [*sizes, max(most, least)]


def query_buckets(longest: int, multiple: int = STICK_ELEMENTS) -> list[int]:
    """Padded query lengths of a prefill chunk: `multiple` times powers of two, up to
    `longest` rounded up to a `multiple`."""
    if longest < 1:
        raise ValueError(f"a query of at least one token, not {longest}")
    top = -(-longest // multiple) * multiple
    sizes, q = [], multiple
    while q < top:
        sizes.append(q)
        q *= 2
    return [*sizes, top]


def context_buckets(max_blocks: int, block_size: int, least_tokens: int) -> list[int]:
    """Padded context widths, in KV cache blocks: the blocks of `least_tokens` times powers
    of two below `max_blocks` (the model's longest length), and `max_blocks`. With
    `least_tokens` 0, `max_blocks` alone."""
    if max_blocks < 1 or block_size < 1 or least_tokens < 0:
        raise ValueError(f"context buckets of {max_blocks} blocks of {block_size} from {least_tokens} tokens")
    sizes, b = [], -(-least_tokens // block_size)
    while 0 < b < max_blocks:
        sizes.append(b)
        b *= 2
    return [*sizes, max_blocks]


def grid_buckets(rows: Sequence[int], longest_query: int, max_tokens: int,
                 multiple: int = STICK_ELEMENTS) -> list[tuple[int, int]]:
    """Every (requests, query length) grid of prefill chunks a step may need, from the
    ladder of `rows` and :func:`query_buckets`, holding at most `max_tokens` cells (a grid
    of the fewest rows and the longest query is always one), smallest first."""
    queries = query_buckets(longest_query, multiple)
    cap = max(max_tokens, rows[0] * queries[-1])
    return sorted(((r, q) for r in rows for q in queries if r * q <= cap), key=lambda g: (g[0] * g[1], g))


def bucket_of(n: int, ladder: Sequence[int]) -> int:
    """The smallest size of `ladder` (ascending) that holds `n`; ValueError past its top."""
    for b in ladder:
        if b >= n:
            return b
    raise ValueError(f"{n} is past the largest bucket, {ladder[-1]}")


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
