"""The work a Granite step needs, counted from the model's config alone.

A cross-check of the kernel-by-kernel roofline: whatever the compiler makes of the model,
a prefill of ``batch x seq`` tokens, or one decode token, needs at least

- FLOPs: every linear layer (q, k, v, o; gate, up, down) on every token, the LM head on
  the positions whose logits are asked for (the last of each sequence, as a server asks:
  ``logits_to_keep=1``; every token with ``all_logits``), and
  causal attention (QK^T and AV over the keys each query sees: ``seq (seq + 1) / 2`` pairs
  per head in prefill, ``seq + 1`` keys for the decode token at position ``seq``);
- weight bytes: every weight read once (norms included), and the embedding rows of the
  tokens;
- KV-cache bytes: the keys and values of the new tokens written, and those attention reads
  (prefill: the prompt's; decode: the ``seq + 1`` positions seen);
- activation bytes: each linear layer's and attention's input read and output written once
  (q, k and v read one input, as do gate and up; elementwise work fused into them), and the
  logits written.

The phase's bound is then max(FLOPs / MAC rate, bytes / bandwidth), as if it were one
kernel: a lower bound of the sum of its kernels' rooflines. Kernels over a static KV cache
attend to the whole cache with a mask, so their own FLOP counts are higher than these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..cost import CostModel
from .roofline import COMPUTE, DRAM


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The least work of one phase step (a prefill, or one decode token)."""

    flops: float
    weight_bytes: float
    kv_bytes: float
    activation_bytes: float
    dtype: str = "float16"

    @property
    def dram_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    def roofline_ms(self, roofline: CostModel) -> float:
        return roofline.kernel_ns(self.flops, self.dram_bytes, self.dtype) / 1e6

    def bound(self, roofline: CostModel) -> str:
        return COMPUTE if roofline.compute_ns(self.flops, self.dtype) >= roofline.dram_ns(self.dram_bytes) else DRAM

    def as_dict(self, roofline: CostModel) -> dict[str, Any]:
        return {"flops": self.flops, "weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes,
                "activation_bytes": self.activation_bytes, "roofline_ms": self.roofline_ms(roofline),
                "bound": self.bound(roofline)}


_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def granite_step(config: Mapping[str, Any], batch: int, seq: int, phase: str, dtype: str = "float16",
                 all_logits: bool = False) -> StepCost:
    """The least work of a Granite prefill of `batch` x `seq` tokens, or of one decode
    token at position `seq` (`phase` "prefill" or "decode"); `config` holds the Hugging
    Face config's keys (a model profile's ``[config]``). Logits are those of each
    sequence's last position, or of every token with `all_logits`."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be prefill or decode, not {phase!r}")
    h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    heads, inter, vocab = int(config["num_attention_heads"]), int(config["intermediate_size"]), int(config["vocab_size"])
    head_dim = h // heads
    kv = int(config["num_key_value_heads"]) * head_dim  # width of k and of v
    w = _DTYPE_BYTES[dtype]
    tokens = batch * seq if phase == "prefill" else batch
    logit_rows = tokens if all_logits else batch
    # (query, key) pairs per head and sequence: causal in prefill, every position so far in decode
    pairs = seq * (seq + 1) // 2 if phase == "prefill" else seq + 1
    keys_read = seq if phase == "prefill" else seq + 1

    linear_macs = h * h + 2 * h * kv + h * h + 3 * h * inter  # q, k, v, o, gate, up, down
    flops = 2 * tokens * layers * linear_macs + 2 * logit_rows * h * vocab + layers * batch * heads * 4 * pairs * head_dim
    layer_weights = linear_macs + 2 * h  # and the two RMS norms
    weights = (layers * layer_weights + h + vocab * h + tokens * h) * w  # final norm, LM head, embedding rows
    kv_bytes = layers * batch * 2 * kv * ((seq if phase == "prefill" else 1) + keys_read) * w
    per_layer = (h + h + 2 * kv) + (h + h) + (h + h) + (h + 2 * inter) + (inter + h)  # qkv, attn, o, gate+up, down
    activations = (tokens * (layers * per_layer + h) + logit_rows * (h + vocab)) * w  # embedding out; LM head in, logits
    return StepCost(float(flops), float(weights), float(kv_bytes), float(activations), dtype)
