"""Grouped matmuls over experts run on the card: every expert's product of every row, and for
each row the product of the expert whose run holds it (``compiler/inductor/grouped.py``).

The oracle is the loop a grouped matmul means (transformers' ``grouped_mm_fallback``, one
``mm`` per expert's run of rows, zeros past the last run). Cases are the routings a router
can produce: every expert with rows, experts with none, every row to one expert, rows past
the last offset; values past the fp16 range in a product the row does not keep.
"""

from __future__ import annotations

import pytest
import torch
from spyre_rt.compiler.inductor.grouped import grouped_mm_by_select

from spyre_rt import dispatch, fallback
from spyre_rt.dispatch import dispatch_mode

pytestmark = pytest.mark.usefixtures("quiet_functional_compile")


def loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end].float().mm(w[e].float()).to(x.dtype)
        start = end
    return out


ROUTINGS = {  # rows per expert, in expert order (their sum may stop short of the rows)
    "every expert": [3, 1, 2, 4],
    "some experts none": [0, 6, 0, 4],
    "one expert": [0, 0, 10, 0],
    "rows past the last run": [2, 3, 1, 0],
}


def _case(counts, dtype, rows=10, k=64, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(len(counts), k, n, generator=g) / 8).to(dtype)
    offs = torch.cumsum(torch.tensor(counts), 0, dtype=torch.int32)
    return x, w, offs


@pytest.mark.parametrize("routing", ROUTINGS)
def test_the_select_is_the_loop(routing):
    x, w, offs = _case(ROUTINGS[routing], torch.float32)
    torch.testing.assert_close(grouped_mm_by_select(x, w, offs), loop(x, w, offs), rtol=1e-6, atol=1e-6)


def _compiled_op():
    pytest.importorskip("transformers")
    from transformers.integrations import moe  # noqa: F401  registers transformers::grouped_mm_fallback

    op = torch.ops.transformers.grouped_mm_fallback
    return torch.compile(lambda x, w, offs: op(x, w, offs), backend="spyre_rt")


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("mode", dispatch.NAMES)
def test_transformers_grouped_matmul_runs_on_the_card(routing, mode):
    x, w, offs = _case(ROUTINGS[routing], torch.float32)
    f = _compiled_op()
    before = sum(fallback.in_steps.values())
    with dispatch_mode(mode):
        got = f(x.to("spyre"), w.to("spyre"), offs.to("spyre")).cpu()
    assert sum(fallback.in_steps.values()) == before, dict(fallback.in_steps)  # nothing ran on the CPU
    torch.testing.assert_close(got, loop(x, w, offs), rtol=1e-5, atol=1e-5)


def test_a_new_routing_reuses_the_compiled_step():
    """The offsets are data: another routing of the same rows is the same kernels."""
    from torch._dynamo.utils import counters

    f = _compiled_op()
    counters.clear()
    for routing in ROUTINGS.values():
        x, w, offs = _case(routing, torch.float32)
        torch.testing.assert_close(f(x.to("spyre"), w.to("spyre"), offs.to("spyre")).cpu(), loop(x, w, offs),
                                   rtol=1e-5, atol=1e-5)
    assert counters["frames"]["ok"] == 1


def test_an_inf_in_a_dropped_product_stays_out_of_the_rows_that_keep_another():
    """fp16: expert 1's weights overflow every product; only its own rows see inf."""
    x, w, offs = _case([4, 3, 3], torch.float16)
    w[1] = 60000
    want = loop(x, w, offs)
    assert torch.isinf(want[4:7]).all() and torch.isfinite(want[:4]).all() and torch.isfinite(want[7:]).all()
    got = _compiled_op()(x.to("spyre"), w.to("spyre"), offs.to("spyre")).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not torch.isnan(got).any()
    torch.testing.assert_close(got[:4], want[:4], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got[7:], want[7:], rtol=2e-3, atol=2e-3)


def test_torch_grouped_mm_runs_on_the_card():
    """torch's own op (bf16 only, as its meta function requires)."""
    x, w, offs = _case([3, 0, 5, 2], torch.bfloat16)
    f = torch.compile(lambda x, w, offs: torch._grouped_mm(x, w, offs=offs), backend="spyre_rt")
    before = sum(fallback.in_steps.values())
    got = f(x.to("spyre"), w.to("spyre"), offs.to("spyre")).cpu()
    assert sum(fallback.in_steps.values()) == before
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, loop(x, w, offs), rtol=2e-2, atol=2e-2)
