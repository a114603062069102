"""Explicit aten kernels of the ``spyre`` (PrivateUse1) dispatch key.

Allocation, copies and fills touch device memory through the runtime. View and metadata
ops only edit sizes, strides, offsets and storage pointers, so they redispatch to the CPU
kernels, which never read the data: the results keep the spyre storage. Everything else
reaches the CPU fallback (:mod:`spyre_rt.fallback`) or runs compiled.
"""

from __future__ import annotations

import torch
from torch._C import DispatchKey, DispatchKeySet

from . import capture, tensors
from .layout import storage_numel

aten = torch.ops.aten
_CPU = DispatchKeySet(DispatchKey.CPU)
_KERNELS: dict[str, object] = {}

def _kernel(*names: str):
    def deco(fn):
        for n in names:
            _KERNELS[n] = fn
        return fn

    return deco


def _contiguous_strides(sizes) -> list[int]:
    strides, acc = [], 1
    for s in reversed(list(sizes)):
        strides.append(acc)
        acc *= max(int(s), 1)
    return strides[::-1]


def _strides_for(sizes, memory_format) -> list[int]:
    if memory_format in (None, torch.contiguous_format, torch.preserve_format):
        return _contiguous_strides(sizes)
    return list(torch.empty(sizes, memory_format=memory_format, device="meta").stride())


@_kernel("empty.memory_format")
def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    if layout not in (None, torch.strided):
        raise RuntimeError(f"spyre tensors are strided; layout {layout} is not supported")
    return tensors.empty_strided(size, _strides_for(size, memory_format), dtype, device)


@_kernel("empty_strided")
def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    if layout not in (None, torch.strided):
        raise RuntimeError(f"spyre tensors are strided; layout {layout} is not supported")
    return tensors.empty_strided(size, stride, dtype, device)


@_kernel("_copy_from")
def _copy_from(self, dst, non_blocking=False):
    return tensors.copy(dst, self)


@_kernel("_copy_from_and_resize")
def _copy_from_and_resize(self, dst):
    if tuple(dst.shape) != tuple(self.shape):
        dst.resize_(self.shape)
    return tensors.copy(dst, self)


@_kernel("_to_copy")
def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    # A copy off the card has completed when the call returns, so non_blocking changes
    # nothing; torch would give a non-blocking copy to the host a pinned result, which a
    # Python backend cannot allocate (no pinned allocator: spyre_rt/accelerator.py).
    return aten._to_copy.default.redispatch(_CPU, self, dtype=dtype, layout=layout, device=device,
                                            pin_memory=pin_memory, non_blocking=False,
                                            memory_format=memory_format)


@_kernel("_local_scalar_dense")
def _local_scalar_dense(self):
    return tensors.to_host(self).item()


@_kernel("fill_.Scalar")
def _fill_scalar(self, value):
    return tensors.fill(self, value)


@_kernel("fill_.Tensor")
def _fill_tensor(self, value):
    if value.device.type == "spyre":
        value = tensors.to_host(value)
    return tensors.fill(self, value.item())


@_kernel("zero_")
def _zero(self):
    return tensors.fill(self, 0)


@_kernel("resize_")
def _resize(self, size, memory_format=None):
    size = [int(s) for s in size]
    strides = _strides_for(size, memory_format)
    need = storage_numel(size, strides, self.storage_offset())
    if need * self.element_size() <= self.untyped_storage().nbytes():
        return aten.resize_.default.redispatch(_CPU, self, size, memory_format=memory_format)
    # Growing: a new storage holding the old elements, then repoint the tensor at it.
    old = self.untyped_storage()
    old_numel = old.nbytes() // self.element_size()
    fresh = tensors.empty_strided([need], [1], self.dtype, card=tensors.card_of(self))
    if old_numel:
        flat_old = aten.as_strided.default.redispatch(_CPU, self, [old_numel], [1], 0)
        tensors.copy(fresh[:old_numel], flat_old)
    aten.set_.source_Storage_storage_offset.redispatch(
        _CPU, self, fresh.untyped_storage(), self.storage_offset(), size, strides
    )
    capture.swapped()
    return self


# Metadata-only ops: the CPU kernels never touch the data.
_METADATA = ("view", "as_strided", "_reshape_alias", "unfold", "alias")
_STORAGE_SWAPS = ("set_.source_Storage", "set_.source_Storage_storage_offset", "set_.source_Tensor", "set_")


def _redispatch(name: str, swaps: bool = False):
    packet, _, overload = name.partition(".")
    op = getattr(getattr(aten, packet), overload or "default")

    def kernel(*args, **kwargs):
        if swaps:
            capture.swapped()
        return op.redispatch(_CPU, *args, **kwargs)

    kernel.__name__ = "spyre_" + name.replace(".", "_")
    return kernel


for _name in _METADATA:
    _KERNELS[_name] = _redispatch(_name)
for _name in _STORAGE_SWAPS:
    _KERNELS[_name] = _redispatch(_name, swaps=True)


@_kernel("_has_compatible_shallow_copy_type")
def _compatible_shallow_copy(self, from_):
    # `tensor.data = other` asks this before swapping the storage: note the swap.
    capture.swapped()
    return self.device.type == from_.device.type


@_kernel("convolution_overrideable")
def _convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    # The composite default of the *_overrideable ops raises instead of reaching the
    # fallback, so route them to it with the real convolution.
    from .fallback import run_on_cpu

    return run_on_cpu(aten.convolution.default, input, weight, bias, stride, padding, dilation,
                      transposed, output_padding, groups)


@_kernel("convolution_backward_overrideable")
def _convolution_backward(grad_output, input, weight, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask):
    from .fallback import run_on_cpu

    out_channels = weight.size(1) * groups if transposed else weight.size(0)
    bias_sizes = [out_channels] if output_mask[2] else None
    return run_on_cpu(aten.convolution_backward.default, grad_output, input, weight, bias_sizes,
                      stride, padding, dilation, transposed, output_padding, groups, output_mask)


_library: torch.library.Library | None = None


def register() -> None:
    global _library
    if _library is None:
        lib = torch.library.Library("aten", "IMPL", "PrivateUse1")
        for name, fn in _KERNELS.items():
            # an eager op on the card can run inside a function torch.compile is running (a
            # tensor's value read after a graph break, `if x.max() > 0`): Dynamo must not trace
            # the kernel, which reads the card through the native module (as the fallback's)
            lib.impl(name, torch._dynamo.disable(fn))
        _library = lib

