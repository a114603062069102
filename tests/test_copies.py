"""Host -> device -> host round trips are bit-exact through the stick layout."""

import pytest
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8]

SHAPES = [(), (1,), (7,), (64,), (100,), (3, 64), (5, 100), (2, 3, 130), (4, 1, 6, 65), (0, 5)]


def _sample(shape, dtype):
    g = torch.Generator().manual_seed(hash((shape, str(dtype))) & 0xFFFF)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        # random bit patterns: every value (subnormals, NaN payloads, -0) must survive
        bits = torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int32)
        if dtype == torch.float32:
            hi = torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int32)
            return ((hi << 16) | (bits & 0xFFFF)).view(torch.float32)
        return bits.to(torch.int16).view(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g, dtype=dtype)


def _same_bits(a, b):
    if a.dtype.is_floating_point:
        view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_contiguous(shape, dtype):
    x = _sample(shape, dtype)
    y = x.to("spyre")
    assert y.shape == x.shape and y.dtype == dtype
    assert _same_bits(y.cpu(), x)


VIEWS = {
    "transposed": lambda x: x.transpose(-1, -2),
    "sliced": lambda x: x[..., 1:-3:2, 3:70],
    "expanded": lambda x: x[..., :1].expand(*x.shape[:-1], 66),
    "row": lambda x: x[..., 2, :],
    "scalar": lambda x: x[..., 1, 5],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("view", VIEWS, ids=str)
@pytest.mark.parametrize("shape", [(9, 100), (3, 8, 128), (2, 5, 64)], ids=str)
def test_round_trip_views(shape, dtype, view):
    x = _sample(shape, dtype)
    v = VIEWS[view](x)
    # host view -> device (a fresh device tensor), and device view -> host
    assert _same_bits(v.to("spyre").cpu(), v)
    assert _same_bits(VIEWS[view](x.to("spyre")).cpu(), v)


def test_round_trip_into_device_views():
    x = _sample((6, 130), torch.float16)
    d = torch.zeros(130, 6, dtype=torch.float16, device="spyre").t()
    d.copy_(x)
    assert _same_bits(d.cpu(), x)
    d[2:4, 64:100].copy_(torch.ones(2, 36, dtype=torch.float16))
    expect = x.clone()
    expect[2:4, 64:100] = 1
    assert _same_bits(d.cpu(), expect)


@pytest.mark.parametrize("mode", ["construct", "prebuilt"])
def test_round_trip_in_both_transfer_modes(monkeypatch, mode):
    from spyre_rt import config

    monkeypatch.setenv("SPYRE_RT_DISPATCH", mode)
    config.reload()
    try:
        x = _sample((33, 70), torch.float32)
        assert _same_bits(x.to("spyre").cpu(), x)
    finally:
        monkeypatch.delenv("SPYRE_RT_DISPATCH")
        config.reload()


@pytest.mark.parametrize("configured, block", [("prebuilt", "construct"), ("construct", "prebuilt"),
                                               ("prebuilt", "prebuilt-compute")])
def test_eager_copies_follow_the_dispatch_mode_block(monkeypatch, configured, block):
    """Inside ``dispatch_mode(m)``, copies build their transfer graphs as mode m does
    (construct and prebuilt-compute: a new graph every copy; prebuilt-transfer and
    prebuilt: one cached graph per view),
    whatever mode the process is configured with."""
    from spyre_rt import card as cards
    from spyre_rt import config, dispatch
    from spyre_rt.dispatch import dispatch_mode

    monkeypatch.setenv("SPYRE_RT_DISPATCH", configured)
    config.reload()
    try:
        transfers = cards.get(0).transfers
        x = _sample((17, 70), torch.float32)
        with dispatch_mode(block):
            before = (transfers.hits, transfers.misses)
            for _ in range(3):
                assert _same_bits(x.to("spyre").cpu(), x)
            used_cache = (transfers.hits, transfers.misses) != before
        assert used_cache == dispatch.named(block).prebuilt_transfers
    finally:
        monkeypatch.delenv("SPYRE_RT_DISPATCH")
        config.reload()


def test_a_timing_card_warns_when_values_leave_it_not_on_a_copy_within_it():
    """A timing-mode card keeps no data: reading values on the host warns (once), while a
    device-to-device copy (staged through the host, its values stay on the card) does not,
    which is what Inductor's compile-time clone of a constant does."""
    import warnings

    from spyre_rt import card as cards
    from spyre_rt import fallback, tensors

    with cards.configured(None, "timing") as cs:
        fallback.forget_warnings(repr(cs.cards[0]))  # each warns once per process
        a = torch.ones(4, 8).to("spyre")
        b = torch.empty(8, 4, device="spyre").t()  # another layout: the copy is staged
        with warnings.catch_warnings():
            warnings.simplefilter("error", tensors.SpyreTimingModeWarning)
            b.copy_(a)
        with pytest.warns(tensors.SpyreTimingModeWarning, match="keeps no tensor data"):
            assert torch.equal(b.cpu(), torch.zeros(4, 8))
