"""Every setting has one path: a compile option, else its ``SPYRE_RT_*`` variable, else the
default, resolved when the step compiles and read from the step by the executor, the plan
cache and the tracer. Each is set both ways here and its effect checked; a setting that
only the whole process can take (the card set's profile and mode) is refused as an option.
"""

from __future__ import annotations

import os

import pytest
import torch

import spyre_rt
from spyre_rt import card as cards
from spyre_rt import config, executor, plan_cache
from spyre_rt.executor.step import live_steps


@pytest.fixture
def setting(monkeypatch, quiet_functional_compile):
    """set(name, value, way): the setting for the next compile, as a compile option
    (returned, to pass to torch.compile) or in the environment (the process settings
    read again)."""
    def set_(var: str, option: str, value, way: str) -> dict:
        if way == "option":
            return {option: value}
        monkeypatch.setenv(var, str(int(value)) if isinstance(value, bool) else str(value))
        config.reload()
        return {}

    yield set_
    monkeypatch.undo()
    config.reload()


def _compiled(fn, options: dict, *args):
    """A new step of `fn` compiled with `options` and called once on `args`: the step and
    the call's outputs on the CPU."""
    torch._dynamo.reset()
    before = set(live_steps())
    f = torch.compile(fn, backend="spyre_rt", dynamic=False, options=options)
    out = f(*(a.to("spyre") for a in args))
    (step,) = set(live_steps()) - before
    return step, out.cpu()


def scaled(x):
    return x * 3 + 1


def _plans(directory) -> list:
    return sorted(p.name for p in directory.glob(f"*{plan_cache.SUFFIX}")) if directory.exists() else []


WAYS = ["option", "environment"]


@pytest.mark.parametrize("way", WAYS)
def test_plans_go_to_the_cache_dir_of_the_compile(setting, tmp_path, way):
    """The README's own example: options={"cache_dir": ...} is where the plans are written."""
    default = config.cache_path()
    before = _plans(default)
    mine = tmp_path / "my-plans"
    options = setting("SPYRE_RT_CACHE_DIR", "cache_dir", str(mine), way)
    _compiled(scaled, options, torch.randn(8, 72))
    assert len(_plans(mine)) == 1
    if way == "option":
        assert _plans(default) == before  # nothing written where the step was not told to write


@pytest.mark.parametrize("way", WAYS)
def test_a_relative_cache_dir_is_taken_from_where_the_compile_ran(setting, tmp_path, monkeypatch, way):
    monkeypatch.chdir(tmp_path)
    options = setting("SPYRE_RT_CACHE_DIR", "cache_dir", "./my-plans", way)
    step, _ = _compiled(scaled, options, torch.randn(8, 73))
    assert step.settings.cache_dir == str(tmp_path / "my-plans")
    assert len(_plans(tmp_path / "my-plans")) == 1


@pytest.mark.parametrize("way", WAYS)
def test_with_the_cache_off_no_plan_is_written(setting, tmp_path, monkeypatch, way):
    monkeypatch.setenv("SPYRE_RT_CACHE_DIR", str(tmp_path))
    config.reload()
    options = setting("SPYRE_RT_CACHE", "cache_enabled", False, way)
    _compiled(scaled, options, torch.randn(8, 74))
    assert _plans(tmp_path) == []
    monkeypatch.delenv("SPYRE_RT_CACHE", raising=False)
    config.reload()
    _compiled(scaled, {}, torch.randn(8, 74))
    assert len(_plans(tmp_path)) == 1  # the same step with the cache on


@pytest.mark.parametrize("way", WAYS)
def test_the_cache_bound_of_the_compile_evicts(setting, tmp_path, monkeypatch, way):
    monkeypatch.setenv("SPYRE_RT_CACHE_DIR", str(tmp_path))
    config.reload()
    writes = plan_cache.stats.writes
    options = setting("SPYRE_RT_CACHE_MAX_BYTES", "cache_max_bytes", 1, way)
    _compiled(scaled, options, torch.randn(8, 75))
    assert plan_cache.stats.writes == writes + 1 and _plans(tmp_path) == []  # written, then over its bound


@pytest.mark.parametrize("way", WAYS)
def test_a_traced_step_records_its_calls_in_the_cards_trace(setting, way):
    card = cards.get(0)
    x = torch.randn(8, 76).to("spyre")
    options = setting("SPYRE_RT_TRACE", "trace", True, way)
    torch._dynamo.reset()
    f = torch.compile(scaled, backend="spyre_rt", dynamic=False, options=options)
    f(x)
    first = card.trace_count()
    f(x)
    assert card.trace_count() > first
    torch._dynamo.reset()
    g = torch.compile(scaled, backend="spyre_rt", dynamic=False, options={"trace": False})
    g(x)
    first = card.trace_count()
    g(x)
    assert card.trace_count() == first  # an untraced step records nothing


@pytest.mark.parametrize("way", WAYS)
def test_trace_commands_off_records_the_launch_without_its_commands(setting, way):
    card = cards.get(0)
    x = torch.randn(8, 77).to("spyre")
    setting("SPYRE_RT_TRACE", "trace", True, "environment")
    options = setting("SPYRE_RT_TRACE_COMMANDS", "trace_commands", False, way)
    kinds = {}
    for commands in (False, True):
        torch._dynamo.reset()
        f = torch.compile(scaled, backend="spyre_rt", dynamic=False,
                          options={**options, **({"trace_commands": True} if commands else {})})
        f(x)
        first = card.trace_count()
        f(x)
        kinds[commands] = len(card.trace_events(first))
    assert 0 < kinds[False] < kinds[True]


@pytest.mark.parametrize("way", WAYS)
def test_the_dispatch_mode_of_the_compile(setting, way):
    options = setting("SPYRE_RT_DISPATCH", "dispatch", "construct", way)
    step, _ = _compiled(scaled, options, torch.randn(8, 78))
    built = executor.stats["kernels_built"]
    step([torch.randn(8, 78).to("spyre")], {})
    assert executor.stats["kernels_built"] > built  # construct mode builds every kernel at every call
    step, _ = _compiled(scaled, {"dispatch": "prebuilt"}, torch.randn(8, 78))
    built = executor.stats["kernels_built"]
    step([torch.randn(8, 78).to("spyre")], {})
    assert executor.stats["kernels_built"] == built


def needs_the_cpu(x):
    return torch.cumprod(x, 0) + 1


@pytest.mark.parametrize("way", WAYS)
def test_cpu_fallback_off_refuses_what_the_card_cannot_run(setting, way):
    options = setting("SPYRE_RT_CPU_FALLBACK", "cpu_fallback", False, way)
    with pytest.raises(spyre_rt.SpyreCompileError, match="cumprod"):
        _compiled(needs_the_cpu, options, torch.randn(4, 64))
    _, out = _compiled(needs_the_cpu, {"cpu_fallback": True}, torch.randn(4, 64))
    assert out.shape == (4, 64)


def test_a_compute_dtype_other_than_auto_is_refused_both_ways(quiet_functional_compile, monkeypatch):
    """No other compute dtype is implemented: the option, or its variable, would change nothing."""
    with pytest.raises(spyre_rt.SpyreCompileError, match="compute_dtype must be auto.*model.half"):
        _compiled(scaled, {"compute_dtype": "float16"}, torch.randn(8, 64))
    monkeypatch.setenv("SPYRE_RT_COMPUTE_DTYPE", "float32")
    try:
        with pytest.raises(ValueError, match="SPYRE_RT_COMPUTE_DTYPE: compute_dtype must be auto"):
            config.reload()
    finally:
        monkeypatch.undo()
        config.reload()
    step, _ = _compiled(scaled, {"compute_dtype": "auto"}, torch.randn(8, 64))
    assert step.desc.options["compute_dtype"] == "auto"


def matmul_relu(x, w):
    return (x @ w).relu()


@pytest.mark.parametrize("way", WAYS)
def test_fuse_epilogues_off_keeps_the_pointwise_kernel_apart(setting, way):
    x, w = torch.randn(64, 64), torch.randn(64, 64)
    options = setting("SPYRE_RT_FUSE_EPILOGUES", "fuse_epilogues", False, way)
    apart, _ = _compiled(matmul_relu, options, x, w)
    fused, _ = _compiled(matmul_relu, {"fuse_epilogues": True}, x, w)
    assert len(fused.desc.kernels) < len(apart.desc.kernels)


def merged_gate_up(x, w):
    y = x @ w.t()
    return torch.nn.functional.silu(y[:, :64]) * y[:, 64:]


@pytest.mark.parametrize("way", WAYS)
def test_split_gated_gemms_off_keeps_the_merged_gemm_whole(setting, way):
    x, w = torch.randn(16, 64), torch.randn(128, 64)
    options = setting("SPYRE_RT_SPLIT_GATED_GEMMS", "split_gated_gemms", False, way)
    whole, _ = _compiled(merged_gate_up, options, x, w)
    split, _ = _compiled(merged_gate_up, {"split_gated_gemms": True}, x, w)
    kinds = lambda step: sorted(k.kind for k in step.desc.kernels.values())  # noqa: E731
    assert kinds(whole) == ["loop", "matmul"] and kinds(split) == ["matmul", "matmul"]


def residual_read_twice(x, h, w):
    h2 = h + x @ w.t()
    return h2 * h2.sum(-1, keepdim=True) + h2 * 2


@pytest.mark.parametrize("way", WAYS)
def test_fuse_residuals_off_leaves_the_sum_to_its_readers(setting, way):
    x, h, w = torch.randn(4096, 64), torch.randn(4096, 64), torch.randn(64, 64)  # a sum of 1 MiB
    options = setting("SPYRE_RT_FUSE_RESIDUALS", "fuse_residuals", False, way)
    inline, _ = _compiled(residual_read_twice, options, x, h, w)
    fused, _ = _compiled(residual_read_twice, {"fuse_residuals": True}, x, h, w)
    epilogues = lambda step: sum(getattr(k, "epilogue", None) is not None for k in step.desc.kernels.values())  # noqa: E731
    assert epilogues(fused) == 1 and epilogues(inline) == 0


def normed_projection(h, w, wq):
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return x @ wq.t()


@pytest.mark.parametrize("way", WAYS)
def test_fuse_prologues_off_keeps_the_norm_a_kernel_of_its_own(setting, way):
    h, w, wq = torch.randn(64, 128), torch.rand(128) + 0.5, torch.randn(96, 128)
    options = setting("SPYRE_RT_FUSE_PROLOGUES", "fuse_prologues", False, way)
    apart, out_apart = _compiled(normed_projection, options, h, w, wq)
    fused, out_fused = _compiled(normed_projection, {"fuse_prologues": True}, h, w, wq)
    prologues = lambda step: sum(getattr(k, "prologue", None) is not None for k in step.desc.kernels.values())  # noqa: E731
    assert prologues(fused) == 1 and prologues(apart) == 0
    assert torch.equal(out_apart, out_fused)


def two_projections(x, wk, wv):
    return x @ wk.t(), x @ wv.t()


@pytest.mark.parametrize("way", WAYS)
def test_group_matmuls_off_keeps_matmuls_of_one_input_apart(setting, way):
    x, wk, wv = torch.randn(300, 256), torch.randn(128, 256), torch.randn(128, 256)
    options = setting("SPYRE_RT_GROUP_MATMULS", "group_matmuls", False, way)
    torch._dynamo.reset()
    steps = {}
    for name, opts in (("apart", options), ("grouped", {"group_matmuls": True})):
        before = set(live_steps())
        torch.compile(two_projections, backend="spyre_rt", dynamic=False, options=opts)(
            *(t.to("spyre") for t in (x, wk, wv)))
        (steps[name],) = set(live_steps()) - before
        torch._dynamo.reset()
    matmuls = lambda step: sorted(len(k.parts) for k in step.desc.kernels.values() if k.kind == "matmul")  # noqa: E731
    assert matmuls(steps["apart"]) == [0, 0] and matmuls(steps["grouped"]) == [1]


def rotated(x, w, pos, inv_freq):
    """A projection's heads (of 64) rotated by a rotary embedding: a sliced epilogue."""
    q = (x @ w.t()).view(1, x.shape[0], -1, 64).transpose(1, 2)
    freqs = pos[:, :, None].float() * inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return q * emb.cos()[:, None] + torch.cat((-q[..., 32:], q[..., :32]), dim=-1) * emb.sin()[:, None]


@pytest.mark.parametrize("way", WAYS)
def test_slice_epilogues_off_keeps_the_rotation_a_kernel_of_its_own(setting, way):
    args = (torch.randn(16, 64), torch.randn(128, 64), torch.arange(16)[None], torch.rand(32))
    options = setting("SPYRE_RT_SLICE_EPILOGUES", "slice_epilogues", False, way)
    apart, out_apart = _compiled(rotated, options, *args)
    sliced, out_sliced = _compiled(rotated, {"slice_epilogues": True}, *args)
    count = lambda step: sum(bool(getattr(getattr(k, "epilogue", None), "slices", ()))  # noqa: E731
                             for k in step.desc.kernels.values())
    assert count(sliced) == 1 and count(apart) == 0
    assert torch.equal(out_apart, out_sliced)


def static_cache_attention(q, k_new, k_cache, position):
    """A static cache's write and its mask (kv <= q + position), as Hugging Face's."""
    at = torch.arange(q.shape[2], device=q.device) + position
    k_cache.index_copy_(2, at, k_new)
    kv = torch.arange(k_cache.shape[2], device=q.device)
    mask = kv[None, :] <= (torch.arange(q.shape[2], device=q.device) + position)[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q, k_cache, k_cache, attn_mask=mask[None, None])


@pytest.mark.parametrize("way", WAYS)
def test_bound_causal_masks_off_leaves_the_attention_to_its_mask(setting, way):
    args = (torch.randn(1, 2, 24, 32), torch.randn(1, 2, 24, 32), torch.zeros(1, 2, 40, 32),
            torch.tensor(3))
    options = setting("SPYRE_RT_BOUND_CAUSAL_MASKS", "bound_causal_masks", False, way)
    apart, out_apart = _compiled(static_cache_attention, options, *args)
    bound, out_bound = _compiled(static_cache_attention, {"bound_causal_masks": True}, *args)
    causal = lambda step: [k.q_offset for k in step.desc.kernels.values() if getattr(k, "causal", False)]  # noqa: E731
    assert causal(bound) == [40 - 24] and causal(apart) == []
    assert torch.equal(out_apart, out_bound)


@pytest.mark.parametrize("name, var", [("sim_mode", "SPYRE_RT_SIM_MODE"),
                                       ("device_profile", "SPYRE_RT_DEVICE_PROFILE"),
                                       ("device_count", "SPYRE_RT_DEVICE_COUNT")])
def test_an_option_only_the_process_can_take_is_refused_saying_where_to_set_it(quiet_functional_compile, name, var):
    value = {"sim_mode": "timing", "device_profile": "spyre", "device_count": 2}[name]
    with pytest.raises(spyre_rt.SpyreCompileError, match=f"{var}.*spyre_rt.configure"):
        _compiled(scaled, {name: value}, torch.randn(8, 64))


def test_the_machines_cards_are_the_profiles_count_or_the_variables(monkeypatch):
    """SPYRE_RT_DEVICE_COUNT sets how many cards of the profile the machine has (one per rank
    of a tensor-parallel group, without a profile of its own); out of range, a clear error."""
    import subprocess
    import sys

    code = "import torch, spyre_rt; print(torch.spyre.device_count(), torch.ones(2).to('spyre:2').device)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SPYRE_RT_DEVICE_COUNT": "3"})
    assert run.stdout.split() == ["3", "spyre:2"], run.stderr[-2000:]
    for bad, why in (("65", "device_count must be 1..64"), ("-1", "device_count must be 1..64"),
                     ("two", "invalid literal")):
        monkeypatch.setenv("SPYRE_RT_DEVICE_COUNT", bad)
        with pytest.raises(ValueError, match=f"SPYRE_RT_DEVICE_COUNT.*: .*{why}"):
            config.from_environment()
    monkeypatch.delenv("SPYRE_RT_DEVICE_COUNT")
    assert config.from_environment().device_count == 0   # the profile's count


def test_a_bad_option_value_is_a_typed_compile_error(quiet_functional_compile):
    with pytest.raises(spyre_rt.SpyreCompileError, match="cache_max_bytes must be positive"):
        _compiled(scaled, {"cache_max_bytes": 0}, torch.randn(8, 64))


def test_a_step_made_without_the_compiler_takes_the_process_settings(tmp_path, monkeypatch):
    from spyre_rt.executor.step import CompiledStep
    from spyre_rt.ir import StepDesc

    monkeypatch.setenv("SPYRE_RT_CACHE_DIR", str(tmp_path))
    config.reload()
    try:
        step = CompiledStep(StepDesc(inputs=(), outputs=(), buffers={}, aliases={}, constants={}, kernels={},
                                     sequence=()))
        assert step.settings.cache_dir == str(tmp_path) and step.default_mode == config.settings().dispatch
    finally:
        monkeypatch.undo()
        config.reload()


def test_every_setting_is_covered_here():
    """A new setting needs its variable, its compile-time path and a test above."""
    import inspect
    import sys

    fields = {f for f in config.Settings.__dataclass_fields__}
    source = inspect.getsource(sys.modules[__name__])
    assert fields == set(config.STEP_FIELDS) | set(config.COMPILE_FIELDS) | set(config.PROCESS_FIELDS)
    for var, (field, _) in config.ENV.items():
        assert field in fields and var in source, var
