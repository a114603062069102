"""Steps with dynamic shapes: one compile, a concrete step per distinct size.

A graph Dynamo traced with symbolic sizes is lowered by Inductor once; its step
description keeps sizes as expressions of the size symbols and its fused groups as
recorded bodies. At a call, the symbols' values are read off the arguments (an int
argument, or a size or stride of a tensor); the first call with new values describes every
kernel for them (:func:`specializer`) and makes a concrete
:class:`~spyre_rt.executor.CompiledStep`, whose plans are then built, or loaded from the
plan cache, as any step's are. So a new size costs a plan build, not a compile, as CUDA
graph trees record a graph per shape.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

from spyre_rt import config
from spyre_rt.executor import CompiledStep
from spyre_rt.executor.step import adopted
from spyre_rt.ir import StepDesc, from_json

from .describe import RecordedKernel, Sym, describe, value
from .fusion import fuse_kernels


def specializer(x) -> Callable[[Mapping[str, int]], Any] | None:
    """A function of the size symbols' values that makes `x` for them: every symbol
    replaced by its value and every recorded kernel described for them. None when `x` is
    its own: nothing in it depends on the symbols and nothing in it can change (no dict or
    list, which each concrete step gets a copy of). Made once per symbolic step, so that a
    new size walks only what depends on it."""
    if isinstance(x, Sym):
        return functools.partial(value, x)
    if isinstance(x, RecordedKernel):
        return functools.partial(describe, x)
    if isinstance(x, (tuple, list)):
        parts = [(specializer(v), v) for v in x]
        if type(x) is tuple and not any(f for f, _ in parts):
            return None
        make = list if isinstance(x, list) else tuple  # a named tuple becomes a plain one
        return lambda env: make(f(env) if f else v for f, v in parts)
    if isinstance(x, dict):
        items = [(k, specializer(v), v) for k, v in x.items()]
        return lambda env: {k: f(env) if f else v for k, f, v in items}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = [(f.name, specializer(getattr(x, f.name)), getattr(x, f.name))
                  for f in dataclasses.fields(x) if f.init]
        if x.__dataclass_params__.frozen and not any(f for _, f, _ in fields):
            return None
        return lambda env: dataclasses.replace(x, **{name: f(env) if f else v for name, f, v in fields})
    return None


class SymbolicStep:
    """A compiled step with dynamic shapes: concrete steps made per distinct size."""

    def __init__(self, desc: StepDesc, digest: str, settings: config.Settings):
        self.desc = desc
        self.digest = digest
        self.settings = settings  # the compile's, carried by every concrete step
        self.symbols = desc.symbols
        self.int_args = {position for _, kind, position, _ in desc.symbols if kind == "int"}
        self._steps: dict[tuple, CompiledStep] = {}
        fixed = dataclasses.replace(desc, symbols=())
        self._concrete = specializer(fixed) or (lambda env: fixed)
        self._lock = threading.Lock()

    def sizes(self, args: list) -> dict[str, int]:
        """The value of every size symbol in this call."""
        env = {}
        for name, kind, position, dim in self.symbols:
            a = args[position]
            env[name] = int(a) if kind == "int" else int(a.size(dim) if kind == "size" else a.stride(dim))
        return env

    def steps(self) -> list[CompiledStep]:
        """The concrete steps made so far (one per distinct size)."""
        return list(self._steps.values())

    def step_for(self, env: Mapping[str, int]) -> CompiledStep:
        key = tuple(sorted(env.items()))
        step = self._steps.get(key)
        if step is None:
            with self._lock:
                step = self._steps.get(key)
                if step is None:
                    concrete = self._concrete(env)
                    concrete = fuse_kernels(concrete)
                    digest = hashlib.sha256(f"{self.digest}{key}".encode()).hexdigest()
                    step = self._steps[key] = CompiledStep(concrete, digest, family=(self.digest, dict(env)),
                                                                 settings=self.settings)
        return step

    def __call__(self, args: list, module_globals: dict):
        env = self.sizes(args)
        tensors = [a for i, a in enumerate(args) if i not in self.int_args]
        args.clear()  # boxed calling convention: drop the caller's references early
        return self.step_for(env)(tensors, module_globals)


def load_step(text: str, settings: dict | None = None):
    """The step a compiled module embeds as JSON, with the settings its compile resolved:
    symbolic, or concrete as any static one."""
    digest = hashlib.sha256(text.encode()).hexdigest()
    resolved = config.for_step(settings)
    prepared = adopted(digest)  # made and prepared when the module was compiled
    if prepared is not None and prepared.settings == resolved:
        return prepared
    desc = from_json(text)
    if not desc.symbols and not _has_recorded(desc):
        return CompiledStep(desc, digest, settings=resolved)
    return SymbolicStep(desc, digest, resolved)


def _has_recorded(desc: StepDesc) -> bool:
    return any(isinstance(k, RecordedKernel) for k in desc.kernels.values())
