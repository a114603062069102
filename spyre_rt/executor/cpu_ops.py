"""Ops the card cannot run, run on the host inside a compiled step.

The op's buffer arguments are copied down from the card, it runs on the CPU, and its
results are copied up into the step's buffers (warning once per op and where it came
from). Their transfers follow the step's dispatch mode.
"""

from __future__ import annotations

import torch

from .. import fallback
from ..dispatch import DispatchMode
from ..dtypes import torch_dtype
from ..errors import warn_once
from ..kernels import CpuOp
from ..transfer import ViewGeometry, from_device, to_device

# The torch constants a CPU op's arguments may name (never getattr on a name read from disk).
_TORCH_CONSTANTS = {str(c).removeprefix("torch."): c for c in (
    torch.strided, torch.sparse_coo, torch.contiguous_format, torch.channels_last, torch.preserve_format)}

def resolve(name: str):
    """``"aten.cumsum.default"`` -> ``torch.ops.aten.cumsum.default``."""
    ns, rest = name.split(".", 1)
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), packet), overload or "default")


class CpuOps:
    """The CPU ops of one executable: where their buffers are, and running them."""

    def __init__(self, exe):
        self.exe = exe
        self._ops: dict[str, object] = {}  # op name -> the torch op, resolved once

    def _geometry(self, name: str, view=None) -> tuple[ViewGeometry, tuple[int, int]]:
        exe = self.exe
        base = exe.base_of(name)
        b_idx, off = exe.relocs[name]
        if view is None:
            b = exe.buffer(name)
            view = (name, b.offset, b.sizes, b.strides)
        _, voff, sizes, strides = view
        return ViewGeometry(exe.layouts[base], exe.offsets[name] + voff, tuple(sizes), tuple(strides)), (b_idx, off)

    def run(self, op: CpuOp, table, mode: DispatchMode):
        exe = self.exe
        if not exe.card.functional:
            warn_once(op.op, "runs on zeros in timing mode (values are not simulated)")
        if not op.host:  # work eager does on the CPU too is no fallback
            fallback.in_steps[op.op] += 1
            warn_once(op.op, f"runs on the CPU inside a compiled step ({op.source})", fallback.SpyreFallbackWarning)
        prebuilt = mode.prebuilt_transfers

        def fetch(ref, as_dtype: str | None):
            name, _, sizes, strides = ref
            geo, (b, o) = self._geometry(name, ref)
            dtype = torch_dtype(exe.buffer(name).dtype)
            if not exe.card.functional:
                value = torch.zeros(sizes, dtype=dtype).as_strided(sizes, strides) if sizes else torch.zeros((), dtype=dtype)
            else:
                value = from_device(exe.card, geo, table[b] + o, dtype, prebuilt)
            if as_dtype and torch_dtype(as_dtype) != dtype:  # a view of the buffer's bits as another dtype
                value = value.view(torch_dtype(as_dtype))
            return value

        def decode(a):
            if isinstance(a, dict) and "buf" in a:
                return fetch(a["buf"], a.get("as"))
            if isinstance(a, dict) and "dtype" in a:
                return torch_dtype(a["dtype"])
            if isinstance(a, dict) and "device" in a:
                return torch.device("cpu")
            if isinstance(a, dict) and "torch" in a:  # a layout or memory format
                return _TORCH_CONSTANTS[a["torch"]]
            if isinstance(a, (list, tuple)):
                return [decode(x) for x in a]
            return a

        fn = self._ops.get(op.op)
        if fn is None:
            fn = self._ops[op.op] = resolve(op.op)
        result = fn(*decode(op.args), **{k: decode(v) for k, v in op.kwargs.items()})
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        for out, value in zip(op.outputs, results, strict=False):
            self.upload(out.name, value, table, mode)
        return result

    def upload(self, name: str, value: torch.Tensor, table, mode: DispatchMode) -> None:
        geo, (b, o) = self._geometry(name)
        value = value.to(torch_dtype(self.exe.buffer(name).dtype)).expand(geo.sizes)
        to_device(self.exe.card, value, geo, table[b] + o, mode.prebuilt_transfers)
