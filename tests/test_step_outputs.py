"""The outputs of a prebuilt step: memory the step owns, reused only once released, and one
native call per step."""

import contextlib

import pytest
import torch

import spyre_rt
from spyre_rt import card as cards
from spyre_rt import graphs, plan, tensors
from spyre_rt.dispatch import dispatch_mode


def _fn(x, w):
    return torch.tanh(x @ w) * 2 + 1


def _ref(x, w):
    return torch.tanh(x @ w) * 2 + 1


@pytest.fixture(scope="module")
def step():
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    f = torch.compile(_fn, backend="spyre_rt", dynamic=False)
    wd = w.to("spyre")
    with dispatch_mode("prebuilt"):
        f(torch.zeros(8, 64).to("spyre"), wd)  # compiled, plans built
    return f, w, wd


def _x(seed):
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(seed))


def _addr(t):
    return t.untyped_storage().data_ptr()


def test_an_output_held_is_never_overwritten(step):
    f, w, wd = step
    with dispatch_mode("prebuilt"):
        held = [f(_x(i).to("spyre"), wd) for i in range(7)]  # more than the pool keeps
    assert len({_addr(t) for t in held}) == len(held)
    for i, t in enumerate(held):
        assert torch.allclose(t.cpu(), _ref(_x(i), w), atol=1e-2), f"output {i} was overwritten"


def test_a_released_output_is_reused(step):
    f, w, wd = step
    with dispatch_mode("prebuilt"):
        a = f(_x(1).to("spyre"), wd)
        where = _addr(a)
        del a
        b = f(_x(2).to("spyre"), wd)
    assert _addr(b) == where  # its memory came back to the step, not to the allocator
    assert torch.allclose(b.cpu(), _ref(_x(2), w), atol=1e-2)


@pytest.mark.parametrize("hold", ["view", "storage", "alias", "list"])
def test_anything_referring_to_an_output_keeps_it(step, hold):
    f, w, wd = step
    with dispatch_mode("prebuilt"):
        out = f(_x(3).to("spyre"), wd)
        expect = out.cpu()
        if hold == "view":
            kept = out[2:5]
        elif hold == "storage":
            kept = out.untyped_storage()
        elif hold == "alias":
            kept = out
        else:
            kept = [out]
        del out
        for i in range(6):
            f(_x(10 + i).to("spyre"), wd)
    if hold == "view":
        assert torch.equal(kept.cpu(), expect[2:5])
    elif hold == "storage":
        assert kept.data_ptr() not in {_addr(f(_x(20).to("spyre"), wd)) for _ in range(3)}
        assert torch.equal(torch.empty(0, device="spyre").set_(kept, 0, expect.shape).cpu(), expect)
    else:
        t = kept if hold == "alias" else kept[0]
        assert torch.equal(t.cpu(), expect)


def test_an_output_changed_in_place_and_dropped_comes_back_as_new(step):
    f, w, wd = step
    with dispatch_mode("prebuilt"):
        out = f(_x(4).to("spyre"), wd)
        out.t_()  # a metadata change on the object the step handed out
        del out
        again = f(_x(5).to("spyre"), wd)
    assert again.shape == (8, 48) and again.stride() == (48, 1)
    assert torch.allclose(again.cpu(), _ref(_x(5), w), atol=1e-2)


def test_outputs_of_a_failed_call_are_reused(step):
    f, w, wd = step
    card = tensors.card_of(wd)
    with dispatch_mode("prebuilt"):
        f(_x(1).to("spyre"), wd)
        x = _x(6).to("spyre")
        start = card.mem_stats()["data_allocated"]
        for _ in range(3):
            card.fault_inject("command", 0)
            with pytest.raises(spyre_rt.SpyreDeviceError):
                f(x, wd)
        assert card.mem_stats()["data_allocated"] == start
        assert torch.allclose(f(x, wd).cpu(), _ref(_x(6), w), atol=1e-2)


class _Counting:
    """The cffi lib, counting the calls made through it."""

    def __init__(self, lib):
        self._lib, self.calls = lib, []

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if not callable(fn):
            return fn

        def counted(*args):
            self.calls.append(name)
            return fn(*args)

        return counted


@contextlib.contextmanager
def counting_native_calls(monkeypatch):
    """Every module that calls the runtime on a step's path, through one counting lib."""
    counter = _Counting(plan.lib)
    for module in (plan, cards, tensors, graphs):
        monkeypatch.setattr(module, "lib", counter)
    yield counter


def test_a_prebuilt_step_is_one_native_call(step, monkeypatch):
    f, w, wd = step
    card = tensors.card_of(wd)
    x = _x(7).to("spyre")
    with dispatch_mode("prebuilt"):
        out = f(x, wd)  # the steady state of a loop that holds its last output
        with counting_native_calls(monkeypatch) as counter:
            c0 = card.counters()["native_calls"]
            for _ in range(5):
                out = f(x, wd)
            c1 = card.counters()["native_calls"]
            calls = list(counter.calls)
    assert [c for c in calls if c != "spy_counters_get"] == ["spy_plan_launch"] * 5
    assert c1 - c0 == 5
    assert torch.allclose(out.cpu(), _ref(_x(7), w), atol=1e-2)


def test_a_reset_drops_the_pooled_outputs(step):
    f, w, _ = step
    cs = cards.open_set(None, "functional")
    with cards.using(cs):
        card = cs.cards[0]
        wd, x = w.to("spyre"), _x(8).to("spyre")
        with dispatch_mode("prebuilt"):
            f(x, wd)
            card.reset()
            wd, x = w.to("spyre"), _x(8).to("spyre")
            out = f(x, wd)
    assert torch.allclose(out.cpu(), _ref(_x(8), w), atol=1e-2)
