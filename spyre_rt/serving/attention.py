"""Paged attention written in torch, so that it runs on the card and compiles with the model.

Each layer's KV cache is one card tensor ``[2, kv_heads, num_blocks + 1, block_size, head_size]``:
the blocks vLLM hands out and one more, the *spare block*, where the slots of padding tokens
are written so that the step needs no branch on them. A step's attention runs on a grid of
``R`` requests by ``Q`` query tokens (:mod:`spyre_rt.serving.steps` lays vLLM's batch out
so), and its metadata is tensors only (no Python numbers that a compiled step would bake in):

- ``slot_mapping [R * Q]``: the cache slot each token's key and value are written to;
- ``block_table [R, B]``: each request's blocks, in order;
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

from spyre_rt.paged_attention import PAGED_ATTENTION
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
    """A grid's metadata, on the card for a compiled step."""

    slot_mapping: torch.Tensor   # [R * Q] int64
    block_table: torch.Tensor    # [R, B] int64
    query_pos: torch.Tensor      # [R, Q] int64

    def to(self, device: torch.device) -> SpyreAttentionMetadata:
        return SpyreAttentionMetadata(*(t.to(device) for t in (self.slot_mapping, self.block_table, self.query_pos)))


@dataclass
class SpyreStepBatch:
    """A step's batch as vLLM describes it, on the host: requests in order, each one's new
    tokens contiguous. What the metadata builder hands the runner's step driver, which lays
    it out as grids (:func:`spyre_rt.serving.steps.layout`)."""

    query_start_loc: torch.Tensor  # [R + 1] int64
    seq_lens: torch.Tensor         # [R] int64
    block_table: torch.Tensor      # [R, vLLM's blocks per request] int64
    slot_mapping: torch.Tensor     # [num_tokens] int64, -1 for a token that writes nothing
    num_tokens: int                # tokens of the step, with vLLM's padding past the last request's
    num_reqs: int

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]


class SpyreAttentionMetadataBuilder(AttentionMetadataBuilder[SpyreStepBatch]):
    # decode steps of one token per request are captured (spyre_rt.serving.graphs)
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> SpyreStepBatch:
        m = common_attn_metadata
        reqs = m.num_reqs
        return SpyreStepBatch(
            query_start_loc=m.query_start_loc_cpu[: reqs + 1].to(torch.int64),
            seq_lens=m.seq_lens[:reqs].to(torch.int64).cpu(),
            block_table=m.block_table_tensor[:reqs].to(torch.int64).cpu(),
            slot_mapping=m.slot_mapping.to(torch.int64).cpu(),
            num_tokens=int(m.slot_mapping.shape[0]), num_reqs=reqs,
        )


def paged_attention(
    query: torch.Tensor,        # [R * Q, H, D]
    key: torch.Tensor,          # [R * Q, KVH, D]
    value: torch.Tensor,        # [R * Q, KVH, D]
    kv_cache: torch.Tensor,     # [2, KVH, N, S, D]
    meta: SpyreAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Writes the grid's keys and values into the cache, then attends: ``[R * Q, H, D]``.

    The cache is head-major, each key one row of ``D``: the attention op
    (:mod:`spyre_rt.paged_attention`) reads each request's keys and values through its row
    of the block table, in place, a gather per block of keys on the card."""
    _, kvh, n_blocks, block, d = kv_cache.shape
    heads = query.shape[1]
    per_head = n_blocks * block
    # one write of the keys and values of every head: row (half, head, slot) of the cache
    # viewed as [2 * KVH * N * S, D]
    rows = torch.arange(2 * kvh, device=query.device)[:, None] * per_head + meta.slot_mapping[None, :]
    new = torch.stack([key, value]).permute(0, 2, 1, 3).reshape(-1, d)
    kv_cache.view(-1, d).index_copy_(0, rows.reshape(-1), new)

    reqs, width = meta.query_pos.shape
    ctx = meta.block_table.shape[1] * block
    # a query at position p sees its request's keys 0..p: a prefill chunk's causal mask and
    # a decode's length mask in one comparison (padding, at -1, sees none)
    visible = torch.arange(ctx, device=query.device)[None, None, :] <= meta.query_pos[:, :, None]
    q = query.view(reqs, width, heads, d).transpose(1, 2)
    out = PAGED_ATTENTION(q, kv_cache[0], kv_cache[1], meta.block_table, visible[:, None], scale)
    return out.transpose(1, 2).reshape(reqs * width, heads, d)


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
        if not isinstance(attn_metadata, SpyreAttentionMetadata):   # a dummy run: no grid, nothing to attend
            return output
        run = paged_attention if _attention_compiled() else _eager_paged_attention
        out = run(query, key, value, kv_cache, attn_metadata, self.scale)
        output.copy_(out.reshape(output.shape))
        return output
