"""Dynamic shapes: one compile serves every size; each new size costs a plan build.

Dynamo's symbolic sizes (``dynamic=True``, ``torch._dynamo.mark_dynamic`` and its automatic
dynamic shapes, which recompile with symbols at the second size it sees) reach the
backend, which keeps the step's sizes as expressions and makes a concrete step per
distinct size at its first call.
"""

from __future__ import annotations

import pytest
import torch
from spyre_rt.compiler import specialize
from torch._dynamo.utils import counters

from spyre_rt import card as cards
from spyre_rt import dispatch, executor, plan_cache
from spyre_rt.dispatch import dispatch_mode

MODES = dispatch.NAMES  # every dispatch mode, from the table


@pytest.fixture(autouse=True)
def functional():
    torch._dynamo.reset()
    counters.clear()
    with cards.configured(sim_mode="functional") as cs:
        yield cs


def attention_like(x, w):
    """Sizes that follow the sequence length everywhere: a matmul, a softmax over it, a
    reduction and a gather of its last row."""
    s = x @ w
    p = torch.softmax(s @ s.t() / 8, -1)
    return (p @ s).sum(-1, keepdim=True) + s[-1:]


def _check(f, g, sizes, modes=MODES):
    w = torch.randn(64, 48, generator=g) / 8
    for n in sizes:
        x = torch.randn(n, 64, generator=g)
        want = attention_like(x, w)
        for mode in modes:
            with dispatch_mode(mode):
                got = f(x.to("spyre"), w.to("spyre")).cpu()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{n} rows, {mode}")


def test_dynamic_true_serves_every_size_from_one_graph_in_every_mode():
    f = torch.compile(attention_like, backend="spyre_rt", dynamic=True)
    _check(f, torch.Generator().manual_seed(0), (5, 64, 65, 130, 2))
    assert counters["stats"]["unique_graphs"] == 1


def test_a_dimension_marked_dynamic_compiles_once():
    f = torch.compile(attention_like, backend="spyre_rt")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 48, generator=g).to("spyre")
    for n in (17, 33, 100):
        x = torch.randn(n, 64, generator=g)
        xd = x.to("spyre")
        torch._dynamo.mark_dynamic(xd, 0)
        torch.testing.assert_close(f(xd, w).cpu(), attention_like(x, w.cpu()), rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1


def test_twenty_sizes_cost_two_compiles_with_automatic_dynamic_shapes():
    """Dynamo's default: the first size compiles static, the second recompiles with
    symbols; the other eighteen reuse that graph."""
    f = torch.compile(attention_like, backend="spyre_rt")
    before = set(map(id, _symbolic_steps()))
    _check(f, torch.Generator().manual_seed(2), [13, 29] + list(range(30, 48)), modes=("prebuilt",))
    assert counters["frames"]["ok"] == 2
    symbolic = [s for s in _symbolic_steps() if id(s) not in before]
    assert len(symbolic) == 1 and len(symbolic[0].steps()) == 19


def _symbolic_steps():
    import gc

    return [o for o in gc.get_objects() if type(o) is specialize.SymbolicStep]


def test_each_size_has_its_own_plan_file_under_the_same_graph(tmp_path):
    f = torch.compile(attention_like, backend="spyre_rt", dynamic=True, options={"cache_dir": str(tmp_path)})
    _check(f, torch.Generator().manual_seed(3), (9, 21, 9), modes=("prebuilt",))
    headers = [plan_cache.decode(p.read_bytes()).header for p in tmp_path.glob("*.plan")]
    assert len(headers) == 2
    assert len({h["step"] for h in headers}) == 1
    rows = [set(h["sizes"].values()) for h in headers]
    assert sorted([9 in r, 21 in r] for r in rows) == [[False, True], [True, False]]


def test_a_new_size_builds_plans_and_compiles_nothing():
    f = torch.compile(attention_like, backend="spyre_rt", dynamic=True)
    g = torch.Generator().manual_seed(4)
    _check(f, g, (8,), modes=("prebuilt",))
    frames, built = counters["frames"]["ok"], executor.stats["plans_built"]
    _check(f, g, (40,), modes=("prebuilt",))
    assert counters["frames"]["ok"] == frames
    assert executor.stats["plans_built"] > built


def test_a_cpu_op_with_a_dynamic_size_runs_inside_the_step():
    f = torch.compile(lambda x: torch.cumsum(x * 2, 0)[-3:] + 1, backend="spyre_rt", dynamic=True)
    g = torch.Generator().manual_seed(5)
    for n in (4, 11):
        x = torch.randn(n, 8, generator=g)
        torch.testing.assert_close(f(x.to("spyre")).cpu(), torch.cumsum(x * 2, 0)[-3:] + 1)


def test_a_mutated_input_with_a_dynamic_size_is_updated():
    def f(cache, x):
        cache[: x.shape[0]].copy_(x * 2)
        return cache.sum(-1)

    c = torch.compile(f, backend="spyre_rt", dynamic=True)
    g = torch.Generator().manual_seed(6)
    for n in (3, 7):
        cache, x = torch.zeros(10, 16), torch.randn(n, 16, generator=g)
        dev = cache.to("spyre")
        out = c(dev, x.to("spyre"))
        want_cache = cache.clone()
        want = f(want_cache, x)
        torch.testing.assert_close(dev.cpu(), want_cache)
        torch.testing.assert_close(out.cpu(), want)
