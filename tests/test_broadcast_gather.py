"""A gather whose rows its readers broadcast is computed apart (compiler/inductor/lowering.py,
``rebroadcast``): vLLM's rotary embedding gathers the cos and sin rows of each token's
position and every head reads them; fused into the rotation, the kernel would gather each
row once per head. Realized, the rows are gathered once into a buffer that the rotation
reads densely. A gather read once per element (a token embedding before its norm) stays
fused. Results are the CPU's either way."""

from __future__ import annotations

import pytest
import torch

import spyre_rt  # noqa: F401
from spyre_rt import executor


def rotary(positions, query, key, cache, head: int = 16):
    """vLLM's RotaryEmbedding.forward_static, Neox style, rotary dim = head size."""
    positions = positions.flatten()
    n = positions.shape[0]
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)

    def apply(x):
        c, s = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    q = apply(query.view(n, -1, head)).reshape(query.shape)
    k = apply(key.view(n, -1, head)).reshape(key.shape)
    return q, k


def embed_and_norm(ids, table, weight):
    x = torch.nn.functional.embedding(ids, table)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def _kernels(fn, args, tokens_dynamic=False):
    """Outputs on the host and the step's kernels; with `tokens_dynamic`, the first dimension
    of every input but the last a size symbol, as a served step's token count is."""
    torch._dynamo.reset()
    before = set(executor.live_steps())
    card = [a.to("spyre") for a in args]
    if tokens_dynamic:
        for a in card[:-1]:
            torch._dynamo.mark_dynamic(a, 0)
    out = torch.compile(fn, backend="spyre_rt", dynamic=False if not tokens_dynamic else None)(*card)
    steps = set(executor.live_steps()) - before
    kernels = [k for st in steps for e in st.executables() for k in e.desc.kernels.values()]
    return [o.cpu() for o in (out if isinstance(out, tuple) else (out,))], kernels


def _gathers(kernel) -> int:
    return sum(op.op == "indirect" for op in getattr(kernel, "ops", ()))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic-tokens"])
def test_rotary_cos_and_sin_are_gathered_once_then_read_by_every_head(dynamic):
    g = torch.Generator().manual_seed(2)
    tokens = 37
    args = (torch.randint(0, 50, (tokens,), generator=g), torch.randn(tokens, 8 * 16, generator=g),
            torch.randn(tokens, 2 * 16, generator=g), torch.randn(50, 16, generator=g))
    (q, k), kernels = _kernels(rotary, args, dynamic)
    want_q, want_k = rotary(*args)
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)
    loops = [k for k in kernels if k.kind == "loop"]
    gathering = [k for k in loops if _gathers(k)]
    assert len(gathering) == 1 and len(loops) == 3, [k.sizes for k in loops]
    (gather,) = gathering
    assert len(gather.sizes) <= 2 and gather.sizes[-1] == 16  # the rows, once: (tokens, 16)


def test_a_gather_read_once_per_element_stays_fused():
    g = torch.Generator().manual_seed(3)
    args = (torch.randint(0, 30, (2, 9), generator=g), torch.randn(30, 64, generator=g), torch.randn(64, generator=g))
    (out,), kernels = _kernels(embed_and_norm, args)
    torch.testing.assert_close(out, embed_and_norm(*args), rtol=1e-5, atol=1e-5)
    loops = [k for k in kernels if k.kind == "loop"]
    assert len(loops) == 1 and _gathers(loops[0])
