"""Hugging Face ``generate()`` with a compiled forward on the card gives CPU eager's tokens.

Models are tiny, built from configs with random weights (no download), fp32 on a
functional card; greedy decoding, in every dispatch mode.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GraniteConfig, GraniteForCausalLM

from spyre_rt import card as cards
from spyre_rt.dispatch import dispatch_mode

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
    model = granite()
    on_card = copy.deepcopy(model).to("spyre")
    torch._dynamo.reset()
    on_card.forward = torch.compile(on_card.forward, backend="spyre_rt")
    return model, on_card


@pytest.mark.parametrize("mode", MODES)
def test_generate_with_a_static_cache_gives_cpu_eagers_tokens(compiled_granite, mode):
    """The static cache keeps per-layer CPU scalars that the graph copies to the card (a
    device copy the step once skipped, so a gather read a garbage row index)."""
    model, on_card = compiled_granite
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")
        with dispatch_mode(mode):
            got = on_card.generate(ids.to("spyre"), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   cache_implementation="static")
    assert got.device.type == "spyre"
    assert got.cpu().tolist() == want.tolist()
    assert len(set(want[0, 8:].tolist())) > 4, "a decode that repeats one token would prove little"
