"""Bad input to a compiled model gets a clear error, as CPU eager's would be, and leaves
nothing on the card half-written; dtypes the card has no kernels for fall back or are
named in a clear error."""

from __future__ import annotations

import pytest
import torch

import spyre_rt
from spyre_rt import card as cards
from spyre_rt import dispatch
from spyre_rt.dispatch import dispatch_mode

MODES = dispatch.NAMES  # every dispatch mode, from the table


@pytest.fixture(autouse=True)
def functional():
    torch._dynamo.reset()
    with cards.configured(sim_mode="functional") as cs:
        yield cs


def embed_into_cache(cache, ids, pos, table):
    """A KV-cache-like update: embed the tokens and write them at their positions."""
    cache.index_copy_(0, pos, torch.nn.functional.embedding(ids, table) * 2)
    return cache.sum(-1)


@pytest.mark.parametrize("mode", MODES)
def test_a_token_outside_the_vocabulary_is_an_index_error_naming_the_op_and_the_value(mode):
    g = torch.Generator().manual_seed(0)
    table, cache = torch.randn(100, 64, generator=g), torch.randn(8, 64, generator=g)
    f = torch.compile(embed_into_cache, backend="spyre_rt", dynamic=False)
    dev_cache, dev_table = cache.to("spyre"), table.to("spyre")
    pos = torch.tensor([2, 5]).to("spyre")
    with dispatch_mode(mode):
        with pytest.raises(IndexError) as info:
            f(dev_cache, torch.tensor([3, 150]).to("spyre"), pos, dev_table)
        assert isinstance(info.value, spyre_rt.SpyreIndexError)
        assert "aten.embedding" in str(info.value) and "150" in str(info.value) and "100 rows" in str(info.value)
        assert torch.equal(dev_cache.cpu(), cache), "the failed call changed the cache"
        out = f(dev_cache, torch.tensor([3, 99]).to("spyre"), pos, dev_table)  # the next call is right
    want = cache.clone()
    torch.testing.assert_close(out.cpu(), embed_into_cache(want, torch.tensor([3, 99]), torch.tensor([2, 5]), table))
    torch.testing.assert_close(dev_cache.cpu(), want)


def test_a_dtype_spyre_tensors_cannot_hold_is_a_compile_error_naming_it():
    f = torch.compile(lambda x: torch.view_as_complex(x).abs(), backend="spyre_rt", dynamic=False)
    with pytest.raises(spyre_rt.SpyreCompileError, match="complex64.*cannot hold"):
        f(torch.randn(3, 4, 2).to("spyre"))


def test_a_matmul_in_a_dtype_the_arrays_do_not_take_runs_on_the_cpu():
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-5, 5, (4, 8), dtype=torch.int8, generator=g)
    b = torch.randint(-5, 5, (8, 3), dtype=torch.int8, generator=g)
    f = torch.compile(lambda a, b: (a @ b) + 1, backend="spyre_rt", dynamic=False)
    assert torch.equal(f(a.to("spyre"), b.to("spyre")).cpu(), a @ b + 1)


def test_a_float64_intermediate_gives_eagers_values():
    x = torch.randn(3, 70, generator=torch.Generator().manual_seed(2))
    f = torch.compile(lambda x: (x.double() * 3).exp().float(), backend="spyre_rt", dynamic=False)
    torch.testing.assert_close(f(x.to("spyre")).cpu(), (x.double() * 3).exp().float(), rtol=1e-5, atol=1e-5)
