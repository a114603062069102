"""Ops the card cannot run, run on the host inside a compiled step.

An op is called as its schema says. Its tensor arguments are copied down from the card
(an ``out=`` argument, which it only writes, is handed over as empty host memory), it runs
on the CPU, every argument its schema marks as written (in-place, a custom op's
``mutates_args``, ``out=``) is copied back into the view of the card's buffer it came
from, and its results are copied up into the step's buffers; all of it before the step's
next segment reads them. Arguments that are views of one buffer, when the op writes any of
them, share one host copy of the part of the buffer they span, so the op sees the aliasing
it would see in eager. Every copy follows the step's dispatch mode (prebuilt transfer
graphs or one built per copy). Each op warns once, naming itself and its model line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import fallback, host_ops
from ..dispatch import DispatchMode
from ..dtypes import torch_dtype
from ..errors import warn_once
from ..ir import TORCH_CONSTANT_NAMES, CpuOp
from ..transfer import ViewGeometry, empty_host, from_device, to_device
from .bindings import Bindings

# The torch constants a CPU op's arguments may name, by the names descriptions use (never
# getattr on a name read from disk).
TORCH_CONSTANTS = {name: getattr(torch, name) for name in TORCH_CONSTANT_NAMES}


def resolve(name: str):
    """``"aten.cumsum.default"`` -> ``torch.ops.aten.cumsum.default``."""
    ns, rest = name.split(".", 1)
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")


def _key(ref: dict) -> tuple:
    name, off, sizes, strides = ref["buf"]
    return name, off, tuple(sizes), tuple(strides), ref.get("as") or ""


@dataclass
class _Source:
    """One region of a card buffer copied to the host for a call: a tensor argument's
    view, or the span of several views of one buffer that must alias on the host."""

    geometry: ViewGeometry
    reloc: tuple[int, int]   # (binding, byte offset) of the buffer
    dtype: torch.dtype
    read: bool               # its values are read (else only written: no copy down)
    written: bool            # copied back after the op


@dataclass(frozen=True)
class _Arg:
    """How a tensor argument is made from its source's host copy: the source itself, or
    ``as_strided`` of its span; then seen as `as_dtype` if that differs."""

    source: int
    strided: tuple | None    # (sizes, strides, offset into the span)
    as_dtype: torch.dtype | None


class _Plan:
    """The host copies one CPU op makes at every call (the same for every call of an
    executable: they depend on the op and the buffers' geometry only)."""

    def __init__(self, bindings: Bindings, op: CpuOp):
        self.sources: list[_Source] = []
        self.args: dict[tuple, _Arg] = {}
        refs: dict[tuple, dict] = {}  # distinct tensor arguments, with their flags merged
        for ref in op.tensor_args():
            k = _key(ref)
            seen = refs.get(k)
            if seen is None:
                refs[k] = {"buf": ref["buf"], "as": ref.get("as"), "write": bool(ref.get("write")),
                           "out": bool(ref.get("out"))}
            else:  # the same view twice: one host tensor, written if either is, read unless both are out=
                seen["write"] = seen["write"] or bool(ref.get("write"))
                seen["out"] = seen["out"] and bool(ref.get("out"))
        by_base: dict[str, list[tuple]] = {}
        for k, ref in refs.items():
            by_base.setdefault(bindings.base_of(ref["buf"][0]), []).append(k)
        for base, keys in by_base.items():
            dtype = torch_dtype(bindings.buffer(base).dtype)
            shared = [k for k in keys if _numel(refs[k]) and _itemsize(refs[k], dtype) == dtype.itemsize]
            if len(shared) > 1 and any(refs[k]["write"] for k in shared):
                self._span(bindings, base, dtype, [refs[k] for k in shared], shared)
                keys = [k for k in keys if k not in shared]
            for k in keys:
                self._single(bindings, dtype, refs[k], k)

    def _single(self, bindings: Bindings, dtype: torch.dtype, ref: dict, key: tuple) -> None:
        name, off, sizes, strides = ref["buf"]
        geometry = ViewGeometry(bindings.layouts[bindings.base_of(name)], bindings.offsets[name] + off, tuple(sizes),
                                tuple(strides))
        self.sources.append(_Source(geometry, bindings.relocs[name], dtype, not ref["out"], ref["write"]))
        self.args[key] = _Arg(len(self.sources) - 1, None, _viewed_as(ref, dtype))

    def _span(self, bindings: Bindings, base: str, dtype: torch.dtype, refs: list[dict], keys: list[tuple]) -> None:
        """One host copy of the elements [lo, hi) of `base` that the views cover, each
        view an ``as_strided`` of it."""
        starts = [bindings.offsets[r["buf"][0]] + r["buf"][1] for r in refs]
        ends = [s + sum((n - 1) * st for n, st in zip(r["buf"][2], r["buf"][3], strict=True)) + 1
                for s, r in zip(starts, refs, strict=True)]
        lo, hi = min(starts), max(ends)
        geometry = ViewGeometry(bindings.layouts[base], lo, (hi - lo,), (1,))
        self.sources.append(_Source(geometry, bindings.relocs[base], dtype, not all(r["out"] for r in refs), True))
        for key, ref, start in zip(keys, refs, starts, strict=True):
            _, _, sizes, strides = ref["buf"]
            self.args[key] = _Arg(len(self.sources) - 1, (tuple(sizes), tuple(strides), start - lo),
                                  _viewed_as(ref, dtype))


def _numel(ref: dict) -> int:
    return math.prod(ref["buf"][2])


def _itemsize(ref: dict, dtype: torch.dtype) -> int:
    return torch_dtype(ref["as"]).itemsize if ref.get("as") else dtype.itemsize


def _viewed_as(ref: dict, dtype: torch.dtype) -> torch.dtype | None:
    seen = torch_dtype(ref["as"]) if ref.get("as") else dtype
    return seen if seen != dtype else None


class CpuOps:
    """The CPU ops of one executable: where their buffers are, and running them."""

    def __init__(self, card, bindings: Bindings):
        self.card, self.bindings = card, bindings
        self._ops: dict[str, object] = {}  # op name -> the torch op, resolved once
        self._plans: dict[str, _Plan] = {}  # CpuOp name -> its host copies

    def _plan(self, op: CpuOp) -> _Plan:
        plan = self._plans.get(op.name)
        if plan is None:
            plan = self._plans[op.name] = _Plan(self.bindings, op)
        return plan

    def run(self, op: CpuOp, table, mode: DispatchMode):
        card = self.card
        functional = card.functional
        if not functional:
            warn_once(op.op, "runs on zeros in timing mode (values are not simulated)")
        if not op.host:  # work eager does on the CPU too is no fallback
            fallback.in_steps[op.op] += 1
            warn_once(op.op, f"runs on the CPU inside a compiled step ({op.source})", fallback.SpyreFallbackWarning)
        prebuilt = mode.prebuilt_transfers
        plan = self._plan(op)

        copies = []
        for src in plan.sources:
            b, o = src.reloc
            if src.read and functional:
                copies.append(from_device(card, src.geometry, table[b] + o, src.dtype, prebuilt))
            else:  # only written, or a timing-mode card (which keeps no values)
                host = empty_host(src.geometry, src.dtype)
                copies.append(host if functional else host.zero_())

        def tensor(ref: dict) -> torch.Tensor:
            arg = plan.args[_key(ref)]
            value = copies[arg.source]
            if arg.strided is not None:
                value = value.as_strided(*arg.strided)
            return value.view(arg.as_dtype) if arg.as_dtype is not None else value

        def decode(a):
            if isinstance(a, dict) and "buf" in a:
                return tensor(a)
            if isinstance(a, dict) and "dtype" in a:
                return torch_dtype(a["dtype"])
            if isinstance(a, dict) and "device" in a:
                return torch.device("cpu")
            if isinstance(a, dict) and "torch" in a:  # a layout or memory format
                return TORCH_CONSTANTS[a["torch"]]
            if isinstance(a, (list, tuple)):
                return [decode(x) for x in a]
            return a

        fn = self._ops.get(op.op)
        if fn is None:
            fn = self._ops[op.op] = host_ops.cpu_kernel(resolve(op.op))
        result = fn(*decode(op.args), **{k: decode(v) for k, v in op.kwargs.items()})
        for src, host in zip(plan.sources, copies, strict=True):
            if src.written:  # the op wrote it in place: back into the view it came from
                b, o = src.reloc
                to_device(card, host, src.geometry, table[b] + o, prebuilt)
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        for out, value in zip(op.outputs, results, strict=False):
            self.upload(out.name, value, table, mode)
        return result

    def upload(self, name: str, value: torch.Tensor, table, mode: DispatchMode) -> None:
        bindings = self.bindings
        b = bindings.buffer(name)
        offset = bindings.offsets[name] + (0 if name in bindings.aliases else b.offset)  # an alias's is in offsets
        geo = ViewGeometry(bindings.layouts[bindings.base_of(name)], offset, tuple(b.sizes), tuple(b.strides))
        value = value.to(torch_dtype(b.dtype)).expand(geo.sizes)
        to_device(self.card, value, geo, bindings.address(table, name), mode.prebuilt_transfers)
