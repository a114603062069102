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
