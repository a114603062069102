"""The step driver of the card's model runner: each vLLM step run as grids of fixed shapes.

vLLM hands the runner a flat batch: each request's new tokens one after another, one token
for a decode, many for a prefill chunk, in any mix and number. A compiled step is built
once per shape, so the driver lays the batch out as grids of ``[requests, query tokens]``
whose sizes come from bucket ladders (:mod:`spyre_rt.serving.bucketing`):

- the step's decodes (one token each) as one grid of a padded batch size, the shape of a
  captured decode step (:mod:`spyre_rt.serving.graphs`), replayed when captured;
- its prefill chunks in grids of padded request counts and query lengths, each holding at
  most ``max_num_batched_tokens`` cells, requests taken in order while the grid's shape is
  one of the set.

A grid's block table, the context its attention gathers and reads, is as wide as the
context bucket of its longest request (:func:`~spyre_rt.serving.bucketing.context_buckets`),
so a step's attention costs what its requests need, not the model's longest length.

Padding cells write their keys and values into the spare block and attend to nothing of a
request's, so every request's tokens are those it would get alone. The set of shapes is
bounded by the ladders and built at start-up (:meth:`CardModel.build_steps`, a progress
bar), so no request waits for a compile. Each grid's attention metadata goes to the card
and into the forward context for the grid's call; its hidden states come back to the host
into the rows of vLLM's batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from spyre_rt.serving.attention import SpyreAttentionMetadata, SpyreStepBatch
from spyre_rt.serving.bucketing import (
    MIN_CONTEXT_TOKENS,
    MIN_ROWS,
    STICK_ELEMENTS,
    batch_buckets,
    bucket_of,
    context_buckets,
    grid_buckets,
)
from spyre_rt.serving.graphs import STATS, DecodeGraph


@dataclass(frozen=True)
class Shapes:
    """The bounded set of step shapes of a served model."""

    decode: tuple[int, ...]                 # padded decode batch sizes
    prefill: frozenset[tuple[int, int]]     # (requests, query length) grids of prefill chunks
    logits: tuple[int, ...]                 # padded rows of the logits of the sampled tokens
    prompt_logits: tuple[int, ...]          # and of prompt logprobs, past those (built when first asked)
    contexts: tuple[int, ...]               # padded context widths, in KV cache blocks
    block: int                              # tokens of a KV cache block

    @classmethod
    def of(cls, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
           block: int = STICK_ELEMENTS, least_context: int = MIN_CONTEXT_TOKENS) -> Shapes:
        longest = min(max_model_len, max_num_batched_tokens)
        rows = batch_buckets(max_num_seqs, least=MIN_ROWS)
        return cls(decode=tuple(rows),
                   prefill=frozenset(grid_buckets(rows, longest, max_num_batched_tokens)),
                   logits=tuple(rows),
                   prompt_logits=tuple(batch_buckets(max(max_num_seqs, max_num_batched_tokens), least=MIN_ROWS)),
                   contexts=tuple(context_buckets(-(-max_model_len // block), block, least_context)),
                   block=block)

    def logits_rows(self, rows: int) -> int:
        """The padded rows of a logits call of `rows` rows."""
        if rows <= self.logits[-1]:
            return bucket_of(rows, self.logits)
        return bucket_of(rows, self.prompt_logits) if rows <= self.prompt_logits[-1] else rows

    def prefill_grids(self) -> list[tuple[int, int]]:
        return sorted(self.prefill, key=lambda g: (g[0] * g[1], g))

    def context_of(self, seq_lens: Sequence[int]) -> int:
        """The context bucket (blocks) of a grid of requests whose sequences are `seq_lens`
        tokens long, the new ones included."""
        return bucket_of(max([1, *(-(-n // self.block) for n in seq_lens)]), self.contexts)

    def steps(self) -> list[tuple[int, int, int]]:
        """(requests, query length, context blocks) of every step shape the set can run:
        each decode size with each context, and each prefill grid with each context that
        can hold its longest request (whose query is longer than the next narrower grid's)."""
        widths = sorted({w for _, w in self.prefill})
        out = [(rows, 1, ctx) for rows in self.decode for ctx in self.contexts]
        for rows, width in self.prefill_grids():
            narrower = max((w for w in widths if w < width), default=1)
            out += [(rows, width, ctx) for ctx in self.contexts if ctx * self.block > narrower or ctx == self.contexts[-1]]
        return out


@dataclass
class Grid:
    """Some of a step's requests laid out as ``rows`` x ``width`` cells: the cells' token ids
    and positions come from vLLM's tokens ``source`` (``-1``: a padding cell)."""

    rows: int
    width: int
    source: torch.Tensor             # [rows * width] int64
    meta: SpyreAttentionMetadata     # on the host

    @property
    def blocks(self) -> int:
        """The context its attention reads, in KV cache blocks (its block table's width)."""
        return self.meta.block_table.shape[1]

    def inputs(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = self.source >= 0
        ids = torch.zeros(self.source.shape[0], dtype=torch.int64)
        pos = torch.zeros(self.source.shape[0], dtype=torch.int64)
        ids[keep] = input_ids[self.source[keep]].to(torch.int64)
        pos[keep] = positions[self.source[keep]].to(torch.int64)
        return ids, pos


def layout(batch: SpyreStepBatch, reqs: Sequence[int], rows: int, width: int, *, block: int, spare: int,
           blocks: int) -> Grid:
    """The requests `reqs` of `batch` (each at most `width` new tokens, and at most `blocks`
    blocks of context) as a grid, padded with requests of no token: padding cells write the
    spare block and see no key."""
    cells = rows * width
    offs = torch.arange(width, dtype=torch.int64)
    slots = (spare * block + torch.arange(cells, dtype=torch.int64) % block).view(rows, width)
    source = torch.full((rows, width), -1, dtype=torch.int64)
    query_pos = torch.full((rows, width), -1, dtype=torch.int64)
    table = torch.full((rows, blocks), spare, dtype=torch.int64)
    n = len(reqs)
    if n:
        r = torch.as_tensor(list(reqs), dtype=torch.int64)
        starts = batch.query_start_loc[r]
        qlen = batch.query_start_loc[r + 1] - starts
        valid = offs[None, :] < qlen[:, None]
        tokens = starts[:, None] + offs[None, :]
        given = batch.slot_mapping[tokens.clamp(max=batch.slot_mapping.shape[0] - 1)]
        source[:n] = torch.where(valid, tokens, -1)
        query_pos[:n] = torch.where(valid, (batch.seq_lens[r] - qlen)[:, None] + offs[None, :], -1)
        slots[:n] = torch.where(valid & (given >= 0), given, slots[:n])
        used = min(blocks, batch.block_table.shape[1])
        table[:n, :used] = batch.block_table[r, :used]
    return Grid(rows, width, source.view(-1),
                SpyreAttentionMetadata(slot_mapping=slots.view(-1), block_table=table, query_pos=query_pos))


def grids(batch: SpyreStepBatch, shapes: Shapes) -> Iterator[tuple[list[int], int, int, int]]:
    """(requests, rows, width, context blocks) of each grid of a step: its decodes, then
    its prefill chunks, in order, as many to a grid as a shape of the set holds."""
    seq_lens = batch.seq_lens.tolist()
    for reqs, rows, width in _grids(batch.query_lens.tolist(), shapes):
        yield reqs, rows, width, shapes.context_of([seq_lens[r] for r in reqs])


def _grids(qlen: list[int], shapes: Shapes) -> Iterator[tuple[list[int], int, int]]:
    decodes = [r for r, q in enumerate(qlen) if q == 1]
    if decodes:
        yield decodes, bucket_of(len(decodes), shapes.decode), 1
    group: list[int] = []
    widths = sorted({w for _, w in shapes.prefill})
    shape = None
    for r, q in enumerate(qlen):
        if q <= 1:
            continue
        trial = (bucket_of(len(group) + 1, shapes.decode), bucket_of(max([q] + [qlen[g] for g in group]), widths))
        if trial not in shapes.prefill:
            if group:
                yield group, *shape
            group = []
            trial = (shapes.decode[0], bucket_of(q, widths))
        group.append(r)
        shape = trial
    if group:
        yield group, *shape


class CardModel:
    """The model as vLLM's runner calls it: host tensors in, the hidden states on the host
    out. The forward runs on the card (`on_card`, compiled unless ``SPYRE_RT_VLLM_COMPILE=0``)
    once per grid of the step; decode grids replay their capture when there is one. Other
    attributes are the model's."""

    def __init__(self, model, on_card: Callable, card: torch.device, shapes: Shapes, hidden_size: int) -> None:
        self.model, self.on_card, self.card, self.hidden_size = model, on_card, card, hidden_size
        self.block_size, self.shapes = shapes.block, shapes
        self.spare_block: int | None = None   # known once the KV cache is allocated
        self.decode_graphs: dict[tuple[int, int], DecodeGraph] = {}   # by (requests, context blocks)
        self.replay = True   # decode grids replay their capture (False: the compiled call, for comparison)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["model"], name)

    def __call__(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                 **model_kwargs):
        if intermediate_tensors is not None:
            raise NotImplementedError("spyre_rt: pipeline parallelism is not supported")
        if inputs_embeds is not None:
            raise NotImplementedError("spyre_rt: input embeddings (multimodal models) are not supported")
        out = torch.zeros(input_ids.shape[0], self.hidden_size, dtype=self.dtype)
        batch = step_batch()
        if batch is None or self.spare_block is None:
            return out   # a dummy run of vLLM's (warm-up, capture): nothing to compute; build_steps warms
        for reqs, rows, width, blocks in grids(batch, self.shapes):
            grid = layout(batch, reqs, rows, width, block=self.block_size, spare=self.spare_block, blocks=blocks)
            hidden = self._run(grid, *grid.inputs(input_ids, positions)).cpu()
            keep = grid.source >= 0
            out[grid.source[keep]] = hidden[keep]
        return out

    def _run(self, grid: Grid, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        graph = self.decode_graphs.get((grid.rows, grid.blocks)) if grid.width == 1 and self.replay else None
        if graph is not None:
            return graph.replay(ids, positions, grid.meta)
        if grid.width == 1:
            STATS["compiled"] += 1
        _use_metadata(grid.meta.to(self.card))
        return self.on_card(input_ids=ids.to(self.card), positions=positions.to(self.card), inputs_embeds=None)

    def capture_decode(self, size: int) -> None:
        """Captures the decode grids of `size` requests, one per context bucket, once: their
        inputs are padding, which writes only the spare block."""
        if self.spare_block is None:
            return
        for blocks in self.shapes.contexts:
            if (size, blocks) in self.decode_graphs:
                continue
            graph = DecodeGraph(size, blocks, self.spare_block, self.block_size, self.card)
            with _metadata_kept():
                graph.capture(self.on_card, _use_metadata)
            self.decode_graphs[size, blocks] = graph

    def padding_grid(self, rows: int, width: int, blocks: int) -> Grid:
        empty = SpyreStepBatch(torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                               torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 0, 0)
        return layout(empty, [], rows, width, block=self.block_size, spare=self.spare_block, blocks=blocks)

    def build_steps(self, logits: Callable[[torch.Tensor], torch.Tensor], progress=None) -> int:
        """Builds every shape of the set that is not captured: the decode grids, the prefill
        grids (each with its contexts) and the logits' rows, each run once on padding.
        Returns the shapes built."""
        todo = [(rows, width, blocks) for rows, width, blocks in self.shapes.steps()
                if width > 1 or (rows, blocks) not in self.decode_graphs]
        bar = progress(total=len(todo) + len(self.shapes.logits)) if progress else None
        with _metadata_kept():
            for rows, width, blocks in todo:
                grid = self.padding_grid(rows, width, blocks)
                self._run(grid, *grid.inputs(torch.zeros(0), torch.zeros(0)))
                if bar:
                    bar.update(1)
        for rows in self.shapes.logits:
            logits(torch.zeros(rows, self.hidden_size, dtype=self.dtype))
            if bar:
                bar.update(1)
        if bar:
            bar.close()
        return len(todo) + len(self.shapes.logits)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def step_batch() -> SpyreStepBatch | None:
    """The step's batch, from vLLM's forward context (one KV cache group: one batch)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if not isinstance(meta, dict):
        return None
    found = {id(m): m for m in meta.values() if isinstance(m, SpyreStepBatch)}
    return next(iter(found.values()), None)


@contextlib.contextmanager
def _metadata_kept():
    """The forward context's metadata as it was, after a block that sets its own."""
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    kept = context.attn_metadata
    kept = dict(kept) if isinstance(kept, dict) else kept
    slots = context.slot_mapping
    try:
        yield
    finally:
        context.attn_metadata, context.slot_mapping = kept, slots


def _use_metadata(meta: SpyreAttentionMetadata) -> None:
    """Every attention layer of the forward reads `meta` (the forward context's per-layer map)."""
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    if isinstance(context.attn_metadata, dict):
        for name in context.attn_metadata:
            context.attn_metadata[name] = meta
    else:
        context.attn_metadata = {name: meta for name in context.no_compile_layers}
    # vLLM's per-layer slot mappings are for backends that write the cache apart from their
    # forward; this one writes it in its forward, from `meta`. Emptied in every call, so that
    # the compiled step's guards on them hold in a step, a capture and a start-up build alike.
    context.slot_mapping = {}
