"""vLLM's mixture-of-experts layers on the card: routing and experts in torch.

vLLM reaches an out-of-tree platform's MoE through two seams, both taken here:

- the method of an unquantized ``FusedMoE`` layer is a vLLM ``CustomOp``, which a platform
  replaces with ``register_oot``. On an out-of-tree platform vLLM gives that method no
  kernel of its own (its routers and experts call vLLM's native CUDA or CPU builds), so
  :class:`SpyreFusedMoEMethod` is *monolithic*: it takes the router's logits and does the
  top-k and the experts itself, in torch, which compiles to card kernels with the model;
- the layer calls its method through the opaque custom op ``vllm.moe_forward``, whose
  layer argument (an opaque object) no compiler can lay out; vLLM's CPU platform calls the
  op's Python body directly instead, which Dynamo traces, and :func:`prepare` makes
  the card's runner do the same.

The experts are computed as the card runs grouped matmuls (``compiler/inductor/grouped.py``):
every expert on every token as one batched matmul, then each token keeps the products of
its top-k experts by an exact select, weighted by the router. That is E / top_k times the
multiply-adds of a grouped kernel; it keeps the layer to static kernels on the card.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

_GATED = {
    MoEActivation.SILU: F.silu,
    MoEActivation.GELU: F.gelu,
    MoEActivation.GELU_TANH: lambda t: F.gelu(t, approximate="tanh"),
}


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax",
          routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights, ``([T, k] float32, [T, k] int64)``:
    softmax (or sigmoid) of the logits in fp32, top-k, optionally renormalized to sum to 1."""
    if scoring_func == "softmax":
        scores = torch.softmax(router_logits.float(), dim=-1)
    elif scoring_func == "sigmoid":
        scores = torch.sigmoid(router_logits.float())
    else:
        raise NotImplementedError(f"spyre_rt MoE: scoring function {scoring_func!r} is not supported")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, activation: MoEActivation = MoEActivation.SILU) -> torch.Tensor:
    """``x [T, H]`` through the experts ``w13 [E, 2I, H]`` (gate, then up) and ``w2 [E, H, I]``:
    ``[T, H]``, each token the router-weighted sum of its chosen experts' outputs."""
    act = _GATED.get(activation)
    if act is None:
        raise NotImplementedError(f"spyre_rt MoE: activation {activation.value!r} is not supported")
    n = w13.shape[0]
    every = x.unsqueeze(0).expand(n, -1, -1)
    gate, up = torch.bmm(every, w13.transpose(1, 2)).chunk(2, dim=-1)          # [E, T, I] each
    out = torch.bmm(act(gate) * up, w2.transpose(1, 2))                        # [E, T, H]
    chosen = topk_ids.unsqueeze(0) == torch.arange(n, device=x.device).view(n, 1, 1)   # [E, T, k]
    weight = (chosen * topk_weights.unsqueeze(0)).sum(-1).to(out.dtype)        # [E, T]
    # a select, not a product with a zero weight: an inf an unchosen expert makes stays out
    kept = torch.where(chosen.any(-1).unsqueeze(-1), out * weight.unsqueeze(-1),
                       torch.zeros((), dtype=out.dtype, device=out.device))
    return kept.sum(0)


@UnquantizedFusedMoEMethod.register_oot
class SpyreFusedMoEMethod(UnquantizedFusedMoEMethod):
    """The unquantized MoE method on the card: routing and experts in torch."""

    @property
    def is_monolithic(self) -> bool:
        return True   # it routes itself: vLLM's routers on an out-of-tree platform call its native kernels

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor, input_ids=None) -> torch.Tensor:
        if layer.use_grouped_topk or layer.custom_routing_function is not None \
                or layer.e_score_correction_bias is not None or layer.expert_map is not None:
            raise NotImplementedError(
                "spyre_rt MoE: grouped top-k, custom routing, score-correction biases and expert "
                "parallelism are not supported; plain softmax or sigmoid top-k is"
            )
        if self.moe.has_bias or layer.apply_router_weight_on_input:
            raise NotImplementedError("spyre_rt MoE: expert biases and router weights on the input are not supported")
        weights, ids = route(router_logits, layer.top_k, layer.renormalize, layer.scoring_func,
                             layer.routed_scaling_factor)
        return experts(x, layer.w13_weight, layer.w2_weight, weights, ids, layer.activation)


def prepare(model: torch.nn.Module) -> int:
    """Makes every MoE layer of `model` call its forward's Python body rather than the opaque
    ``vllm.moe_forward`` op, as vLLM does on its CPU platform, with its method's config made
    now (vLLM makes it at the first call, which a compiled step would guard on and compile
    again for). Returns the layers changed."""
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    changed = 0
    for module in model.modules():
        if isinstance(module, moe_runner.MoERunner):
            shared = module._shared_experts is not None
            module._forward_entry = moe_runner._moe_forward_shared if shared else moe_runner._moe_forward
            module.routed_experts._ensure_moe_quant_config_init()
            changed += 1
    return changed
