"""Grouped matmuls: matmuls of one A computed as one (``MatmulKernel.parts``).

A decoder layer multiplies its normalized hidden states by the k and the v weights: two
GEMMs of one shape and one A, each too small to keep the card busy from end to end (their
loads at the start and their stores at the end are a fifth of their time at a 1,024-token
prefill, 142 µs each). As one GEMM, over the two weights side by side, their tiles fill the
waves of both: each part keeps its own weight and output (nothing is copied), the tiles
of both run on the cores, and A (with its prologue) is loaded and rewritten once.

The values are those of the matmuls apart, bit for bit: they are grouped only when each
alone would be cut the same way (the same tiling, so the same K chunks and slices add each
dot product in the same order), and the grouped matmul is cut into the tiles of each.
Groups are made only where the cost model says the group is faster than its members one
after another, and only when moving the later members up to the first one's place crosses
nothing that writes what they read or touches what they write.
"""

from __future__ import annotations

import dataclasses

from spyre_rt.construct.context import ScratchpadOverflow
from spyre_rt.construct.matmul import Problem, spec_of
from spyre_rt.construct.matmul.record import grouped_tiling, members
from spyre_rt.construct.matmul.tiling import estimate_one
from spyre_rt.cost import CostModel
from spyre_rt.ir import MatmulKernel, StepDesc

from .fusion import card_target
from .step_buffers import base, touches, writes

MAX_PARTS = 8  # SPY_MM_MAX_PARTS


def group_matmuls(step: StepDesc, target: CostModel | None = None) -> StepDesc:
    """The step with each run of matmuls of one A that can be one computed as one (see the
    module docstring); `target` the card they run on (the current card set's by default)."""
    target = card_target(target)
    kernels = dict(step.kernels)
    seq = list(step.sequence)
    changed = False
    i = 0
    while i < len(seq):
        first = _plain(kernels, seq[i])
        if first is not None:
            group = [i] + [j for j in range(i + 1, len(seq)) if _joins(kernels, seq, first, j)]
            group = _movable(step, kernels, seq, group)[:MAX_PARTS]
            if len(group) > 1 and _faster(target, [kernels[seq[j][1]] for j in group]):
                mates = [kernels[seq[j][1]] for j in group]
                bufs = {b.name: b for m in mates for b in m.buffers}
                kernels[first.name] = dataclasses.replace(
                    first, parts=tuple((m.b, m.out) for m in mates[1:]), buffers=tuple(bufs.values()),
                    origins=tuple(sorted({o for m in mates for o in m.origins})),
                    module=joined_modules([m.module for m in mates]))
                for j in reversed(group[1:]):
                    del kernels[seq[j][1]]
                    del seq[j]
                changed = True
        i += 1
    if not changed:
        return step
    return dataclasses.replace(step, kernels=kernels, sequence=tuple(seq))


def joined_modules(modules: list[str]) -> str:
    """The module path of a group: its members' paths' common prefix and their distinct
    last parts, ``model.layers.3.self_attn.k_proj+v_proj``, so that a profile grouped by
    module names every member of the group (not its first one only)."""
    parts = [m.split(".") if m else [] for m in modules]
    distinct = list(dict.fromkeys(modules))
    if len(distinct) < 2 or not all(parts):
        return distinct[0] if len(distinct) == 1 else "+".join(m for m in distinct if m)
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    tails = list(dict.fromkeys(".".join(p[common:]) for p in parts))
    return ".".join(parts[0][:common] + ["+".join(tails)])


def _plain(kernels: dict, item) -> MatmulKernel | None:
    """The matmul at `item` when it can be a group's member: no epilogue, bias or parts."""
    m = kernels.get(item[1]) if item[0] == "run" else None
    if isinstance(m, MatmulKernel) and m.epilogue is None and m.bias is None and not m.parts:
        return m
    return None


def _joins(kernels: dict, seq: list, first: MatmulKernel, j: int) -> bool:
    m = _plain(kernels, seq[j])
    return (m is not None and m.a == first.a and m.prologue == first.prologue and m.in_dtype == first.in_dtype
            and m.out_dtype == first.out_dtype and m.b[2][:2] == first.b[2][:2] and m.out[2][:2] == first.out[2][:2]
            and (m.b[3][1] == 1) == (first.b[3][1] == 1))  # B read the same way (W.t() or not)


def _movable(step: StepDesc, kernels: dict, seq: list, group: list[int]) -> list[int]:
    """The members that can run at the first one's place: nothing between them and it writes
    what they read or touches what they write (a member left out stays where it is, and
    those after it must not need it moved)."""
    kept = [group[0]]
    for j in group[1:]:
        m = kernels[seq[j][1]]
        reads = {base(step, v[0]) for v in m.views()} - {base(step, m.out[0])}
        out = {base(step, m.out[0])}
        if any(writes(step, kernels, seq[t]) & reads or touches(step, kernels, seq[t]) & out
               for t in range(group[0] + 1, j) if t not in kept):
            continue
        kept.append(j)
    return kept


def _faster(target: CostModel, mates: list[MatmulKernel]) -> bool:
    """Whether the members are cut alike and, by the cost model, faster as one."""
    grouped = spec_of(dataclasses.replace(mates[0], parts=tuple((m.b, m.out) for m in mates[1:])))
    try:
        t = grouped_tiling(target, grouped)
        if t is None:
            return False
        alone = sum(estimate_one(target, Problem.of(s), dataclasses.replace(t, n_tiles=t.n_tiles // len(mates)))
                    for s in members(grouped))
        return estimate_one(target, Problem.of(grouped), t) < alone
    except ScratchpadOverflow:
        return False
