"""Regional compilation: a model's decoder layers compiled once, not once per layer.

    spyre_rt.compiler.regional.compile_layers_once(model)
    fast = torch.compile(model, backend="spyre_rt")

A Hugging Face decoder's layers (the classes its ``_no_split_modules`` names, in a
``ModuleList``) are the same graph many times. Each layer's call goes through one function
marked with ``torch.compiler.nested_compile_region``: Dynamo traces it once and stamps out
that trace for every later layer whose inputs match (a layer that traces differently, a
sliding-window layer beside a global one, gets a region of its own), AOT and Inductor
compile each region once, and the backend describes its kernels once and puts a copy in the
step for every call (:mod:`spyre_rt.compiler.regions`): the step still launches as one plan.

Dynamo reuses a region's trace only for calls whose inputs are tensors, sizes, constants
and modules. A transformers KV cache is none of these, so a layer's call hands the region its
own cache layer as tensors and constants (:class:`_CacheLayer`), and the region rebuilds a
cache of that one layer to call the layer's forward with. This holds for the caches
transformers marks compileable (their layers update their tensors in place and nothing
else); any other cache (a dynamic one grows by rebinding its tensors) is passed as it is,
and Dynamo then traces every layer.

The mark is a subclass of each layer's class whose ``forward`` makes that call, set on the
layer instances only (the transformers class is left as it is); ``enabled=False`` takes it
off again. In eager mode the marked forward is the layer's own.
"""

from __future__ import annotations

import inspect

import torch

_MARKED: dict[type, type] = {}  # a layer class -> its subclass with the marked forward
_CLASSES: list[type] = []  # cache and cache layer classes, named in a region call by index
_CONSTANTS = (bool, int, float, str, type(None), torch.dtype, torch.device)
_STANDINS: dict[type, type] = {}  # a cache class -> the class of a region's cache of one layer
_MAX_REGIONS = 64  # distinct traces of the region Dynamo keeps (one per distinct layer)


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
    _standin_classes()
    changed = 0
    for layer in decoder_layers(model):
        cls = type(layer)
        want = _marked(_original(cls)) if enabled else _original(cls)
        if cls is not want:
            layer.__class__ = want
            changed += 1
        if enabled:
            # read here, not by Dynamo: a guard on it would differ for every layer
            layer._spyre_rt_cache_index = _layer_index(layer)
    return changed


def _original(cls: type) -> type:
    return getattr(cls, "_spyre_rt_unmarked", cls)


def _marked(cls: type) -> type:
    if cls not in _MARKED:
        _MARKED[cls] = type(cls.__name__, (cls,), {
            "forward": _forward,
            "_spyre_rt_unmarked": cls,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        })
    return _MARKED[cls]


def _forward(self, *args, **kwargs):
    """A marked layer's forward: its call of the region."""
    if not torch.compiler.is_compiling():
        return _original(type(self)).forward(self, *args, **kwargs)
    cache = kwargs.get("past_key_values")
    layer = _cache_layer(cache, self) if cache is not None else None
    if layer is None:
        return _region(self, args, kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k != "past_key_values"}
    return _region_with_cache(self, layer.kinds, layer.names, layer.constants, layer.tensors,
                              layer.cache_constants, len(cache.layers), args, kwargs)


class _CacheLayer:
    """One layer of a transformers cache as a region's inputs: the classes of the cache and
    of the layer (by index), the layer's constant attributes and its tensors, and the
    cache's constant attributes."""

    def __init__(self, kinds: tuple, names: tuple, constants: tuple, tensors: tuple, cache_constants: tuple):
        self.kinds, self.names, self.constants, self.tensors = kinds, names, constants, tensors
        self.cache_constants = cache_constants


def _cache_layer(cache, layer: torch.nn.Module) -> _CacheLayer | None:
    """`layer`'s own layer of `cache`, when the region can take it as tensors and constants."""
    index = getattr(layer, "_spyre_rt_cache_index", None)
    layers = getattr(cache, "layers", None)
    if index is None or not isinstance(layers, list) or not 0 <= index < len(layers):
        return None
    entry = layers[index]
    if not getattr(type(entry), "is_compileable", False) or not getattr(entry, "is_initialized", False):
        return None
    names, constants, tensors = [], [], []
    for name, value in vars(entry).items():
        if isinstance(value, torch.Tensor):
            tensors.append((name, value))
        elif isinstance(value, _CONSTANTS):
            names.append(name)
            constants.append(value)
        else:
            return None
    cache_constants = []
    for name, value in vars(cache).items():
        if name == "layers":
            continue
        if not isinstance(value, _CONSTANTS):
            return None
        cache_constants.append((name, value))
    standin = _STANDINS.get(type(cache))
    if standin is None:
        return None
    return _CacheLayer((_kind(standin), _kind(type(entry))), (*names, *(n for n, _ in tensors)),
                       tuple(constants), tuple(t for _, t in tensors), tuple(cache_constants))


def _kind(cls: type) -> int:
    if cls not in _CLASSES:
        _CLASSES.append(cls)
    return _CLASSES.index(cls)


def _layer_index(layer: torch.nn.Module) -> int | None:
    """The cache index of a decoder layer: the ``layer_idx`` its attention (or itself) keeps."""
    for m in layer.modules():
        index = getattr(m, "layer_idx", None)
        if isinstance(index, int):
            return index
    return None


def _standin_classes() -> None:
    """For every transformers cache class, the class of the cache a region builds: one whose
    methods that take a ``layer_idx`` use the one layer it has. The layer's own index never
    reaches a region's trace, so a guard on it cannot tell one layer's trace from another's.
    Made before any trace (Dynamo cannot make a class)."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # no transformers: no cache to hand a region
        return
    todo = [Cache]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls in _STANDINS or cls in _STANDINS.values():
            continue
        methods = {}
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if "layer_idx" in inspect.signature(fn).parameters:
                methods[name] = _at_layer_zero(fn)
        _STANDINS[cls] = type(f"{cls.__name__}OfOneLayer", (cls,), methods)


def _at_layer_zero(fn):
    position = list(inspect.signature(fn).parameters).index("layer_idx") - 1  # after self

    def method(self, *args, **kwargs):
        if "layer_idx" in kwargs:
            kwargs = {**kwargs, "layer_idx": 0}
        elif len(args) > position:
            args = (*args[:position], 0, *args[position + 1:])
        return fn(self, *args, **kwargs)

    return method


def _region_body(layer, kinds, names, constants, tensors, cache_constants, count, args, kwargs):
    """A layer's forward on a cache of its own layer, rebuilt from the region's inputs."""
    entry = object.__new__(_CLASSES[kinds[1]])
    for name, value in zip(names, (*constants, *tensors), strict=True):
        setattr(entry, name, value)
    cache = object.__new__(_CLASSES[kinds[0]])
    for name, value in cache_constants:
        setattr(cache, name, value)
    cache.layers = [entry] * count
    return _original(type(layer)).forward(layer, *args, past_key_values=cache, **kwargs)


def _region_plain(layer, args, kwargs):
    return _original(type(layer)).forward(layer, *args, **kwargs)


_region = torch.compiler.nested_compile_region(_region_plain, max_reuse_entries=_MAX_REGIONS)
_region_with_cache = torch.compiler.nested_compile_region(_region_body, max_reuse_entries=_MAX_REGIONS)
