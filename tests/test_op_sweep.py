"""Every pointwise operation Inductor can emit, and the structural ops models use, through a
compiled one-liner on the card against CPU eager: each runs on the card (directly or
through an adapter) or falls back to the CPU; none fails to compile.

The pointwise list is the methods of Inductor's ops handler, so a torch upgrade that adds
one fails this test until the new method is given a case or a reason.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._inductor.ops_handler import OpsHandler

from spyre_rt import card as cards
from spyre_rt import fallback
from spyre_rt.dispatch import NAMES, dispatch_mode
from spyre_rt.errors import SpyreIndexError

SHAPE = (5, 70)  # off the 64 grid
sp = torch.special


def _unit(g):      # (0.1, 0.9): the domain of every inverse function
    return torch.rand(SHAPE, generator=g) * 0.8 + 0.1


def _signed(g):
    return torch.randn(SHAPE, generator=g)


def _ints(g):
    return torch.randint(-50, 50, SHAPE, generator=g)


def _small_ints(g):
    return torch.randint(0, 5, SHAPE, generator=g)


# ops-handler method -> (the one-liner, its inputs' makers)
UNARY_FLOAT = {
    "abs": torch.abs, "acos": torch.acos, "asin": torch.asin, "atan": torch.atan, "atanh": torch.atanh,
    "ceil": torch.ceil, "cos": torch.cos, "cosh": torch.cosh, "erf": torch.erf, "erfc": torch.erfc,
    "erfinv": torch.erfinv, "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1, "floor": torch.floor,
    "lgamma": torch.lgamma, "digamma": torch.digamma, "log": torch.log, "log10": torch.log10,
    "log1p": torch.log1p, "log2": torch.log2, "neg": torch.neg, "reciprocal": torch.reciprocal,
    "relu": torch.relu, "round": torch.round, "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid,
    "sign": torch.sign, "signbit": torch.signbit, "sin": torch.sin, "sinh": torch.sinh, "sqrt": torch.sqrt,
    "square": torch.square, "tan": torch.tan, "tanh": torch.tanh, "trunc": torch.trunc, "isnan": torch.isnan,
    "isinf": torch.isinf, "asinh": torch.asinh, "i0": torch.i0, "i0e": sp.i0e, "i1": sp.i1, "i1e": sp.i1e,
    "ndtr": sp.ndtr, "ndtri": sp.ndtri, "log_ndtr": sp.log_ndtr, "erfcx": sp.erfcx,
    "bessel_j0": sp.bessel_j0, "bessel_j1": sp.bessel_j1, "bessel_y0": sp.bessel_y0, "bessel_y1": sp.bessel_y1,
    "modified_bessel_i0": sp.modified_bessel_i0, "modified_bessel_i1": sp.modified_bessel_i1,
    "modified_bessel_k0": sp.modified_bessel_k0, "modified_bessel_k1": sp.modified_bessel_k1,
    "scaled_modified_bessel_k0": sp.scaled_modified_bessel_k0,
    "scaled_modified_bessel_k1": sp.scaled_modified_bessel_k1,
    "spherical_bessel_j0": sp.spherical_bessel_j0, "airy_ai": sp.airy_ai,
    "frexp": lambda x: torch.frexp(x)[0],
}
BINARY_FLOAT = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.true_divide,
    "atan2": torch.atan2, "copysign": torch.copysign, "fmod": torch.fmod, "hypot": torch.hypot,
    "maximum": torch.maximum, "minimum": torch.minimum, "pow": torch.pow, "remainder": torch.remainder,
    "nextafter": torch.nextafter, "ldexp": lambda x, y: torch.ldexp(x, (y * 4).round()),
    "igamma": sp.gammainc, "igammac": sp.gammaincc, "gammainc": sp.gammainc, "gammaincc": sp.gammaincc,
    "zeta": lambda x, y: sp.zeta(x + 1.5, y), "polygamma": lambda x, y: sp.polygamma(1, x),
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
    "logical_and": lambda x, y: torch.logical_and(x > 0.5, y > 0.5),
    "logical_or": lambda x, y: torch.logical_or(x > 0.5, y > 0.5),
    "logical_xor": lambda x, y: torch.logical_xor(x > 0.5, y > 0.5),
    "logical_not": lambda x, y: torch.logical_not(x > y),
    "where": lambda x, y: torch.where(x > y, x, y),
    "fma": lambda x, y: torch.addcmul(x, x, y),
    "to_dtype": lambda x, y: (x * 10).to(torch.int32) + 1,
    "to_dtype_bitcast": lambda x, y: (x + 1).view(torch.int32) & 255,
    "identity": lambda x, y: x.clone(),
    "bucketize": lambda x, y: torch.bucketize(x, torch.tensor([0.25, 0.5, 0.75], device=x.device)),
}
# the orthogonal polynomials, each at degree 3
BINARY_FLOAT |= {name: (lambda x, y, name=name: getattr(sp, name)(x, 3)) for name in (
    "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
    "legendre_polynomial_p")}
BINARY_INT = {
    "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor,
    "bitwise_not": lambda a, b: torch.bitwise_not(a), "floordiv": lambda a, b: torch.floor_divide(a, b * 2 - 3),  # odd divisors of both signs, never 0
    "truncdiv": lambda a, b: torch.div(a, b.abs() + 1, rounding_mode="trunc"),
    "mod": lambda a, b: torch.remainder(a, b.abs() + 1), "int_truediv": lambda a, b: a / (b.abs() + 1),
    "bitwise_left_shift": lambda a, b: torch.bitwise_left_shift(a, b.abs() % 5),
    "bitwise_right_shift": lambda a, b: torch.bitwise_right_shift(a, b.abs() % 5),
    "lshift": lambda a, b: a << (b.abs() % 5), "rshift": lambda a, b: a >> (b.abs() % 5),
    "and_": lambda a, b: (a > 0) & (b > 0), "or_": lambda a, b: (a > 0) | (b > 0),
    "xor": lambda a, b: (a > 0) ^ (b > 0),
}
# Methods that are not elementwise operations of a model: loop-body plumbing, the rounding
# helpers of index arithmetic, and variants Inductor emits for other backends.
NOT_A_MODEL_OP = {
    "load": "plumbing", "store": "plumbing", "store_reduction": "plumbing", "reduction": "plumbing",
    "constant": "plumbing", "index_expr": "plumbing", "indirect_indexing": "plumbing", "masked": "plumbing",
    "check_bounds": "plumbing", "device_assert_async": "plumbing", "output": "plumbing",
    "placeholder": "plumbing", "value_expr": "plumbing", "partial_accumulate": "plumbing",
    "scan": "cumsum's scan: covered by the structural cases", "sort": "covered by the structural cases",
    "load_seed": "random numbers fall back (fallback_random)", "rand": "random", "randn": "random",
    "randint64": "random", "rand_eager": "random",
    "ceil_to_int": "index rounding", "floor_to_int": "index rounding", "round_to_int": "index rounding",
    "trunc_to_int": "index rounding", "div_rn": "a Triton rounding variant", "mul_rn": "a Triton rounding variant",
    "halide_clamp": "Halide only", "inline_asm_elementwise": "Triton only", "dot": "Triton only",
}
STRUCTURAL = {
    "cat": lambda x, y: torch.cat([x, y[:, :3]], 1) * 2,
    "stack": lambda x, y: torch.stack([x, y], 1).sum(1),
    "split": lambda x, y: torch.split(x, 30, 1)[1] + 1,
    "slice_scatter": lambda x, y: torch.slice_scatter(x, y[:, :10], 1, 5, 15),
    "select_scatter": lambda x, y: torch.select_scatter(x, y[:, 0], 1, 3),
    "index": lambda x, y: x[torch.tensor([4, 0, 2], device=x.device)] * y[:3],
    "roll": lambda x, y: torch.roll(x, 3, 1) + y,
    "flip": lambda x, y: torch.flip(x, [1]) - y,
    "pad": lambda x, y: torch.nn.functional.pad(x, (2, 3)) * 2,
    "where": lambda x, y: torch.where(x > 0, x, y),
    "masked_fill": lambda x, y: x.masked_fill(y > 0, -1.0),
    "cumsum": lambda x, y: torch.cumsum(x, 1),
    "sort": lambda x, y: torch.sort(x, 1)[0] + 1,
    "topk": lambda x, y: torch.topk(x, 4, 1)[0] * 2,
}


def _cases():
    for name, fn in UNARY_FLOAT.items():
        makers = (lambda g: torch.rand(SHAPE, generator=g) + 1,) if name == "acosh" else (_unit,)
        yield name, (lambda x, _f=fn: _f(x)), makers
    yield "acosh", torch.acosh, (lambda g: torch.rand(SHAPE, generator=g) + 1,)
    for name, fn in BINARY_FLOAT.items():
        yield name, fn, (_unit, _unit)
    for name, fn in BINARY_INT.items():
        yield name, fn, (_ints, _small_ints)
    for name, fn in STRUCTURAL.items():
        yield f"structural:{name}", fn, (_signed, _signed)


CASES = {name: (fn, makers) for name, fn, makers in _cases()}


def test_every_ops_handler_method_has_a_case_or_a_reason():
    methods = {n for n in dir(OpsHandler) if not n.startswith("_")}
    unclassified = methods - set(CASES) - set(NOT_A_MODEL_OP)
    assert not unclassified, f"ops-handler methods with no sweep case: {sorted(unclassified)}"


@pytest.fixture(scope="module")
def functional():
    with cards.configured(sim_mode="functional") as cs:
        yield cs


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.is_floating_point:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_runs_on_the_card_or_falls_back(functional, name):
    fn, makers = CASES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    args = [make(g) for make in makers]
    try:
        want = fn(*args)
    except RuntimeError as e:  # a case eager refuses compares nothing: its inputs are wrong
        pytest.fail(f"CPU eager refuses the case's inputs: {e}")
    torch._dynamo.reset()
    f = torch.compile(fn, backend="spyre_rt", dynamic=False, fullgraph=True)
    before = sum(fallback.calls.values())
    with dispatch_mode("prebuilt"):
        got = f(*[a.to("spyre") for a in args])
    assert sum(fallback.calls.values()) == before, "the compiled call ran eager CPU ops"
    _close(got.cpu(), want)
    assert math.isfinite(float(got.float().nan_to_num().sum().cpu()))


# ---- falling back -----------------------------------------------------------------------

def _ran_on_cpu(f, *args) -> set[str]:
    before = dict(fallback.in_steps)
    f(*args)
    return {op for op, n in fallback.in_steps.items() if n != before.get(op, 0)}


def test_an_op_the_card_lacks_inside_a_fusion_runs_on_the_cpu_and_the_rest_on_the_card(functional):
    """bessel_j0 of a product, added to a cumprod: the product and the sum stay card kernels
    and the fusion forms around bessel_j0 (it once failed the compile)."""
    torch._dynamo.reset()
    fn = lambda x: torch.special.bessel_j0(x * 2) + x.cumprod(-1)  # noqa: E731
    f = torch.compile(fn, backend="spyre_rt", dynamic=False)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9))
    ran = _ran_on_cpu(lambda: _close(f(x.to("spyre")).cpu(), fn(x)))
    assert ran == {"aten.special_bessel_j0.default", "aten.cumprod.default"}


def test_with_cpu_fallback_off_the_error_names_the_op_and_the_model_line(functional):
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.special.bessel_j0(x * 2) + 1,  # the line the error names
                      backend="spyre_rt", dynamic=False, options={"cpu_fallback": False})
    import spyre_rt

    with pytest.raises(spyre_rt.SpyreCompileError) as info:
        f(torch.randn(SHAPE).to("spyre"))
    message = str(info.value)
    assert "bessel_j0" in message and __file__ in message and "CPU fallback is off" in message


def test_a_kernel_construction_cannot_build_runs_on_the_cpu(functional):
    """Gathering columns by indices computed in the kernel: construction cannot (an indirect
    index that varies along the columns), so the compile is made again with the ops of that
    kernel on the CPU."""
    torch._dynamo.reset()
    fn = lambda x: x[:, (torch.arange(70, device=x.device) + 3) % 70] * 2 + 1  # noqa: E731
    f = torch.compile(fn, backend="spyre_rt", dynamic=False)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(10))
    ran = _ran_on_cpu(lambda: _close(f(x.to("spyre")).cpu(), fn(x.cpu())))
    assert "aten.index.Tensor" in ran


def test_ops_the_card_lacks_are_rewritten_by_adapters_and_run_on_the_card(functional):
    torch._dynamo.reset()
    fn = lambda x: torch.log2(x + 1) + torch.atanh(x * 0.9) + torch.hypot(x, x * 2) + torch.atan2(x, x - 0.5)  # noqa: E731
    f = torch.compile(fn, backend="spyre_rt", dynamic=False)
    x = torch.rand(SHAPE, generator=torch.Generator().manual_seed(11))
    assert _ran_on_cpu(lambda: _close(f(x.to("spyre")).cpu(), fn(x))) == set()


# ---- vLLM's rotary embedding --------------------------------------------------------------
#
# RotaryEmbedding.forward_native as vLLM writes it (not imported): the cos and sin of each
# token gathered from a cache of (max positions, rotary dim) by its position, applied to the
# first rotary_dim of every head of q and k, which come from a fused qkv projection's output.
# The gathered row's halves once failed the first launch: the `sin` half, read over all the
# columns of the output's `cat` and masked to half of them, ran into the next row, and in
# partial rotary (and fp16) its run crossed a stick boundary at an unaligned column.

def _rotate(x, cos, sin, neox: bool):
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    if neox:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1) if neox else torch.stack((o1, o2), dim=-1).flatten(-2)


def rotary_step(heads: int, kv_heads: int, head_size: int, rotary_dim: int, neox: bool):
    def forward(positions, qkv, cos_sin_cache):
        query, key, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
        positions = positions.flatten()
        tokens = positions.shape[0]
        cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        out = []
        for x in (query, key):
            shape = x.shape
            x = x.view(tokens, -1, head_size)
            rotated = _rotate(x[..., :rotary_dim], cos, sin, neox)
            out.append(torch.cat((rotated, x[..., rotary_dim:]), dim=-1).reshape(shape))
        return tuple(out)
    return forward


def _rotary_case(head, dtype, rot, style, slow=False):
    return pytest.param(head, dtype, rot, style, id=f"{style}-{dtype}-head{head}-rot{rot}",
                        marks=[pytest.mark.slow] if slow else [])


ROTARY = [
    _rotary_case(32, "float32", 32, "neox"), _rotary_case(64, "float32", 64, "neox"),
    _rotary_case(128, "float32", 128, "neox"), _rotary_case(128, "float32", 96, "neox"),
    _rotary_case(64, "float16", 64, "neox"), _rotary_case(128, "float16", 128, "neox"),
    _rotary_case(128, "float16", 96, "neox"), _rotary_case(64, "float16", 32, "neox"),
    _rotary_case(32, "float32", 16, "gptj"), _rotary_case(64, "float32", 64, "gptj"),
    _rotary_case(128, "float16", 128, "gptj"), _rotary_case(128, "float16", 64, "gptj"),
    _rotary_case(32, "float16", 32, "neox", slow=True), _rotary_case(64, "float32", 48, "neox", slow=True),
    _rotary_case(128, "float32", 128, "gptj", slow=True), _rotary_case(64, "float16", 64, "gptj", slow=True),
    _rotary_case(128, "float32", 64, "gptj", slow=True),
]


def _card_calls(f, args, modes) -> dict:
    """The outputs of `f` on the card in each mode (CPU tensors); fails if anything of it
    ran on the CPU, eagerly or inside the step."""
    before, in_steps = sum(fallback.calls.values()), dict(fallback.in_steps)
    outs = {}
    for mode in modes:
        with dispatch_mode(mode):
            outs[mode] = [o.cpu() for o in f(*[a.to("spyre") for a in args])]
    assert sum(fallback.calls.values()) == before, "eager CPU ops ran"
    assert dict(fallback.in_steps) == in_steps, f"ops ran on the CPU: {set(fallback.in_steps) - set(in_steps)}"
    return outs


@pytest.mark.parametrize(("head", "dtype", "rot", "style"), ROTARY)
def test_vllm_rotary_embedding_runs_on_the_card(functional, head, dtype, rot, style):
    """On the card in every dispatch mode (no CPU op), the modes bit for bit alike; fp32
    within 1e-6 of CPU eager; fp16 within one fp16 rounding of CPU eager's fp32 arithmetic
    on the same fp16 values (the card computes in fp32 and rounds once, eager fp16 rounds
    after every op)."""
    torch._dynamo.reset()
    heads, kv_heads, tokens, positions = 4, 2, 5, 40
    forward = rotary_step(heads, kv_heads, head, rot, style == "neox")
    g = torch.Generator().manual_seed(head + rot)
    dt = getattr(torch, dtype)
    args = [torch.tensor([3, 0, 39, 7, 3]),
            torch.randn(tokens, (heads + 2 * kv_heads) * head, generator=g).to(dt),
            torch.randn(positions, rot, generator=g).to(dt)]
    outs = _card_calls(torch.compile(forward, backend="spyre_rt", dynamic=False), args, NAMES)
    for mode in NAMES:
        assert all(torch.equal(a, b) for a, b in zip(outs[mode], outs["prebuilt"], strict=True)), mode
    if dt == torch.float32:
        for got, want in zip(outs["prebuilt"], forward(*args), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    else:
        exact = forward(args[0], args[1].float(), args[2].float())
        for got, want in zip(outs["prebuilt"], exact, strict=True):
            torch.testing.assert_close(got.float(), want.to(dt).float(), rtol=2 ** -10, atol=2 ** -14)


def test_vllm_rotary_embedding_with_dynamic_token_counts_runs_on_the_card(functional):
    torch._dynamo.reset()
    forward = rotary_step(4, 2, 64, 64, True)
    f = torch.compile(forward, backend="spyre_rt", dynamic=True)
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(300, 64, generator=g)
    for tokens in (5, 9, 70):
        args = [torch.randint(0, 300, (tokens,), generator=g), torch.randn(tokens, 8 * 64, generator=g), cache]
        outs = _card_calls(f, args, NAMES)
        for got, want in zip(outs["prebuilt"], forward(*args), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# ---- index_put and index with several index tensors ---------------------------------------
#
# On a (4, 5, 6) tensor: one index tensor, two, three; broadcasting index tensors; a slice
# between them; an index on an inner dimension; negative indices; boolean masks; and
# accumulate=True. Each runs on the card (an index that picks whole rows of the storage) or
# on the CPU (an element index, an accumulation, a boolean mask), never a wrong value: a
# CPU op's in-place update is written back (three index tensors once left the tensor as it
# was), and two index tensors once failed with an untyped ValueError.

_I = torch.tensor
INDEXING = {  # name -> (indices, None for a slice; the values' shape, or "read"; accumulate; on the card?)
    "one": ((_I([3, 0]),), (2, 5, 6), False, True),
    "one-broadcast-values": ((_I([3, 0]),), (6,), False, True),
    "two": ((_I([0, 1]), _I([2, 3])), (2, 6), False, True),
    "three": ((_I([0, 1]), _I([2, 3]), _I([1, 4])), (2,), False, False),
    "broadcasting-indices": ((_I([[0], [3]]), _I([[1, 2, 4]])), (2, 3, 6), False, True),
    "slice-between": ((_I([0, 2]), None, _I([1, 5])), (2, 5), False, False),
    "inner-dim": ((None, _I([4, 1])), (4, 2, 6), False, True),
    "innermost-dim": ((None, None, _I([4, 1])), (4, 5, 2), False, False),
    "negative": ((_I([-1, 0]), _I([-2, 3])), (2, 6), False, True),
    "bool-rows": ((_I([True, False, True, False]),), (2, 5, 6), False, False),
    "accumulate-one": ((_I([3, 3]),), (2, 5, 6), True, False),
    "accumulate-three": ((_I([0, 0]), _I([2, 2]), _I([1, 1])), (2,), True, False),
    "read-one": ((_I([3, 0, 3]),), "read", False, True),
    "read-two": ((_I([0, 3]), _I([2, 1])), "read", False, True),
    "read-three": ((_I([0, 3]), _I([2, 1]), _I([5, 0])), "read", False, False),
    "read-slice-between": ((_I([0, 3]), None, _I([5, 0])), "read", False, False),
    "read-inner-dim": ((None, _I([4, 0])), "read", False, True),
    "read-negative": ((_I([-1, 0]), _I([-3, 1])), "read", False, True),
    "read-broadcasting-indices": ((_I([[0], [3]]), _I([[1, 2, 4]])), "read", False, True),
}


def _indexing(indices, read: bool, accumulate: bool):
    positions = [i for i, x in enumerate(indices) if x is not None]

    def f(a, v, *index_tensors):
        full = [slice(None)] * len(indices)
        for p, t in zip(positions, index_tensors, strict=True):
            full[p] = t
        if read:
            return a[tuple(full)] * 2
        if all(isinstance(x, torch.Tensor) for x in full):
            a.index_put_(tuple(full), v, accumulate=accumulate)
        else:
            a[tuple(full)] = v
        return a * 1
    return f, [indices[i] for i in positions]


@pytest.mark.parametrize("name", sorted(INDEXING))
def test_index_put_and_index_match_cpu_eager_in_every_mode(functional, name):
    indices, values, accumulate, on_card = INDEXING[name]
    f, index_tensors = _indexing(indices, values == "read", accumulate)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    a0 = torch.rand(4, 5, 6, generator=g)
    v = torch.zeros(()) if values == "read" else torch.rand(values, generator=g)
    want_a = a0.clone()
    want = f(want_a, v, *index_tensors)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="spyre_rt", dynamic=False)
    ran = set()
    for mode in NAMES:
        with dispatch_mode(mode):
            a = a0.to("spyre")
            ran |= _ran_on_cpu(lambda a=a: _close(compiled(a, v.to("spyre"), *[t.to("spyre") for t in index_tensors])
                                                  .cpu(), want))
            _close(a.cpu(), want_a)  # the tensor updated in place
    assert (ran == set()) == on_card, ran


@pytest.mark.parametrize("read", [False, True])
def test_an_index_outside_an_inner_dimension_is_an_index_error_not_another_rows_element(functional, read):
    """An index of dimension 1 of a (4, 5, 6) tensor at 5 addresses a row of the storage
    that exists (the next slice's first): the card refuses it as CPU eager does, and an
    update leaves the tensor as it was."""
    f, index_tensors = _indexing((None, _I([5, 1])), read, False)
    a0, v = torch.rand(4, 5, 6), torch.ones(4, 2, 6)
    with pytest.raises(IndexError):
        f(a0.clone(), v, *index_tensors)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="spyre_rt", dynamic=False)
    for mode in NAMES:
        with dispatch_mode(mode):
            a = a0.to("spyre")
            with pytest.raises(SpyreIndexError, match="aten.index"):
                compiled(a, v.to("spyre"), *[t.to("spyre") for t in index_tensors])
            assert torch.equal(a.cpu(), a0), mode


def test_a_masked_sum_over_a_broadcast_row_matches_cpu_eager(functional):
    """Found while writing a cumsum as a masked sum (element i the sum of the j <= i): rows
    past the first ~11 of 15 went wrong for a summed dimension of 70 or 100, two tiles
    storing into one stick of the output (tests/test_loop_tiling.py)."""
    def f(x):
        n = x.shape[-1]
        i = torch.arange(n, device=x.device)
        return torch.where(i[None, :] <= i[:, None], x[..., None, :].expand(*x.shape[:-1], n, n), 0.0).sum(-1)

    torch._dynamo.reset()
    x = torch.randn(15, 70, generator=torch.Generator().manual_seed(0))
    got = torch.compile(f, backend="spyre_rt", dynamic=False)(x.to("spyre")).cpu()
    torch.testing.assert_close(got, f(x), rtol=1e-5, atol=1e-4)
