"""Attention over a paged KV cache as one op: what serving calls, what the compiler lowers.

vLLM keeps each layer's keys and values in pages of ``page`` keys, and a request's context
is its pages in the order of its row of the block table. Written in torch, attention would
gather that context into a dense copy before its matmuls read it; as this op, the compiler
lowers it to the card's attention kernel with its loads of keys and values gathered through
the block table (:mod:`spyre_rt.construct.attention`, native/build_attention.c): the cache
is read once, in place. The op's own kernel, its definition, runs where the card does not
take the call.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("spyre_rt::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention over a paged KV cache. query (batch, heads, q_len, dim); key_cache and
    value_cache (kv_heads, pages, page, dim); block_table (batch, width) of page numbers,
    batch element b's keys in its pages in order; mask (batch, 1, q_len, width * page),
    true where a query sees a key. Grouped-query attention is implied by the head counts;
    a query that sees no key attends to nothing (zeros), as the card's kernel answers. The
    result holds the heads inside each position."""
    kv_heads = key_cache.shape[0]
    keys, values = (c[:, block_table.long()].transpose(0, 1).flatten(2, 3) for c in (key_cache, value_cache))
    group = query.shape[1] // kv_heads
    scores = torch.matmul(query.float(), keys.float().repeat_interleave(group, 1).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, -torch.inf)
    seen = mask.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~seen, 0), dim=-1)
    out = torch.matmul(probs, values.float().repeat_interleave(group, 1)).masked_fill(~seen, 0)
    return out.to(query.dtype).transpose(1, 2).contiguous().transpose(1, 2)


@paged_attention.register_fake
def _paged_attention_fake(query, key_cache, value_cache, block_table, mask, scale):
    batch, heads, q_len, _ = query.shape
    return query.new_empty((batch, q_len, heads, value_cache.size(-1))).transpose(1, 2)


PAGED_ATTENTION = torch.ops.spyre_rt.paged_attention.default
