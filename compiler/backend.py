"""The ``spyre_rt`` torch.compile backend.

Found through the ``torch_dynamo_backends`` entry point, so ``torch.compile(model,
backend="spyre_rt")`` works without importing spyre_rt first. The graph goes through AOT
(inference) and TorchInductor with the spyre device backend; the result runs on the card.
"""

from __future__ import annotations

import functools
import logging
import threading

import torch

import spyre_rt
from spyre_rt import config

from .errors import OptionError
from .inductor import STATIC_INPUTS
from .version import compiler_version

log = logging.getLogger("spyre_rt.compiler.backend")
_registered = False
_lock = threading.Lock()

# Inductor settings for the card: no Python/C++ templates, no autotuning, one kernel per
# reduction (split reductions would need a second kernel and buy nothing on 32 cores).
INDUCTOR_PATCHES = {
    "size_asserts": False,
    "nan_asserts": False,
    "alignment_asserts": False,
    "scalar_asserts": False,
    "cpp_wrapper": False,
    "max_autotune": False,
    "max_autotune_gemm": False,
    "triton.cudagraphs": False,
    "fallback_random": True,
    "freezing": False,
    "graph_partition": False,
    "combo_kernels": False,
    "memory_planning": False,
    "comprehensive_padding": False,
    "split_reductions": False,
    "unroll_reductions_threshold": 1,
}


def _inductor_patches() -> dict:
    from .inductor.attention import FoldRepeatedKV
    from .inductor.gated_gemm import SplitGatedGEMM

    # attention reads the KV heads repeat_kv copied (see compiler/inductor/attention.py); a
    # merged gate-and-up GEMM is two, its activation an epilogue (compiler/inductor/gated_gemm.py)
    return {**INDUCTOR_PATCHES, "post_grad_custom_pre_pass": FoldRepeatedKV(),
            "post_grad_custom_post_pass": SplitGatedGEMM()}


def register() -> None:
    """Register the Inductor device backend for ``spyre`` (idempotent)."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        spyre_rt.register()
        from torch._dynamo.device_interface import register_interface_for_device
        from torch._inductor.codegen.common import register_backend_for_device, register_device_op_overrides

        from . import options
        from .inductor import lowering
        from .inductor.interface import SpyreInterface, SpyreOpOverrides
        from .inductor.scheduling import SpyreScheduling
        from .inductor.wrapper import SpyreWrapperCodegen

        register_interface_for_device("spyre", SpyreInterface)
        register_device_op_overrides("spyre", SpyreOpOverrides())
        register_backend_for_device("spyre", SpyreScheduling, SpyreWrapperCodegen, device_custom_config=options)
        lowering.install()
        _registered = True


def _inner_compile(gm, example_inputs, *, patch: dict, **kwargs):
    from torch._inductor.compile_fx import compile_fx_inner

    from . import options as opts
    from .inductor.lowering import decomposition_table

    # The decomposition table handed to compile_fx reaches here and into Inductor's cache
    # key; a module-level function pickles by name where the table itself cannot.
    if "get_decomp_fn" in kwargs:
        kwargs["get_decomp_fn"] = decomposition_table
    # The wrapper records which inputs keep their memory (parameters, static caches): a call
    # checks them by identity, not by address. They travel with the graph, not beside it.
    gm.meta[STATIC_INPUTS] = tuple(kwargs.get("static_input_idxs", ()) or ())
    # A fused kernel that construction cannot express (a non-affine index, an accumulating
    # scatter) names the FX nodes it holds; with CPU fallback on, they run on the CPU in a
    # compile again, and the fusion forms around them. Here rather than around compile_fx:
    # AOT compiles a backward graph lazily, at the first backward, outside that call, and
    # it needs the backend's options as much as the forward does.
    # A gather it cannot address inside a fusion is first computed into a buffer of its own
    # on the card (``realize_nodes``); only if that kernel cannot be built either does it
    # run on the CPU.
    cpu_nodes: list[str] = []
    realize_nodes: list[str] = []
    for _ in range(MAX_RECOMPILES + 1):
        try:
            with (opts.patch({**patch, "cpu_nodes": cpu_nodes, "realize_nodes": realize_nodes}),
                  spyre_rt.graphs.compiling()):
                return compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as e:
            ours = _our_error(e)
            if ours is None:
                raise
            refused = set(getattr(ours, "fallback_nodes", ())) - set(cpu_nodes)
            apart = sorted(set(getattr(ours, "apart_nodes", ())) & refused - set(realize_nodes))
            more = sorted(refused - set(apart)) if patch["cpu_fallback"] else []
            if not (apart or more):
                raise ours from None
            realize_nodes = realize_nodes + apart
            cpu_nodes = cpu_nodes + more
    raise ours from None


def spyre_rt_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode=None, **_):
    """torch.compile backend: options are spyre_rt settings (``dispatch``, ``cpu_fallback``,
    ``compute_dtype``, ``cache_dir``...) or Inductor config keys. ``mode="reduce-overhead"``
    captures and replays the compiled graph per shape (:mod:`.reduce_overhead`)."""
    from . import reduce_overhead

    if reduce_overhead.replays(mode):
        return reduce_overhead.ReplayPerShape(spyre_rt_backend(gm, example_inputs, options))
    register()
    from torch._inductor.compile_fx import compile_fx

    from . import options as opts
    from .inductor.attention import use_card_attention
    from .inductor.custom_ops import check_fake_kernels
    from .inductor.lowering import decompositions

    options = dict(options or {})
    ours = {k.replace("-", "_"): options.pop(k) for k in list(options) if k.replace("-", "_") in config.Settings.__dataclass_fields__}
    try:
        settings = config.with_options(ours)  # resolved once: the step carries what its calls read
    except ValueError as e:
        raise OptionError(f"spyre_rt options: {e}") from None
    patch = {
        "dispatch": settings.dispatch,
        "cpu_fallback": settings.cpu_fallback,
        "compute_dtype": settings.compute_dtype,
        "fuse_epilogues": settings.fuse_epilogues,
        "slice_epilogues": settings.slice_epilogues,
        "split_gated_gemms": settings.split_gated_gemms,
        "fuse_residuals": settings.fuse_residuals,
        "fuse_prologues": settings.fuse_prologues,
        "group_matmuls": settings.group_matmuls,
        "bound_causal_masks": settings.bound_causal_masks,
        "step_settings": config.step_fields(settings),
        "profile_digest": spyre_rt.card.card_set().profile.digest,
        "compiler_version": compiler_version(),
    }

    for graph in gm.modules():  # the graph and its compile regions' bodies
        if isinstance(graph, torch.fx.GraphModule):
            check_fake_kernels(graph)  # AOT traces every op with fake tensors
            use_card_attention(graph)  # before AOT would decompose it into its math

    inner = functools.partial(_inner_compile, patch=patch)
    try:
        # inside a graph capture, what compiling does on the card is not the step's work
        with opts.patch(patch), spyre_rt.graphs.compiling():
            return compile_fx(gm, example_inputs, inner_compile=inner,
                              config_patches={**_inductor_patches(), **options}, decompositions=decompositions())
    except Exception as e:
        # Inductor wraps exceptions (in a LoweringException, in an InductorError): hand our
        # compile errors to the caller as themselves.
        ours = _our_error(e)
        if ours is None:
            raise
        if getattr(ours, "inline_regions", False):
            # a region the card cannot call as it is (see lowering._install_region_writes):
            # this graph compiles with its regions' bodies inlined, as if never marked
            from torch._dynamo.utils import counters
            from torch._higher_order_ops.passes.inline_invoke_subgraph import inline_invoke_subgraph

            log.info("spyre_rt: %s; compiling this graph with its regions inlined", ours)
            counters["spyre_rt"]["graphs_inlined"] += 1
            return spyre_rt_backend(inline_invoke_subgraph(gm), example_inputs, options, mode)
        raise ours from None


MAX_RECOMPILES = 32  # compiles of one graph with more of its nodes on the CPU, one refused kernel each


def _our_error(e: BaseException) -> BaseException | None:
    """The SpyreCompileError an exception of Inductor's wraps, if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, spyre_rt.SpyreCompileError):
            return e
        seen.add(id(e))
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return None
