"""Regional compilation: a model's decoder layers compiled once, not once per layer.

    spyre_rt.regional.compile_layers_once(model)
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
own cache layer as tensors and constants (:func:`_flat_cache`), and the region rebuilds a
cache of that one layer to call the layer's forward with. That is right only for cache
layers whose update changes nothing but their tensors, in place: a static cache's layers
(``StaticLayer``). The region gets such a layer's tensors alone and sets its other fields
(sizes, dtype, device) from them, as the layer's own initialization does; that is checked
against transformers' class before it is relied on. Any other cache is passed as it is (a dynamic cache grows by rebinding
its tensors, a sliding window counts its tokens in a Python int), and Dynamo then traces
every layer that has one; the region still bounds what Inductor fuses across the layer's
edges (its inputs and outputs are realized), as the layers compiled once have them. A cache
whose update a region cannot hold (a sliding window's keeps a view of what it concatenated)
is not passed to one: its layer is traced inline.

The mark is a subclass of each layer's class whose ``forward`` makes that call, set on the
layer instances only (the transformers class is left as it is); ``enabled=False`` takes it
off again. In eager mode the marked forward is the layer's own.

A layer whose parameters or buffers are tensor subclasses (DTensor shards of a
tensor-parallel model) is left unmarked: torch 2.13's AOT has no rule for a region call on
them, so such layers are traced one by one, as without regional compilation.
"""

from __future__ import annotations

import inspect

import torch

_MARKED: dict[type, type] = {}  # a layer class -> its subclass with the marked forward
_CLASSES: list[type] = []  # cache and cache layer classes, named in a region call by index
_KINDS: dict[type, int] = {}  # a class in _CLASSES -> its index (all made before any trace)
_CONSTANTS = (bool, int, float, str, type(None), torch.dtype, torch.device)
# cache layer classes whose update only writes their tensors in place -> the names of those
# tensors; the layer's other fields are read off them (see _static_fields)
_IN_PLACE: dict[type, tuple[str, ...]] = {}
_REBINDING: set[type] = set()  # cache layer classes whose update rebinds their tensors to new ones
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
        if enabled and _has_subclass_tensors(layer):
            continue
        cls = type(layer)
        want = _marked(_original(cls)) if enabled else _original(cls)
        if cls is not want:
            layer.__class__ = want
            changed += 1
        if enabled:
            # read here, not by Dynamo: a guard on it would differ for every layer
            layer._spyre_rt_cache_index = _layer_index(layer)
    return changed


def _has_subclass_tensors(layer: torch.nn.Module) -> bool:
    # a parameter of a subclass's data keeps the subclass's type (DTensor), not Parameter
    return any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in (*layer.parameters(), *layer.buffers()))


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
    """A marked layer's forward: its call of the region, with flat inputs (see :func:`_flat`)."""
    if not torch.compiler.is_compiling():
        return _original(type(self)).forward(self, *args, **kwargs)
    cache = kwargs.get("past_key_values")
    flat = _flat_cache(cache, self) if cache is not None else None
    own = flat is not None  # the layer's own cache layer is in `flat`: the call's cache is left out
    if not own:
        flat = [_PASSED]
    if not (_flat(args, flat) and _flat(kwargs, flat, "past_key_values" if own else None)):
        if cache is not None and not own and not _holds_in_a_region(cache):
            # a cache whose update a region cannot hold (a sliding window keeps a view of what
            # it concatenated: Dynamo fails on it inside a region): the layer is traced inline
            return _original(type(self)).forward(self, *args, **kwargs)
        # an input that is not plain data: traced every time, with the call's cache as it is
        return _region(self, args, kwargs)
    return _region_flat(self, *flat)


def _holds_in_a_region(cache) -> bool:
    """Whether a cache passed to a region as it is can update itself there: every layer of it
    one that rebinds its tensors to new ones (a dynamic cache's), nothing else."""
    layers = getattr(cache, "layers", None)
    return isinstance(layers, list) and all(type(layer) in _REBINDING for layer in layers)


# A region's inputs are one flat list of tensors and constants: Dynamo matches such calls
# against its earlier traces cheaply, where a nested one (a tuple, a dict) is flattened by
# tracing torch's pytree functions at every call. Tags say how the list nests:
_PASSED = "passed"   # the call's own cache, if any, is among its arguments
_CACHE = "cache"     # then: cache class, layer class (by index), layer count, n, n (name, value) of the
                     # cache's constants, n, n (name, tensor) of the layer's tensors
_LEAF, _TUPLE, _LIST, _DICT = "leaf", "tuple", "list", "dict"  # then: a value; n and n values; n and n (key, value)
_LEAVES = (torch.Tensor, *_CONSTANTS)


def _flat(value, out: list, skip: str | None = None) -> bool:
    """Append `value` to `out` as tags and leaves (a dict without its key `skip`); False if some
    part of it is no leaf. Dynamo runs this at every layer's call, so it is written for Dynamo:
    a leaf inside a container is appended in place rather than by a call of its own, and there
    are no generators (Dynamo traces a call or a generator far more slowly than a loop)."""
    if isinstance(value, _LEAVES):
        out += (_LEAF, value)
        return True
    if isinstance(value, (tuple, list)):
        out += (_TUPLE if isinstance(value, tuple) else _LIST, len(value))
        for v in value:
            if isinstance(v, _LEAVES):
                out += (_LEAF, v)
            elif not _flat(v, out):
                return False
        return True
    if isinstance(value, dict):
        out += (_DICT, len(value) - (skip in value))
        for k, v in value.items():
            if k == skip:
                continue
            if not isinstance(k, str):
                return False
            out.append(k)
            if isinstance(v, _LEAVES):
                out += (_LEAF, v)
            elif not _flat(v, out):
                return False
        return True
    return False


def _unflat(flat: tuple, at: int):
    """The value that starts at `flat[at]`, and where the next one starts."""
    tag = flat[at]
    if tag == _LEAF:
        return flat[at + 1], at + 2
    n, at = flat[at + 1], at + 2
    if tag == _DICT:
        out = {}
        for _ in range(n):
            key = flat[at]
            out[key], at = _unflat(flat, at + 1)
        return out, at
    items = []
    for _ in range(n):
        v, at = _unflat(flat, at)
        items.append(v)
    return (tuple(items) if tag == _TUPLE else items), at


def _flat_cache(cache, layer: torch.nn.Module) -> list | None:
    """`layer`'s own layer of `cache` as tags and leaves, when it is a layer whose update only
    writes its tensors in place; else None (the cache is passed as it is)."""
    index = getattr(layer, "_spyre_rt_cache_index", None)
    layers = getattr(cache, "layers", None)
    standin = _STANDINS.get(type(cache))
    if standin is None or index is None or not isinstance(layers, list) or not 0 <= index < len(layers):
        return None
    entry = layers[index]
    tensors = _IN_PLACE.get(type(entry))
    if tensors is None or not getattr(entry, "is_initialized", False):
        return None
    own = vars(cache)
    out = [_CACHE, _KINDS[standin], _KINDS[type(entry)], len(layers), len(own) - ("layers" in own)]
    for k, v in own.items():
        if k != "layers":
            if not isinstance(v, _CONSTANTS):
                return None
            out += (k, v)
    # the layer's tensors alone: its other fields are the tensors' sizes, dtype and device, which
    # Dynamo checks of every tensor a region gets (reading them here cost every layer's call as
    # much again, and a guard each in the step)
    out.append(len(tensors))
    for k in tensors:
        out += (k, getattr(entry, k))
    return out


def _kind(cls: type) -> int:
    """A class's index in `_CLASSES`, by which a region's flat inputs name it."""
    if cls not in _KINDS:
        _KINDS[cls] = len(_CLASSES)
        _CLASSES.append(cls)
    return _KINDS[cls]


def _layer_index(layer: torch.nn.Module) -> int | None:
    """The cache index of a decoder layer: the ``layer_idx`` its attention (or itself) keeps."""
    for m in layer.modules():
        index = getattr(m, "layer_idx", None)
        if isinstance(index, int):
            return index
    return None


# A static cache layer's tensors, and its fields that are read off them (as its lazy
# initialization sets them): checked against transformers' class before it is trusted.
_STATIC_TENSORS = ("keys", "values", "cumulative_length")


def _static_fields(keys: torch.Tensor, values: torch.Tensor) -> dict:
    batch, heads, length, k_dim = keys.shape
    return {"is_initialized": True, "max_cache_len": length, "dtype": keys.dtype, "device": keys.device,
            "batch_size": batch, "num_heads": heads, "k_head_dim": k_dim, "v_head_dim": values.shape[-1]}


def _static_layer_is_as_known(cls: type) -> bool:
    """Whether an initialized `cls` has the tensors of _STATIC_TENSORS and, beside them, just the
    fields _static_fields reads off them: else its fields are not known here and its layers are
    not handed to a region by their tensors."""
    try:
        entry = cls(max_cache_len=3)
        entry.lazy_initialization(torch.zeros(2, 5, 1, 4), torch.zeros(2, 5, 1, 6))
        fields = vars(entry)
    except Exception:  # another signature: not the class this knows
        return False
    derived = _static_fields(fields.get("keys", torch.zeros(0, 0, 0, 0)), fields.get("values", torch.zeros(0)))
    return (set(fields) == set(_STATIC_TENSORS) | set(derived)
            and all(isinstance(fields[k], torch.Tensor) for k in _STATIC_TENSORS)
            and all(type(fields[k]) is type(v) and fields[k] == v for k, v in derived.items()))


def _standin_classes() -> None:
    """For every transformers cache class, the class of the cache a region builds: one whose
    methods that take a ``layer_idx`` use the one layer it has. The layer's own index never
    reaches a region's trace, so a guard on it cannot tell one layer's trace from another's.
    Made before any trace (Dynamo cannot make a class)."""
    try:
        from transformers.cache_utils import Cache, DynamicLayer, StaticLayer
    except ImportError:  # no transformers: no cache to hand a region
        return
    if StaticLayer not in _IN_PLACE and _static_layer_is_as_known(StaticLayer):
        _IN_PLACE[StaticLayer] = _STATIC_TENSORS
        _kind(StaticLayer)
    _REBINDING.add(DynamicLayer)
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
        _kind(_STANDINS[cls])


def _at_layer_zero(fn):
    position = list(inspect.signature(fn).parameters).index("layer_idx") - 1  # after self

    def method(self, *args, **kwargs):
        if "layer_idx" in kwargs:
            kwargs = {**kwargs, "layer_idx": 0}
        elif len(args) > position:
            args = (*args[:position], 0, *args[position + 1:])
        return fn(self, *args, **kwargs)

    return method


def _region_body(layer, *flat):
    """A layer's forward on its flat inputs: with a cache of its own layer rebuilt from them."""
    at = 1
    kwargs = {}
    if flat[0] == _CACHE:
        cache = object.__new__(_CLASSES[flat[1]])
        entry = object.__new__(_CLASSES[flat[2]])
        count, n, at = flat[3], flat[4], 5
        for i in range(n):
            setattr(cache, flat[at + 2 * i], flat[at + 2 * i + 1])
        at += 2 * n
        n, at = flat[at], at + 1
        for i in range(n):
            setattr(entry, flat[at + 2 * i], flat[at + 2 * i + 1])
        at += 2 * n
        for k, v in _static_fields(entry.keys, entry.values).items():
            setattr(entry, k, v)
        cache.layers = [entry] * count
        kwargs["past_key_values"] = cache
    args, at = _unflat(flat, at)
    more, at = _unflat(flat, at)
    return _unaliased(_original(type(layer)).forward(layer, *args, **more, **kwargs), flat)


def _region_plain(layer, args, kwargs):
    return _unaliased(_original(type(layer)).forward(layer, *args, **kwargs), _tensors((args, kwargs), []))


def _tensors(value, out: list) -> list:
    """The tensors in `value`'s tuples, lists and dicts, appended to `out`."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)
    return out


def _unaliased(result, inputs: list):
    """The layer's result with a copy of each tensor in it that is one of its inputs, or one
    of its results already: a region's outputs may not alias (T5's blocks after the first
    hand back the position bias they were given). Traced once per region, not per call."""
    if isinstance(result, torch.Tensor):
        return _unaliased((result,), inputs)[0]
    if type(result) not in (tuple, list):  # a named tuple or an output class is left as it is
        return result
    out, copied = [], False
    for item in result:
        if isinstance(item, torch.Tensor):
            for x in (*inputs, *out):
                if item is x:
                    item, copied = item.clone(), True
                    break
        out.append(item)
    if not copied:
        return result
    return out if type(result) is list else tuple(out)


_region = torch.compiler.nested_compile_region(_region_plain, max_reuse_entries=_MAX_REGIONS)
_region_flat = torch.compiler.nested_compile_region(_region_body, max_reuse_entries=_MAX_REGIONS)
