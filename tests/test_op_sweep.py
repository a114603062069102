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
from spyre_rt.dispatch import dispatch_mode

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
    "bitwise_not": lambda a, b: torch.bitwise_not(a), "floordiv": torch.floor_divide,
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
    except RuntimeError as e:  # eager refuses it on the CPU too: nothing to compare
        pytest.skip(f"CPU eager: {e}")
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
    """bessel_j0 of a product, added to a cumsum: the product and the sum stay card kernels
    and the fusion forms around bessel_j0 (it once failed the compile)."""
    torch._dynamo.reset()
    fn = lambda x: torch.special.bessel_j0(x * 2) + x.cumsum(-1)  # noqa: E731
    f = torch.compile(fn, backend="spyre_rt", dynamic=False)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9))
    ran = _ran_on_cpu(lambda: _close(f(x.to("spyre")).cpu(), fn(x)))
    assert ran == {"aten.special_bessel_j0.default", "aten.cumsum.default"}


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
