"""Sorts, top-k, integer histograms and cumulative sums of short rows run on the card, by
comparing every pair of a row's elements (``compiler/inductor/ranking.py``); longer rows
stay torch's ops, on the CPU inside the step. Each case is checked against CPU eager, with
nothing run on the CPU for the short ones.
"""

from __future__ import annotations

import pytest
import torch
from spyre_rt.compiler.inductor import ranking

from spyre_rt import dispatch, fallback
from spyre_rt.dispatch import dispatch_mode

pytestmark = pytest.mark.usefixtures("quiet_functional_compile")


def _on_card(fn, *args):
    """fn compiled for the card on `args`: (its results on the host, the ops that ran on
    the CPU)."""
    before = dict(fallback.in_steps)
    out = torch.compile(fn, backend="spyre_rt")(*[a.to("spyre") for a in args])
    cpu = {k: v - before.get(k, 0) for k, v in fallback.in_steps.items() if v != before.get(k, 0)}
    out = tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()
    return out, cpu


G = torch.Generator().manual_seed(0)
FLOATS = torch.randn(6, 10, generator=G)
WITH_SPECIALS = torch.tensor([[0.5, float("nan"), -float("inf"), 2.0, float("inf"), -1.0, 0.5, float("nan")]])
INTS = torch.randint(0, 5, (4, 16), generator=G)  # many ties


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("x,k,dim", [(FLOATS, 3, -1), (FLOATS, 2, 0), (FLOATS, 10, 1), (WITH_SPECIALS, 8, -1)],
                         ids=["floats-k3", "floats-dim0", "floats-all", "nan-inf"])
def test_topk_of_short_rows_runs_on_the_card(x, k, dim, largest):
    (values, index), cpu = _on_card(lambda t: torch.topk(t, k, dim=dim, largest=largest), x)
    want_values, want_index = torch.topk(x, k, dim=dim, largest=largest)
    assert not cpu, cpu
    torch.testing.assert_close(values, want_values, equal_nan=True, rtol=0, atol=0)
    if x is WITH_SPECIALS:  # tied values (0.5, NaN): torch leaves the order of their indices open
        torch.testing.assert_close(torch.gather(x, dim, index), values, equal_nan=True, rtol=0, atol=0)
        assert len(set(index.reshape(-1).tolist())) == index.numel()
    else:
        assert torch.equal(index, want_index)


def test_topk_of_tied_integers_picks_the_largest_values_each_once():
    (values, index), cpu = _on_card(lambda t: torch.topk(t, 5, dim=-1), INTS)
    assert not cpu
    assert torch.equal(values, torch.topk(INTS, 5, dim=-1).values)
    assert torch.equal(torch.gather(INTS, 1, index), values)
    assert all(len(set(row.tolist())) == 5 for row in index)


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("x", [INTS, FLOATS, WITH_SPECIALS, INTS.to(torch.int32), FLOATS.half()],
                         ids=["ints", "floats", "nan-inf", "int32", "fp16"])
def test_a_stable_sort_of_short_rows_is_torchs(x, descending):
    (values, index), cpu = _on_card(lambda t: torch.sort(t, dim=-1, descending=descending, stable=True), x)
    want = torch.sort(x, dim=-1, descending=descending, stable=True)
    assert not cpu, cpu
    assert values.dtype == x.dtype
    torch.testing.assert_close(values, want.values, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(index, want.indices)


def test_an_unstable_sort_of_ties_is_a_sorting_permutation():
    (values, index), cpu = _on_card(lambda t: torch.sort(t.reshape(-1)), INTS)
    assert not cpu
    flat = INTS.reshape(-1)
    assert torch.equal(values, torch.sort(flat).values)
    assert torch.equal(flat[index], values) and torch.equal(torch.sort(index).values, torch.arange(flat.numel()))


@pytest.mark.parametrize("bins,lo,hi", [(5, 0, 4), (3, 0, 8), (4, 1, 3)])
def test_an_integer_histc_of_a_given_range_runs_on_the_card(bins, lo, hi):
    x = torch.tensor([0, 4, 4, 2, 9, -1, 3, 3, 3, 1, 8]).to(torch.int32)
    got, cpu = _on_card(lambda t: torch.histc(t, bins=bins, min=lo, max=hi), x)
    assert not cpu
    assert got.dtype == torch.int32
    assert torch.equal(got, torch.histc(x.double(), bins=bins, min=lo, max=hi).int())


@pytest.mark.parametrize("x,dim,dtype", [
    (INTS, 1, None), (INTS.to(torch.int32), 0, torch.int32), (FLOATS, 1, None), (FLOATS, 0, None),
    (FLOATS.half(), 1, None), (INTS.bool(), 1, None)], ids=["int64", "int32-dim0", "fp32", "fp32-dim0", "fp16", "bool"])
def test_cumsum_of_short_rows_runs_on_the_card(x, dim, dtype):
    got, cpu = _on_card(lambda t: torch.cumsum(t, dim, dtype=dtype), x)
    want = torch.cumsum(x, dim, dtype=dtype)
    assert not cpu
    assert got.dtype == want.dtype
    tol = 1e-3 if x.dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", dispatch.NAMES)
def test_a_router_runs_on_the_card_in_every_mode(mode):
    """top-2 of 6 experts, the sort of the expert ids, their counts and offsets."""
    def route(logits):
        w, ids = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
        flat, perm = torch.sort(ids.reshape(-1))
        counts = torch.histc(flat.int(), bins=6, min=0, max=5)
        return w, flat, counts, torch.cumsum(counts, 0, dtype=torch.int32)

    logits = torch.randn(12, 6, generator=torch.Generator().manual_seed(3))
    with dispatch_mode(mode):
        (w, flat, counts, offs), cpu = _on_card(route, logits)
    assert not cpu, cpu
    ref_w, ref_ids = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    ref_flat = torch.sort(ref_ids.reshape(-1)).values
    ref_counts = torch.histc(ref_flat.double(), bins=6, min=0, max=5).int()
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-6)
    assert torch.equal(flat, ref_flat) and torch.equal(counts, ref_counts)
    assert torch.equal(offs, torch.cumsum(ref_counts, 0, dtype=torch.int32))


def test_a_row_past_the_bound_stays_torchs_op(monkeypatch):
    monkeypatch.setattr(ranking, "MAX_PAIRS", 50)
    x = torch.randn(1, 10, generator=torch.Generator().manual_seed(4))
    (values, index), cpu = _on_card(lambda t: torch.sort(t, dim=-1), x)
    assert cpu == {"aten.sort.default": 1} or set(cpu) == {"aten.sort.stable"}, cpu
    want = torch.sort(x, dim=-1)
    assert torch.equal(values, want.values) and torch.equal(index, want.indices)


def test_pairwise_sums_over_rows_that_tiles_split_mid_stick():
    """(9, 128) rows: 36 rows per core once split each 128-element output row inside a stick,
    and two cores' stores into it lost one's sums (tests/test_loop_tiling.py)."""
    for shape in ((9, 128), (17, 64), (9, 120)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
        fn = lambda t: (t.unsqueeze(-1) - t.unsqueeze(-2)).sum(-1)  # noqa: E731
        got, cpu = _on_card(fn, x)
        assert not cpu
        torch.testing.assert_close(got, fn(x), rtol=1e-4, atol=1e-4)


# ---- one element per index in short 1-D tensors ----------------------------------------------

def test_a_gather_of_a_1d_tensor_runs_on_the_card():
    w = torch.randn(24, generator=torch.Generator().manual_seed(6))
    idx = torch.tensor([3, 0, 23, -1, 5, 5, -24, 7])  # repeats and indices from the end
    got, cpu = _on_card(lambda t, i: t[i] * 2, w, idx)
    assert not cpu
    assert torch.equal(got, w[idx] * 2)


@pytest.mark.parametrize("accumulate", [False, True])
def test_a_scatter_into_a_1d_tensor_runs_on_the_card(accumulate):
    """The inverse of a permutation, and a scatter whose repeated index keeps the last
    value (the CPU's loop) or, accumulating, adds them all."""
    g = torch.Generator().manual_seed(7)
    perm = torch.randperm(24, generator=g)
    got, cpu = _on_card(lambda p: torch.empty_like(p).index_put_((p,), torch.arange(24, device=p.device)), perm)
    assert not cpu and torch.equal(got, torch.argsort(perm))
    x, idx, v = torch.randn(10, generator=g), torch.tensor([2, 7, 2, -1]), torch.randn(4, generator=g)
    fn = lambda x, i, v: x.clone().index_put_((i,), v, accumulate=accumulate) + 1  # noqa: E731
    got, cpu = _on_card(fn, x, idx, v)
    assert not cpu
    torch.testing.assert_close(got, fn(x, idx, v), rtol=1e-6, atol=1e-6)


def test_a_refused_gather_runs_alone_on_the_cpu_and_the_arithmetic_around_it_on_the_card():
    """An element gather along the columns (which construction cannot address) in a fused
    kernel with arithmetic: only the gather runs on the CPU."""
    g = torch.Generator().manual_seed(8)
    x, idx = torch.randn(6, 70, generator=g), torch.randint(0, 70, (6, 70), generator=g)
    fn = lambda x, i: torch.gather(x, 1, i) * 2 + x.exp()  # noqa: E731
    got, cpu = _on_card(fn, x, idx)
    assert set(cpu) == {"aten.gather.default"}, cpu
    torch.testing.assert_close(got, fn(x, idx), rtol=1e-5, atol=1e-5)
