"""The vLLM platform of the card: vLLM's CPU platform with the model, its KV cache and its
compiled steps on the card, and none of vLLM's native CPU kernels."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import PlatformEnum

from spyre_rt.serving.bucketing import MIN_ROWS, batch_buckets, min_context_tokens

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_log = logging.getLogger("spyre_rt.serving")

#: KV blocks are whole sticks of tokens: the card's 128-byte stick holds 64 fp16 elements
BLOCK_MULTIPLE = 64
#: the block size when the user names none
DEFAULT_BLOCK_SIZE = BLOCK_MULTIPLE


def _flag(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def on_host() -> bool:
    """The model and its KV cache kept on the host CPU, eager, with everything else of the
    plugin as on the card (``SPYRE_RT_VLLM_DEVICE=cpu``): vLLM's CPU runner with the plugin's
    torch attention, the per-step anchor of ``spyre-profile serve --engine host`` (vLLM's
    own CPU kernels are native builds that a CUDA wheel of vLLM does not carry)."""
    return os.environ.get("SPYRE_RT_VLLM_DEVICE", "spyre").strip().lower() == "cpu"


def compile_enabled() -> bool:
    """The forward and the logits compiled with ``backend="spyre_rt"`` (``SPYRE_RT_VLLM_COMPILE=0``: eager)."""
    return _flag("SPYRE_RT_VLLM_COMPILE") and not on_host()


def replay_enabled() -> bool:
    """Decode steps captured and replayed (``SPYRE_RT_VLLM_REPLAY=0``: the compiled call)."""
    return compile_enabled() and _flag("SPYRE_RT_VLLM_REPLAY")


class SpyrePlatform(CpuPlatform):
    _enum = PlatformEnum.OOT
    # vLLM builds torch.device(device_name) for its host-side buffers; the model and the KV
    # cache are moved to the card by the model runner
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.float32]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.spyre.get_device_properties(device_id).name

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.spyre.mem_get_info(device_id)[1]

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return float(torch.spyre.memory_allocated())

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError("spyre_rt: MLA and sparse attention are not supported on the card")
        return "spyre_rt.serving.attention.SpyreAttentionBackend"

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # attention is plain torch, traced into the model's graph with everything else
        return False

    @classmethod
    def import_kernels(cls) -> None:
        pass  # vllm._C is vLLM's native CPU (or CUDA) build: nothing here calls it

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        from vllm.triton_utils.dispatcher import register_kernels

        from spyre_rt.serving.host_kernels import compute_slot_mapping

        register_kernels({"vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping})

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "spyre_rt.serving.communicator.SpyreCommunicator"

    @classmethod
    def supports_structured_output(cls) -> bool:
        return False

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        cache = vllm_config.cache_config
        user_block = cache.block_size if cache.user_specified_block_size else None
        if user_block is not None and user_block % BLOCK_MULTIPLE:
            raise ValueError(
                f"spyre_rt: block_size {user_block} is not a multiple of {BLOCK_MULTIPLE}, the tokens "
                "of one stick; pass --block-size 64 (or 128, ...)"
            )
        min_context_tokens()  # a bad setting is refused here, before the engine starts
        super().check_and_update_config(vllm_config)
        cache.block_size = user_block or DEFAULT_BLOCK_SIZE
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            raise NotImplementedError("spyre_rt: MLA models are not supported on the card")
        cache.enable_prefix_caching = False
        parallel = vllm_config.parallel_config
        cls._check_cards(parallel)
        if parallel.worker_cls in ("auto", "vllm.v1.worker.cpu_worker.CPUWorker"):
            parallel.worker_cls = "spyre_rt.serving.worker.SpyreWorker"
        scheduler = vllm_config.scheduler_config
        if scheduler.scheduler_cls is None and not scheduler.async_scheduling:
            # a step the card failed fails its requests, not the engine
            scheduler.scheduler_cls = "spyre_rt.serving.scheduler.SpyreScheduler"
        # the model runner compiles the forward and the logits itself, with backend="spyre_rt"
        from vllm.config import CompilationMode

        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        cls._static_graphs(vllm_config)

    @classmethod
    def _check_cards(cls, parallel) -> None:
        """A card per rank of the machine, as a GPU per rank: more ranks than cards is a
        start-up error, not two ranks sharing one card."""
        if on_host():
            return
        if parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1:
            raise NotImplementedError(
                "spyre_rt: pipeline and data parallelism are not supported on the card; "
                "use --tensor-parallel-size"
            )
        if parallel.enable_expert_parallel:
            raise NotImplementedError(
                "spyre_rt: expert parallelism is not supported on the card; without "
                "--enable-expert-parallel, --tensor-parallel-size splits each expert over the cards"
            )
        ranks, cards = parallel.tensor_parallel_size, torch.spyre.device_count()
        if ranks > cards:
            raise ValueError(
                f"spyre_rt: tensor_parallel_size={ranks} needs {ranks} cards, and the machine has "
                f"{cards}; set SPYRE_RT_DEVICE_COUNT={ranks} (or a device profile whose [device] count "
                f"is at least {ranks})"
            )

    @classmethod
    def _static_graphs(cls, vllm_config: VllmConfig) -> None:
        """vLLM's FULL_DECODE_ONLY on the card: decode batches padded to the capture sizes
        (2 times powers of two up to max_num_seqs) and replayed by :class:`SpyreGraphWrapper`. A
        cudagraph_mode of NONE, SPYRE_RT_VLLM_REPLAY=0 or an eager model turn it off."""
        from vllm.config import CUDAGraphMode

        compilation = vllm_config.compilation_config
        if not replay_enabled() or compilation.cudagraph_mode == CUDAGraphMode.NONE:
            compilation.cudagraph_mode = CUDAGraphMode.NONE
            compilation.cudagraph_capture_sizes = []
            compilation.max_cudagraph_capture_size = 0
            return
        sizes = batch_buckets(vllm_config.scheduler_config.max_num_seqs, least=MIN_ROWS)
        compilation.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
        compilation.cudagraph_capture_sizes = sizes
        compilation.max_cudagraph_capture_size = sizes[-1]

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return True

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        return "spyre_rt.serving.graphs.SpyreGraphWrapper"
