"""Every cache's key holds everything its value depends on.

Each cache of construction and of the runtime (the decision records later launches build
loop kernels from, operand patterns of matmuls, transfer graphs, plan files and the memory
plan behind them) is checked by varying each input of its key, or against the same work
done with the cache never hitting.
"""

import copy
import dataclasses
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from spyre_rt import card as cards
from spyre_rt import construct, device_profile, dispatch, fallback
from spyre_rt import executor as step_mod
from spyre_rt.construct import loops
from spyre_rt.construct import matmul as mm
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.executor import plans
from spyre_rt.layout import StickLayout

MODES = dispatch.NAMES  # every dispatch mode, from the table


@pytest.fixture
def functional():
    with cards.configured(sim_mode="functional") as cs:
        yield cs


# ---- loop kernels: DMA patterns, stage programs, tile classes -------------------------

def _in_place(op):
    def f(a, x):
        op(a, x)
        return a * 1
    return f


IN_PLACE = {
    "add_": lambda a, x: a.add_(x),
    "mul_": lambda a, x: a.mul_(x),
    "copy_": lambda a, x: a.copy_(x),
    "sub_ of a transposed view": lambda a, x: a.t().sub_(x.t()),
    "slice assigned": lambda a, x: a[1:].copy_(x[:-1] * 2),
}


@pytest.mark.parametrize("shape", [(8, 64), (2, 3, 64), (512, 256), (5, 7), (3, 130)])
@pytest.mark.parametrize("name", list(IN_PLACE))
def test_in_place_updates_of_inputs_land_at_their_positions(functional, name, shape):
    """A store and a load with the same geometry share no DMA pattern: a store's strides
    are a load's swapped (the pattern cache once left the direction out of its key)."""
    if name == "sub_ of a transposed view" and len(shape) != 2:
        pytest.skip("a 2-d op")
    f = _in_place(IN_PLACE[name])
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    a, x = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    want_a = a.clone()
    want_out = f(want_a, x)
    torch._dynamo.reset()  # every test compiles its own graph (no recompile limit, no eager)
    compiled = torch.compile(f, backend="spyre_rt", dynamic=False)
    for mode in MODES:
        ad, xd = a.to("spyre"), x.to("spyre")
        eager = sum(fallback.calls.values())
        with dispatch_mode(mode):
            out = compiled(ad, xd)
        assert sum(fallback.calls.values()) == eager, "the call ran eagerly, not compiled"
        assert torch.equal(ad.cpu(), want_a), f"{mode}: the mutated input"
        assert torch.equal(out.cpu(), want_out), f"{mode}: the output"


KERNELS = {
    "in-place add": (lambda a, x: a.add_(x).mul(3), [(37, 96), (37, 96)]),
    "transposed store": (lambda a, x: (a.t() * 2 + x.t()).contiguous(), [(70, 130), (70, 130)]),
    "row reduction": (lambda a, x: (a * x).sum(-1, keepdim=True) + a, [(33, 200), (33, 200)]),
    "masked cat": (lambda a, x: torch.cat([a, x[:, :5]], 1) * 2, [(40, 64), (40, 64)]),
    "gather rows": (lambda a, i: torch.nn.functional.embedding(i, a) + 1, [(50, 96), None]),
    "scatter rows": (lambda a, x: a.index_copy_(0, torch.tensor([3, 7, 1], device=a.device), x[:3]).sum(0), [(20, 72), (20, 72)]),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_loop_kernels_built_from_their_record_make_what_a_fresh_decision_makes(functional, monkeypatch, name):
    """Every construct-mode launch after the first builds from the decision record the first
    made; deciding afresh at every launch must give the same results."""
    fn, shapes = KERNELS[name]
    g = torch.Generator().manual_seed(7)
    args = [torch.randn(s, generator=g) if s else torch.randint(0, 50, (9,), generator=g) for s in shapes]

    def run():
        torch._dynamo.reset()
        f = torch.compile(fn, backend="spyre_rt", dynamic=False)
        dev = [a.to("spyre") for a in args]
        with dispatch_mode("construct"):  # builds every kernel at its launch
            out = f(*dev)
        return [out.cpu()] + [d.cpu() for d in dev]

    taken_back = run()
    build, decisions = loops.build, []

    def decide_afresh(ctx, k, decided=None):
        decisions.append(k.name)
        return build(ctx, k)

    monkeypatch.setattr(construct, "BUILDERS", {**construct.BUILDERS, "loop": decide_afresh})
    fresh = run()
    assert len(decisions) > len(set(decisions)), "no launch built a kernel again"
    for got, want in zip(fresh, taken_back, strict=True):
        assert torch.equal(got, want)


# ---- matmul operand patterns ----------------------------------------------------------

@pytest.mark.parametrize("col0,pad", [(3, 0), (5, 7), (64, 0), (0, 61)])
def test_matmul_boxes_at_every_column_of_a_row_move_their_own_bytes(col0, pad):
    """The native builder (native/build_matmul.c) reuses a box's DMA pattern for the next box
    alike: the same shape, column inside a stick, reaching past its storage row's end or not,
    ending at the row's last column or not. K chunks and output tiles that start at several
    columns of their rows, the last of them at the row's end, each move their own bytes: the
    product equals torch's and the columns around the output are untouched."""
    from test_matmul_build import check, operand

    card = cards.Card(device_profile.load("spyre"), "functional", 0)
    g = torch.Generator().manual_seed(col0 + pad)
    a = operand("a", torch.float16, 1, 65, 300, col0=col0, pad=pad, gen=g)
    b = operand("b", torch.float16, 1, 300, 130, col0=col0, pad=pad, gen=g)
    out = operand("o", torch.float16, 1, 65, 130, col0=col0, pad=pad, gen=g)
    check(card, a, b, out, tiling=mm.Tiling(4, 1, 2, 4, 2, 8, 64, 2))


def test_a_matmul_over_a_reshaped_input_reads_rows_that_wrap(functional):
    """The operand's rows span two storage rows: its boxes have no compact pattern and are
    moved by descriptor lists."""
    f = torch.compile(lambda x, w: x.view(2, 192) @ w, backend="spyre_rt", dynamic=False)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 96, generator=g), torch.randn(192, 70, generator=g)
    for mode in MODES:
        with dispatch_mode(mode):
            out = f(x.to("spyre"), w.to("spyre")).cpu()
        torch.testing.assert_close(out, x.view(2, 192) @ w, rtol=1e-5, atol=1e-4)


# ---- transfer graphs ---------------------------------------------------------------------

def test_transfer_graphs_are_keyed_by_every_field_of_the_view(functional):
    """Copies through views that differ in one field each (offset, sizes, strides, dtype,
    layout, direction) each get their own graph and move the right elements."""
    card = cards.get(0)
    base = torch.arange(12 * 40, dtype=torch.float32).reshape(12, 40)
    views = {
        "whole": lambda t: t,
        "offset": lambda t: t[1:],
        "sizes": lambda t: t[:5],
        "strides": lambda t: t[::2],
        "transposed": lambda t: t.t(),
        "columns": lambda t: t[:, 3:17],
    }
    for dtype in (torch.float32, torch.float16):
        for shape in ((12, 40), (40, 12)):
            src = base.reshape(shape).to(dtype)
            dev = src.to("spyre")
            with dispatch_mode("prebuilt"):
                for name, v in views.items():
                    assert torch.equal(v(dev).cpu(), v(src)), (dtype, shape, name)
                    fresh = torch.full_like(v(src), -1)
                    v(dev).copy_(fresh)
                    assert torch.equal(v(dev).cpu(), fresh), (dtype, shape, name, "upload")
                    v(dev).copy_(v(src))
    assert card.transfers.hits > 0


# ---- plan files and the memory plan ---------------------------------------------------

def _executables():
    return [e for s in step_mod.live_steps() for e in s.executables()]


def test_the_plan_key_changes_with_each_input(functional, monkeypatch):
    f = torch.compile(lambda x: torch.relu(x) * 2, backend="spyre_rt", dynamic=False)
    f(torch.randn(8, 64).to("spyre"))
    exe = next(e for e in _executables() if e.card is cards.get(0))
    b = exe.bindings
    first_input = b.names[1]
    variants = {
        "step description": {"step": SimpleNamespace(digest="0" * 64)},
        "options": {"desc": dataclasses.replace(exe.desc, options={**exe.desc.options, "cpu_fallback": False})},
        "compiler": {"desc": dataclasses.replace(exe.desc, options={**exe.desc.options, "compiler_version": "x"})},
        "input offset": {"bindings": dataclasses.replace(b, offsets={**b.offsets,
                                                                    first_input: b.offsets[first_input] + 64})},
        "input layout": {"bindings": dataclasses.replace(b, layouts={**b.layouts, first_input: StickLayout(1, 512, 4)})},
        "arena size": {"bindings": dataclasses.replace(b, arena_bytes=b.arena_bytes + 128)},
        "arena offsets": {"bindings": dataclasses.replace(b, relocs={**b.relocs, "<none>": (0, 128)})},
        "device profile": {"card": SimpleNamespace(profile=SimpleNamespace(digest="other"))},
    }
    keys = {"as compiled": exe.cache_key()}
    for what, fields in variants.items():
        other = copy.copy(exe)
        for name, value in fields.items():
            setattr(other, name, value)
        keys[what] = other.cache_key()
    f(torch.randn(16, 64).to("spyre")[8:])  # the same sizes and strides, in a larger storage
    keys["a larger input storage"] = next(e for e in _executables() if e is not exe and e.card is cards.get(0)
                                          and e.desc is exe.desc).cache_key()
    monkeypatch.setattr(plans, "runtime_version", lambda: "another runtime")
    keys["runtime and native module"] = exe.cache_key()
    monkeypatch.setattr(torch, "__version__", "0.0")
    keys["torch"] = exe.cache_key()
    assert len(set(keys.values())) == len(keys), keys


def test_the_versions_cover_the_compiler_the_runtime_and_the_native_module():
    from spyre_rt.compiler.version import compiler_version
    from spyre_rt.compiler.version import sources as compiler_sources

    from spyre_rt.version import runtime_version
    from spyre_rt.version import sources as runtime_sources

    names = {p.name for p in runtime_sources()}
    assert {"executable.py", "tiling.py", "layout.py", "transfer.py", "plan.py"} <= names
    assert any(n.startswith("_native") for n in names)
    assert {"describe.py", "lowering.py", "wrapper.py"} <= {p.name for p in compiler_sources()}
    assert compiler_version() != runtime_version()


ARENA_SCRIPT = textwrap.dedent("""
    import json, torch, spyre_rt
    from spyre_rt import executor as step
    def f(x, w):
        h = x @ w
        a, b, c = torch.relu(h), torch.sigmoid(h), torch.tanh(h)
        return (a @ w.t()) + (b @ w.t()) + (c @ w.t()) + h.cumsum(-1)
    torch.compile(f, backend="spyre_rt", dynamic=False)(torch.randn(64, 128).to("spyre"),
                                                         torch.randn(128, 128).to("spyre"))
    exe = [e for s in step.live_steps() for e in s.executables()][0]
    print(json.dumps([exe.bindings.arena_bytes, sorted(exe.bindings.relocs.items()), exe.cache_key()]))
""")


def test_the_memory_plan_is_the_same_in_every_process(tmp_path):
    """Two processes with the same step and the same plan key lay out the same arena (it
    once followed set iteration order, which differs with the hash seed: a plan file from
    one process then met another process's offsets under one key)."""
    plans = set()
    for seed in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed, SPYRE_RT_CACHE="0")
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", ARENA_SCRIPT], capture_output=True,
                             text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        plans.add(out.stdout.strip().splitlines()[-1])
    assert len(plans) == 1
