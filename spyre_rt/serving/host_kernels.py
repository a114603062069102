"""Host-side kernels vLLM's scheduler needs, in torch, in place of its native CPU ones."""

from __future__ import annotations

import torch


def compute_slot_mapping(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc_ptr: torch.Tensor,   # [num_reqs + 1, ...]
    positions_ptr: torch.Tensor,         # [num_tokens]
    block_table_ptr: torch.Tensor,       # [max_num_reqs, max_num_blocks_per_req]
    block_table_stride: int,
    slot_mapping_ptr: torch.Tensor,      # [max_num_tokens], written
    KV_CACHE_BLOCK_SIZE: int,
    TOTAL_CP_WORLD_SIZE: int = 1,
    TOTAL_CP_RANK: int = 0,
    CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,
    PAD_ID: int = -1,
    BLOCK_SIZE: int = 1024,
) -> None:
    """Each scheduled token's KV cache slot: its request's block for its position, and the
    offset in it; the slots from ``num_tokens`` to ``max_num_tokens`` are ``PAD_ID``. The
    parameters are those of vLLM's Triton kernel, which this replaces on the host."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("context parallelism is not supported on the card")
    block = KV_CACHE_BLOCK_SIZE
    bounds = query_start_loc_ptr.to(torch.int64)
    tokens = torch.arange(num_tokens, dtype=torch.int64)
    # the request of each token: the last whose start is at or before it (the starts past the
    # batch's requests are at least num_tokens)
    req = torch.searchsorted(bounds, tokens, right=True) - 1
    pos = positions_ptr[:num_tokens].to(torch.int64)
    blocks = block_table_ptr[req, pos // block].to(torch.int64)
    slot_mapping_ptr[:num_tokens] = blocks * block + pos % block
    slot_mapping_ptr[num_tokens:max_num_tokens] = PAD_ID
