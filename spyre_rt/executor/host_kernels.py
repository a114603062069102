"""Kernels of a step that construction refused for the card, run on the host.

The compiler builds every kernel of a static step when it compiles it and gives a kernel
construction refuses back to Inductor, whose ops then run as CPU fallbacks. What it could
not foresee shows at the first call of an executable (another input geometry than the
compile predicted, a size of a dynamic-shape step): the executor constructs every kernel
before any runs, and a kernel construction refuses then runs here, from its description
(:mod:`spyre_rt.reference`), with a one-time warning naming its ops and model line. Its
buffers are copied down from the card, computed on, and the ones it writes copied back,
with the transfers of the step's dispatch mode (in timing mode it computes on zeros and
copies its results up, as a CPU op does).
"""

from __future__ import annotations

import torch

from .. import fallback, reference
from ..dispatch import DispatchMode
from ..dtypes import torch_dtype
from ..errors import warn_once
from ..transfer import ViewGeometry, from_device, to_device
from .bindings import Bindings


class HostKernels:
    """The refused kernels of one executable: why each was refused, and running them."""

    def __init__(self, card, bindings: Bindings, kernels: dict, sources: dict[str, str]):
        self.card, self.bindings, self.kernels, self.sources = card, bindings, kernels, sources
        self.reasons: dict[str, str] = {}  # kernel name -> what construction said

    def __contains__(self, name: str) -> bool:
        return name in self.reasons

    def add(self, name: str, reason: str) -> None:
        self.reasons[name] = reason

    def ops_of(self, name: str) -> list[str]:
        kernel = self.kernels[name]
        return list(getattr(kernel, "origins", ())) or [name]

    def source_of(self, name: str) -> str:
        """'op (file:line of the model code)' of the kernel, as the compiler recorded it."""
        return self.sources.get(name, "") or ", ".join(self.ops_of(name))

    def run(self, name: str, table, mode: DispatchMode) -> None:
        bindings, card = self.bindings, self.card
        kernel = self.kernels[name]
        for op in self.ops_of(name):
            fallback.in_steps[op] += 1
        warn_once(", ".join(self.ops_of(name)),
                  f"runs on the CPU inside a compiled step ({self.source_of(name)}): the card's construction "
                  f"refused its kernel {name} ({self.reasons[name]})", fallback.SpyreFallbackWarning)
        functional = card.functional
        if not functional:
            warn_once(", ".join(self.ops_of(name)), "runs on zeros in timing mode (values are not simulated)")
        prebuilt = mode.prebuilt_transfers
        storages = self._storages(kernel)
        memory = {}
        fetched = {}
        for key, (lo, hi) in storages.items():
            base, dtype = key
            view = ViewGeometry(bindings.layouts[base], lo, (hi - lo,), (1,))
            address = bindings.address(table, base)
            value = from_device(card, view, address, torch_dtype(dtype), prebuilt) if functional else \
                torch.zeros(hi - lo, dtype=torch_dtype(dtype))  # as a CPU op does: no values to copy down
            fetched[key] = (view, address, value)
        for b in kernel.buffers:
            key = (bindings.base_of(b.name), b.dtype)
            memory[b.name] = reference.Place(fetched[key][2], bindings.offsets[b.name] - storages[key][0])
        reference.run(kernel, memory)
        written = {(bindings.base_of(n), bindings.buffer(n).dtype) for n in reference.written(kernel)}
        for key in written:
            view, address, value = fetched[key]
            to_device(card, value, view, address, prebuilt)

    def _storages(self, kernel) -> dict[tuple[str, str], tuple[int, int]]:
        """Per (storage, dtype) the kernel reads or writes: the logical elements [lo, hi) of
        the storage it touches, in whole rows of its stick layout."""
        bindings = self.bindings
        spans = reference.extents(kernel)
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for b in kernel.buffers:
            base = bindings.base_of(b.name)
            layout = bindings.layouts[base]
            span = spans.get(b.name, (0, 0))
            start = bindings.offsets[b.name]
            lo, hi = (0, layout.numel) if span is None else (start + span[0], start + span[1])
            lo, hi = max(0, lo), min(layout.numel, max(hi, lo + 1))
            row = layout.row_len
            lo, hi = lo // row * row, min(layout.numel, -(-hi // row) * row)
            key = (base, b.dtype)
            if key in out:
                lo, hi = min(lo, out[key][0]), max(hi, out[key][1])
            out[key] = (lo, hi)
        return out
