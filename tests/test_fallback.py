"""Eager ops without a device kernel run on the CPU, correct, warned once, counted."""

import warnings

import pytest
import torch

import spyre_rt
from spyre_rt import fallback


def test_results_match_cpu_and_stay_on_spyre():
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    da, db = a.to("spyre"), b.to("spyre")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", spyre_rt.SpyreFallbackWarning)
        cases = {
            "add": (lambda x, y: x + y),
            "matmul": (lambda x, y: x @ y.t()),
            "softmax": (lambda x, y: torch.softmax(x, -1)),
            "cat": (lambda x, y: torch.cat([x, y], 1)),
            "max": (lambda x, y: x.max(1).values),
            "where": (lambda x, y: torch.where(x > 0, x, y)),
        }
        for name, f in cases.items():
            out = f(da, db)
            assert out.device.type == "spyre", name
            assert torch.allclose(out.cpu(), f(a, b), atol=1e-6), name


def test_in_place_and_out_ops_write_back():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", spyre_rt.SpyreFallbackWarning)
        x = torch.arange(6.0).reshape(2, 3).to("spyre")
        r = x.add_(1)
        assert r is x and x.cpu().tolist() == [[1, 2, 3], [4, 5, 6]]
        x.t()[0].mul_(10)  # through a transposed view
        assert x.cpu().tolist() == [[10, 2, 3], [40, 5, 6]]
        out = torch.empty(0, device="spyre")
        torch.abs(torch.tensor([-1.0, 2.0]).to("spyre"), out=out)
        assert out.cpu().tolist() == [1.0, 2.0]


def test_each_op_warns_once_and_is_counted():
    x = torch.ones(3).to("spyre")
    fallback.forget_warnings("aten::exp.out")
    before = fallback.calls["aten::exp.out"]
    with pytest.warns(spyre_rt.SpyreFallbackWarning, match="aten::exp"):
        torch.exp(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", spyre_rt.SpyreFallbackWarning)
        torch.exp(x)  # no second warning
    assert fallback.calls["aten::exp.out"] - before == 2
    assert torch.spyre.memory_stats()["cpu_fallback.aten::exp.out"] >= 2


def test_mixed_devices_are_refused():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(torch.ones(2, 2).to("spyre"), torch.ones(2, 2))


@pytest.mark.parametrize("dynamic", [False, True])
def test_work_on_cpu_tensors_inside_a_compiled_graph_runs_and_stays_on_the_cpu(dynamic):
    """A model may pass 0-d CPU tensors, or make CPU tensors, inside a graph compiled for the
    card: aten runs that work (a step has no C++ kernels), and what eager leaves on the CPU
    comes back on the CPU."""
    from spyre_rt.dispatch import NAMES, dispatch_mode

    def f(x, s):
        t = s.to(torch.float32) * 2  # computed on the CPU, read by a card kernel, returned
        made = torch.arange(4, dtype=torch.float32) * 3
        return x * t, t, made

    x, s = torch.randn(5, 70), torch.tensor(3)
    want = f(x, s)
    torch._dynamo.reset()
    fast = torch.compile(f, backend="spyre_rt", dynamic=dynamic)
    fallback.in_steps.clear()
    for mode in NAMES:  # every dispatch mode: prebuilt-compute reads and writes a CPU op's values
        with dispatch_mode(mode), warnings.catch_warnings():
            warnings.simplefilter("error", spyre_rt.SpyreFallbackWarning)  # eager's CPU work is no fallback
            got = fast(x.to("spyre"), s)
        assert got[0].device.type == "spyre" and got[1].device.type == "cpu" and got[2].device.type == "cpu"
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.cpu(), w)
    assert not fallback.in_steps


@pytest.mark.parametrize("backend", ["eager", "spyre_rt"])
def test_a_branch_on_a_card_tensors_value_inside_a_compiled_function(backend):
    """`if x.max() > 0` graph-breaks, and the card's kernels then run eagerly inside the
    function torch.compile runs (Hugging Face's dynamic NTK rotary embedding does this): Dynamo
    must not trace them (it failed building a guard on the native module)."""
    def f(x):
        if x.max() > 0:
            return x * 2
        return x - 1

    for x in (torch.randn(8), -torch.rand(8)):
        torch._dynamo.reset()
        got = torch.compile(f, backend=backend)(x.to("spyre"))
        assert got.device.type == "spyre" and torch.equal(got.cpu(), f(x))
