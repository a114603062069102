"""A gather construction cannot address inside a fusion is computed into a buffer of its own,
on the card, before any of its ops go to the CPU (``compiler/backend.py``'s
``realize_nodes``).

The cases are the patterns that models run: MoE's combine (each (token, expert) pair's
output gathered at the inverse permutation, scaled by its routing weight, then summed over
the top-k: the index varies along the sum's columns), and Gemma 4's per-layer embeddings
(one embedding row holds every layer's slice; the norm over a slice reads a row narrower
than the table's). Once apart, the MoE gather's routing weight is an element gather of a
one-row table, which the card's GATHER command moves an item at a time.
"""

from __future__ import annotations

import pytest
import torch

from spyre_rt import dispatch, fallback
from spyre_rt.dispatch import dispatch_mode

pytestmark = pytest.mark.usefixtures("quiet_functional_compile")

T, K, H = 6, 2, 64


def moe_combine(out, weights, perm):
    """transformers' grouped-experts combine: pair outputs sorted by expert, back to tokens."""
    weighted = out * weights[perm].unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0), device=perm.device)
    return weighted[inv].view(-1, K, out.shape[-1]).sum(dim=1)


def per_layer_norm(table, ids, scale):
    """Gemma 4's per-layer inputs: one embedding row of L slices, each slice normed."""
    rows = table[ids].view(*ids.shape, 3, 32)
    return rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6) * scale


def _moe_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T * K, H, generator=g), torch.rand(T * K, generator=g), torch.randperm(T * K, generator=g)


def _on_card(fn, args, **options):
    f = torch.compile(fn, backend="spyre_rt", fullgraph=True, options=options or None)
    before = sum(fallback.in_steps.values())
    got = f(*(a.to("spyre") for a in args)).cpu()
    return got, sum(fallback.in_steps.values()) - before


@pytest.mark.parametrize("mode", dispatch.NAMES)
def test_the_moe_combine_runs_on_the_card(mode):
    args = _moe_inputs()
    with dispatch_mode(mode):
        got, on_cpu = _on_card(moe_combine, args)
    assert on_cpu == 0, dict(fallback.in_steps)
    torch.testing.assert_close(got, moe_combine(*args), rtol=1e-6, atol=1e-6)


def test_a_new_permutation_is_data():
    """Other routings through the same compiled step: the gathers read the new indices."""
    f = torch.compile(moe_combine, backend="spyre_rt", fullgraph=True)
    for seed in range(3):
        args = _moe_inputs(seed)
        torch.testing.assert_close(f(*(a.to("spyre") for a in args)).cpu(), moe_combine(*args),
                                   rtol=1e-6, atol=1e-6)


def test_apart_is_on_the_card_so_it_needs_no_cpu_fallback():
    """With CPU fallback off the compile still succeeds: a gather apart is a card kernel."""
    args = _moe_inputs()
    got, on_cpu = _on_card(moe_combine, args, cpu_fallback=False)
    assert on_cpu == 0
    torch.testing.assert_close(got, moe_combine(*args), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_layer_embeddings_norm_on_the_card(dtype):
    g = torch.Generator().manual_seed(1)
    table = torch.randn(50, 96, generator=g).to(dtype)
    ids = torch.randint(0, 50, (2, 5), generator=g)
    scale = torch.rand(32, generator=g).to(dtype)
    got, on_cpu = _on_card(per_layer_norm, (table, ids, scale))
    assert on_cpu == 0, dict(fallback.in_steps)
    want = per_layer_norm(table.float(), ids, scale.float())
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def combine_at(out, weights, perm, inv):
    return (out * weights[perm].unsqueeze(-1))[inv].view(T, K, H).sum(1)


def test_an_index_past_the_table_is_an_index_error():
    """The gathers apart check their indices as every gather does: the pair rows and the
    routing weights (an element gather) at an index past their table."""
    from spyre_rt.errors import SpyreIndexError

    out, weights, perm = _moe_inputs()
    inv = torch.argsort(perm)
    f = torch.compile(combine_at, backend="spyre_rt", fullgraph=True)
    torch.testing.assert_close(f(*(a.to("spyre") for a in (out, weights, perm, inv))).cpu(),
                               combine_at(out, weights, perm, inv), rtol=1e-6, atol=1e-6)
    bad = inv.clone()
    bad[3] = T * K + 5
    with pytest.raises(SpyreIndexError):
        f(*(a.to("spyre") for a in (out, weights, perm, bad))).cpu()
