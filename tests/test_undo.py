"""What a failed call puts back, and what it costs to be able to: an input written only by
scatters is saved by the rows the step writes, not whole (a static KV cache's one new row
per decode step), and a fault anywhere after the saves leaves every mutated input as it
was: a decode position the step advances, the cache rows it indexes, an input whose
indices are computed inside the step (saved whole)."""

import pytest
import torch
from small_profiles import small_profile_text

from spyre_rt import SpyreDeviceError, dispatch
from spyre_rt import card as cards
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.executor.step import live_steps

DEV = "spyre:1"


@pytest.fixture
def card(tmp_path):
    """spyre:1 of a fresh two-card set; no fault is left armed after the test."""
    path = tmp_path / "two-cards.toml"
    path.write_text(small_profile_text(dram_gib=1 / 64, count=2))
    with cards.configured(str(path)) as cs:
        c = cs.cards[1]
        try:
            yield c
        finally:
            c.fault_inject("none")


def decode_write(cache, pos, x):
    """A static cache's decode update: one row at the position, then the position moves on."""
    cache.index_copy_(0, pos, x)
    pos.add_(1)
    return cache.sum(0)


def computed_index(cache, pos, x):
    """The row to write is computed inside the step, by an earlier kernel."""
    row = x[:, :8].argmax(1) + pos
    cache.index_copy_(0, row, x)
    return cache.sum(0)


def _args(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 128, generator=g), torch.tensor([3]), torch.randn(1, 128, generator=g)]


def _executable(fn):
    """The executable a fresh compile of `fn` runs."""
    torch._dynamo.reset()
    before = set(map(id, live_steps()))
    torch.compile(fn, backend="spyre_rt", dynamic=False)(*[t.to(DEV) for t in _args()])
    (exe,) = [e for s in live_steps() if id(s) not in before for e in s.executables()]
    return exe


def test_a_cache_written_by_rows_is_saved_by_rows(card):
    exe = _executable(decode_write)
    cache, pos = (next(b.name for b, _ in exe.desc.inputs if b.sizes == size) for size in ((64, 128), (1,)))
    whole = {c.src for c in exe.snapshots}
    assert cache not in whole, "the cache was saved whole"
    assert exe.row_saves, "no row save"
    saved = sum(r.buffer.sizes[0] * r.buffer.strides[0] for r in exe.row_saves)
    assert saved == 128, f"the saves keep {saved} elements, the step writes 128"
    assert pos in whole  # the position, advanced by the step, saved whole


@pytest.mark.parametrize("fn", [decode_write, computed_index])
@pytest.mark.parametrize("mode", dispatch.NAMES)
def test_a_fault_after_the_saves_restores_every_mutated_input(card, fn, mode):
    f = torch.compile(fn, backend="spyre_rt", dynamic=False)
    orig = _args(1)
    expected = [t.clone() for t in orig]
    want = fn(*expected)
    args = [t.to(DEV) for t in orig]
    with dispatch_mode(mode):
        f(*args)  # warm
        for t, o in zip(args, orig, strict=True):
            t.copy_(o)
        card.trace_clear()
        card.trace_enable(True, True)
        try:
            f(*args)
        finally:
            card.trace_enable(False)
        n = int((card.trace_events()["kind"] == cards.EV_CMD).sum())
        card.trace_clear()
        for t, o in zip(args, orig, strict=True):
            t.copy_(o)
        for after in sorted({0, 1, 2, n // 3, n // 2, n - 2, n - 1}):
            card.fault_inject("command", after)
            with pytest.raises(SpyreDeviceError):
                f(*args)
            for t, o in zip(args, orig, strict=True):
                assert torch.equal(t.cpu(), o), f"a fault after {after} of {n} commands changed an input"
        got = f(*args)
        assert torch.allclose(got.cpu(), want, rtol=1e-5, atol=1e-5)
        for t, w in zip(args, expected, strict=True):
            assert torch.allclose(t.cpu(), w, rtol=0, atol=1e-6)


def test_an_index_computed_in_the_step_saves_the_input_whole(card):
    exe = _executable(computed_index)
    cache = next(b.name for b, _ in exe.desc.inputs if b.sizes == (64, 128))
    assert cache in {c.src for c in exe.snapshots}
    assert not exe.row_saves



def test_a_row_save_construction_refuses_saves_the_input_whole(card, monkeypatch):
    """Row saves run before every kernel and on every failure, so they cannot run on the
    host: when construction refuses one, the step saves the cache whole and a fault still
    puts every input back."""
    from spyre_rt.construct import Refused, loops
    from spyre_rt.executor import undo

    decide = loops.decide

    def refuse_saves(ctx, kernel):
        if kernel.name.startswith((undo.SAVE, undo.RESTORE)):
            raise Refused("refused for this test")
        return decide(ctx, kernel)

    monkeypatch.setattr(loops, "decide", refuse_saves)
    exe = _executable(decode_write)
    cache = next(b.name for b, _ in exe.desc.inputs if b.sizes == (64, 128))
    assert not exe.row_saves and cache in {c.src for c in exe.snapshots}
    assert not exe.host.reasons, "a model kernel ran on the host"
    assert not [n for n in exe.bindings.layouts if n.startswith(undo.SAVE)], "the row buffers stayed in the arena"
    f = torch.compile(decode_write, backend="spyre_rt", dynamic=False)
    orig = _args(2)
    expected = [t.clone() for t in orig]
    want = decode_write(*expected)
    args = [t.to(DEV) for t in orig]
    for mode in dispatch.NAMES:
        with dispatch_mode(mode):
            card.fault_inject("command", 3)
            with pytest.raises(SpyreDeviceError):
                f(*args)
            for t, o in zip(args, orig, strict=True):
                assert torch.equal(t.cpu(), o), mode
    assert torch.allclose(f(*args).cpu(), want, rtol=1e-5, atol=1e-5)
    for t, w in zip(args, expected, strict=True):
        assert torch.allclose(t.cpu(), w, rtol=0, atol=1e-6)
