"""Prompt lengths padded up to buckets bound the plans a compiled model makes, and the
tokens stay those of the unpadded prompt."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GraniteConfig, GraniteForCausalLM

from spyre_rt import card as cards
from spyre_rt import plan_cache
from spyre_rt.profiler import cli
from spyre_rt.serving.bucketing import (
    batch_buckets,
    bucket_length,
    bucket_of,
    grid_buckets,
    pad_prompt,
    query_buckets,
)


def test_bucket_lengths():
    assert [bucket_length(n) for n in (0, 1, 64, 65, 200)] == [64, 64, 64, 128, 256]
    assert [bucket_length(n, [16, 32]) for n in (3, 16, 17, 33)] == [16, 16, 32, 64]
    with pytest.raises(ValueError):
        bucket_length(-1)


def test_served_step_ladders_are_bounded_and_hold_every_size():
    assert batch_buckets(1) == [1] and batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(1, least=2) == [2] and batch_buckets(32, least=2) == [2, 4, 8, 16, 32]
    assert query_buckets(1) == [64] and query_buckets(384) == [64, 128, 256, 384]
    grids = grid_buckets([2, 4, 8], 256, 256)
    assert (2, 256) in grids                               # the longest query alone always fits
    assert all(r * q <= 512 for r, q in grids) and (8, 128) not in grids
    assert [bucket_of(n, [2, 4, 8]) for n in (1, 2, 3, 8)] == [2, 2, 4, 8]
    with pytest.raises(ValueError, match="past the largest"):
        bucket_of(9, [2, 4, 8])


def test_padding_goes_on_the_left_with_a_zero_mask():
    ids = torch.tensor([[5, 6, 7]])
    padded, mask = pad_prompt(ids, buckets=[8], pad_token_id=1)
    assert padded.tolist() == [[1, 1, 1, 1, 1, 5, 6, 7]]
    assert mask.tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]


def test_bucketed_prompts_give_the_unpadded_tokens_with_one_plan_per_bucket(tmp_path, capsys):
    cfg = GraniteConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
                        initializer_range=0.1, pad_token_id=0)
    torch.manual_seed(0)
    model = GraniteForCausalLM(cfg).eval()
    with cards.configured(sim_mode="functional"), torch.no_grad():
        on_card = copy.deepcopy(model).to("spyre")
        torch._dynamo.reset()
        forward = torch.compile(on_card, backend="spyre_rt", options={"cache_dir": str(tmp_path)})
        for n in (5, 9, 14, 17, 30):  # two buckets: 16 and 32
            ids = torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(n))
            padded, mask = pad_prompt(ids, buckets=[16, 32])
            got = forward(padded.to("spyre"), attention_mask=mask.to("spyre")).logits[0, -1].cpu()
            want = model(ids).logits[0, -1]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    headers = [h for _, h in plan_cache.PlanCache(tmp_path, 1 << 30).headers()]
    assert len(headers) == 2, "one plan file per bucket"
    assert cli.main(["cache", "stats", "--dir", str(tmp_path)]) == 0
    printed = "".join(capsys.readouterr().out.split())
    # the first length compiled a static graph (bucket 16); the second made the graph
    # dynamic, and its bucket (32) is a size of it
    assert "planspercompiledgraph" in printed and "static" in printed and "=32" in printed
