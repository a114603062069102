"""Op parity: aten ops that transformer models use, compiled for spyre against CPU eager.

Every case is a small function of tensors, compiled with ``torch.compile(fn,
backend="spyre_rt", dynamic=False, fullgraph=True)`` for two shape families:

* ``aligned``: the inner size D is 64, one whole stick of fp16 (and two of fp32);
* ``ragged``:  D is 100, which is not a multiple of 64: the last stick of a row is padded.

and for fp32 and fp16 inputs (index and mask inputs keep their own dtypes). One compiled
function per (case, family, dtype) runs in all three dispatch modes; the outputs must be
bit-identical across the modes and match CPU eager:

* fp32: ``rtol=1e-5`` and ``atol=1e-6``. The card computes in fp32 like the CPU, but not in
  the same order or with the same math library (the SFU's exp/erf/tanh are not Sleef's), so
  results differ by a few ulps (1e-5 relative is ~80 ulps). The absolute floor is for
  results near zero, where a relative bound is meaningless: ``sin(x)`` near a root, or a
  difference of two nearly equal values, carries an absolute error of a few ulps of its
  *operands* (~1e-7 for operands of size ~1), far below 1e-6. Cases whose outputs are sums
  of many O(1) terms (reductions, matmuls, norms) with cancellation get an absolute floor
  scaled by their reduction length, given per case.
* fp16: ``rtol=2e-3`` and ``atol=2e-3``. Both sides compute in fp32, but CPU eager rounds to
  fp16 after every op while a fused spyre kernel rounds only when it stores a buffer, so a
  chain of ops differs by up to about one fp16 rounding (2**-11 ~ 4.9e-4 relative) per
  rounding eager does that the card does not; 2e-3 allows four of them. The absolute floor
  is the same bound for values of magnitude < 1, where an fp16 ulp is absolute rather than
  relative. Cases with long fp16 chains (norms, attention) document a wider one.

Integer and boolean results must match exactly. Inputs are generated per case: positive
values for log/sqrt/rsqrt/pow, values away from zero for divisors, small integers where
equality comparisons must be exercised, index tensors in range, random boolean masks.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

import spyre_rt
from spyre_rt import fallback
from spyre_rt.dispatch import dispatch_mode

MODES = ("construct", "prebuilt-transfer", "prebuilt")
FAMILIES = {"aligned": 64, "ragged": 100}
F32, F16 = torch.float32, torch.float16
TOL = {F32: (1e-5, 1e-6), F16: (2e-3, 2e-3)}


# ---- input generators -------------------------------------------------------------------
# A generator makes one CPU tensor from its shape, the case's float dtype and a seeded
# torch.Generator. Float inputs take the case's dtype; index and mask inputs do not.


def normal(shape, dtype, g):
    return torch.randn(shape, generator=g).to(dtype)


def positive(shape, dtype, g):
    """In [0.5, 2.5): log, sqrt, rsqrt, pow and divisors stay well conditioned."""
    return (torch.rand(shape, generator=g) * 2 + 0.5).to(dtype)


def near_one(shape, dtype, g):
    """In [0.95, 1.05): products of 100 of them stay O(1)."""
    return (torch.rand(shape, generator=g) * 0.1 + 0.95).to(dtype)


def small_ints(shape, dtype, g):
    """Integer values in [-2, 2] as floats: equal pairs are frequent."""
    return torch.randint(-2, 3, shape, generator=g).to(dtype)


def mask(shape, dtype, g):
    return torch.rand(shape, generator=g) < 0.5


def ints(high):
    """int64 indices in [0, high); `high` may be "D" for the family's inner size."""

    def gen(shape, dtype, g, D=None):
        return torch.randint(0, D if high == "D" else high, shape, generator=g)

    gen.needs_D = True
    return gen


def distinct(high):
    """Distinct int64 indices in [0, high) (index_copy_ needs no repeats)."""

    def gen(shape, dtype, g, D=None):
        n = math.prod(shape)
        return torch.randperm(high, generator=g)[:n].reshape(shape)

    return gen


def causal_float_mask(shape, dtype, g):
    """An additive attention mask: 0 where allowed, a large negative where not, with the
    diagonal always allowed so no row is empty."""
    s = shape[-1]
    allowed = torch.rand(shape, generator=g) < 0.6
    allowed |= torch.eye(s, dtype=torch.bool).expand(shape)
    return torch.zeros(shape).masked_fill(~allowed, -1e4).to(dtype)


def attention_bool_mask(shape, dtype, g):
    s = shape[-1]
    allowed = torch.rand(shape, generator=g) < 0.6
    return allowed | torch.eye(s, dtype=torch.bool).expand(shape)


# ---- the table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Arg:
    shape: tuple  # ints, or "D" for the family's inner size, or "D/2", "2D"
    gen: Callable = normal

    def make(self, D: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
        shape = tuple(_dim(s, D) for s in self.shape)
        if getattr(self.gen, "needs_D", False):
            return self.gen(shape, dtype, g, D=D)
        return self.gen(shape, dtype, g)


def _dim(s, D: int) -> int:
    if isinstance(s, int):
        return s
    return {"D": D, "D/2": D // 2, "2D": 2 * D}[s]


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    args: tuple[Arg, ...]
    dtypes: tuple = (F32, F16)
    tol: dict = field(default_factory=dict)  # dtype -> (rtol, atol), overriding TOL
    xfail: dict = field(default_factory=dict)  # (family, dtype) or "all" -> reason
    fallback_op: str = ""  # an op expected to run on the CPU inside the compiled step


def A(*shape, gen=normal) -> Arg:
    return Arg(shape, gen)


X = A(3, 5, "D")  # the usual activation-shaped input
Y = A(3, 5, "D")
P = A(3, 5, "D", gen=positive)

# Reductions sum D (or 3*5*D) terms of size ~1: the absolute error of a sum with
# cancellation is a few ulps of the sum of magnitudes (~D * 6e-8), so atol grows with D.
SUM_TOL = {F32: (1e-5, 2e-5), F16: (2e-3, 2e-2)}
# Attention and norms in fp16: eager rounds q@k^T, the softmax and its normalisation to fp16
# separately; the card keeps them in fp32 within a kernel. A few fp16 ulps of O(1) values.
CHAIN16 = {F16: (5e-3, 5e-3)}


def rms_norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def rotary(q, cos, sin):
    return q * cos + rotate_half(q) * sin


def kv_cache_index_copy(cache, pos, k):
    cache.index_copy_(2, pos, k)
    return cache.sum(-1)


def kv_cache_index_put(cache, pos, k):
    cache[:, :, pos] = k
    return cache * 2


def kv_cache_attention(q, cache_k, cache_v, pos, k, v):
    cache_k.index_copy_(2, pos, k)
    cache_v.index_copy_(2, pos, v)
    return F.scaled_dot_product_attention(q, cache_k, cache_v)


CASES: list[Case] = [
    # -- elementwise, binary --
    Case("add", lambda a, b: a + b, (X, Y)),
    Case("add_alpha", lambda a, b: torch.add(a, b, alpha=2.5), (X, Y)),
    Case("add_broadcast_row", lambda a, b: a + b, (X, A("D"))),
    Case("sub", lambda a, b: a - b, (X, Y)),
    Case("rsub_scalar", lambda a: 1.0 - a, (X,)),
    Case("mul", lambda a, b: a * b, (X, Y)),
    Case("mul_scalar", lambda a: a * 3.5, (X,)),
    Case("div", lambda a, b: a / b, (X, P)),
    Case("div_scalar", lambda a: a / 7.0, (X,)),
    Case("pow_tensor_scalar", lambda a: a**3, (X,)),
    Case("pow_square", lambda a: a.pow(2), (X,)),
    Case("pow_fractional", lambda a: a**1.5, (P,)),
    Case("pow_tensor_tensor", lambda a, b: torch.pow(a, b), (P, Y)),
    Case("minimum", torch.minimum, (X, Y)),
    Case("maximum", torch.maximum, (X, Y)),
    # -- elementwise, unary --
    Case("neg", torch.neg, (X,)),
    Case("abs", torch.abs, (X,)),
    Case("exp", torch.exp, (X,)),
    Case("log", torch.log, (P,)),
    Case("sqrt", torch.sqrt, (P,)),
    Case("rsqrt", torch.rsqrt, (P,)),
    Case("reciprocal", torch.reciprocal, (P,)),
    Case("tanh", torch.tanh, (X,)),
    Case("sigmoid", torch.sigmoid, (X,)),
    Case("relu", torch.relu, (X,)),
    Case("silu", F.silu, (X,)),
    Case("gelu", F.gelu, (X,)),
    Case("gelu_tanh", lambda a: F.gelu(a, approximate="tanh"), (X,)),
    Case("erf", torch.erf, (X,)),
    Case("sin", torch.sin, (X,)),
    Case("cos", torch.cos, (X,)),
    Case("clamp", lambda a: torch.clamp(a, -0.5, 0.75), (X,)),
    Case("clamp_min", lambda a: a.clamp_min(0.1), (X,)),
    Case("floor_ceil_round", lambda a: torch.floor(a * 3) + torch.ceil(a) + torch.round(a * 2), (X,)),
    Case("swiglu", lambda a, b: F.silu(a) * b, (X, Y)),
    # -- comparisons, masks, selection --
    Case("eq", torch.eq, (A(3, 5, "D", gen=small_ints),) * 2),
    Case("ne", torch.ne, (A(3, 5, "D", gen=small_ints),) * 2),
    Case("lt", torch.lt, (A(3, 5, "D", gen=small_ints),) * 2),
    Case("le", torch.le, (A(3, 5, "D", gen=small_ints),) * 2),
    Case("gt", torch.gt, (A(3, 5, "D", gen=small_ints),) * 2),
    Case("ge_scalar", lambda a: a >= 0.0, (A(3, 5, "D", gen=small_ints),)),
    Case("logical_and_or_not", lambda m, n: (m & n, m | ~n, torch.logical_not(m)),
         (A(3, 5, "D", gen=mask), A(3, 5, "D", gen=mask))),
    Case("where", torch.where, (A(3, 5, "D", gen=mask), X, Y)),
    Case("where_scalar", lambda a: torch.where(a > 0, a, 0.0), (X,)),
    Case("masked_fill", lambda a, m: a.masked_fill(m, -1e4), (X, A(3, 5, "D", gen=mask))),
    Case("masked_fill_broadcast", lambda a, m: a.masked_fill(m, 0.0), (X, A(5, "D", gen=mask))),
    # -- dtype conversions and creation --
    Case("to_float16", lambda a: a.to(torch.float16), (X,), dtypes=(F32,)),
    Case("to_float32", lambda a: a.to(torch.float32) * 2, (X,), dtypes=(F16,)),
    Case("to_int64", lambda a: (a * 4).to(torch.int64), (X,)),
    Case("bool_to_float", lambda m, a: m.to(a.dtype) * a, (A(3, 5, "D", gen=mask), X)),
    Case("zeros_like_full", lambda a: (torch.zeros_like(a), torch.full_like(a, 2.5) + a,
                                       torch.ones_like(a) - a), (X,)),
    Case("full", lambda a: a + torch.full((a.shape[-1],), 0.25, dtype=a.dtype, device=a.device), (X,)),
    Case("arange", lambda a: a * torch.arange(a.shape[-1], device=a.device).to(a.dtype), (X,)),
    Case("arange_causal_mask", lambda a: a.masked_fill(
        torch.arange(5, device=a.device)[None, :] > torch.arange(5, device=a.device)[:, None],
        float("-inf")).softmax(-1), (A(3, 5, 5),)),
    # -- reductions --
    Case("sum_last", lambda a: a.sum(-1), (X,), tol=SUM_TOL),
    Case("sum_first", lambda a: a.sum(0), (X,), tol=SUM_TOL),
    Case("sum_all", lambda a: a.sum(), (X,), tol=SUM_TOL),
    Case("mean", lambda a: a.mean(-1, keepdim=True), (X,), tol=SUM_TOL),
    Case("amax", lambda a: a.amax(-1), (X,)),
    Case("amin", lambda a: a.amin(1), (X,)),
    Case("max_values", lambda a: a.max(-1).values, (X,)),
    Case("max_dim", lambda a: tuple(a.max(-1)), (X,)),
    Case("argmax", lambda a: a.argmax(-1), (X,)),
    Case("argmin", lambda a: a.argmin(-1), (X,)),
    Case("prod", lambda a: a.prod(-1), (A(3, 5, "D", gen=near_one),), tol=SUM_TOL),
    Case("var", lambda a: a.var(-1), (X,), tol=SUM_TOL),
    Case("var_mean", lambda a: torch.var_mean(a, -1, correction=0), (X,), tol=SUM_TOL),
    Case("std", lambda a: a.std(-1), (X,), tol=SUM_TOL),
    Case("logsumexp", lambda a: torch.logsumexp(a, -1), (X,), tol=SUM_TOL),
    Case("softmax", lambda a: torch.softmax(a, -1), (X,), tol=CHAIN16),
    Case("softmax_dim0", lambda a: torch.softmax(a, 0), (X,), tol=CHAIN16),
    Case("log_softmax", lambda a: F.log_softmax(a, -1), (X,), tol={**SUM_TOL, **CHAIN16}),
    Case("layer_norm", lambda a, w, b: F.layer_norm(a, (a.shape[-1],), w, b, 1e-5),
         (X, A("D"), A("D")), tol={F32: (1e-5, 1e-5), **CHAIN16}),
    Case("rms_norm", rms_norm, (X, A("D")), tol={F32: (1e-5, 1e-5), **CHAIN16}),
    # -- matmuls (K = D: the reduction runs over the family's inner size) --
    Case("mm", torch.mm, (A(8, "D"), A("D", 24)), tol=SUM_TOL),
    Case("mm_transposed", lambda a, b: a @ b.t(), (A(8, "D"), A(24, "D")), tol=SUM_TOL),
    Case("bmm", torch.bmm, (A(2, 8, "D"), A(2, "D", 24)), tol=SUM_TOL),
    Case("addmm", torch.addmm, (A(24), A(8, "D"), A("D", 24)), tol=SUM_TOL),
    Case("addmm_beta_alpha", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
         (A(8, 24), A(8, "D"), A("D", 24)), tol=SUM_TOL),
    Case("baddbmm", lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=0.125),
         (A(2, 8, 24), A(2, 8, "D"), A(2, "D", 24)), tol=SUM_TOL),
    Case("matmul_3d_2d", torch.matmul, (A(2, 8, "D"), A("D", 24)), tol=SUM_TOL),
    Case("linear", F.linear, (A(2, 8, "D"), A(24, "D"), A(24)), tol=SUM_TOL),
    Case("linear_no_bias", F.linear, (A(2, 8, "D"), A("D", "D")), tol=SUM_TOL),
    Case("mlp_block", lambda x, w1, w2: F.linear(F.silu(F.linear(x, w1)), w2),
         (A(8, "D"), A(32, "D"), A("D", 32)), tol=SUM_TOL),
    # -- indexing --
    Case("embedding", F.embedding, (A(2, 7, gen=ints(50)), A(50, "D"))),
    Case("index_select", lambda a, i: a.index_select(0, i), (A(12, "D"), A(5, gen=ints(12)))),
    Case("index_tensor", lambda a, i: a[i], (A(12, "D"), A(2, 3, gen=ints(12)))),
    Case("gather_last", lambda a, i: torch.gather(a, -1, i), (A(6, "D"), A(6, 9, gen=ints("D")))),
    Case("select", lambda a: a[:, 2] * 2, (X,)),
    Case("slice_step", lambda a: a[:, 1:, ::2] + 1, (X,)),
    Case("slice_narrow", lambda a: a.narrow(-1, 3, 20) * a[..., -20:], (X,)),
    Case("rotate_half", rotate_half, (A(2, 3, 5, "D"),)),
    Case("rotary", rotary, (A(2, 3, 5, "D"), A(5, "D"), A(5, "D"))),
    # -- shapes and views --
    Case("cat_last", lambda a, b: torch.cat([a, b], -1), (X, A(3, 5, 17))),
    Case("cat_first", lambda a, b: torch.cat([a, b], 0), (X, A(2, 5, "D"))),
    Case("stack", lambda a, b: torch.stack([a, b], 1), (X, Y)),
    Case("split", lambda a: [t * (k + 1) for k, t in enumerate(torch.split(a, 2, 1))], (X,)),
    Case("chunk_last", lambda a: [t + k for k, t in enumerate(a.chunk(2, -1))], (X,)),
    Case("transpose", lambda a: a.transpose(0, 1) + 1, (X,)),
    Case("transpose_inner", lambda a: a.transpose(-1, -2) * 2, (X,)),
    Case("permute", lambda a: a.permute(2, 0, 1) - 1, (X,)),
    Case("permute_contiguous", lambda a: a.permute(1, 0, 2).contiguous(), (X,)),
    Case("reshape", lambda a: (a * 2).reshape(15, -1), (X,)),
    Case("view_heads", lambda a: (a + 1).view(3, 5, 2, -1).transpose(1, 2).contiguous(), (X,)),
    Case("unsqueeze_squeeze", lambda a, b: (a.unsqueeze(1) + b.unsqueeze(-1)).unsqueeze(0).squeeze(0),
         (A(4, "D"), A(4, 6))),
    Case("flatten", lambda a: torch.flatten(a * 3, 0, 1), (X,)),
    Case("expand", lambda a, b: a.expand(3, 5, -1) * b, (A(1, 5, "D"), Y)),
    Case("expand_repeat_kv", lambda kv: kv[:, :, None].expand(2, 2, 3, 5, kv.shape[-1])
         .reshape(2, 6, 5, kv.shape[-1]) * 1, (A(2, 2, 5, "D"),)),
    # -- attention --
    Case("sdpa_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         (A(1, 2, 8, "D"), A(1, 2, 8, "D"), A(1, 2, 8, "D")), tol={**SUM_TOL, **CHAIN16}),
    Case("sdpa_float_mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
         (A(1, 2, 8, "D"), A(1, 2, 8, "D"), A(1, 2, 8, "D"), A(1, 1, 8, 8, gen=causal_float_mask)),
         tol={**SUM_TOL, **CHAIN16}),
    Case("sdpa_bool_mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
         (A(1, 2, 8, "D"), A(1, 2, 8, "D"), A(1, 2, 8, "D"), A(1, 1, 8, 8, gen=attention_bool_mask)),
         tol={**SUM_TOL, **CHAIN16}),
    Case("attention_by_hand", lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / 8.0, -1) @ v,
         (A(1, 2, 8, "D"), A(1, 2, 8, "D"), A(1, 2, 8, "D")), tol={**SUM_TOL, **CHAIN16}),
    # -- static KV cache updates (the decode step's mutation of a graph input) --
    Case("index_copy_", kv_cache_index_copy, (A(1, 2, 16, "D"), A(1, gen=distinct(16)), A(1, 2, 1, "D")),
         tol=SUM_TOL),
    Case("index_copy_prefill", kv_cache_index_copy,
         (A(1, 2, 16, "D"), A(4, gen=distinct(16)), A(1, 2, 4, "D")), tol=SUM_TOL),
    Case("index_put_", kv_cache_index_put, (A(1, 2, 16, "D"), A(1, gen=distinct(16)), A(1, 2, 1, "D"))),
    Case("kv_cache_attention", kv_cache_attention,
         (A(1, 2, 1, "D"), A(1, 2, 16, "D"), A(1, 2, 16, "D"), A(1, gen=distinct(16)),
          A(1, 2, 1, "D"), A(1, 2, 1, "D")), tol={**SUM_TOL, **CHAIN16}),
    # -- a CPU fallback inside the compiled step --
    Case("cumsum", lambda a: torch.cumsum(a, -1) * 2, (X,), tol=SUM_TOL, fallback_op="cumsum"),
]


# ---- running a case ----------------------------------------------------------------------


def _params():
    for case in CASES:
        for family in FAMILIES:
            for dtype in case.dtypes:
                dname = str(dtype).removeprefix("torch.")
                reason = case.xfail.get((family, dtype)) or case.xfail.get(family) or case.xfail.get("all")
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                yield pytest.param(case, family, dtype, id=f"{case.name}-{family}-{dname}", marks=marks)


def _inputs(case: Case, family: str, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{family}".encode()))
    return [a.make(FAMILIES[family], dtype, g) for a in case.args]


def _flat(out) -> list:
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [out]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that NaNs, -0.0 and infinities compare exactly."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.numel() else t


def _check_close(actual: torch.Tensor, expected: torch.Tensor, tol, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if expected.is_floating_point():
        rtol, atol = tol
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, expected), f"{what}: {(actual != expected).sum()} elements differ"


def _run(compiled, cpu_inputs: list[torch.Tensor], mode: str):
    """Run on spyre copies of the inputs in one dispatch mode; (outputs, inputs) on the CPU."""
    inputs = [t.to("spyre") for t in cpu_inputs]
    before = sum(fallback.calls.values())
    with dispatch_mode(mode):
        out = compiled(*inputs)
    assert sum(fallback.calls.values()) == before, "an op of the compiled function ran as an eager CPU fallback"
    outs = _flat(out)
    assert all(o.device.type == "spyre" for o in outs), "an output is not on spyre"
    return [o.cpu() for o in outs], [t.cpu() for t in inputs]


@pytest.mark.parametrize(("case", "family", "dtype"), list(_params()))
def test_op(case: Case, family: str, dtype: torch.dtype):
    torch._dynamo.reset()  # a fresh compile per case: no guard or recompile-limit sharing
    cpu_inputs = _inputs(case, family, dtype)
    eager_inputs = [t.clone() for t in cpu_inputs]
    expected = [t for t in _flat(case.fn(*eager_inputs))]
    counter = torch._dynamo.testing.CompileCounterWithBackend("spyre_rt")
    compiled = torch.compile(case.fn, backend=counter, dynamic=False, fullgraph=True)
    tol = case.tol.get(dtype, TOL[dtype])

    if case.fallback_op:  # the step warns once per process and op: make this test see it
        from spyre_rt.compiler import step

        step._warned -= {w for w in step._warned if case.fallback_op in w[0]}
    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", spyre_rt.SpyreFallbackWarning)
        for mode in MODES:
            results[mode] = _run(compiled, cpu_inputs, mode)
    assert counter.frame_count == 1, f"compiled into {counter.frame_count} graphs"
    fell_back = [str(w.message) for w in caught if issubclass(w.category, spyre_rt.SpyreFallbackWarning)]
    if case.fallback_op:
        assert any(case.fallback_op in m for m in fell_back), f"{case.fallback_op} did not fall back to the CPU"
    else:
        assert not fell_back, f"unexpected CPU fallback: {fell_back}"

    outs, ins = results["prebuilt"]
    assert len(outs) == len(expected)
    for k, (a, e) in enumerate(zip(outs, expected, strict=True)):
        _check_close(a, e, tol, f"output {k}")
    for k, (a, e) in enumerate(zip(ins, eager_inputs, strict=True)):
        _check_close(a, e, tol, f"input {k} after the call")  # mutated inputs (KV cache)
    for mode in MODES[:-1]:
        other_outs, other_ins = results[mode]
        for k, (a, b) in enumerate(zip(other_outs + other_ins, outs + ins, strict=True)):
            assert torch.equal(_bits(a), _bits(b)), f"{mode} and prebuilt differ in tensor {k}"


def test_sweep_covers_sixty_aten_ops():
    """The cases that pass exercise at least 60 distinct aten ops (as traced by make_fx,
    before Inductor's decompositions)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    seen = set()
    for case in CASES:
        if "all" in case.xfail:
            continue
        inputs = _inputs(case, "ragged", F32 if F32 in case.dtypes else case.dtypes[0])
        gm = make_fx(case.fn)(*[t.clone() for t in inputs])
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                seen.add(node.target.overloadpacket.__name__)
    assert len(seen) >= 60, sorted(seen)
