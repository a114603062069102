"""A symbolic step's description made concrete for sizes (spyre_rt.compiler.specialize):
the specializer, made once per step, walks only what depends on the sizes and gives what a
walk of the whole description gives."""

from __future__ import annotations

import dataclasses

from spyre_rt.compiler import describe as d
from spyre_rt.compiler.specialize import specializer

from spyre_rt.ir import Access, Buffer, Op, StepDesc, View


def walked(x, env):
    """Every part of `x` rebuilt, sizes replaced and recorded kernels described: the
    definition the specializer keeps to."""
    if isinstance(x, d.Sym):
        return d.value(x, env)
    if isinstance(x, d.RecordedKernel):
        return d.describe(x, env)
    if isinstance(x, tuple):
        return tuple(walked(v, env) for v in x)
    if isinstance(x, list):
        return [walked(v, env) for v in x]
    if isinstance(x, dict):
        return {k: walked(v, env) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: walked(getattr(x, f.name), env)
                                         for f in dataclasses.fields(x) if f.init})
    return x


def _recorded() -> d.RecordedKernel:
    x = d.loop_symbols("n0_", 1)[0]
    ops = ({"op": "load", "id": "l", "buf": "a", "index": x},
           {"op": "exp", "id": "e", "args": ["l"]},
           {"op": "store", "id": "s", "args": ["e"], "buf": "out", "index": x})
    n = d.Sym("4*s0")
    buffers = {b: Buffer(b, "float32", (n,), (1,)) for b in ("a", "out")}
    return d.RecordedKernel("k0", (d.RecordedNode((n,), (), ops),), n, 1, (), buffers)


def _desc() -> StepDesc:
    s0 = d.Sym("s0")
    fixed = Buffer("w", "float32", (64, 8), (8, 1))
    return StepDesc(
        inputs=((Buffer("x", "float32", (s0, 8), (8, 1)), False), (fixed, False)),
        outputs=(View("y", 0, (s0, 8), (8, 1)), View("w", 0, (64, 8), (8, 1)), {"int": s0}),
        buffers={"y": Buffer("y", "float32", (s0, 8), (8, 1)), "z": fixed},
        aliases={"v": ("y", 0, (s0,), (8,))},
        constants={"c": Buffer("c", "float32", (4,), (1,))},
        kernels={"k0": _recorded(), "k1": Op("o", "constant", (), "float32", Access("y", 0, (1,)), {"value": 1.0})},
        sequence=(("run", "k0"), ("run", "k1")),
        options={"fuse_epilogues": True, "lists": [1, [2, s0]]},
        sources={"k0": "exp (model.py:1)"})


def test_a_specialized_description_is_the_whole_walk_of_it():
    desc = _desc()
    make = specializer(desc)
    for n in (1, 2, 7, 64):
        env = {"s0": n}
        assert make(env) == walked(desc, env)


def test_what_may_change_is_each_concrete_steps_own_and_named_tuples_are_plain():
    desc = _desc()
    make = specializer(desc)
    one, two = make({"s0": 3}), make({"s0": 3})
    assert one.options is not desc.options and one.options is not two.options
    assert one.options["lists"] is not two.options["lists"]
    assert one.kernels["k1"].attrs is not desc.kernels["k1"].attrs  # an op's attributes are a dict
    assert [type(v) for v in one.outputs] == [tuple, tuple, dict]  # as the walk makes them
    assert one.outputs == walked(desc, {"s0": 3}).outputs


def test_a_part_without_sizes_and_without_dicts_or_lists_is_its_own():
    fixed = Buffer("w", "float32", (64, 8), (8, 1))
    assert specializer(fixed) is None
    assert specializer(((fixed, 1), "x")) is None
    assert specializer(Buffer("x", "float32", (d.Sym("s0"),), (1,)))({"s0": 5}) == Buffer("x", "float32", (5,), (1,))
