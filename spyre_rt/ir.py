"""The IR: kernel and step descriptions, what the compiler hands to the runtime, as plain data.

The compiler decides *what* a step computes and describes it here; construction
(:mod:`spyre_rt.construct`) decides how the card runs each kernel, and the executor
(:mod:`spyre_rt.executor`) runs the step. Everything round-trips through JSON
(:func:`to_json` / :func:`from_json`): a compiled module embeds its step as JSON, so that
Inductor's FX graph cache can reload it, and nothing is ever unpickled.

A :class:`LoopKernel` is one fused Inductor kernel (pointwise, reduction, gather, scatter)
over a box of *canonical* loop variables: every node of the kernel and every index
expression is affine in them (non-affine ``//`` and ``%`` were removed by splitting
variables at compile time). The trailing ``ncols`` variables form the columns of a tile
(reduced when ``reduce``); the others its rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Buffer:
    """A buffer a kernel touches: its dtype and the geometry Inductor gave it."""

    name: str
    dtype: str
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0


@dataclass(frozen=True)
class Access:
    """Element ``const + sum(coeffs[v] * var_v) + sum(c * value(ind))`` of ``buf``.

    ``ind`` terms come from indirect indexing: ``(ssa id of the index value, coefficient)``.
    ``domain`` restricts a masked load to the box where its mask can be true, as
    ``(var, lo, hi)`` triples (elsewhere the value is never used)."""

    buf: str
    const: int
    coeffs: tuple[int, ...]
    ind: tuple[tuple[str, int], ...] = ()
    domain: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class Op:
    """One SSA operation of a kernel's body.

    ``op`` is ``load``, ``store``, ``reduction``, ``constant``, ``index``, ``indirect``,
    ``to_dtype``, ``where``/``masked`` or an elementwise operation name (``add``, ``exp``...).
    ``dtype`` is the torch dtype name of the result."""

    id: str
    op: str
    args: tuple[str, ...] = ()
    dtype: str = ""
    access: Access | None = None
    attrs: dict[str, Any] = field(default_factory=dict)


class View(NamedTuple):
    """A strided view of a buffer, in logical elements of its storage. A tuple: a
    description decoded from JSON holds plain ``(buf, offset, sizes, strides)`` tuples, and
    builders name the fields."""

    buf: str
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

_TYPES: dict[str, type] = {}  # every description type, by name (for from_json)


def description(cls):
    """Register a plain-data description type (a frozen dataclass) for JSON decoding."""
    _TYPES[cls.__name__] = cls
    return cls


@description
@dataclass(frozen=True)
class LoopKernel:
    name: str
    sizes: tuple[int, ...]   # canonical variables, outermost first
    ncols: int               # trailing variables that form a tile's columns
    reduce: bool             # the columns are reduced
    ops: tuple[Op, ...]
    buffers: tuple[Buffer, ...]
    origins: tuple[str, ...] = ()
    module: str = ""         # the nn.Module it came from (``model.layers.3.mlp``), if known

    kind = "loop"  # the builder that constructs it (spyre_rt.construct.BUILDERS)

    def views(self) -> list[View]:
        """Every view through which the kernel touches a buffer: the box of each access
        (an indirect row moves by whole rows)."""
        out = []
        for op in self.ops:
            acc = op.access
            if acc is None or not acc.buf:
                continue
            dims = [(n, c) for n, c in zip(self.sizes, acc.coeffs, strict=True) if c and n > 1]
            dims += [(2, c) for _, c in acc.ind]
            out.append((acc.buf, acc.const, tuple(n for n, _ in dims), tuple(c for _, c in dims)))
        return out

    @property
    def shape(self) -> str:
        """pointwise, reduction, gather or scatter."""
        ops = {o.op for o in self.ops}
        if any(o.op == "store" and o.access and o.access.ind for o in self.ops):
            return "scatter"
        if "reduction" in ops:
            return "reduction"
        if any(o.op == "load" and o.access and o.access.ind for o in self.ops):
            return "gather"
        return "pointwise"


@description
@dataclass(frozen=True)
class Epilogue:
    """Pointwise work a matmul does on each output tile before storing it: a pointwise
    loop kernel that read the product (and nothing else did), folded into the matmul.

    ``ops`` is an SSA body as a :class:`LoopKernel`'s, over the (batch, M, N) elements of
    the product: ``product`` is the product rounded to the matmul's ``out_dtype`` (what the
    loop kernel loaded), ``load`` reads ``inputs[attrs["input"]]`` and ``store`` writes
    ``outputs[attrs["output"]]``; the views are (batch, M, N), a stride 0 where a view is
    broadcast. The product itself is not stored.

    A body whose work depends on where a column lies in a period of the columns (a rotary
    embedding's rotate-half reads each head's other half) is *sliced*: ``slices`` holds it
    once for each slice of ``slice_cols`` columns of a period, with what depends on the
    slice decided (its masks, its selections), and ``ops`` is empty. Slice ``i`` of every
    tile (columns ``i * slice_cols`` on) computes ``slices[i % len(slices)]``: a tile's
    columns start at a period's first. There ``product`` may read the product
    ``attrs["shift"]`` columns away (inside the period), and a ``load`` of an input in
    ``periodic`` (a view of one period's values, ``(1, 1, L)``, the same for every period)
    reads it from column ``attrs["at"]``."""

    ops: tuple[Op, ...]
    inputs: tuple[View, ...]
    input_dtypes: tuple[str, ...]
    outputs: tuple[View, ...]
    output_dtypes: tuple[str, ...]
    fused: str = ""          # the loop kernel it came from
    slices: tuple[tuple[Op, ...], ...] = ()
    slice_cols: int = 0
    periodic: tuple[int, ...] = ()

    @property
    def period(self) -> int:
        """Columns of a sliced body's period (0 when it is not sliced)."""
        return self.slice_cols * len(self.slices)

    def bodies(self) -> tuple[tuple[Op, ...], ...]:
        """The body once, or once per slice of a period."""
        return self.slices or (self.ops,)


@description
@dataclass(frozen=True)
class Prologue:
    """Pointwise work a matmul does on each chunk of A before multiplying it: the loop
    kernel that made A (a normalization's elementwise part: ``w * (x * rstd)``), folded in.

    ``ops`` is an SSA body over the (batch, M, K) elements of A; ``load`` reads
    ``inputs[attrs["input"]]`` and the one ``store`` is A's element. ``inputs[0]`` is the
    tile the matmul loads in A's place (the same dtype, K contiguous); the others are
    vectors, one value per row (a K stride of 0) or per column (an M stride of 0)."""

    ops: tuple[Op, ...]
    inputs: tuple[View, ...]
    input_dtypes: tuple[str, ...]
    fused: str = ""          # the loop kernel it came from


@description
@dataclass(frozen=True)
class MatmulKernel:
    """``out = a @ b (+ bias)``, batched; views in logical elements of their buffers.
    With an ``epilogue``, ``out`` only names the product: the epilogue's stores are what
    the kernel writes. With a ``prologue``, ``a`` is the prologue's result, and what the
    kernel reads in its place are the prologue's inputs (``a`` is their first). ``parts``
    groups more matmuls of the same A with it: each a (B, out) pair whose columns follow
    those of the ones before (``b`` and ``out`` are the first), computed as one."""

    name: str
    a: tuple[str, int, tuple[int, ...], tuple[int, ...]]      # (buffer, offset, sizes, strides)
    b: tuple[str, int, tuple[int, ...], tuple[int, ...]]
    out: tuple[str, int, tuple[int, ...], tuple[int, ...]]
    in_dtype: str
    out_dtype: str
    bias: tuple[str, int, tuple[int, ...], tuple[int, ...]] | None = None
    bias_dtype: str = ""
    buffers: tuple[Buffer, ...] = ()
    origins: tuple[str, ...] = ()
    module: str = ""
    epilogue: Epilogue | None = None
    prologue: Prologue | None = None
    parts: tuple[tuple[tuple, tuple], ...] = ()

    kind = "matmul"

    def views(self) -> list[View]:
        out = [v for v in (self.a, self.b, self.bias) if v is not None]
        if self.prologue is not None:
            out += self.prologue.inputs[1:]
        out += [b for b, _ in self.parts]
        if self.epilogue is None:
            return [*out, self.out, *self.outs()[1:]]
        return [*out, *self.epilogue.inputs, *self.epilogue.outputs]

    def outs(self) -> list:
        """The views of its products: ``out``, then each part's."""
        return [self.out, *(o for _, o in self.parts)]


@description
@dataclass(frozen=True)
class AttentionKernel:
    """``out = softmax(q @ k^T * scale + mask) @ v`` for every (batch, head), as
    ``torch.nn.functional.scaled_dot_product_attention`` defines it.

    q is (batch, heads, q_len, head_dim); k and v are (batch, kv_heads, kv_len, dim), and
    query head h reads kv head ``h // (heads // kv_heads)`` (grouped-query attention). The
    mask is broadcast to (batch, heads, q_len, kv_len): a boolean mask keeps the scores
    where it is true, a float mask is added to them. ``causal`` keeps key j for query i
    when ``j <= i + q_offset`` (torch's ``is_causal`` aligns the corners: offset 0).

    Paged (``page`` > 0, vLLM's paged KV cache): k and v are (pages, kv_heads, page, dim)
    views of a cache of pages, and key j of batch element b is row ``j % page`` of page
    ``block_table[b, j // page]``; kv_len is the table's width times ``page``."""

    name: str
    q: View
    k: View
    v: View
    out: View
    dtype: str               # of q, k, v and out
    scale: float
    causal: bool = False
    q_offset: int = 0
    mask: View | None = None
    mask_dtype: str = ""
    buffers: tuple[Buffer, ...] = ()
    origins: tuple[str, ...] = ()
    module: str = ""
    page: int = 0
    block_table: View | None = None  # (batch, kv_len // page)
    table_dtype: str = ""
    # (query rows, keys per block) its tiling must take, if any (query rows 0: any): an
    # attention a pass marked causal keeps the key blocks of the kernel it was, so that each
    # row's sums add in the same order
    blocks: tuple[int, ...] = ()

    kind = "attention"

    def views(self) -> list[View]:
        out = [self.q, self.k, self.v, self.out] + ([self.block_table] if self.block_table is not None else [])
        if self.mask is not None:  # its broadcast dimensions read nothing more
            name, off, sizes, strides = self.mask
            moving = [(n, s) for n, s in zip(sizes, strides, strict=True) if s != 0]
            out.append((name, off, tuple(n for n, _ in moving), tuple(s for _, s in moving)))
        return out


@description
@dataclass(frozen=True)
class CollectiveKernel:
    """A collective between the cards of a process group (a functional collective of the
    graph, ``_c10d_functional.all_reduce_`` and its kin): a job of the step's plan that the
    card runs with its peers, in place on the card's memory.

    ``collective`` is ``all_reduce`` (``out`` is ``inp``), ``all_gather`` (``out`` holds
    ``ranks`` inputs along its first dimension), ``reduce_scatter`` (``inp`` holds
    ``ranks`` outputs) or ``broadcast`` (from ``root``; ``out`` is ``inp``). ``group`` is
    the process group's name, resolved through ``torch.distributed`` when the step runs;
    ``ranks`` is its size when the step was compiled."""

    name: str
    collective: str
    group: str
    ranks: int
    inp: View
    out: View
    dtype: str
    op: str = "sum"          # reductions: sum, avg, max, min, product
    root: int = 0
    buffers: tuple[Buffer, ...] = ()
    origins: tuple[str, ...] = ()
    module: str = ""

    kind = "collective"

    def views(self) -> list[View]:
        return [self.inp, self.out]


@description
@dataclass(frozen=True)
class CpuOp:
    """An op that runs on the host inside a compiled step (CPU fallback), called as its
    schema says: ``op`` names a ``torch.ops`` overload (``aten.cumsum.default``,
    ``aten.convolution.default``, ``aten.mm.out``, a custom op's ``ns.name.default``).

    ``args``/``kwargs`` hold a tensor argument as ``{"buf": view, "as": dtype}`` (the dtype
    it is read as: a view may reinterpret its buffer's bits), with ``"write": True`` when
    the op's schema marks it written (in-place, ``mutates_args``, ``out=``; the step copies
    it back into that view) and ``"out": True`` when it is an ``out=`` argument (only
    written: nothing is read from it); dtypes as ``{"dtype": name}``, devices as
    ``{"device": type}``, layouts and memory formats as ``{"torch": name}``, sizes that
    depend on size symbols as Sym text until a concrete step is made. ``outputs`` are the
    buffers its results are copied into; ``mutated`` the buffers it writes in place.
    ``host`` marks work the graph does on CPU tensors, as eager does: it runs the same way
    but is no fallback (no warning, not counted)."""

    name: str
    op: str
    args: tuple
    kwargs: dict[str, Any]
    outputs: tuple[Buffer, ...]
    mutated: tuple[str, ...]
    source: str
    host: bool = False

    def buffer_refs(self) -> list[View]:
        return [tuple(ref["buf"]) for ref in self.tensor_args()]

    def tensor_args(self) -> list[dict]:
        """Every tensor argument (``{"buf": view, ...}``), in call order."""
        return _tensor_args(self.args) + _tensor_args(self.kwargs)

    def buffer_names(self) -> set[str]:
        return {o.name for o in self.outputs} | {ref[0] for ref in self.buffer_refs()}

    def written_names(self) -> set[str]:
        """The buffers the op writes: its outputs and the arguments it writes in place."""
        return {o.name for o in self.outputs} | {ref["buf"][0] for ref in self.tensor_args() if ref.get("write")}


# The torch layouts and memory formats a CpuOp's arguments may name ({"torch": name}).
TORCH_CONSTANT_NAMES = ("strided", "sparse_coo", "_mkldnn", "contiguous_format", "channels_last",
                        "channels_last_3d", "preserve_format")


def _tensor_args(a) -> list:
    if isinstance(a, dict) and "buf" in a:
        return [a]
    if isinstance(a, (list, tuple)):
        return [r for x in a for r in _tensor_args(x)]
    if isinstance(a, dict):
        return [r for x in a.values() for r in _tensor_args(x)]
    return []


@description
@dataclass(frozen=True)
class StepDesc:
    """A compiled graph: what runs, in which order, on which buffers.

    ``sequence`` items are ``("run", kernel name)`` (a kernel of the card, or a
    collective), ``("cpu", CpuOp)`` or
    ``("pick", (tuple-output buffer, index path, buffer))``. Views are
    ``(buffer, offset, sizes, strides)`` in logical elements."""

    inputs: tuple[tuple[Buffer, bool], ...]                 # graph inputs, mutated?
    outputs: tuple                      # views (see View), {"int": n} for a size it returns, {"none": True}
    buffers: dict[str, Buffer]                               # intermediates the step owns
    aliases: dict[str, tuple[str, int, tuple[int, ...], tuple[int, ...]]]
    constants: dict[str, Buffer]
    kernels: dict[str, Any]
    sequence: tuple[tuple[str, Any], ...]
    options: dict[str, Any] = field(default_factory=dict)
    static_inputs: tuple[int, ...] = ()   # inputs whose memory does not change (parameters)
    # size symbols of a dynamic-shape step: (name, "int" | "size" | "stride", argument, dim)
    symbols: tuple[tuple[str, str, int, int], ...] = ()
    host_outputs: tuple[int, ...] = ()    # outputs the graph computes on the CPU device
    # where each kernel came from, "ops (file:line of the model code)": what a warning names
    # when the kernel runs on the CPU because construction refused it
    sources: dict[str, str] = field(default_factory=dict)


for _cls in (Buffer, Access, Op):
    description(_cls)


def resolve_alias(aliases: dict, name: str, element: int = 0) -> tuple[str, int]:
    """(buffer, element) that element `element` of `name` is, through `aliases` (alias ->
    (the buffer it views, its offset there, ...)): a buffer is itself. A cycle, which no
    step makes, stops where it would repeat."""
    if name not in aliases:  # most names are buffers: no cycle guard to make
        return name, element
    seen = set()
    while name in aliases and name not in seen:
        seen.add(name)
        base, offset = aliases[name][:2]
        name, element = base, element + offset
    return name, element


@functools.cache
def field_names(cls: type) -> tuple[str, ...]:
    """A description class's field names, asked of dataclasses once per class."""
    return tuple(f.name for f in dataclasses.fields(cls))


def _encode(obj: Any) -> Any:
    if isinstance(obj, (list, tuple)):
        return [_encode(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _encode(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj):
        out = {"__type__": type(obj).__name__}
        for name in field_names(type(obj)):
            out[name] = _encode(getattr(obj, name))
        return out
    return obj


def _tuples(value: Any) -> Any:
    """JSON arrays back to the tuples the dataclasses hold (dicts stay dicts)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def _decoded(obj: dict) -> Any:
    """A JSON object as the parser meets it, innermost first: a description's own object
    (its fields decoded already) becomes the dataclass, any other stays a dict."""
    kind = obj.get("__type__")
    if kind is None:
        return obj
    cls = _TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown kernel description type {kind!r}")
    kwargs = {}
    for name in field_names(cls):
        if name not in obj:
            raise ValueError(f"{cls.__name__} description lacks {name!r}")
        kwargs[name] = _tuples(obj[name])
    return cls(**kwargs)


def to_json(obj: Any) -> str:
    return json.dumps(_encode(obj), separators=(",", ":"), sort_keys=True)


def from_json(text: str) -> Any:
    return json.loads(text, object_hook=_decoded)
