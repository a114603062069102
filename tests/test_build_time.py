"""A failed construction is a compile-time event.

Every kernel of a step is constructed when its plan is built: the compiler constructs a
static step's kernels when it compiles it (at the input geometry it foresees), and an
executable constructs every kernel before its first call runs any, in every dispatch mode.
A kernel construction refuses (here: a reduction whose one row does not fit the 2 MiB
scratchpad) is compiled again with its ops on the CPU, or, when only the first call shows
it (a size of a dynamic-shape step), runs on the host from its description. No
construction error reaches a call.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import spyre_rt
from spyre_rt import card as cards
from spyre_rt import construct, dispatch, executor, fallback, jobs, plan_cache
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.executor.executable import Executable
from spyre_rt.executor.step import live_steps

MODES = dispatch.NAMES
WIDE = 1 << 20  # fp32 columns: one row of them and its temporaries outgrow a 2 MiB scratchpad


@pytest.fixture(autouse=True)
def functional():
    torch._dynamo.reset()
    with cards.configured(sim_mode="functional") as cs:
        yield cs


def scaled_sum(x):
    return (x * 2).sum(-1) + 1  # the kernel construction refuses when a row is WIDE


def _steps_of(run):
    """The compiled steps made while `run()` ran."""
    before = set(map(id, live_steps()))
    run()
    return [s for s in live_steps() if id(s) not in before]


def _ran_on_cpu(run) -> set[str]:
    before = dict(fallback.in_steps)
    run()
    return {op for op, n in fallback.in_steps.items() if n != before.get(op, 0)}


def _call(f, x: torch.Tensor, atol: float) -> tuple[list, set[str]]:
    """`f` called on `x` on the card and checked against CPU eager: the steps it made and
    the ops that ran on the CPU."""
    steps: list = []

    def run():
        steps.extend(_steps_of(lambda: torch.testing.assert_close(f(x.to("spyre")).cpu(), scaled_sum(x),
                                                                  rtol=1e-5, atol=atol)))

    return steps, _ran_on_cpu(run)


def _host_kernels(steps) -> dict[str, str]:
    return {k: v for s in steps for exe in s.executables() for k, v in exe.host.reasons.items()}


def test_a_kernel_construction_refuses_is_compiled_again_on_the_cpu_in_every_mode():
    """Once failed at the first launch with an untyped ScratchpadOverflow."""
    x = torch.randn(2, WIDE, generator=torch.Generator().manual_seed(0))
    for mode in MODES:
        torch._dynamo.reset()
        f = torch.compile(scaled_sum, backend="spyre_rt", dynamic=False)
        fallback.forget_warnings("aten.sum")
        with dispatch_mode(mode), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps, ran = _call(f, x, atol=1e-4)
        assert "aten.sum.dim_IntList" in ran, mode
        # the compile put it on the CPU: no kernel of the step was refused at its call
        assert not _host_kernels(steps), mode
        assert any(kind == "cpu" and "sum" in x.op for s in steps for kind, x in s.desc.sequence), mode
        message = [str(w.message) for w in caught if issubclass(w.category, spyre_rt.SpyreFallbackWarning)
                   and "aten.sum" in str(w.message)]
        assert message and __file__ in message[0], mode


def test_with_cpu_fallback_off_a_refused_kernel_is_a_compile_error_naming_the_op_and_line():
    for mode in MODES:
        torch._dynamo.reset()
        f = torch.compile(scaled_sum, backend="spyre_rt", dynamic=False, options={"cpu_fallback": False})
        with dispatch_mode(mode), pytest.raises(spyre_rt.SpyreCompileError) as info:
            f(torch.randn(2, WIDE).to("spyre"))
        message = str(info.value)
        assert "refused" in message and "scratchpad" in message and __file__ in message, mode


def test_a_size_the_compile_did_not_foresee_runs_the_refused_kernel_on_the_host():
    """A dynamic-shape step compiled at a small size and called at one whose kernel does not
    fit: the first call at that size constructs every kernel, and the refused one runs on
    the host from its description, warned once; other sizes stay on the card."""
    f = torch.compile(scaled_sum, backend="spyre_rt", dynamic=True)
    g = torch.Generator().manual_seed(1)
    small = torch.randn(2, 1000, generator=g)
    wide = torch.randn(2, WIDE, generator=g)
    for mode in MODES:
        with dispatch_mode(mode):
            assert _call(f, small, atol=1e-4)[1] == set(), mode
    fallback.forget_warnings("aten.sum")
    steps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mode in MODES:
            with dispatch_mode(mode):
                made, ran = _call(f, wide, atol=1e-3)
            steps += made
            assert "aten.sum.dim_IntList" in ran, mode
    texts = [str(w.message) for w in caught if issubclass(w.category, spyre_rt.SpyreFallbackWarning)]
    assert len(texts) == 1 and "refused" in texts[0] and "scratchpad" in texts[0] and __file__ in texts[0], texts
    refused = _host_kernels(steps)
    assert len(refused) == 1 and "scratchpad" in next(iter(refused.values()))


def test_with_cpu_fallback_off_a_refusal_at_the_first_call_is_a_typed_error():
    f = torch.compile(scaled_sum, backend="spyre_rt", dynamic=True, options={"cpu_fallback": False})
    f(torch.randn(2, 1000).to("spyre"))
    for mode in MODES:
        with dispatch_mode(mode), pytest.raises(spyre_rt.SpyreRefusedError) as info:
            f(torch.randn(2, WIDE + 64 * MODES.index(mode)).to("spyre"))
        assert isinstance(info.value, spyre_rt.SpyreCompileError) and "aten.sum" in str(info.value), mode
        assert "CPU fallback is off" in str(info.value) and info.value.kernels, mode


def test_construct_modes_construct_every_kernel_before_any_runs(monkeypatch):
    """The first call of an executable in a mode without plans builds the whole step, then
    launches (each launch builds its kernel again, as the mode does)."""
    events: list[str] = []
    build, run_once = Executable.build, jobs.run_once

    def logged_build(self, name):
        events.append("build")
        return build(self, name)

    def logged_run(*args, **kwargs):
        events.append("run")
        return run_once(*args, **kwargs)

    monkeypatch.setattr(Executable, "build", logged_build)
    monkeypatch.setattr(jobs, "run_once", logged_run)

    def f(x, w):
        return torch.softmax(torch.relu(x @ w) + 1, -1).sum(-1) * 3

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(80, 64, generator=g), torch.randn(64, 90, generator=g)
    compiled = torch.compile(f, backend="spyre_rt", dynamic=True)
    compiled(torch.randn(8, 64).to("spyre"), w.to("spyre"))  # the compile, at another size
    for mode in ("construct", "prebuilt-transfer"):
        events.clear()
        n = 70 + 10 * (mode != "construct")
        with dispatch_mode(mode):
            torch.testing.assert_close(compiled(x[:n].to("spyre"), w.to("spyre")).cpu(), f(x[:n], w),
                                       rtol=1e-4, atol=1e-4)
        kernels = events.count("run")
        assert kernels >= 2 and events == ["build"] * kernels + ["build", "run"] * kernels, (mode, events)


def test_the_first_call_finds_the_kernels_the_compile_built():
    """Compile-time construction is not repeated at the first call: in prebuilt mode each
    kernel is constructed once for compile and first call together."""
    def f(x, w):
        return torch.relu(x @ w).sum(-1) + x.mean(-1)

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 64, generator=g), torch.randn(64, 64, generator=g)
    built = executor.stats["kernels_built"]
    compiled = torch.compile(f, backend="spyre_rt", dynamic=False)
    with dispatch_mode("prebuilt"):
        steps = _steps_of(lambda: torch.testing.assert_close(compiled(x.to("spyre"), w.to("spyre")).cpu(), f(x, w),
                                                             rtol=1e-4, atol=1e-4))
    (step,) = steps
    (exe,) = step.executables()
    kernels = sum(len(seg.kernels) for seg in exe.device_segments())
    assert executor.stats["kernels_built"] - built == kernels


def scaled_sum_and_exp(x):
    return scaled_sum(x), torch.exp(x[:, :100])  # two kernels: one refused when x is WIDE


def _wide_step():
    """A dynamic-shape step compiled at a small size, and its concrete step and executable
    at WIDE columns (prebuilt), whose first kernel construction refused."""
    f = torch.compile(scaled_sum_and_exp, backend="spyre_rt", dynamic=True)
    f(torch.randn(2, 1000).to("spyre"))
    with dispatch_mode("prebuilt"), warnings.catch_warnings():
        warnings.simplefilter("ignore", spyre_rt.SpyreFallbackWarning)
        (step,) = _steps_of(lambda: f(torch.randn(2, WIDE).to("spyre")))
    (exe,) = step.executables()
    assert len(exe.host.reasons) == 1 and len(exe.device_segments()) == 1
    geometry = tuple((exe.bindings.layouts[b.name], exe.bindings.offsets[b.name]) for b, _ in step.desc.inputs)
    return step, exe, geometry


def test_a_plan_file_names_its_refused_kernels_and_a_new_executable_takes_them_from_it():
    step, exe, geometry = _wide_step()
    again = Executable(step, exe.card, geometry)
    hits, built = plan_cache.stats.hits, executor.stats["kernels_built"]
    again.prepare(dispatch.named("prebuilt"))
    assert plan_cache.stats.hits == hits + 1 and executor.stats["kernels_built"] == built  # nothing constructed
    assert again.host.reasons == exe.host.reasons and [type(s) for s in again.segments] == [type(s) for s in exe.segments]


def test_a_plan_file_that_runs_unknown_kernels_on_the_host_is_rejected_and_rebuilt():
    step, exe, geometry = _wide_step()
    cache = plan_cache.default()
    entry = cache.load(exe.cache_key())
    header = dict(entry.header, host_kernels={"k99": "made up"})
    cache.store(exe.cache_key(), {k: v for k, v in header.items() if k != "key"}, entry.blocks)
    again = Executable(step, exe.card, geometry)
    corrupt, built = plan_cache.stats.corrupt, executor.stats["kernels_built"]
    again.prepare(dispatch.named("prebuilt"))
    assert plan_cache.stats.corrupt == corrupt + 1 and executor.stats["kernels_built"] > built
    assert set(again.host.reasons) == set(exe.host.reasons)


def test_every_kernel_of_a_model_computes_on_the_host_what_it_computes_on_the_card(monkeypatch):
    """The host evaluation of kernel descriptions (spyre_rt.reference) against CPU eager: a
    tiny Granite (embedding gather, KV-cache scatter, attention, matmuls with epilogues,
    RMSNorm reductions) with construction refusing every kernel at the first call."""
    from spyre_rt.compiler.inductor import wrapper

    from spyre_rt.profiler import models, parity

    monkeypatch.setattr(wrapper, "prebuild", lambda *a, **k: None)  # leave every kernel to the first call

    def refuse(ctx, kernel, tiling=None):
        raise construct.Refused("refused for this test")

    monkeypatch.setattr(construct, "build", refuse)
    fam = models.family("granite")
    ref = parity.reference(fam)
    result = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", spyre_rt.SpyreFallbackWarning)
        steps = _steps_of(lambda: result.update(compared=parity.compare(fam, "fp32", ("prebuilt",), ref)))
    run = result["compared"].card["prebuilt"]
    assert (run.prefill - ref.prefill).abs().max().item() <= 1e-4
    for r, o in zip(ref.decode, run.decode, strict=True):
        assert (o - r).abs().max().item() <= 1e-4
    hosted = _host_kernels(steps)
    assert len(hosted) >= 10 and set(hosted.values()) == {"refused for this test"}
