"""The CPU fallback: any aten op without a spyre kernel runs on the host.

Spyre arguments are copied to the host, the op runs on the CPU, arguments the op writes
(in-place and ``out=``) are written back and new results are uploaded. Each op warns once
(:class:`SpyreFallbackWarning`, naming it) and every call is counted, so a model runs,
slowly but correctly, before it is compiled. View ops keep aliasing: their geometry is
computed on meta tensors and applied to the real input with ``as_strided``.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter

import torch

from . import capture, errors, host_ops, tensors
from . import card as cards

aten = torch.ops.aten


class SpyreFallbackWarning(UserWarning):
    """An op ran on the CPU because the card has no kernel for it."""


calls: Counter[str] = Counter()     # eager calls that ran on the CPU, by op
in_steps: Counter[str] = Counter()  # CPU ops run inside compiled steps, by op (compiler.step)
_warned: set[str] = set()
_lock = threading.Lock()


def _is_spyre(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "spyre"


class _Schema:
    """What the fallback needs from an op's schema, computed once per overload."""

    __slots__ = ("name", "is_view", "arg_names", "written", "kw_out", "tensor_args")

    def __init__(self, op):
        s = op._schema
        self.name = op.name()
        self.is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in s.returns)
        self.arg_names = [a.name for a in s.arguments]
        self.written = [a.name for a in s.arguments if a.alias_info is not None and a.alias_info.is_write]
        self.kw_out = {a.name for a in s.arguments
                       if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write}
        # (position, name) of the Tensor and Tensor? parameters: where a wrapped number may come
        self.tensor_args = tuple((i, a.name) for i, a in enumerate(s.arguments) if _is_tensor_type(a.type))

    def number_for_tensor(self, args, kwargs) -> bool:
        """Whether a Tensor parameter holds a Python number. A scalar the caller passed
        reaches a Tensor overload as a *wrapped number* (``x % 4`` is remainder.Scalar, which
        calls remainder.Tensor with 4 wrapped), and the boxed fallback receives it as a
        plain number, which the Tensor overload then refuses."""
        for i, name in self.tensor_args:
            v = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(v, (bool, int, float, complex)):
                return True
        return False


def _is_tensor_type(t) -> bool:
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch._C.TensorType)


_schemas: dict = {}


def _schema(op) -> _Schema:
    sc = _schemas.get(op)
    if sc is None:
        sc = _schemas[op] = _Schema(op)
    return sc


class _Call:
    """Host copies of one call's spyre arguments. Methods rather than nested closures: a
    recursive closure would form a reference cycle holding device tensors until GC."""

    __slots__ = ("device", "host", "origin")

    def __init__(self, device: torch.device):
        self.device = device
        self.host: dict[int, torch.Tensor] = {}    # id(spyre tensor) -> host copy
        self.origin: dict[int, torch.Tensor] = {}  # id(host copy) -> spyre tensor

    def _remember(self, t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        self.host[id(t)] = h
        self.origin[id(h)] = t
        return h

    def down(self, v):
        if _is_spyre(v):
            h = self.host.get(id(v))
            return h if h is not None else self._remember(v, tensors.to_host(v))
        if isinstance(v, (list, tuple)):
            return type(v)(self.down(e) for e in v)
        if isinstance(v, torch.device) and v.type == "spyre":
            return torch.device("cpu")
        return v

    def down_out(self, v, read_ids: set[int]):
        """out= tensors are only written: give the op empty host tensors, no download."""
        if _is_spyre(v) and id(v) not in read_ids and id(v) not in self.host:
            return self._remember(v, torch.empty_strided(v.shape, v.stride(), dtype=v.dtype))
        if isinstance(v, (list, tuple)):
            return type(v)(self.down_out(e, read_ids) for e in v)
        return self.down(v)

    def up(self, o):
        if isinstance(o, torch.Tensor):
            src = self.origin.get(id(o))
            if src is not None:  # the op returned an argument it mutated
                return src
            return o.to(self.device)
        if isinstance(o, (list, tuple)):
            return type(o)(self.up(e) for e in o)
        return o


def _device_of(args, kwargs) -> torch.device:
    found, host = None, None
    stack = list(args) + list(kwargs.values())
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() > 0:
            host = v  # like CUDA ops: CPU tensors are accepted only as 0-d scalars
        elif _is_spyre(v):
            if found is None:
                found = v.device
            elif v.device != found:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices, "
                    f"{found} and {v.device}!"
                )
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    if found is not None and host is not None:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, {found} and cpu!"
        )
    if found is None:
        found = torch.device("spyre", tensors.device_index(kwargs.get("device")))
    return found


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(n, dtype=t.dtype, device="meta").as_strided(t.shape, t.stride(), t.storage_offset())


def _metas(v):
    if _is_spyre(v):
        return _meta_like(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_metas(e) for e in v)
    return v


def _restride(o, src):
    if isinstance(o, torch.Tensor):
        return aten.as_strided.default(src, o.shape, o.stride(), o.storage_offset())
    if isinstance(o, (list, tuple)):
        return type(o)(_restride(e, src) for e in o)
    return o


def forget_warnings(op: str) -> None:
    """Warn again about ops whose name contains `op` (each warns once per process)."""
    with _lock:
        _warned.difference_update({w for w in _warned if op in w})
    errors.forget_warnings(op)  # and the warnings of CPU ops inside compiled steps


def _note(name: str) -> None:
    with _lock:
        calls[name] += 1
        first = name not in _warned
        _warned.add(name)
    if first:
        warnings.warn(
            f"spyre: {name} has no device kernel and runs on the CPU (correct, but slow; "
            "compile the model with torch.compile(backend='spyre_rt') to run it on the card)",
            SpyreFallbackWarning,
            stacklevel=3,
        )


# An eager op on the card can run inside a function torch.compile is running (after a graph
# break): Dynamo must not trace the fallback itself, whose copies are the op's meaning.
@torch._dynamo.disable
def run_on_cpu(op, *args, **kwargs):
    """Run `op` on the host with spyre arguments copied down and results copied up."""
    sc = _schema(op)
    if sc.is_view:
        view = _view_on_meta(op, args, kwargs)
        if view is not None:
            _note(sc.name)
            return view
    if capture.capturing:
        capture.refuse(f"{sc.name} (no device kernel: it runs on the CPU)")
    _note(sc.name)
    device = _device_of(args, kwargs)
    return cards.get(tensors.device_index(device)).on_cpu(sc.name, _run_on_cpu, sc, op, device, args, kwargs)


def _run_on_cpu(sc: _Schema, op, device: torch.device, args, kwargs):
    call = _Call(device)  # on a timing-mode card the inputs read as zeros
    read_ids = {id(a) for a in args}
    host_args = [call.down(a) for a in args]
    host_kwargs = {k: (call.down_out(v, read_ids) if k in sc.kw_out else call.down(v)) for k, v in kwargs.items()}
    if sc.number_for_tensor(host_args, host_kwargs):
        # The op's overload packet picks the overload that takes the number as a Scalar,
        # which on the CPU wraps it again: the same promotion as the caller's own call.
        result = op.overloadpacket(*host_args, **host_kwargs)
    else:
        result = host_ops.cpu_kernel(op)(*host_args, **host_kwargs)
    bound = dict(zip(sc.arg_names, args, strict=False)) | kwargs
    host_bound = dict(zip(sc.arg_names, host_args, strict=False)) | host_kwargs
    for name in sc.written:
        if name not in bound:
            continue
        orig, host = bound[name], host_bound[name]
        pairs = zip(orig, host, strict=True) if isinstance(orig, (list, tuple)) else [(orig, host)]
        for o, h in pairs:
            if _is_spyre(o):
                if tuple(o.shape) != tuple(h.shape):
                    o.resize_(h.shape)
                tensors.upload(h, o)
    return call.up(result)


def _view_on_meta(op, args, kwargs):
    """A view op applied to the real input with the geometry it has on meta tensors, or
    None when that cannot keep the aliasing (no meta kernel, or a dtype-changing view)."""
    src = next((a for a in args if _is_spyre(a)), None)
    if src is None:
        return None
    try:
        out = op(*_metas(list(args)), **{k: _metas(v) for k, v in kwargs.items()})
    except Exception:
        return None
    if any(o.dtype != src.dtype for o in _flat(out)):
        return None
    return _restride(out, src)


def _flat(o):
    if isinstance(o, torch.Tensor):
        return [o]
    if isinstance(o, (list, tuple)):
        return [t for e in o for t in _flat(e)]
    return []


_library: torch.library.Library | None = None


def register() -> None:
    global _library
    if _library is None:
        lib = torch.library.Library("_", "IMPL")
        lib.fallback(run_on_cpu, "PrivateUse1")
        _library = lib
