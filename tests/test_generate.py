"""Hugging Face ``generate()`` with a compiled forward on the card gives CPU eager's tokens.

Models are tiny, built from configs with random weights (no download), fp32 on a
functional card; greedy decoding, in every dispatch mode.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GraniteConfig, GraniteForCausalLM, StaticCache

from spyre_rt import card as cards
from spyre_rt.dispatch import dispatch_mode

# Not every mode of the table: each is a generate() run per parameter, and prebuilt-compute
# runs the plans prebuilt runs (the model-parity tests run Granite in every mode).
MODES = ("construct", "prebuilt-transfer", "prebuilt")
NEW_TOKENS = 24


def granite() -> GraniteForCausalLM:
    cfg = GraniteConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128,
                        initializer_range=0.1)
    torch.manual_seed(0)
    return GraniteForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def functional():
    with cards.configured(sim_mode="functional") as cs:
        yield cs


@pytest.fixture(scope="module")
def compiled_granite(functional):
    """The CPU model and its copy on the card with a compiled forward (compiled once for
    the module: each cache kind and batch shape adds its graphs)."""
    model = granite()
    on_card = copy.deepcopy(model).to("spyre")
    torch._dynamo.reset()
    on_card.forward = torch.compile(on_card.forward, backend="spyre_rt")
    return model, on_card


def prompts(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask; with two rows, the second is left-padded by four."""
    ids = torch.randint(3, 1000, (batch, 9), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones(batch, 9, dtype=torch.long)
    if batch > 1:
        ids[1, :4], mask[1, :4] = 0, 0
    return ids, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch", [1, 2], ids=["batch1", "batch2-left-padded"])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_generate_gives_cpu_eagers_greedy_tokens(compiled_granite, cache, batch, mode):
    """generate() with a compiled forward: the static cache (its per-layer CPU scalars are
    copied to the card inside the step: a copy the step once skipped, so a gather read a
    garbage row index) and Hugging Face's default dynamic cache (its length grows every
    step: one compile with symbolic sizes, a concrete step per length)."""
    model, on_card = compiled_granite
    ids, mask = prompts(batch)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, **kwargs)
        with dispatch_mode(mode):
            got = on_card.generate(ids.to("spyre"), attention_mask=mask.to("spyre"), **kwargs)
    assert got.device.type == "spyre"
    assert got.cpu().tolist() == want.tolist()
    assert len(set(want[0, 9:].tolist())) > 4, "a decode that repeats one token would prove little"


def test_a_hand_written_decode_loop_with_cache_positions_gives_cpu_eagers_tokens(functional):
    """A serving loop: a static cache, the model called with explicit cache_position for
    the prompt and then for each new token, compiled once for both."""
    model = granite()
    on_card = copy.deepcopy(model).to("spyre")
    cfg = model.config

    def decode(m, device):
        cache = StaticCache(config=cfg, max_cache_len=40)
        ids = prompts(1)[0].to(device)
        forward = m if device == "cpu" else torch.compile(m, backend="spyre_rt")
        with torch.no_grad():
            logits = forward(ids, past_key_values=cache, cache_position=torch.arange(9, device=device),
                             use_cache=True).logits
            tokens = [int(logits[0, -1].argmax())]
            for pos in range(9, 9 + NEW_TOKENS):
                nxt = torch.tensor([[tokens[-1]]], device=device)
                logits = forward(nxt, past_key_values=cache, cache_position=torch.tensor([pos], device=device),
                                 use_cache=True).logits
                tokens.append(int(logits[0, -1].argmax()))
        return tokens

    torch._dynamo.reset()
    assert decode(on_card, "spyre") == decode(model, "cpu")


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_generate_with_a_sliding_window_shorter_than_the_decode(functional, cache):
    """Mistral's sliding window (16 positions, 8 + 20 tokens), dynamic shapes: its mask
    arithmetic on 0-d CPU tensors runs inside the compiled graph."""
    from spyre_rt.profiler.models import family

    _, model = family("mistral").build(torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    want = model.generate(ids, max_new_tokens=20, do_sample=False, cache_implementation=cache)
    on_card = copy.deepcopy(model).to("spyre")
    torch._dynamo.reset()
    on_card.forward = torch.compile(on_card.forward, backend="spyre_rt", dynamic=True)
    got = on_card.generate(ids.to("spyre"), max_new_tokens=20, do_sample=False, cache_implementation=cache)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("name", ["gpt_neox", "qwen3", "phi3"])
def test_generate_on_the_default_dynamic_cache_across_families(functional, name):
    """Hugging Face's default cache, batch 2 left-padded, automatic dynamic shapes: the
    decode step's new key is computed in place in its slice of the cat that grows the cache
    (GPT-NeoX's partial rotary, Qwen3's per-head norm), at an offset the step must keep."""
    from spyre_rt.profiler.models import family

    _, model = family(name).build(torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    on_card = copy.deepcopy(model).to("spyre")
    torch._dynamo.reset()
    on_card.forward = torch.compile(on_card.forward, backend="spyre_rt")
    got = on_card.generate(ids.to("spyre"), attention_mask=mask.to("spyre"), max_new_tokens=12, do_sample=False,
                           pad_token_id=0)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("family", ["mamba2", "granite_moe_hybrid"])
def test_generate_with_the_models_own_cache_gives_cpu_eagers_tokens(functional, family):
    """Mamba2 and the Granite 4 hybrid through generate() with the cache class the model
    makes for itself (Mamba's conv and SSM states; the hybrid's states beside a growing
    attention cache): a compiled forward on the card, greedy, CPU eager's tokens."""
    from spyre_rt.profiler import models

    cfg, model = models.family(family).build(torch.float32)
    on_card = copy.deepcopy(model).to("spyre")
    torch._dynamo.reset()
    on_card.forward = torch.compile(on_card.forward, backend="spyre_rt")
    ids = torch.randint(3, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(11))
    kwargs = dict(max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        got = on_card.generate(ids.to("spyre"), attention_mask=torch.ones_like(ids).to("spyre"), **kwargs)
    assert got.cpu().tolist() == want.tolist()
    assert len(set(want[0, 9:].tolist())) > 3, "a decode that repeats one token would prove little"
