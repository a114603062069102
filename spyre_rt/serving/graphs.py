"""The platform's static graph wrapper (vLLM's ``AbstractStaticGraphWrapper``): decode
steps captured with ``torch.spyre.graph`` and replayed, as vLLM does with CUDA graphs.

vLLM's own dispatcher decides each step's runtime mode and padded batch
(``cudagraph_mode=FULL_DECODE_ONLY``: a batch of one new token per request, padded to a
capture size, runs ``FULL``; everything else ``NONE``) and says so in the forward context.
The wrapper replays the capture of that batch descriptor, captures it the first time (at
start-up, in the runner's ``capture_model``), and calls the model as it is otherwise.

A capture is made on persistent card inputs (token ids, positions, and the attention
metadata with the block table at the model's longest length), so one capture serves every
step of its batch size; a step copies its values in and replays: one native call, no Dynamo.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context

from spyre_rt.serving import attention

_log = logging.getLogger("spyre_rt.serving")

#: decode steps captured and replayed (read by the tests)
STATS = {"captures": 0, "replays": 0}


class _DecodeGraph:
    """One batch size's capture: the persistent card inputs, the graph, its static output."""

    def __init__(self, model, size: int, num_reqs: int) -> None:
        card, spare, block = model.card, model.spare_block, model.block_size
        self.size, self.num_reqs = size, num_reqs
        self.spare, self.block, self.max_blocks = spare, block, model.max_blocks
        self.ids = torch.zeros(size, dtype=torch.int64, device=card)
        self.positions = torch.zeros(size, dtype=torch.int64, device=card)
        self.meta = attention.SpyreAttentionMetadata(
            slot_mapping=torch.full((size,), spare * block, dtype=torch.int64, device=card),
            block_table=torch.full((num_reqs + 1, self.max_blocks), spare, dtype=torch.int64, device=card),
            token_index=torch.arange(size, dtype=torch.int64, device=card),
            query_pos=torch.full((num_reqs + 1, 1), -1, dtype=torch.int64, device=card),
        )

    def capture(self, forward, metas: dict) -> None:
        for name in metas:
            metas[name] = self.meta
        forward(input_ids=self.ids, positions=self.positions, inputs_embeds=None)  # compiles outside
        self.graph = torch.spyre.SpyreGraph()
        with torch.spyre.graph(self.graph):
            self.hidden = forward(input_ids=self.ids, positions=self.positions, inputs_embeds=None)
        STATS["captures"] += 1

    def fits(self, input_ids: torch.Tensor, m: attention.SpyreAttentionMetadata) -> bool:
        return (input_ids.shape[0] == self.size and m.slot_mapping.shape[0] == self.size
                and m.query_pos.shape == (self.num_reqs + 1, 1) and m.block_table.shape[1] <= self.max_blocks
                and torch.equal(m.token_index, torch.arange(self.size)))

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               m: attention.SpyreAttentionMetadata) -> torch.Tensor:
        table = torch.full((self.num_reqs + 1, self.max_blocks), self.spare, dtype=torch.int64)
        table[:, : m.block_table.shape[1]] = m.block_table
        for static, new in ((self.ids, input_ids), (self.positions, positions),
                            (self.meta.slot_mapping, m.slot_mapping), (self.meta.block_table, table),
                            (self.meta.query_pos, m.query_pos)):
            static.copy_(new)
        self.graph.replay()
        STATS["replays"] += 1
        return self.hidden.cpu()


class SpyreGraphWrapper:
    """vLLM's static graph wrapper for a model on the card. `runnable` is the runner's
    :class:`~spyre_rt.serving.worker.CardModel` (host tensors in, the hidden states on the
    host out); its ``on_card`` forward is what a capture records."""

    def __init__(self, runnable, vllm_config, runtime_mode: CUDAGraphMode, **kwargs: Any) -> None:
        if runtime_mode != CUDAGraphMode.FULL:
            raise NotImplementedError(f"spyre_rt: static graphs are whole decode steps (FULL), not {runtime_mode.name}")
        self.runnable = runnable
        self.vllm_config = vllm_config
        self.runtime_mode = runtime_mode
        self._graphs: dict = {}

    def __getattr__(self, name: str):
        return getattr(self.__dict__["runnable"], name)   # the model's own attributes

    def unwrap(self):
        return self.runnable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = get_forward_context()
        if context.cudagraph_runtime_mode != self.runtime_mode or context.batch_descriptor is None:
            return self.runnable(*args, **kwargs)
        desc = context.batch_descriptor
        input_ids, positions = kwargs["input_ids"], kwargs["positions"]
        metas = context.attn_metadata
        (m,) = {id(v): v for v in metas.values()}.values()   # one KV cache group: one metadata
        graph = self._graphs.get(desc)
        if graph is None:
            graph = _DecodeGraph(self.runnable, desc.num_tokens, desc.num_reqs or desc.num_tokens)
            graph.capture(self.runnable.on_card, metas)
            self._graphs[desc] = graph
            return graph.hidden.cpu()
        if not graph.fits(input_ids, m):
            _log.warning("spyre_rt: a step dispatched to the decode graph of %s does not fit it; "
                         "it runs the compiled forward", desc)
            return self.runnable(*args, **kwargs)
        return graph.replay(input_ids, positions, m)

    @property
    def captured(self) -> int:
        return len(self._graphs)
