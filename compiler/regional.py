"""Regional compilation: a model's decoder layers compiled once, not once per layer.

    spyre_rt.compiler.regional.compile_layers_once(model)
    fast = torch.compile(model, backend="spyre_rt")

A Hugging Face decoder's layers (the classes its ``_no_split_modules`` names, in a
``ModuleList``) are the same graph many times. Their ``forward`` is marked with
``torch.compiler.nested_compile_region``: Dynamo traces a layer once and reuses the trace
for every layer it fits (a layer that traces differently, a sliding-window layer beside a
global one, gets a region of its own), AOT and Inductor compile each region once, and the
backend describes its kernels once and puts a copy in the step for every call
(:mod:`spyre_rt.compiler.regions`): the step still launches as one plan.

The mark is a subclass of each layer's class whose ``forward`` is the marked one, set on the
layer instances only (the transformers class is left as it is); ``enabled=False`` takes it
off again. In eager mode the marked forward is the layer's own.
"""

from __future__ import annotations

import torch

_MARKED: dict[type, type] = {}  # a layer class -> its subclass with the marked forward


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of `model` that regional compilation compiles once: modules of a class the
    model names in ``_no_split_modules`` that sit in a ``ModuleList``."""
    names = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    layers = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList):
            layers += [c for c in m if _original(type(c)).__name__ in names]
    return layers


def compile_layers_once(model: torch.nn.Module, enabled: bool = True) -> int:
    """Mark `model`'s decoder layers as compile regions (or, with ``enabled=False``, unmark
    them); the number of layers changed."""
    changed = 0
    for layer in decoder_layers(model):
        cls = type(layer)
        want = _marked(_original(cls)) if enabled else _original(cls)
        if cls is not want:
            layer.__class__ = want
            changed += 1
    return changed


def _original(cls: type) -> type:
    return getattr(cls, "_spyre_rt_unmarked", cls)


def _marked(cls: type) -> type:
    if cls not in _MARKED:
        # one subclass, and one marked function, per layer class: every layer of the class
        # calls the same region, which is what lets Dynamo reuse its trace
        _MARKED[cls] = type(cls.__name__, (cls,), {
            "forward": torch.compiler.nested_compile_region(cls.forward),
            "_spyre_rt_unmarked": cls,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        })
    return _MARKED[cls]
