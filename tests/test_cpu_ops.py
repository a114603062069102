"""CPU ops inside a compiled step honour their schema: every argument the op's schema marks
as written (a custom op's ``mutates_args``, an aten in-place op's ``self``, an ``out=``,
tensor lists too) is written back to the card, into the view it came from, before anything
reads it; an op that returns nothing compiles; a result that is an argument the op wrote
is that argument's memory; a failed call leaves the mutated inputs as they were.

Each case runs in every dispatch mode, bit for bit the same across modes and within 1e-6
of CPU eager (fp32), the mutated tensors checked as well as the results.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import spyre_rt
from spyre_rt import card as cards
from spyre_rt import dispatch, executor, fallback
from spyre_rt.dispatch import dispatch_mode

MODES = dispatch.NAMES  # every dispatch mode, from the table
NS = "spyre_cpu_ops_test"


# ---- custom ops: CPU kernels with fakes, as a library would register them ------------------

@torch.library.custom_op(f"{NS}::bump", mutates_args=("x",))
def bump(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Adds y into x (in place) and returns a new tensor."""
    x.add_(y)
    return y * 2 + x


@bump.register_fake
def _(x, y):
    return torch.empty_like(y)


@torch.library.custom_op(f"{NS}::bump_only", mutates_args=("x",))
def bump_only(x: torch.Tensor, y: torch.Tensor) -> None:
    x.mul_(y).add_(1)


@bump_only.register_fake
def _(x, y):
    return None


@torch.library.custom_op(f"{NS}::bump_all", mutates_args=("xs",))
def bump_all(xs: list[torch.Tensor], y: torch.Tensor) -> None:
    for i, x in enumerate(xs):
        x.add_(y * (i + 1))


@bump_all.register_fake
def _(xs, y):
    return None


@torch.library.custom_op(f"{NS}::kv_write", mutates_args=("cache",))
def kv_write(cache: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor) -> None:
    """A static KV cache update (vLLM's reshape_and_cache is such an op): the rows of `kv`
    into `cache` at the positions `pos`, along the sequence dimension."""
    cache.index_copy_(2, pos, kv)


@kv_write.register_fake
def _(cache, pos, kv):
    return None


@torch.library.custom_op(f"{NS}::refuse", mutates_args=())
def refuse(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("refused by the test op")


@refuse.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NS}::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x * 3


_lib = torch.library.Library(NS, "FRAGMENT")
_lib.define("no_meta(Tensor x) -> Tensor")
_lib.impl("no_meta", lambda x: x * 3, "CPU")


# an op whose arguments are of every kind a schema has (SymInt, SymInt[], float, bool, str,
# ScalarType, Device, Layout, MemoryFormat, Tensor[], Tensor?, Scalar)
_lib.define("kinds(Tensor x, SymInt n, SymInt[] sizes, float f, bool b, str s, ScalarType dt, Device dev, "
            "Layout layout, MemoryFormat fmt, Tensor[] xs, Tensor? maybe, Tensor? none, Scalar k) -> Tensor")


def _kinds(x, n, sizes, f, b, s, dt, dev, layout, fmt, xs, maybe, none, k):
    assert dev.type == "cpu" and layout == torch.strided and fmt == torch.contiguous_format and none is None
    out = (x[:n] * f + xs[0][:n] - xs[1][:n] * maybe[:n] + k).reshape(sizes).to(dt)
    out = -out if b else out
    return out * 2 if s == "twice" else out


_lib.impl("kinds", _kinds, "CPU")
torch.library.register_fake(f"{NS}::kinds", lambda x, n, sizes, *rest: x.new_empty(sizes, dtype=rest[3]), lib=_lib)


# ---- running a case ---------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def functional():
    torch._dynamo.reset()
    with cards.configured(sim_mode="functional") as cs, warnings.catch_warnings():
        warnings.simplefilter("ignore", spyre_rt.SpyreFallbackWarning)
        yield cs


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _on_cpu(fn, args: list[torch.Tensor], mutated: tuple[int, ...], steps: int = 1, dynamic=False,
            prepare=None) -> set[str]:
    """Run `fn` compiled in every dispatch mode (`steps` calls each, on fresh device copies
    of `args`) against CPU eager, checking results and the mutated arguments; the ops that
    ran on the CPU inside the step."""
    eager = [a.clone() for a in args]
    want = [_tensors(fn(*eager)) for _ in range(steps)]
    f = torch.compile(fn, backend="spyre_rt", dynamic=dynamic)
    first = None
    before_eager, before_steps = sum(fallback.calls.values()), dict(fallback.in_steps)
    for mode in MODES:
        dev = [a.to("spyre") for a in args]
        if prepare is not None:
            prepare(dev)
        with dispatch_mode(mode):
            got = [[t.cpu() for t in _tensors(f(*dev))] for _ in range(steps)]
        written = [dev[i].cpu() for i in mutated]
        for g, w in zip(got, want, strict=True):
            for a, b in zip(g, w, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{mode}: result")
        for i, t in zip(mutated, written, strict=True):
            torch.testing.assert_close(t, eager[i], rtol=1e-6, atol=1e-6, msg=f"{mode}: mutated argument {i}")
        if first is None:
            first = (got, written)
        else:  # the modes differ only in when construction runs: the same bits
            for a, b in zip(_tensors(got) + written, _tensors(first[0]) + first[1], strict=True):
                assert torch.equal(a, b), f"{mode} differs from {MODES[0]}"
    assert sum(fallback.calls.values()) == before_eager, "the compiled calls ran eager CPU ops"
    return {op for op, n in fallback.in_steps.items() if n != before_steps.get(op, 0)}


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- custom ops with mutates_args -------------------------------------------------------------

def test_a_custom_op_that_mutates_an_input_and_returns_a_tensor_writes_the_input():
    def f(x, w):
        r = bump(x, w * 3)
        return r + 1, x * 2  # x read after the op: its new values

    ran = _on_cpu(f, [_randn(4, 70, seed=0), _randn(4, 70, seed=1)], mutated=(0,))
    assert ran == {f"{NS}.bump.default"}


def test_a_custom_op_that_returns_nothing_compiles_and_writes_its_input():
    def f(x, w):
        bump_only(x, w.sigmoid())
        return x + 1

    ran = _on_cpu(f, [_randn(3, 65, seed=2), _randn(3, 65, seed=3)], mutated=(0,))
    assert ran == {f"{NS}.bump_only.default"}


def test_a_custom_op_that_mutates_an_intermediate_the_card_reads_after():
    def f(x, w):
        h = x * 2 - 1          # on the card, into a buffer of the step
        bump_only(h, w)        # on the CPU, written back into that buffer
        return (h * w).sum(-1), h.exp()

    _on_cpu(f, [_randn(5, 70, seed=4), _randn(5, 70, seed=5)], mutated=())


def test_a_custom_op_that_mutates_a_view_writes_that_view_only():
    def f(x, w):
        bump_only(x[:, 3:40], w[:, :37])  # columns 3..39 of the input, through a strided view
        return x.sum(-1)

    _on_cpu(f, [_randn(6, 70, seed=6), _randn(6, 70, seed=7)], mutated=(0,))


def test_a_custom_op_that_mutates_a_list_of_tensors_writes_each():
    def f(a, b, w):
        bump_all([a, b[1:]], w)
        return a * b[1:]

    _on_cpu(f, [_randn(4, 66, seed=8), _randn(5, 66, seed=9), _randn(4, 66, seed=10)], mutated=(0, 1))


def test_an_op_that_reads_the_tensor_it_writes_sees_one_tensor():
    def f(x):
        bump_only(x, x)  # written and read: in eager both are x, so x becomes x*x + 1
        return x - 1

    _on_cpu(f, [_randn(4, 64, seed=11)], mutated=(0,))


def test_overlapping_views_of_a_written_buffer_alias_on_the_host():
    def f(x):
        bump_only(x[:, 1:], x[:, :-1])  # eager mul_ reads columns it has already written
        return x * 3

    _on_cpu(f, [_randn(3, 64, seed=12)], mutated=(0,))


# ---- aten in-place ops that run on the CPU ----------------------------------------------------

def test_an_accumulating_index_put_on_an_input_writes_the_input():
    """Functionalized and reinplaced, it is ``index_put_`` on the graph input itself, which
    runs on the CPU (an accumulating scatter)."""
    def f(x, idx, v):
        x.index_put_((idx,), v, accumulate=True)
        return x * 2

    idx = torch.tensor([0, 2, 2, 5])
    ran = _on_cpu(f, [_randn(6, 70, seed=13), idx, _randn(4, 70, seed=14)], mutated=(0,))
    assert ran == {"aten.index_put_.default"}


def test_an_in_place_op_on_an_intermediate_returns_that_buffer():
    """``index_put_`` on a buffer of the step returns its argument: the result is the
    buffer's memory, not a copy of it."""
    def f(x, idx, v):
        y = x * 2
        z = y.index_put_((idx,), v, accumulate=True)
        return z + 1, y.sum(0)

    idx = torch.tensor([1, 1, 4])
    earlier = {id(s) for s in executor.live_steps()}  # steps other tests left alive
    ran = _on_cpu(f, [_randn(6, 70, seed=15), idx, _randn(3, 70, seed=16)], mutated=())
    assert ran == {"aten.index_put_.default"}
    (step,) = [s for s in executor.live_steps() if id(s) not in earlier and s.executables() and any(
        kind == "cpu" and x.op == "aten.index_put_.default" and set(x.mutated) <= set(s.desc.buffers)
        for kind, x in s.desc.sequence)]
    (op,) = [x for kind, x in step.desc.sequence if kind == "cpu"]
    assert [ref["buf"][0] for ref in op.tensor_args() if ref.get("write")] == list(op.mutated)
    assert not [x for kind, x in step.desc.sequence if kind == "pick"], "the result was copied"
    assert [name for name in step.desc.aliases if executor.memory.base_of(step.desc, name) == op.mutated[0]]


# ---- a KV cache updated by a CPU op -----------------------------------------------------------

def test_a_static_kv_cache_updated_by_a_cpu_op_over_decode_steps():
    """A static cache (a graph input whose memory never changes) written by a CPU op at
    each decode position, and attention over it on the card."""
    heads, length, dim = 2, 16, 64

    def decode(q, k, v, k_cache, v_cache, pos, mask):
        kv_write(k_cache, pos, k)
        kv_write(v_cache, pos, v)
        scores = (q @ k_cache.transpose(-1, -2)) / 8 + mask
        return scores.softmax(-1) @ v_cache

    positions = [0, 1, 2]
    g = torch.Generator().manual_seed(17)
    k_cache, v_cache = torch.zeros(1, heads, length, dim), torch.zeros(1, heads, length, dim)
    f = torch.compile(decode, backend="spyre_rt", dynamic=False)
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    feeds = []
    for p in positions:
        q, k, v = (torch.randn(1, heads, 1, dim, generator=g) for _ in range(3))
        mask = torch.full((1, 1, 1, length), float("-inf"))
        mask[..., : p + 1] = 0
        feeds.append((q, k, v, torch.tensor([p]), mask))
    want = [decode(q, k, v, eager_k, eager_v, pos, mask) for q, k, v, pos, mask in feeds]
    first = None
    for mode in MODES:
        dk, dv = k_cache.to("spyre"), v_cache.to("spyre")
        torch._dynamo.mark_static_address(dk)
        torch._dynamo.mark_static_address(dv)
        with dispatch_mode(mode):
            got = [f(*(t.to("spyre") for t in (q, k, v)), dk, dv, pos.to("spyre"), mask.to("spyre")).cpu()
                   for q, k, v, pos, mask in feeds]
        caches = [dk.cpu(), dv.cpu()]
        for a, b in zip(got + caches, want + [eager_k, eager_v], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{mode}")
        if first is None:
            first = got + caches
        else:
            assert all(torch.equal(a, b) for a, b in zip(got + caches, first, strict=True)), f"{mode} differs"
    assert eager_k[0, :, 3:].abs().sum() == 0 and eager_k[0, :, :3].abs().sum() > 0


# ---- any argument ------------------------------------------------------------------------------

def test_a_cpu_op_takes_arguments_of_every_kind_with_symbolic_sizes():
    """SymInts and lists of them (the first call at a new size evaluates them), floats,
    bools, strings, dtypes, devices, layouts, memory formats, tensor lists and optional
    tensors, present and None, and scalars: each reaches the CPU op as the value it was."""
    def f(x, y, z):
        n = x.shape[0] - 1
        return torch.ops.spyre_cpu_ops_test.kinds(x * 2, n, [n, x.shape[1]], 0.5, True, "twice", torch.float32,
                                                  x.device, torch.strided, torch.contiguous_format, [y, z], z.exp(),
                                                  None, 3) + 1

    g = torch.Generator().manual_seed(22)
    fast = torch.compile(f, backend="spyre_rt", dynamic=True)
    for rows in (4, 7):
        args = [torch.randn(rows, 70, generator=g) for _ in range(3)]
        want = f(*args)
        for mode in MODES:
            with dispatch_mode(mode):
                got = fast(*[a.to("spyre") for a in args])
            torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6, msg=f"{rows} rows, {mode}")


# ---- failure -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_a_failed_call_leaves_an_input_a_cpu_op_wrote_as_it_was(mode):
    def f(x, w):
        bump_only(x, w)
        return refuse(x * 2)  # fails after the input was written

    x, w = _randn(4, 70, seed=18), _randn(4, 70, seed=19)
    fast = torch.compile(f, backend="spyre_rt", dynamic=False)
    dx = x.to("spyre")
    with dispatch_mode(mode), pytest.raises(RuntimeError, match="refused by the test op"):
        fast(dx, w.to("spyre"))
    assert torch.equal(dx.cpu(), x), "the failed call left the input written"


@pytest.mark.parametrize("mode", MODES)
def test_a_card_error_after_a_cpu_op_leaves_its_input_as_it_was(mode):
    def f(x, ids, table):
        bump_only(x, x)
        return x + torch.nn.functional.embedding(ids, table) * 2

    x, table = _randn(3, 64, seed=20), _randn(10, 64, seed=21)
    fast = torch.compile(f, backend="spyre_rt", dynamic=False)
    dx = x.to("spyre")
    with dispatch_mode(mode), pytest.raises(spyre_rt.SpyreIndexError, match="aten.embedding"):
        fast(dx, torch.tensor([1, 12, 3]).to("spyre"), table.to("spyre"))
    assert torch.equal(dx.cpu(), x), "the failed call left the input written"



# ---- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("op, register", [(no_fake, "@no_fake.register_fake"),
                                          (torch.ops.spyre_cpu_ops_test.no_meta,
                                           'torch.library.register_fake("spyre_cpu_ops_test::no_meta")')])
def test_a_custom_op_without_a_fake_is_a_compile_error_naming_it_and_what_to_register(op, register):
    """A graph handed to the backend (here traced without Dynamo, which would stop at the
    op itself) that holds a custom op with no fake implementation: the error names the op,
    the model line and what to register, before AOT traces anything."""
    from spyre_rt.compiler.backend import spyre_rt_backend

    class Model(torch.nn.Module):
        def forward(self, x):
            return op(x + 1) * 2  # the line the error names

    tracer = torch.fx.Tracer()
    tracer.record_stack_traces = True  # the model lines, as Dynamo records them
    model = Model()
    gm = torch.fx.GraphModule(model, tracer.trace(model))
    with pytest.raises(spyre_rt.SpyreCompileError) as info:
        spyre_rt_backend(gm, [torch.ones(4, 64).to("spyre")])
    message = str(info.value)
    assert "no fake (meta) implementation" in message and register in message, message
    assert "spyre_cpu_ops_test::no_" in message and f"{__file__}" in message, message
