"""The model families of the compatibility matrix: small Hugging Face models from configs.

Each :class:`Family` names a transformers architecture and the config of a small model of
it (random weights, no download): two layers, 256 wide, 8 heads, a 1000-token vocabulary,
spelt in each architecture's own config keys. The test suite (``tests/test_models.py``)
and ``spyre-profile models`` build their models here, so both measure the same ones.

Random configs: a larger ``initializer_range`` than the default, so that greedy decoding
wanders over many tokens and cache positions (a decode that repeats one token would let a
cache written at the wrong place go unnoticed), and biases and norm weights randomised
(their inits leave them at 0 and 1, where a wrong epilogue would go unnoticed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

DECODER, ENCODER, SEQ2SEQ = "decoder", "encoder", "encoder-decoder"

VOCAB = 1000
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 8, 2
MAX_POSITIONS = 128
INIT = 0.1  # the weights' standard deviation (the configs' default of 0.02 makes a decode repeat itself)

# The shape in the keys most configs share (Llama's); families with other names map it below.
_LLAMA_SHAPE = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                    max_position_embeddings=MAX_POSITIONS, initializer_range=INIT)
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclass(frozen=True)
class Family:
    """One architecture at a small config."""

    name: str
    kind: str                        # DECODER (a causal LM), ENCODER (hidden states) or SEQ2SEQ (generate())
    model_class: str                 # the transformers class, e.g. "LlamaForCausalLM"
    config_class: str                # its config class
    config: dict[str, Any]
    brings: str                      # what it exercises beyond the families before it
    slow: bool = False               # kept out of the default test run (a fast family covers it)
    # a decoder's cache: "static" (a full-length static KV layer per layer, see
    # parity.static_cache) or "model" (transformers' StaticCache of the config: the cache
    # class of each layer the config names, Mamba's conv and SSM states among them)
    cache: str = "static"
    tags: tuple[str, ...] = field(default=())

    def hf_config(self):
        import transformers

        return getattr(transformers, self.config_class)(**self.config)

    def build(self, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Any, torch.nn.Module]:
        """The config and the model (eval mode, on the CPU, in `dtype`): the same weights
        for the same seed."""
        import transformers

        cfg = self.hf_config()
        torch.manual_seed(seed)
        model = getattr(transformers, self.model_class)(cfg).eval()
        randomise_biases_and_norms(model)
        return cfg, model.to(dtype)


def randomise_biases_and_norms(model: torch.nn.Module, std: float = 0.1) -> None:
    """Biases ~ N(0, std) and norm weights ~ N(1, std): their inits (0 and 1) would hide a
    bias or a norm scale the card dropped."""
    with torch.no_grad():
        for module in model.modules():
            is_norm = "norm" in type(module).__name__.lower()
            for name, p in module.named_parameters(recurse=False):
                if name == "bias":
                    p.normal_(0.0, std)
                elif is_norm and name == "weight":
                    p.normal_(1.0, std)


def _granite_tiny() -> dict[str, Any]:
    """The config of the ``granite-tiny`` model profile (``profiles/models``)."""
    from .run import load_model

    return dict(load_model("granite-tiny").config)


_EXPERT = INTERMEDIATE // 4  # each expert's hidden width: top-2 of 4 costs half the dense MLP


def _granite_tiny_shape() -> dict[str, Any]:
    """granite-tiny's shape and multipliers, for Granite's MoE family."""
    cfg = _granite_tiny()
    keep = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "max_position_embeddings", "rms_norm_eps", "rope_theta", "embedding_multiplier",
            "residual_multiplier", "attention_multiplier", "logits_scaling")
    return {k: cfg[k] for k in keep if k in cfg} | {"intermediate_size": _EXPERT}


def _family(name, kind, model_class, config_class, config, brings, **kw) -> Family:
    return Family(name, kind, model_class, config_class, config, brings, **kw)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    # ---- decoders: rotary position embeddings, RMSNorm, gated MLPs ----
    _family("granite", DECODER, "GraniteForCausalLM", "GraniteConfig", _granite_tiny(),
            "Granite's multipliers (embedding, residual, attention, logits), tied embeddings "
            "(the granite-tiny profile that spyre-profile run uses)"),
    _family("llama", DECODER, "LlamaForCausalLM", "LlamaConfig", {**_LLAMA_SHAPE, "tie_word_embeddings": False},
            "rotary embeddings, RMSNorm, SwiGLU, grouped-query attention"),
    _family("mistral", DECODER, "MistralForCausalLM", "MistralConfig", {**_LLAMA_SHAPE, "sliding_window": 16},
            "a sliding attention window (16) shorter than the decode"),
    _family("qwen2", DECODER, "Qwen2ForCausalLM", "Qwen2Config", {**_LLAMA_SHAPE, "tie_word_embeddings": False},
            "q/k/v projection biases"),
    _family("qwen3", DECODER, "Qwen3ForCausalLM", "Qwen3Config", {**_LLAMA_SHAPE, "head_dim": 32},
            "RMSNorm of each query and key head"),
    _family("phi3", DECODER, "Phi3ForCausalLM", "Phi3Config", {**_LLAMA_SHAPE, **_IDS},
            "fused qkv and gate/up projections, split"),
    _family("gemma2", DECODER, "Gemma2ForCausalLM", "Gemma2Config", {
        # query_pre_attn_scalar 16 (a scale of 1/4, not 1/sqrt(head_dim)): attention sharp
        # enough at random weights that the greedy tokens follow the context, not a
        # token-to-token cycle that a cache written at the wrong position would not change.
        # (At 8, with the cache the decode steps now really read, one step is so sharp that
        # CPU fp32 is 2.7e-5 from fp64 and the card 7.8e-5 on the other side.)
        **_LLAMA_SHAPE, "head_dim": 32, "sliding_window": 16, "query_pre_attn_scalar": 16,
        "tie_word_embeddings": False},
        "GELU (tanh), (1 + w) RMSNorm, soft-capped attention and logits, sliding and global layers"),
    _family("gemma", DECODER, "GemmaForCausalLM", "GemmaConfig", {**_LLAMA_SHAPE, "head_dim": 32},
            "Gemma's GELU (tanh), (1 + w) RMSNorm and embeddings scaled by sqrt(hidden)", slow=True),
    _family("olmo", DECODER, "OlmoForCausalLM", "OlmoConfig", {**_LLAMA_SHAPE, **_IDS},
            "LayerNorm without parameters", slow=True),
    _family("stablelm", DECODER, "StableLmForCausalLM", "StableLmConfig", {
        **_LLAMA_SHAPE, "partial_rotary_factor": 0.25},
        "LayerNorm with bias, rotary embeddings on a quarter of each head"),
    # ---- decoders: mixtures of experts (top-k routing, per-expert token counts, grouped experts) ----
    _family("granitemoe", DECODER, "GraniteMoeForCausalLM", "GraniteMoeConfig", {
        **_granite_tiny_shape(), "num_local_experts": 4, "num_experts_per_tok": 2, "initializer_range": INIT,
        "tie_word_embeddings": False},  # tied, its greedy decode repeats one token
        "top-2 of 4 experts, softmax over the chosen logits, Granite's multipliers"),
    _family("mixtral", DECODER, "MixtralForCausalLM", "MixtralConfig", {
        **_LLAMA_SHAPE, "intermediate_size": _EXPERT, "num_local_experts": 4, "num_experts_per_tok": 2,
        "tie_word_embeddings": False},
        "top-2 of 4 SwiGLU experts, the routing weights renormalised"),
    _family("qwen3_moe", DECODER, "Qwen3MoeForCausalLM", "Qwen3MoeConfig", {
        **_LLAMA_SHAPE, "head_dim": 32, "moe_intermediate_size": _EXPERT, "num_experts": 4,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "tie_word_embeddings": False},
        "top-2 of 4 experts in every layer, RMSNorm of each query and key head"),
    _family("qwen2_moe", DECODER, "Qwen2MoeForCausalLM", "Qwen2MoeConfig", {
        **_LLAMA_SHAPE, "moe_intermediate_size": _EXPERT, "shared_expert_intermediate_size": _EXPERT,
        "num_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False},
        "routed experts beside a shared expert behind a sigmoid gate, unnormalised top-k weights"),
    _family("gemma4", DECODER, "Gemma4ForCausalLM", "Gemma4TextConfig", {
        **_LLAMA_SHAPE, "head_dim": 32, "global_head_dim": 64, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"], "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 64, "final_logit_softcapping": 30.0, "tie_word_embeddings": False},
        "Gemma 4 (text): per-layer input embeddings, wider heads and proportional partial rotary "
        "embeddings in the global layer, value norms, soft-capped logits"),
    # ---- decoders: state-space (Mamba2) layers ----
    _family("mamba2", DECODER, "Mamba2ForCausalLM", "Mamba2Config", dict(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_heads=HEADS, head_dim=2 * HIDDEN // HEADS,
        state_size=32, n_groups=1, chunk_size=4, vocab_size=VOCAB, initializer_range=INIT, **_IDS),
        "Mamba2: the causal depthwise conv1d, the chunked SSM scan (cumsum, segment sums, "
        "einsums) over two chunks in the prefill, the recurrent state update in decode, a gated "
        "RMSNorm; its own conv and SSM state cache", cache="model"),
    _family("granite_moe_hybrid", DECODER, "GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", dict(
        **{k: v for k, v in _LLAMA_SHAPE.items() if k != "intermediate_size"}, intermediate_size=HIDDEN,
        shared_intermediate_size=HIDDEN, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"], mamba_n_heads=HEADS, mamba_n_groups=1,
        mamba_d_state=32, mamba_d_head=2 * HIDDEN // HEADS, mamba_chunk_size=4,
        position_embedding_type="rope", embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.1, logits_scaling=2.0, **_IDS),
        "Granite 4 (Mamba2 + attention + MoE): a Mamba2 layer and an attention layer, each with "
        "a top-2-of-4 MoE and a shared MLP; the hybrid cache (SSM states and a static KV layer)",
        cache="model"),
    # ---- decoders: learned positions, LayerNorm, GELU MLPs ----
    _family("gpt2", DECODER, "GPT2LMHeadModel", "GPT2Config", dict(
        n_embd=HIDDEN, n_inner=INTERMEDIATE, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POSITIONS,
        vocab_size=VOCAB, initializer_range=INIT, **_IDS),
        "learned positions, Conv1D projections, GELU (tanh), tied embeddings"),
    _family("opt", DECODER, "OPTForCausalLM", "OPTConfig", dict(
        hidden_size=HIDDEN, ffn_dim=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        word_embed_proj_dim=HIDDEN, max_position_embeddings=MAX_POSITIONS, vocab_size=VOCAB, init_std=INIT,
        **_IDS),
        "learned positions offset by 2, ReLU"),
    _family("gpt_neox", DECODER, "GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS, vocab_size=VOCAB, initializer_range=INIT, rotary_pct=0.25,
        use_parallel_residual=True, **_IDS),
        "parallel attention and MLP, interleaved fused qkv, partial rotary"),
    _family("falcon", DECODER, "FalconForCausalLM", "FalconConfig", dict(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_kv_heads=KV_HEADS,
        new_decoder_architecture=True, max_position_embeddings=MAX_POSITIONS, vocab_size=VOCAB,
        initializer_range=INIT, **_IDS),
        "Falcon's new decoder architecture: two LayerNorms, parallel attention, grouped fused qkv"),
    # ---- encoders: hidden states under a padding mask ----
    _family("bert", ENCODER, "BertModel", "BertConfig", dict(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS, vocab_size=VOCAB, initializer_range=INIT),
        "bidirectional attention under a padding mask, token types, pooler"),
    _family("roberta", ENCODER, "RobertaModel", "RobertaConfig", dict(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS, vocab_size=VOCAB, initializer_range=INIT, pad_token_id=1),
        "positions counted from the padding (a cumulative sum)"),
    _family("modernbert", ENCODER, "ModernBertModel", "ModernBertConfig", dict(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS, vocab_size=VOCAB, initializer_range=INIT, cls_token_id=1,
        sep_token_id=2, **_IDS),
        "rotary embeddings in an encoder, GeGLU, local and global attention, LayerNorm without bias"),
    _family("deberta_v2", ENCODER, "DebertaV2Model", "DebertaV2Config", dict(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS, vocab_size=VOCAB, initializer_range=INIT,
        relative_attention=True, position_buckets=32, pos_att_type=["p2c", "c2p"]),
        "disentangled relative-position attention (gathers)"),
    # ---- encoder-decoders: generate() ----
    _family("t5", SEQ2SEQ, "T5ForConditionalGeneration", "T5Config", dict(
        # initializer_factor 3: T5's init scales every weight by it; at 1 or 2 greedy decoding
        # repeats one token. T5's attention has no 1/sqrt(d) scale, so larger factors sharpen
        # it until fp32 itself is ill-conditioned (at 4, CPU fp32 is 1.5e-4 from fp64)
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=INTERMEDIATE, num_layers=LAYERS,
        num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=32,
        relative_attention_max_distance=64, feed_forward_proj="gated-gelu", initializer_factor=3.0,
        pad_token_id=0, eos_token_id=2, decoder_start_token_id=0),
        "encoder-decoder generate(): relative-position buckets, cross-attention, gated GELU, "
        "RMSNorm without mean, the encoder-decoder cache"),
    _family("bart", SEQ2SEQ, "BartForConditionalGeneration", "BartConfig", dict(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=INTERMEDIATE,
        decoder_ffn_dim=INTERMEDIATE, max_position_embeddings=MAX_POSITIONS, init_std=INIT,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        forced_bos_token_id=None, forced_eos_token_id=None),
        "learned positions offset by 2 in an encoder-decoder, post-LayerNorm, GELU, biases"),
)}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"no model family {name!r}; known: {', '.join(FAMILIES)}") from None
