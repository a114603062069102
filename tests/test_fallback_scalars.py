"""Eager ops with Python scalar operands give CPU eager's results on the card.

A scalar reaches an op's Tensor overload as a wrapped number (``x % 4`` is remainder.Scalar,
which calls remainder.Tensor with 4 wrapped); the CPU fallback receives it as a plain
number and must still run the op as the caller's call would have on the CPU: same values,
same dtype, same errors. The sweep runs each op of the Scalar-overload family with int,
float and bool scalars, on either side where torch allows it, on tensors of several
dtypes and on 0-d tensors (where a wrapped number and a 0-d tensor promote differently),
in-place forms included, and compares with CPU eager.
"""

import warnings

import pytest
import torch

import spyre_rt  # noqa: F401

DTYPES = (torch.int32, torch.int64, torch.uint8, torch.float16, torch.float32, torch.bool)
SCALARS = (3, -2, 2.5, True)


def _tensors(dtype):
    """A vector without zeros (so that scalar % t is defined) and a 0-d tensor."""
    if dtype == torch.bool:
        return torch.tensor([True, False, True, True]), torch.tensor(True)
    if dtype == torch.uint8:
        return torch.tensor([1, 2, 3, 7, 200], dtype=dtype), torch.tensor(5, dtype=dtype)
    vec = torch.tensor([-3, -2, -1, 1, 2, 3, 4, 7], dtype=dtype)
    if dtype.is_floating_point:
        vec = vec * 1.25
    return vec, torch.tensor(3, dtype=dtype)


def _clone(t):
    return t.clone()


# name -> f(tensor, scalar); in-place forms act on a copy and return it
OPS = {
    "add": lambda t, s: t + s,
    "radd": lambda t, s: s + t,
    "add_alpha": lambda t, s: torch.add(t, s, alpha=2),
    "sub": lambda t, s: t - s,
    "rsub": lambda t, s: s - t,
    "sub_alpha": lambda t, s: torch.sub(t, s, alpha=2),
    "torch_rsub": lambda t, s: torch.rsub(t, s),
    "mul": lambda t, s: t * s,
    "div": lambda t, s: t / s,
    "rdiv": lambda t, s: s / t,
    "div_floor": lambda t, s: torch.div(t, s, rounding_mode="floor"),
    "div_trunc": lambda t, s: torch.div(t, s, rounding_mode="trunc"),
    "floordiv": lambda t, s: t // s,
    "rfloordiv": lambda t, s: s // t,
    "remainder": lambda t, s: t % s,
    "rremainder": lambda t, s: s % t,
    "torch_remainder": lambda t, s: torch.remainder(t, s),
    "fmod": lambda t, s: torch.fmod(t, s),
    "pow": lambda t, s: t ** s,
    "rpow": lambda t, s: s ** t,
    "float_power": lambda t, s: torch.float_power(t, s),
    "bitwise_and": lambda t, s: t & s,
    "bitwise_or": lambda t, s: t | s,
    "bitwise_xor": lambda t, s: t ^ s,
    "rbitwise_and": lambda t, s: s & t,
    "lshift": lambda t, s: t << s,
    "rshift": lambda t, s: t >> s,
    "eq": lambda t, s: t == s,
    "ne": lambda t, s: t != s,
    "lt": lambda t, s: t < s,
    "le": lambda t, s: t <= s,
    "gt": lambda t, s: t > s,
    "ge": lambda t, s: t >= s,
    "rlt": lambda t, s: s < t,
    "clamp_min": lambda t, s: torch.clamp(t, min=s),
    "clamp_max": lambda t, s: torch.clamp(t, max=s),
    "clamp_both": lambda t, s: torch.clamp(t, -s, s),
    "where_other": lambda t, s: torch.where(t > 1, t, s),
    "where_self": lambda t, s: torch.where(t > 1, s, t),
    "where_both": lambda t, s: torch.where(t > 1, s, 0),
    "masked_fill": lambda t, s: t.masked_fill(t > 1, s),
    "full_like": lambda t, s: torch.full_like(t, s),
    "copysign": lambda t, s: torch.copysign(t, s),
    "xlogy": lambda t, s: torch.xlogy(t, s),
    "rxlogy": lambda t, s: torch.xlogy(s, t),
    "lerp": lambda t, s: torch.lerp(t, t * 2, s),
    "atan2": lambda t, s: torch.atan2(t, s),  # no Scalar overload: a TypeError on both
    "add_": lambda t, s: _clone(t).add_(s),
    "mul_": lambda t, s: _clone(t).mul_(s),
    "remainder_": lambda t, s: _clone(t).remainder_(s),
    "fmod_": lambda t, s: _clone(t).fmod_(s),
    "pow_": lambda t, s: _clone(t).pow_(s),
    "div_floor_": lambda t, s: _clone(t).div_(s, rounding_mode="floor"),
    "bitwise_and_": lambda t, s: _clone(t).bitwise_and_(s),
    "bitwise_or_": lambda t, s: _clone(t).bitwise_or_(s),
    "lshift_": lambda t, s: _clone(t).bitwise_left_shift_(s),
    "clamp_": lambda t, s: _clone(t).clamp_(min=s),
    "lt_": lambda t, s: _clone(t).lt_(s),
    "masked_fill_": lambda t, s: _clone(t).masked_fill_(t > 1, s),
    "fill_": lambda t, s: _clone(t).fill_(s),
}


def _outcome(f, t, s):
    try:
        return f(t, s), None
    except Exception as e:  # noqa: BLE001 - the CPU's exception type is the expectation
        return None, type(e)


@pytest.mark.parametrize("name", sorted(OPS))
def test_scalar_operand_matches_cpu_eager(name):
    f = OPS[name]
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in DTYPES:
            for cpu in _tensors(dtype):
                dev = cpu.to("spyre")
                for s in SCALARS:
                    want, want_error = _outcome(f, cpu, s)
                    got, got_error = _outcome(f, dev, s)
                    where = f"{name}: {dtype} shape {tuple(cpu.shape)} with {s!r}"
                    assert got_error is want_error, f"{where}: CPU {want_error}, spyre {got_error}"
                    if want is None:
                        continue
                    assert got.device.type == "spyre", where
                    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True, msg=where)
                    assert torch.equal(dev.cpu(), cpu), f"{where}: the input changed"
                    checked += 1
    assert checked > 0 or name == "atan2"


def test_int_tensor_mod_int_is_remainder_on_the_card():
    """The report that started the sweep: ``int_tensor % 4`` on the card."""
    x = torch.arange(-6, 7, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = x.to("spyre") % 4
    assert out.device.type == "spyre" and out.dtype == torch.int32
    assert out.cpu().tolist() == (x % 4).tolist()
