"""The worker and model runner that put the model and its KV cache on the card.

They derive from vLLM's CPU ones, which keep the scheduler's batch buffers on the host; what
runs the model is the card: the weights are moved there after loading, each layer's KV cache
is allocated there, and the forward and the logits are compiled with ``backend="spyre_rt"``.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import torch
from vllm.config import CUDAGraphMode
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment

import spyre_rt  # noqa: F401  (registers the device)
from spyre_rt.errors import SpyreCollectiveError, SpyreDeviceError, SpyreDeviceLostError
from spyre_rt.serving import attention, moe
from spyre_rt.serving.platform import compile_enabled, min_context_tokens, on_host
from spyre_rt.serving.scheduler import failed_step
from spyre_rt.serving.steps import CardModel, Shapes

_log = logging.getLogger("spyre_rt.serving")


def kv_cache_budget(total: int, allocated: int, utilization: float, most_used: int | None = None,
                    one_request: int = 0, max_model_len: int = 0) -> int:
    """Bytes the KV cache may take: the share ``utilization`` of the card's memory, less what
    is already allocated (the weights); ``gpu_memory_utilization`` means the card's. No more
    than ``most_used``, what the scheduler can fill at once (every sequence it runs at the
    longest length, and vLLM's null block): on the simulated card every byte of the cache is
    host memory too. Less
    than ``one_request`` (one sequence at ``max_model_len``) is a start-up error."""
    budget = int(total * utilization) - allocated
    if budget <= 0:
        raise ValueError(
            f"spyre_rt: the card has {total} bytes and {allocated} are allocated, so "
            f"gpu_memory_utilization={utilization} leaves no room for a KV cache; raise it"
        )
    check_one_request(budget, one_request, max_model_len,
                      f"gpu_memory_utilization={utilization} of the card's {total} bytes, less {allocated} allocated")
    return budget if most_used is None else min(budget, most_used)


def check_one_request(budget: int, one_request: int, max_model_len: int, source: str) -> None:
    """A KV cache that cannot hold one request at the longest length is refused at start-up
    (vLLM's own check words it in GiB, which rounds a small model's cache to 0.0)."""
    if budget < one_request:
        raise ValueError(
            f"spyre_rt: the KV cache has {budget} bytes ({source}), but one request of max_model_len="
            f"{max_model_len} tokens needs {one_request} bytes; raise gpu_memory_utilization "
            "(or kv_cache_memory_bytes) or lower max_model_len"
        )


def _card_group():
    """The ``spyreccl`` group of this rank's card and its tensor-parallel peers, or None on one card."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return group.device_group if group.world_size > 1 and hasattr(group.device_group, "ring") else None


class SpyreModelRunner(CPUModelRunner):
    def __init__(self, vllm_config, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self.card = torch.device("cpu") if on_host() else torch.device("spyre", torch.spyre.current_device())
        self.card_group = _card_group()   # the worker made its groups before its runner
        self.block_size = self.cache_config.block_size
        self._card_model: CardModel | None = None
        sched = self.scheduler_config
        self.shapes = Shapes.of(sched.max_num_seqs, self.model_config.max_model_len, sched.max_num_batched_tokens,
                                block=self.block_size, least_context=min_context_tokens())

    def load_model(self, load_dummy_weights: bool = False) -> None:
        from vllm.platforms import current_platform
        from vllm.utils.import_utils import resolve_obj_by_qualname

        super().load_model(load_dummy_weights=load_dummy_weights)
        model = self.model
        moe.prepare(model)
        model.to(self.card)
        forward, logits = model.forward, model.compute_logits
        if compile_enabled():
            # the model's Python floats (norm epsilons, attention scales) are constants of the
            # graph, not 0-d host tensors copied to the card at every call (and refused by a
            # capture)
            constants = torch._dynamo.config.patch(specialize_float=True)
            forward = constants(torch.compile(forward, backend="spyre_rt", dynamic=True))
            logits = constants(torch.compile(logits, backend="spyre_rt", dynamic=True))
        elif not on_host():
            # eager on the card: vLLM's helpers compiled with the platform's simple backend
            # (Inductor, for the host's tensors: a vocabulary shard's mask, say) run eagerly
            eager = torch.compiler.set_stance("force_eager")
            forward, logits = eager(forward), eager(logits)

        shapes = self.shapes

        def compute_logits(hidden_states: torch.Tensor) -> torch.Tensor:
            # rows padded to a bucket: a plan per bucket, not per number of requests
            rows = hidden_states.shape[0]
            padded = shapes.logits_rows(rows)
            if padded != rows:
                hidden_states = torch.cat([hidden_states, hidden_states.new_zeros(padded - rows, hidden_states.shape[1])])
            return logits(hidden_states.to(self.card)).cpu()[:rows]

        self._logits = compute_logits
        # the runner and the sampler take the logits on the host, as they keep the batch there
        model.compute_logits = compute_logits
        self._card_model = CardModel(model, forward, self.card, self.shapes,
                                     self.model_config.get_hidden_size())
        self.model = self._card_model
        if self.compilation_config.cudagraph_mode.has_full_cudagraphs():
            wrapper = resolve_obj_by_qualname(current_platform.get_static_graph_wrapper_cls())
            self.model = wrapper(self._card_model, self.vllm_config, runtime_mode=CUDAGraphMode.FULL)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        """vLLM's step; one the card fails (a command or a DMA: the card keeps its state)
        is reported as a :class:`~spyre_rt.serving.scheduler.FailedStep` of its requests.

        On several cards a step ends the same way on every rank, as only one rank's report
        reaches the engine: a rank whose card failed aborts the group, so that its peers'
        collectives, or the barrier of the group's ring that ends every step, fail too; every
        rank then reports the step failed and the ranks rearm the group together."""
        group = self.card_group
        try:
            out = super().execute_model(scheduler_output, intermediate_tensors)
            if group is not None:
                group.ring.barrier()
            return out
        except SpyreDeviceLostError:
            raise
        except (SpyreDeviceError, SpyreCollectiveError) as e:
            if group is None and isinstance(e, SpyreCollectiveError):
                raise
            if group is not None:
                group.ring.abort(f"a step failed: {e}")   # kept only if the group is not aborted yet
                group.rearm()
            self.execute_model_state = None
            return failed_step(list(scheduler_output.num_scheduled_tokens), str(e))

    def get_model(self) -> torch.nn.Module:
        return self._card_model.model   # the bare model, as vLLM's callers expect

    @torch.inference_mode()   # as vLLM runs its steps: a compiled step guards on the grad mode
    def capture_model(self) -> int:
        """At start-up, every step shape of the bounded set (:class:`~spyre_rt.serving.steps.Shapes`),
        so that no request waits for a compile: the decode step of every capture size vLLM's
        dispatcher names, captured; the other grids and the logits' rows built. Each runs on
        padding inputs, which write the spare block only. Progress bars."""
        if self._card_model.spare_block is None:
            return 0
        from tqdm import tqdm
        from vllm.forward_context import set_forward_context

        if self.compilation_config.cudagraph_mode.has_full_cudagraphs():
            for mode, descs in self.cudagraph_dispatcher.get_capture_descs():
                for desc in tqdm(descs, desc="spyre_rt: capturing decode steps", unit="batch size"):
                    self._warmup_and_capture(desc, cudagraph_runtime_mode=mode)
        with set_forward_context(None, self.vllm_config):
            self._card_model.build_steps(
                self._logits, lambda total: tqdm(total=total, desc="spyre_rt: building step shapes", unit="shape"))
        return 0

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
        self._card_model.spare_block = kv_cache_config.num_blocks
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
        if not on_host():
            torch.spyre.set_device(self.local_rank)
        init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                            self.local_rank, self._dist_backend())
        set_random_seed(self.model_config.seed)
        self.model_runner = SpyreModelRunner(self.vllm_config, self.device)

    @staticmethod
    def _dist_backend() -> str:
        """The ranks' groups: ``spyreccl`` for the card's tensors (the ring between the cards,
        collectives in the graph plans), gloo for the host's, as ``"cuda"`` ranks pair NCCL
        with gloo."""
        if on_host():
            return "gloo"
        import spyre_rt.distributed as ccl  # registers the backend

        return f"cpu:gloo,spyre:{ccl.BACKEND_NAME}"

    def inject_card_fault(self, kind: str, after: str = "0", rank: str = "") -> None:
        """The project's fault injection on this worker's card (``spy_fault_inject``): the
        `after`-th ``kind`` (command, dma, lost) from now fails; with `rank`, on that rank's
        card only. For tests, through vLLM's ``collective_rpc`` (``/collective_rpc`` of a
        server in ``VLLM_SERVER_DEV_MODE``), which passes arguments as strings."""
        from spyre_rt import card as cards

        if rank and int(rank) != self.rank:
            return
        cards.get(torch.spyre.current_device()).fault_inject(kind, int(after))

    def card_counters(self) -> dict[str, float]:
        """This rank's card's counters (commands, jobs, plan launches, bytes copied...)."""
        from spyre_rt import card as cards

        return cards.get(torch.spyre.current_device()).counters()

    def decode_graph_stats(self) -> dict:
        """This rank's decode grids captured, replayed and run by the compiled call
        (:data:`spyre_rt.serving.graphs.STATS`), and its replays by context blocks, through
        vLLM's ``collective_rpc``."""
        from spyre_rt.serving.graphs import REPLAYED_CONTEXTS, STATS

        return {**STATS, "contexts": dict(REPLAYED_CONTEXTS)}

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        return nullcontext()  # no sleep-mode allocator on the card

    def determine_available_memory(self) -> int:
        longest = self.model_config.max_model_len
        specs = self.model_runner.get_kv_cache_spec().values()
        per_sequence = sum(s.page_size_bytes * s.max_num_blocks_per_req(self.vllm_config, longest) for s in specs)
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            check_one_request(int(explicit), per_sequence, longest, "kv_cache_memory_bytes")
            return int(explicit)
        # every sequence at the longest length, and the block vLLM keeps back as its null block
        most_used = per_sequence * self.scheduler_config.max_num_seqs + sum(s.page_size_bytes for s in specs)
        if on_host():
            return most_used
        free, total = torch.spyre.mem_get_info()
        most_used = most_used if per_sequence else None
        return kv_cache_budget(total, total - free, self.cache_config.gpu_memory_utilization, most_used,
                               one_request=per_sequence, max_model_len=longest)

    def compile_or_warm_up_model(self):
        import time

        from vllm.v1.worker.worker_base import CompilationTimes

        start = time.perf_counter()
        self.model_runner.capture_model()
        set_random_seed(self.model_config.seed)
        return CompilationTimes(language_model=time.perf_counter() - start, encoder=0.0)
