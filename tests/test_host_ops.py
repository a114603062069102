"""Ops whose CPU kernel refuses a dtype that the card accepts run exactly on the host.

An integer ``torch.histc`` (how transformers counts the tokens routed to each expert on an
accelerator) has no CPU kernel; for the card it runs as a bincount of each element's bin,
eagerly and inside a compiled step. The oracle is the CPU's float histc over the same
integers (exact for these magnitudes), cast to the integer dtype as an accelerator's
integer histc returns it.
"""

from __future__ import annotations

import pytest
import torch

from spyre_rt import dispatch
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.host_ops import cpu_kernel

aten = torch.ops.aten


pytestmark = pytest.mark.usefixtures("quiet_functional_compile")


def _oracle(x: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    return torch.histc(x.double(), bins=bins, min=lo, max=hi).to(x.dtype)


CASES = [
    # (values, bins, min, max): the router's counts, one expert taking every token, experts
    # with no token, values outside the range, the data's own range (min == max), one value
    (torch.tensor([3, 0, 1, 3, 3, 2, 0, 1]), 4, 0, 3),
    (torch.full((16,), 5), 8, 0, 7),
    (torch.tensor([7, 7, 0, 0]), 8, 0, 7),
    (torch.tensor([-3, 0, 2, 9, 11, 4]), 5, 0, 9),
    (torch.tensor([4, 9, 6, 6, 12]), 4, 0, 0),
    (torch.tensor([6, 6, 6]), 3, 0, 0),
    (torch.tensor([1, 2, 3, 4, 5, 6, 7]), 3, 1.5, 6.5),
    (torch.randint(0, 40, (1000,), generator=torch.Generator().manual_seed(0)), 40, 0, 39),
]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_an_integer_histc_counts_as_the_float_histc_does(case, dtype):
    values, bins, lo, hi = CASES[case]
    x = values.to(dtype)
    want = _oracle(x, bins, lo, hi)
    got = cpu_kernel(aten.histc.default)(x, bins, lo, hi)
    assert got.dtype == dtype
    assert torch.equal(got, want)
    eager = torch.histc(x.to("spyre"), bins=bins, min=lo, max=hi).cpu()
    assert eager.dtype == dtype and torch.equal(eager, want)


def test_an_empty_integer_histc_counts_nothing():
    got = cpu_kernel(aten.histc.default)(torch.empty(0, dtype=torch.int32), 4, 0, 0)
    assert torch.equal(got, torch.zeros(4, dtype=torch.int32))


def test_an_integer_histc_refuses_what_the_float_histc_refuses():
    x = torch.tensor([1, 2], dtype=torch.int32)
    for bins, lo, hi in ((0, 0, 3), (4, 3, 1)):
        with pytest.raises(RuntimeError) as want:
            torch.histc(x.float(), bins=bins, min=lo, max=hi)
        with pytest.raises(RuntimeError) as got:
            torch.histc(x.to("spyre"), bins=bins, min=lo, max=hi)
        assert str(got.value) == str(want.value)


def test_the_float_histc_is_torchs_own():
    x = torch.randn(100, generator=torch.Generator().manual_seed(1))
    assert torch.equal(cpu_kernel(aten.histc.default)(x, 10, -1, 1), torch.histc(x, 10, -1, 1))


def route(logits: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A router as transformers writes it for an accelerator: top-2, then each expert's
    token count with an int32 histc, then the offsets of each expert's rows."""
    _, ids = torch.topk(logits, 2, dim=-1)
    counts = torch.histc(ids.reshape(-1).int(), bins=experts, min=0, max=experts - 1)
    return counts, torch.cumsum(counts, 0, dtype=torch.int32)


def _route_reference(logits: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, ids = torch.topk(logits, 2, dim=-1)
    counts = torch.histc(ids.reshape(-1).float(), bins=experts, min=0, max=experts - 1).int()
    return counts, torch.cumsum(counts, 0, dtype=torch.int32)


@pytest.mark.parametrize("mode", dispatch.NAMES)
def test_an_integer_histc_inside_a_compiled_step(mode):
    g = torch.Generator().manual_seed(2)
    f = torch.compile(route, backend="spyre_rt")
    every_token_to_4_and_1 = torch.zeros(12, 6).index_fill_(1, torch.tensor([4]), 2.0).index_fill_(1, torch.tensor([1]), 1.0)
    for logits in (torch.randn(12, 6, generator=g), every_token_to_4_and_1):
        want = _route_reference(logits, 6)
        with dispatch_mode(mode):
            counts, offsets = (t.cpu() for t in f(logits.to("spyre"), 6))
        assert counts.dtype == torch.int32
        assert torch.equal(counts, want[0]) and torch.equal(offsets, want[1])
