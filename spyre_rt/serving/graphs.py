"""Decode steps captured with ``torch.spyre.graph`` and replayed, as vLLM does with CUDA
graphs, behind the platform's static graph wrapper (vLLM's ``AbstractStaticGraphWrapper``).

vLLM's own dispatcher decides each step's runtime mode and padded batch
(``cudagraph_mode=FULL_DECODE_ONLY``: a batch of one new token per request, padded to a
capture size, runs ``FULL``; everything else ``NONE``) and says so in the forward context.
At start-up (the runner's ``capture_model``) it runs each capture size once in ``FULL``
mode: the wrapper then has the step driver capture that size's decode grid. From then on
the driver replays the capture of a decode grid of that size, in every step that has one
(a pure decode step, or the decodes of a step with prefill chunks).

A capture is made on persistent card inputs (token ids, positions, and the grid's metadata
with the block table as wide as one context bucket), one per batch size and context bucket,
so a capture serves every step of its batch size whose longest request fits its context; a
step copies its values in and replays: one native call, no Dynamo.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context

from spyre_rt.serving.attention import SpyreAttentionMetadata

#: decode grids captured, replayed, and run by the compiled call instead (read by the tests)
STATS = {"captures": 0, "replays": 0, "compiled": 0}
#: replays by the context their block table spans, in blocks
REPLAYED_CONTEXTS: collections.Counter[int] = collections.Counter()


class DecodeGraph:
    """The capture of one decode grid (`size` requests of one token, `blocks` blocks of
    context): its persistent card inputs, the graph, and its static output."""

    def __init__(self, size: int, blocks: int, spare: int, block: int, card: torch.device) -> None:
        self.size, self.blocks = size, blocks
        self.ids = torch.zeros(size, dtype=torch.int64, device=card)
        self.positions = torch.zeros(size, dtype=torch.int64, device=card)
        self.meta = SpyreAttentionMetadata(
            slot_mapping=torch.full((size,), spare * block, dtype=torch.int64, device=card),
            block_table=torch.full((size, blocks), spare, dtype=torch.int64, device=card),
            query_pos=torch.full((size, 1), -1, dtype=torch.int64, device=card),
        )

    def capture(self, forward, use_metadata) -> None:
        """`forward(ids, positions)` on the card; `use_metadata(meta)` makes every layer's
        attention read `meta`. Compiled before the capture, which records the plans' launches."""
        use_metadata(self.meta)
        forward(input_ids=self.ids, positions=self.positions, inputs_embeds=None)
        self.graph = torch.spyre.SpyreGraph()
        with torch.spyre.graph(self.graph):
            self.hidden = forward(input_ids=self.ids, positions=self.positions, inputs_embeds=None)
        STATS["captures"] += 1

    def replay(self, ids: torch.Tensor, positions: torch.Tensor, meta: SpyreAttentionMetadata) -> torch.Tensor:
        """The grid's hidden states on the card, for these host inputs."""
        for static, new in ((self.ids, ids), (self.positions, positions),
                            (self.meta.slot_mapping, meta.slot_mapping), (self.meta.block_table, meta.block_table),
                            (self.meta.query_pos, meta.query_pos)):
            static.copy_(new)
        self.graph.replay()
        STATS["replays"] += 1
        REPLAYED_CONTEXTS[self.blocks] += 1
        return self.hidden


class SpyreGraphWrapper:
    """vLLM's static graph wrapper for a model on the card. `runnable` is the runner's step
    driver (:class:`~spyre_rt.serving.steps.CardModel`), which holds the captures."""

    def __init__(self, runnable, vllm_config, runtime_mode: CUDAGraphMode, **kwargs: Any) -> None:
        if runtime_mode != CUDAGraphMode.FULL:
            raise NotImplementedError(f"spyre_rt: static graphs are whole decode steps (FULL), not {runtime_mode.name}")
        self.runnable = runnable
        self.vllm_config = vllm_config
        self.runtime_mode = runtime_mode

    def __getattr__(self, name: str):
        return getattr(self.__dict__["runnable"], name)   # the model's own attributes

    def unwrap(self):
        return self.runnable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = get_forward_context()
        if context.cudagraph_runtime_mode == self.runtime_mode and context.batch_descriptor is not None:
            self.runnable.capture_decode(context.batch_descriptor.num_tokens)   # once per size, at start-up
        return self.runnable(*args, **kwargs)
