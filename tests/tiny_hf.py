"""Tiny random-weight Hugging Face models and a tokenizer built here, saved to a directory
that vLLM and transformers load as they would a downloaded checkpoint (no network)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def word(i: int) -> str:
    return f"w{i}"


def save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", ":"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(len(specials), VOCAB):
        vocab[word(i)] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def config(family: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "granite":
        return transformers.GraniteConfig(**common, embedding_multiplier=12.0, residual_multiplier=0.22,
                                          attention_multiplier=0.0625, logits_scaling=8.0)
    if family == "qwen3":
        return transformers.Qwen3Config(**common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           decoder_sparse_step=1, norm_topk_prob=True)
    raise ValueError(family)


def save_model(family: str, path: Path, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = config(family)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(path)
    save_tokenizer(path)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's greedy tokens on the CPU, not stopping at the end-of-sequence token."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
