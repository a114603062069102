"""Paged attention written in torch, so that it runs on the card and compiles with the model.

Each layer's KV cache is one card tensor ``[2, kv_heads, num_blocks + 1, block_size, head_size]``:
the blocks vLLM hands out and one more, the *spare block*, where the slots of padding tokens
are written so that the step needs no branch on them. A step's metadata is tensors only
(no Python numbers that a compiled step would bake in):

- ``slot_mapping [T]``: the cache slot each new token's key and value are written to;
- ``block_table [R, B]``: each request's blocks, in order;
- ``token_index [T]``: where each token sits in the ``[R * Q]`` grid of queries, ``Q`` the
  longest query of the step;
- ``query_pos [R, Q]``: each query's position in its sequence, ``-1`` in padding.

A query at position ``p`` sees the keys at positions ``0..p`` of its own request: the causal
mask of a prefill chunk and the length mask of a decode are the one comparison.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from spyre_rt.serving.platform import BLOCK_MULTIPLE


class SpyreAttentionBackend(AttentionBackend):
    # the KV write is part of the attention's own forward, so the whole layer is one graph
    forward_includes_kv_cache_update: bool = True
    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[SpyreAttentionImpl]:
        return SpyreAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[SpyreAttentionMetadataBuilder]:
        return SpyreAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_size)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(BLOCK_MULTIPLE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size: the card pads the innermost dimension to sticks

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class SpyreAttentionMetadata:
    slot_mapping: torch.Tensor   # [T] int64
    block_table: torch.Tensor    # [R, B] int64
    token_index: torch.Tensor    # [T] int64
    query_pos: torch.Tensor      # [R, Q] int64


def step_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    num_reqs: int,
    block_size: int,
    spare_block: int,
) -> SpyreAttentionMetadata:
    """The step's metadata on the host, from vLLM's batch (requests in order, each one's
    query tokens contiguous). One more request than the batch's, of no query, takes the
    padding tokens past the batch's last, and reads only the spare block."""
    qsl = query_start_loc[: num_reqs + 1].to(torch.int64).cpu()
    lens = seq_lens[:num_reqs].to(torch.int64).cpu()
    qlen = qsl[1:] - qsl[:-1]
    n = int(qsl[-1])
    width = max(int(qlen.max()) if num_reqs else 1, num_tokens - n, 1)
    blocks_needed = max(int(((lens + block_size - 1) // block_size).max()), 1) if num_reqs else 1
    table = torch.full((num_reqs + 1, blocks_needed), spare_block, dtype=torch.int64)
    table[:num_reqs] = block_table[:num_reqs, :blocks_needed].to(torch.int64).cpu()

    offs = torch.arange(width, dtype=torch.int64)
    first = lens - qlen                                    # the position of each query's first token
    pos = torch.full((num_reqs + 1, width), -1, dtype=torch.int64)
    pos[:num_reqs] = torch.where(offs[None, :] < qlen[:, None], first[:, None] + offs[None, :], -1)

    req = torch.repeat_interleave(torch.arange(num_reqs, dtype=torch.int64), qlen)
    within = torch.arange(n, dtype=torch.int64) - qsl[req]
    index = num_reqs * width + torch.arange(num_tokens, dtype=torch.int64) - n   # padding: the spare row
    index[:n] = req * width + within

    slots = spare_block * block_size + torch.arange(num_tokens, dtype=torch.int64) % block_size
    given = slot_mapping[:num_tokens].to(torch.int64).cpu()
    keep = (given >= 0) & (torch.arange(num_tokens) < n)
    slots[keep] = given[keep]
    return SpyreAttentionMetadata(slot_mapping=slots, block_table=table, token_index=index, query_pos=pos)


class SpyreAttentionMetadataBuilder(AttentionMetadataBuilder[SpyreAttentionMetadata]):
    # decode steps of one token per request are captured (spyre_rt.serving.graphs)
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.num_blocks = vllm_config.cache_config.num_gpu_blocks

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> SpyreAttentionMetadata:
        m = common_attn_metadata
        return step_metadata(
            m.query_start_loc_cpu, m.seq_lens, m.block_table_tensor, m.slot_mapping,
            num_tokens=m.slot_mapping.shape[0], num_reqs=m.num_reqs,
            block_size=self.block_size, spare_block=self.num_blocks,
        )


def paged_attention(
    query: torch.Tensor,        # [T, H, D]
    key: torch.Tensor,          # [T, KVH, D]
    value: torch.Tensor,        # [T, KVH, D]
    kv_cache: torch.Tensor,     # [2, KVH, N, S, D]
    meta: SpyreAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Writes the step's keys and values into the cache, then attends: ``[T, H, D]``.

    The cache is head-major, so that a request's context gathered by its block table is
    already the ``[KVH, R, ctx, D]`` operand of the score and value matmuls: a gather that
    feeds a matmul through a transposition of its batch dimensions is not a card kernel."""
    _, kvh, n_blocks, block, d = kv_cache.shape
    heads = query.shape[1]
    group = heads // kvh
    per_head = n_blocks * block
    # one write of the keys and values of every head: row (half, head, slot) of the cache
    # viewed as [2 * KVH * N * S, D]
    rows = torch.arange(2 * kvh, device=query.device)[:, None] * per_head + meta.slot_mapping[None, :]
    new = torch.stack([key, value]).permute(0, 2, 1, 3).reshape(-1, d)
    kv_cache.view(-1, d).index_copy_(0, rows.reshape(-1), new)

    reqs, width = meta.query_pos.shape
    ctx = meta.block_table.shape[1] * block
    blocks = meta.block_table.reshape(-1)
    keys = kv_cache[0].index_select(1, blocks).view(kvh, reqs, ctx, d)
    values = kv_cache[1].index_select(1, blocks).view(kvh, reqs, ctx, d)

    q = query.new_zeros(reqs * width, heads, d).index_copy(0, meta.token_index, query)
    q = q.view(reqs, width, kvh, group, d).permute(2, 0, 3, 1, 4).reshape(kvh, reqs, group * width, d)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale               # [KVH, R, G*Q, ctx]
    scores = scores.view(kvh, reqs, group, width, ctx)
    visible = torch.arange(ctx, device=query.device)[None, None, :] <= meta.query_pos[:, :, None]
    scores = scores.masked_fill(~visible[None, :, None, :, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).view(kvh, reqs, group * width, ctx)
    out = torch.matmul(probs, values).view(kvh, reqs, group, width, d)
    # each token's row picked by (request, place) from the attention's own layout: a gather of
    # the [R * Q] grid through a permuted view loses the request stride when compiled
    picked = out[:, meta.token_index // width, :, meta.token_index % width]   # [T, KVH, G, D]
    return picked.reshape(-1, heads, d)


def _attention_compiled() -> bool:
    return os.environ.get("SPYRE_RT_VLLM_ATTENTION", "compiled").strip().lower() != "eager"


# SPYRE_RT_VLLM_ATTENTION=eager runs attention eagerly on the card between the compiled
# pieces of each layer: to tell the attention's compilation from the rest of the model's
_eager_paged_attention = torch.compiler.disable(paged_attention)


class SpyreAttentionImpl(AttentionImpl):
    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
        sliding_window, kv_cache_dtype: str, logits_soft_cap=None, attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name=None, **unused,
    ) -> None:
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise NotImplementedError(
                "spyre_rt attention: ALiBi, sliding windows and logit soft-capping are not supported"
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"spyre_rt attention: {attn_type} attention is not supported")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:   # the profiling run: no cache yet
            return output
        run = paged_attention if _attention_compiled() else _eager_paged_attention
        out = run(query, key, value, kv_cache, attn_metadata, self.scale)
        output.copy_(out.reshape(output.shape))
        return output
