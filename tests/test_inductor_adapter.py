"""The adapter between Inductor's wrapper and the step description."""

import pytest
import torch
from spyre_rt.compiler.inductor import wrapper

import spyre_rt


def test_a_wrapper_line_the_step_does_not_know_fails_the_compile(monkeypatch):
    """Work the step description would leave undone is a compile error, never a skipped
    line (a device copy rendered as a plain line was once skipped, and its buffer read as
    garbage)."""
    monkeypatch.setattr(wrapper.SpyreWrapperCodegen, "codegen_device_copy",
                        lambda self, src, dst, nb: self.writeline(f"{dst}.copy_({src})"))
    torch._dynamo.reset()
    f = torch.compile(lambda x, n: x + n.to(x.device), backend="spyre_rt", dynamic=False)
    with (torch._inductor.config.patch(fx_graph_cache=False),  # codegen must run, not a cached module
          pytest.raises(spyre_rt.SpyreCompileError, match="wrapper line of kind str")):
        f(torch.randn(4, 8).to("spyre"), torch.tensor(3.0))


def test_a_cpu_scalar_used_on_the_card_is_copied_by_the_step():
    torch._dynamo.reset()
    f = torch.compile(lambda x, n: x + n.to(x.device), backend="spyre_rt", dynamic=False)
    x = torch.randn(4, 8)
    for n in (3.0, -2.5):
        torch.testing.assert_close(f(x.to("spyre"), torch.tensor(n)).cpu(), x + n)


def _sized_by(x, n):
    """OPT's decoder: a mask sized by the cache's length (a 0-d tensor, read back with
    .item()) that nothing then uses."""
    unused = torch.ones(x.shape[0], n + x.shape[1], device=x.device)  # noqa: F841
    return x * 2


def test_a_value_read_back_from_the_card_that_nothing_uses_is_not_read():
    torch._dynamo.reset()
    f = torch.compile(_sized_by, backend="spyre_rt", dynamic=False, fullgraph=True)
    x = torch.randn(2, 8)
    with torch._inductor.config.patch(fx_graph_cache=False):
        out = f(x.to("spyre"), torch.tensor(3).to("spyre"))
    torch.testing.assert_close(out.cpu(), x * 2)


def test_sizes_that_depend_on_a_value_read_back_from_the_card_are_a_compile_error_naming_the_line():
    def sized(x, n):
        return torch.ones(n + x.shape[1], device=x.device) * 2  # a step's sizes are fixed by its plan

    torch._dynamo.reset()
    f = torch.compile(sized, backend="spyre_rt", dynamic=False, fullgraph=True)
    with (torch._inductor.config.patch(fx_graph_cache=False),
          pytest.raises(spyre_rt.SpyreCompileError, match="value read back from the card") as info):
        f(torch.randn(2, 8).to("spyre"), torch.tensor(3).to("spyre"))
    assert f"line {sized.__code__.co_firstlineno + 1}, in sized" in str(info.value)
