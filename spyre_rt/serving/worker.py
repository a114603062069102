"""The worker and model runner that put the model and its KV cache on the card.

They derive from vLLM's CPU ones, which keep the scheduler's batch buffers on the host; what
runs the model is the card: the weights are moved there after loading, each layer's KV cache
is allocated there, and the forward and the logits are compiled with ``backend="spyre_rt"``.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, nullcontext

import torch
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment

import spyre_rt  # noqa: F401  (registers the device)
from spyre_rt.serving import attention

_log = logging.getLogger("spyre_rt.serving")


def kv_cache_budget(total: int, allocated: int, utilization: float, most_used: int | None = None) -> int:
    """Bytes the KV cache may take: the share ``utilization`` of the card's memory, less what
    is already allocated (the weights); ``gpu_memory_utilization`` means the card's. No more
    than ``most_used``, what the scheduler can fill at once (every sequence it runs at the
    longest length): on the simulated card every byte of the cache is host memory too."""
    budget = int(total * utilization) - allocated
    if budget <= 0:
        raise ValueError(
            f"spyre_rt: the card has {total} bytes and {allocated} are allocated, so "
            f"gpu_memory_utilization={utilization} leaves no room for a KV cache; raise it"
        )
    return budget if most_used is None else min(budget, most_used)


def _flag(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def _compile_enabled() -> bool:
    return _flag("SPYRE_RT_VLLM_COMPILE")


#: decode steps captured and replayed, by padded batch size (read by the tests)
STATS = {"captures": 0, "replays": 0}


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The padded batch sizes of captured decode steps: powers of two up to ``max_num_seqs``."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max_num_seqs]


class _DecodeGraph:
    """A decode step of ``size`` requests (padding included) captured with
    ``torch.spyre.graph``: persistent card inputs that each step's values are copied into,
    then one replay. Every request's context is read at the model's longest length, so one
    capture serves every step of that size."""

    def __init__(self, runner: SpyreModelRunner, size: int) -> None:
        card, spare, block = runner.card, runner.spare_block, runner.block_size
        self.size = size
        self.ids = torch.zeros(size, dtype=torch.int64, device=card)
        self.positions = torch.zeros(size, dtype=torch.int64, device=card)
        self.meta = attention.SpyreAttentionMetadata(
            slot_mapping=torch.full((size,), spare * block, dtype=torch.int64, device=card),
            block_table=torch.full((size + 1, runner.max_blocks), spare, dtype=torch.int64, device=card),
            token_index=torch.arange(size, dtype=torch.int64, device=card),
            query_pos=torch.full((size + 1, 1), -1, dtype=torch.int64, device=card),
        )
        self.spare, self.block, self.max_blocks = spare, block, runner.max_blocks

    def capture(self, forward, metas: dict) -> None:
        for name in metas:
            metas[name] = self.meta
        forward(input_ids=self.ids, positions=self.positions, inputs_embeds=None)  # compile outside
        self.graph = torch.spyre.SpyreGraph()
        with torch.spyre.graph(self.graph):
            self.hidden = forward(input_ids=self.ids, positions=self.positions, inputs_embeds=None)
        STATS["captures"] += 1

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               m: attention.SpyreAttentionMetadata) -> torch.Tensor:
        n, size = input_ids.shape[0], self.size
        ids = torch.zeros(size, dtype=torch.int64)
        ids[:n] = input_ids
        pos = torch.zeros(size, dtype=torch.int64)
        pos[:n] = positions
        slots = self.spare * self.block + torch.arange(size, dtype=torch.int64) % self.block
        slots[:n] = m.slot_mapping[:n]
        table = torch.full((size + 1, self.max_blocks), self.spare, dtype=torch.int64)
        table[:n, : m.block_table.shape[1]] = m.block_table[:n]
        qpos = torch.full((size + 1, 1), -1, dtype=torch.int64)
        qpos[:n] = m.query_pos[:n]
        for static, new in ((self.ids, ids), (self.positions, pos), (self.meta.slot_mapping, slots),
                            (self.meta.block_table, table), (self.meta.query_pos, qpos)):
            static.copy_(new)
        self.graph.replay()
        STATS["replays"] += 1
        return self.hidden[:n].cpu()


class SpyreModelRunner(CPUModelRunner):
    def __init__(self, vllm_config, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self.card = torch.device("spyre", torch.spyre.current_device())
        self._forward = None
        self._logits = None
        self._graphs: dict[int, _DecodeGraph] = {}
        self._buckets = decode_buckets(self.scheduler_config.max_num_seqs)
        self.block_size = self.cache_config.block_size
        self.max_blocks = -(-self.model_config.max_model_len // self.block_size)
        self.spare_block = None   # known once the KV cache is allocated

    def load_model(self, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights=load_dummy_weights)
        self.model.to(self.card)
        forward, logits = self.model.forward, self.model.compute_logits
        if _compile_enabled():
            # the model's Python floats (norm epsilons, attention scales) are constants of the
            # graph, not 0-d host tensors copied to the card at every call (and refused by a
            # capture)
            constants = torch._dynamo.config.patch(specialize_float=True)
            forward = constants(torch.compile(forward, backend="spyre_rt", dynamic=True))
            logits = constants(torch.compile(logits, backend="spyre_rt", dynamic=True))
        self._forward, self._logits = forward, logits
        model = self.model

        def compute_logits(hidden_states: torch.Tensor) -> torch.Tensor:
            out = logits(hidden_states.to(self.card))
            return out.cpu()

        # the runner and the sampler take the logits on the host, as they keep the batch there
        model.compute_logits = compute_logits

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **model_kwargs):
        if intermediate_tensors is not None:
            raise NotImplementedError("spyre_rt: pipeline parallelism is not supported")
        decode = self._decode_metadata(input_ids, inputs_embeds, model_kwargs)
        if decode is not None:
            metas, m = decode
            size = next(b for b in self._buckets if b >= input_ids.shape[0])
            graph = self._graphs.get(size)
            if graph is None:
                graph = self._graphs[size] = _DecodeGraph(self, size)
                graph.capture(self._forward, metas)
            return graph.replay(input_ids, positions, m)
        to_card = lambda t: None if t is None else t.to(self.card)  # noqa: E731
        self._metadata_to_card()
        hidden = self._forward(input_ids=to_card(input_ids), positions=to_card(positions),
                               inputs_embeds=to_card(inputs_embeds), **model_kwargs)
        return hidden.cpu()

    def capture_decode_graphs(self) -> None:
        """Captures the decode step of every bucket at start-up, on padding inputs (they write
        the spare block only), so that no request waits for a compile or a capture."""
        if not (_compile_enabled() and _flag("SPYRE_RT_VLLM_REPLAY")) or self.spare_block is None:
            return
        from tqdm import tqdm
        from vllm.forward_context import set_forward_context

        names = [n for g in self.kv_cache_config.kv_cache_groups for n in g.layer_names]
        for size in tqdm(self._buckets, desc="spyre_rt: capturing decode steps", unit="batch size"):
            if size in self._graphs:
                continue
            graph = _DecodeGraph(self, size)
            metas = dict.fromkeys(names)
            with set_forward_context(metas, self.vllm_config, num_tokens=size):
                graph.capture(self._forward, metas)
            self._graphs[size] = graph

    def _decode_metadata(self, input_ids, inputs_embeds, model_kwargs):
        """The step's metadata when it is a decode step a captured graph can run: compiled,
        one new token per request, no more requests than the largest bucket."""
        from vllm.forward_context import get_forward_context

        if (not (_compile_enabled() and _flag("SPYRE_RT_VLLM_REPLAY")) or self.spare_block is None
                or input_ids is None or inputs_embeds is not None or model_kwargs):
            return None
        metas = get_forward_context().attn_metadata
        if not isinstance(metas, dict) or not metas:
            return None
        found = {id(m): m for m in metas.values()}
        if len(found) != 1:
            return None
        (m,) = found.values()
        n = input_ids.shape[0]
        if (not isinstance(m, attention.SpyreAttentionMetadata) or m.slot_mapping.device.type != "cpu"
                or m.query_pos.shape != (n + 1, 1) or n > self._buckets[-1]
                or not torch.equal(m.token_index, torch.arange(n))):
            return None
        return metas, m

    def _metadata_to_card(self) -> None:
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().attn_metadata
        if not isinstance(meta, dict):
            return
        moved: dict[int, attention.SpyreAttentionMetadata] = {}
        for name, m in meta.items():
            if isinstance(m, attention.SpyreAttentionMetadata) and m.slot_mapping.device != self.card:
                if id(m) not in moved:
                    moved[id(m)] = attention.SpyreAttentionMetadata(
                        *(t.to(self.card) for t in (m.slot_mapping, m.block_table, m.token_index, m.query_pos))
                    )
                meta[name] = moved[id(m)]

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes,
                                    kv_cache_allocation_context: AbstractContextManager | None = None):
        """One zeroed card tensor per layer (a stick layout each; no shared byte buffer with
        per-layer dtype views), with the spare block past the blocks vLLM hands out."""
        from vllm.v1.worker.utils import bind_kv_cache

        kv_caches: dict[str, torch.Tensor] = {}
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            shape = attention.SpyreAttentionBackend.get_kv_cache_shape(
                kv_cache_config.num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_size
            )
            for name in group.layer_names:
                kv_caches[name] = torch.zeros(shape, dtype=spec.dtype, device=self.card)
        self.spare_block = kv_cache_config.num_blocks
        for name, target in self.shared_kv_cache_layers.items():
            kv_caches[name] = kv_caches[target]
        bind_kv_cache(kv_caches, self.compilation_config.static_forward_context, self.kv_caches,
                      kv_cache_groups=kv_cache_config.kv_cache_groups)
        return kv_caches

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        pass  # a block's stale slots are never read: each query sees only positions it has written


class SpyreWorker(CPUWorker):
    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False) -> None:
        # vLLM's CPU worker binds host memory nodes through its native library; the card's
        # memory is what counts here
        Worker.__init__(self, vllm_config, local_rank, rank, distributed_init_method,
                        is_driver_worker=is_driver_worker)
        self.parallel_config.disable_custom_all_reduce = True

    def init_device(self) -> None:
        self.device = torch.device("cpu")
        torch.spyre.set_device(self.local_rank % torch.spyre.device_count())
        init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                            self.local_rank, "gloo")
        set_random_seed(self.model_config.seed)
        self.model_runner = SpyreModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        return nullcontext()  # no sleep-mode allocator on the card

    def determine_available_memory(self) -> int:
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            return int(explicit)
        free, total = torch.spyre.mem_get_info()
        specs = self.model_runner.get_kv_cache_spec().values()
        per_sequence = sum(s.page_size_bytes * s.max_num_blocks_per_req(self.vllm_config, self.model_config.max_model_len)
                           for s in specs)
        most_used = (per_sequence * self.scheduler_config.max_num_seqs) if per_sequence else None
        return kv_cache_budget(total, total - free, self.cache_config.gpu_memory_utilization, most_used)

    def compile_or_warm_up_model(self):
        import time

        from vllm.v1.worker.worker_base import CompilationTimes

        start = time.perf_counter()
        self.model_runner.capture_decode_graphs()
        set_random_seed(self.model_config.seed)
        return CompilationTimes(language_model=time.perf_counter() - start, encoder=0.0)
