"""Graph capture and replay (torch.spyre.SpyreGraph, torch.spyre.graph,
torch.spyre.make_graphed_callables): replay equals the compiled call, is one native call,
and every misuse is a clear error, never a wrong result."""

import copy

import pytest
import torch
import torch.nn.functional as F
from test_step_outputs import counting_native_calls

import spyre_rt
from spyre_rt import card as cards
from spyre_rt import tensors
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.errors import SpyreGraphError
from spyre_rt.executor import live_steps

WIDTH = 64


def _weights(layers, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(WIDTH, WIDTH, generator=g) / 8, torch.randn(WIDTH, generator=g) / 8) for _ in range(layers)]


def stack(x, *params):
    """`layers` residual MLP layers (a kernel or more each)."""
    for i in range(0, len(params), 2):
        w, b = params[i], params[i + 1]
        x = x + F.silu(x @ w + b)
    return torch.softmax(x, -1)


def _flat(weights):
    return [t for wb in weights for t in wb]


def _x(seed, rows=4):
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def compiled():
    return torch.compile(stack, backend="spyre_rt", dynamic=False)


@pytest.mark.parametrize("layers", [1, 4, 12])
def test_replay_equals_the_compiled_call(compiled, layers):
    weights = _flat(_weights(layers))
    wd = [t.to("spyre") for t in weights]
    static_x = _x(0).to("spyre")
    compiled(static_x, *wd)  # compiles (a capture refuses to compile)
    g = torch.spyre.SpyreGraph()
    with torch.spyre.graph(g):
        static_out = compiled(static_x, *wd)
    assert torch.allclose(static_out.cpu(), stack(_x(0), *weights), atol=1e-3)
    for seed in (1, 2, 3):
        static_x.copy_(_x(seed))
        g.replay()
        called = compiled(_x(seed).to("spyre"), *wd).cpu()
        assert torch.equal(static_out.cpu(), called)  # the same plans, the same numbers
        assert torch.allclose(called, stack(_x(seed), *weights), atol=1e-3)


def test_replay_is_one_native_call_for_any_number_of_kernels(compiled, monkeypatch):
    card = cards.get(0)
    for layers in (1, 8):
        wd = [t.to("spyre") for t in _flat(_weights(layers))]
        x = _x(0).to("spyre")
        compiled(x, *wd)
        g = torch.spyre.SpyreGraph()
        with torch.spyre.graph(g):
            compiled(x, *wd)
        before = card.counters()
        with counting_native_calls(monkeypatch) as counter:
            g.replay()
        monkeypatch.undo()
        after = card.counters()
        assert counter.calls == ["spy_plan_launch_many"]
        assert after["native_calls"] - before["native_calls"] == 1
        assert after["plan_launches"] - before["plan_launches"] == g.launches
        assert after["jobs"] - before["jobs"] > layers  # every kernel ran


def test_several_steps_and_a_device_copy_replay_in_order(compiled):
    w1, w2 = _flat(_weights(2, seed=1)), _flat(_weights(3, seed=2))
    d1, d2 = [t.to("spyre") for t in w1], [t.to("spyre") for t in w2]
    src, x = _x(0).to("spyre"), _x(0).to("spyre")
    compiled(x, *d1)
    compiled(x, *d2)
    g = torch.spyre.SpyreGraph()
    with torch.spyre.graph(g):
        x.copy_(src)                 # recorded: runs at every replay
        mid = compiled(x, *d1)
        out = compiled(mid, *d2)
    src.copy_(_x(5))  # outside the capture: only the copy inside reads src
    g.replay()
    assert torch.allclose(x.cpu(), _x(5))
    assert torch.allclose(out.cpu(), stack(stack(_x(5), *w1), *w2), atol=1e-3)


def test_a_step_that_mutates_its_input_replays_the_mutation():
    def bump(cache, x):
        cache.mul_(2).add_(x)
        return cache.sum(-1)

    f = torch.compile(bump, backend="spyre_rt", dynamic=False)
    cache, x = torch.ones(4, WIDTH).to("spyre"), _x(0).to("spyre")
    f(cache, x)
    g = torch.spyre.SpyreGraph()
    with torch.spyre.graph(g):
        out = f(cache, x)
    expect = cache.cpu()
    for _ in range(3):
        g.replay()
        expect = expect * 2 + _x(0)
        assert torch.allclose(cache.cpu(), expect, atol=1e-3)
        assert torch.allclose(out.cpu(), expect.sum(-1), atol=1e-2)


@pytest.mark.parametrize("work", ["new tensor", "to host", "item", "host copy", "cpu op", "host input"])
def test_eager_work_inside_a_capture_is_a_clear_error(compiled, work):
    wd = [t.to("spyre") for t in _flat(_weights(1))]
    x = _x(0).to("spyre")
    compiled(x, *wd)
    g = torch.spyre.SpyreGraph()
    with pytest.raises(SpyreGraphError, match="inside a spyre graph capture"):
        with torch.spyre.graph(g):
            out = compiled(x, *wd)
            if work == "new tensor":
                torch.empty(3, device="spyre")
            elif work == "to host":
                out.cpu()
            elif work == "item":
                out[0, 0].item()
            elif work == "host copy":
                x.copy_(_x(1))
            elif work == "cpu op":
                torch.cumsum(out, 0)
            else:  # a step handed a CPU tensor (Dynamo sends CPU calls to a CPU graph)
                step = next(s for s in live_steps() if len(s.desc.inputs) == 1 + len(wd))
                step([_x(1), *wd], {})
    with pytest.raises(SpyreGraphError, match="capture failed"):
        g.replay()
    assert graphs_idle()
    g.reset()
    with torch.spyre.graph(g):  # a reset graph captures again
        out = compiled(x, *wd)
    x.copy_(_x(3))
    g.replay()
    assert torch.allclose(out.cpu(), compiled(_x(3).to("spyre"), *wd).cpu())


def graphs_idle():
    from spyre_rt import capture

    return capture.capturing == 0 and capture.current() is None


def test_a_step_with_a_cpu_op_cannot_be_captured():
    def gathered(x, idx):
        return torch.gather(x, 1, idx) * 2

    f = torch.compile(gathered, backend="spyre_rt", dynamic=False)
    x, idx = _x(0).to("spyre"), torch.randint(0, WIDTH, (4, 3)).to("spyre")
    f(x, idx)
    with pytest.raises(SpyreGraphError, match="on the CPU and cannot be captured"):
        with torch.spyre.graph(torch.spyre.SpyreGraph()):
            f(x, idx)


def test_a_copy_the_card_cannot_make_as_bytes_is_refused(compiled):
    a = torch.zeros(4, WIDTH).to("spyre")
    with pytest.raises(SpyreGraphError, match="whole tensors"):
        with torch.spyre.graph(torch.spyre.SpyreGraph()):
            a[:2].copy_(a[2:])


def test_replay_after_a_reset_is_a_clear_error(compiled):
    weights = _flat(_weights(2))
    cs = cards.open_set(None, "functional")
    with cards.using(cs):
        wd = [t.to("spyre") for t in weights]
        x = _x(0).to("spyre")
        compiled(x, *wd)
        g = torch.spyre.SpyreGraph()
        with torch.spyre.graph(g):
            compiled(x, *wd)
        g.replay()
        spyre_rt.reset_device(0)
        with pytest.raises(SpyreGraphError, match="was reset"):
            g.replay()
        assert g.stale()
        # the card refuses the stale plans too, before running any of them
        jobs = cs.cards[0].counters()["jobs"]
        with pytest.raises(spyre_rt.SpyreError, match="before the device was reset"):
            g._launch(g._native)
        assert cs.cards[0].counters()["jobs"] == jobs


def test_the_card_refuses_a_malformed_launch_list():
    from spyre_rt.native import ffi, lib

    a = _x(0).to("spyre")
    b = torch.empty_like(a)
    _, plan, table = tensors.copy_plan(b, a)
    failed, end = ffi.new("uint32_t *"), ffi.new("double *")
    plans = ffi.new("spy_plan *[]", [plan.handle, ffi.NULL])
    tables = ffi.new("uint64_t *[]", [table, table])
    nbind = ffi.new("uint32_t[]", [2, 2])
    names = ffi.new("uint32_t[]", [0, 0])
    assert lib.spy_plan_launch_many(0, plans, tables, nbind, names, failed, end) == lib.SPY_E_INVALID_ARG
    assert lib.spy_plan_launch_many(2, plans, tables, nbind, names, failed, end) == lib.SPY_E_INVALID_ARG
    nbind[0] = 3
    assert lib.spy_plan_launch_many(1, plans, tables, nbind, names, failed, end) == lib.SPY_E_INVALID_ARG
    assert failed[0] == 0
    nbind[0] = 2
    assert lib.spy_plan_launch_many(1, plans, tables, nbind, names, failed, end) == lib.SPY_OK
    assert torch.equal(b.cpu(), a.cpu())


@pytest.mark.parametrize("how", ["set_", "data", "resize_"])
def test_replay_after_a_static_input_was_reallocated_is_a_clear_error(compiled, how):
    wd = [t.to("spyre") for t in _flat(_weights(1))]
    x = _x(0).to("spyre")
    compiled(x, *wd)
    g = torch.spyre.SpyreGraph()
    with torch.spyre.graph(g):
        compiled(x, *wd)
    other = _x(1).to("spyre")
    if how == "set_":
        x.set_(other)
    elif how == "data":
        x.data = other
    else:
        x.resize_(8, WIDTH)
    with pytest.raises(SpyreGraphError, match="pointed at other memory"):
        g.replay()


def test_capture_misuse_is_refused():
    g = torch.spyre.SpyreGraph()
    with pytest.raises(SpyreGraphError, match="capture it first"):
        g.replay()
    with torch.spyre.graph(g):
        with pytest.raises(SpyreGraphError, match="already under way"):
            torch.spyre.SpyreGraph().capture_begin()
    with pytest.raises(SpyreGraphError, match="captured already"):
        g.capture_begin()
    with pytest.raises(TypeError):
        with torch.spyre.graph(object()):
            pass


def test_make_graphed_callables(compiled):
    weights = _flat(_weights(3))
    wd = [t.to("spyre") for t in weights]
    x = _x(0).to("spyre")
    graphed = torch.spyre.make_graphed_callables(compiled, (x, *wd))
    for seed in (4, 5):
        out = graphed(_x(seed).to("spyre"), *wd)
        assert torch.allclose(out.cpu(), stack(_x(seed), *weights), atol=1e-3)
    with pytest.raises(SpyreGraphError, match="captured with a"):
        graphed(_x(6, rows=5).to("spyre"), *wd)
    with pytest.raises(SpyreGraphError, match="static inputs are spyre tensors"):
        torch.spyre.make_graphed_callables(compiled, (_x(0), *wd))


def test_timing_mode_replays_the_same_device_work(compiled):
    """On a timing-mode card a replay costs the device what the compiled call does."""
    cs = cards.open_set(None, "timing")
    with cards.using(cs), dispatch_mode("prebuilt"):
        card = cs.cards[0]
        wd = [torch.empty(WIDTH, WIDTH, device="spyre") if i % 2 == 0 else torch.empty(WIDTH, device="spyre")
              for i in range(2 * 4)]
        x = torch.empty(4, WIDTH, device="spyre")
        compiled(x, *wd)
        g = torch.spyre.SpyreGraph()
        with torch.spyre.graph(g):
            compiled(x, *wd)
        c0 = card.counters()
        compiled(x, *wd)
        c1 = card.counters()
        g.replay()
        c2 = card.counters()
    assert c2["commands"] - c1["commands"] == c1["commands"] - c0["commands"] > 0
    assert tensors.card_of(x) is card


def test_a_launch_with_the_last_bindings_is_checked_again_after_a_free():
    """The card skips re-checking the bindings of a plan launched again with the same ones
    (a replay) only while nothing was freed: a freed binding is refused, never written."""
    import gc

    a = _x(0).to("spyre")
    b = torch.empty_like(a)
    _, plan, table = tensors.copy_plan(b, a)
    plan.launch(table)
    plan.launch(table)  # the same bindings, nothing freed: the checks are skipped
    assert torch.equal(b.cpu(), a.cpu())
    del b
    gc.collect()
    with pytest.raises(spyre_rt.SpyreInvalidCommandError, match="not inside a live allocation"):
        plan.launch(table)


def test_a_first_call_compiles_inside_a_capture_and_is_recorded():
    """Compiling is not the step's work: whatever it does on the card (Inductor's first
    compile in a process allocates there) is neither recorded nor refused."""
    def fresh(x, w):  # a function no test compiled before
        return torch.relu(x @ w) - 3

    f = torch.compile(fresh, backend="spyre_rt", dynamic=False)
    x, w = _x(0).to("spyre"), torch.randn(WIDTH, 16).to("spyre")
    g = torch.spyre.SpyreGraph()
    with torch.spyre.graph(g):
        out = f(x, w)
    assert g.launches == 1
    x.copy_(_x(1))
    g.replay()
    assert torch.allclose(out.cpu(), torch.relu(_x(1) @ w.cpu()) - 3, atol=1e-2)


# ---- torch.compile(mode="reduce-overhead"): captured and replayed per shape ----


def _counts():
    from spyre_rt.compiler import reduce_overhead

    return dict(reduce_overhead.stats)


def _delta(before):
    return {k: v - before[k] for k, v in _counts().items() if v != before[k]}


def test_reduce_overhead_captures_once_per_shape_and_replays(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8))
    card_model = copy.deepcopy(model).to("spyre")
    fast = torch.compile(card_model, backend="spyre_rt", mode="reduce-overhead")
    plain = torch.compile(card_model, backend="spyre_rt")
    before = _counts()
    held = []
    for rows, seed in [(4, 1), (4, 2), (4, 3), (4, 4), (7, 5), (7, 6), (7, 7)]:
        x = _x(seed, rows)
        out = fast(x.to("spyre"))
        held.append((x, out))
        assert torch.equal(out.cpu(), plain(x.to("spyre")).cpu())   # the same plans, the same numbers
    # per shape: a warm-up call, a capture, then replays
    assert _delta(before) == {"warmups": 2, "captures": 2, "replays": 3}
    for x, out in held:   # no later replay overwrote what an earlier call returned
        assert torch.allclose(out.cpu(), model(x), atol=1e-3)
    with counting_native_calls(monkeypatch) as counter:
        fast(_x(8, 7).to("spyre"))   # the last shape, replayed
    assert "spy_plan_launch_many" in counter.calls and "spy_plan_launch" not in counter.calls


def test_reduce_overhead_writes_back_the_inputs_the_graph_mutates():
    def accumulate(x, total):
        total.add_(x)
        return total * 2

    fast = torch.compile(accumulate, backend="spyre_rt", mode="reduce-overhead", dynamic=False)
    total, ref_total = torch.zeros(4, WIDTH).to("spyre"), torch.zeros(4, WIDTH)
    before = _counts()
    for seed in range(4):
        out = fast(_x(seed).to("spyre"), total)
        expected = accumulate(_x(seed), ref_total)
        assert torch.allclose(total.cpu(), ref_total, atol=1e-4)
        assert torch.allclose(out.cpu(), expected, atol=1e-4)
    assert _delta(before) == {"warmups": 1, "captures": 1, "replays": 2}


def test_reduce_overhead_runs_a_graph_with_a_cpu_op_uncaptured():
    def gathered(x, idx):
        return torch.gather(x, 1, idx) * 2

    fast = torch.compile(gathered, backend="spyre_rt", mode="reduce-overhead", dynamic=False)
    idx = torch.randint(0, WIDTH, (4, 3), generator=torch.Generator().manual_seed(0))
    before = _counts()
    for seed in range(3):
        out = fast(_x(seed).to("spyre"), idx.to("spyre"))
        assert torch.equal(out.cpu(), gathered(_x(seed), idx))
    assert _delta(before) == {"warmups": 1, "uncaptured": 2}


def test_an_unknown_compile_mode_is_a_clear_error():
    f = torch.compile(lambda x: x + 1, backend="spyre_rt", mode="reduce-everything")
    with pytest.raises(Exception, match="reduce-everything.*reduce-overhead"):
        f(_x(0).to("spyre"))
