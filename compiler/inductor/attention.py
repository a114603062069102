"""Scaled-dot-product attention on the card: one kernel per attention, not its math.

For a device it does not know, torch picks the fused attention kernel in C++ and falls
back to the math: AOT would hand Inductor an fp32 upcast, ``repeat_kv`` copies of the
cache, two batched matmuls and a softmax whose scores go through DRAM. So the call is
taken before AOT sees it, in three steps:

1. :func:`use_card_attention` (on Dynamo's graph): calls of
   ``F.scaled_dot_product_attention`` on spyre tensors become calls of
   ``spyre_rt::attention``, an op that AOT keeps whole (a fake kernel for tracing, and a
   CPU kernel for when it runs on the host).
2. :class:`FoldRepeatedKV` (a post-grad pass over the aten graph): where Hugging Face's
   ``repeat_kv`` repeated the KV heads (unsqueeze, expand, clone, reshape), the op reads
   the KV heads themselves; the op is grouped-query attention whenever the query has more
   heads than the keys, so the copy is gone.
3. The lowering: a :class:`SpyreAttention` extern node whose description is an
   :class:`~spyre_rt.ir.AttentionKernel` (constructed by
   :mod:`spyre_rt.construct.attention`).

The op's output holds the heads inside each position, (batch, q_len, heads, dim) in
memory, as the CPU's flash kernel does: the ``transpose(1, 2).contiguous()`` that
follows attention in every Hugging Face model is then a view, not a copy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch._inductor import ir
from torch._inductor import lowering as L
from torch._inductor.custom_graph_pass import CustomGraphPass

from spyre_rt import dtypes
from spyre_rt.ir import AttentionKernel
from spyre_rt.paged_attention import PAGED_ATTENTION

from .record import (
    buffer_info,
    dtype_name,
    fx_origins,
    module_of,
    node_origins,
    stored_buffer,
    stored_view,
    view_of,
)

aten = torch.ops.aten


@torch.library.custom_op("spyre_rt::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
              is_causal: bool, scale: float | None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with grouped-query attention implied by the
    head counts; the result holds the heads inside each position."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                         enable_gqa=key.size(1) != query.size(1))
    return out.transpose(1, 2).contiguous().transpose(1, 2)


@attention.register_fake
def _(query, key, value, attn_mask, is_causal, scale):
    batch, heads, q_len, _ = query.shape
    return query.new_empty((batch, q_len, heads, value.size(-1))).transpose(1, 2)


ATTENTION = torch.ops.spyre_rt.attention.default




# ---- 1. Dynamo's graph: the call ------------------------------------------------------------

_SDPA = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)


def use_card_attention(gm: torch.fx.GraphModule) -> None:
    """Calls of scaled-dot-product attention on spyre tensors call :func:`card_sdpa`."""
    from ..version import compiler_version

    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _SDPA and _on_spyre_value(node):
            node.target = card_sdpa
            # AOT's cache takes a wrapped function whose behaviour a hash names: card_sdpa's
            # is the compiler's, so a warm start reloads the graph instead of tracing it again
            node.meta["is_wrapped"] = True
            node.meta["user_cache_hash"] = compiler_version()
            changed = True
    if changed:
        gm.recompile()


def _on_spyre_value(node: torch.fx.Node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.device.type == "spyre"


def card_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as the card runs it: its own op where the card
    takes the call, torch's math otherwise (and torch's errors for calls it refuses)."""
    if not _card_takes(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return ATTENTION(query, key, value, attn_mask, is_causal, scale)


def _card_takes(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> bool:
    if dropout_p or query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return False
    if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value, attn_mask) if x is not None):
        return False  # the card's kernel is forward only: autograd differentiates torch's math
    if not (query.dtype == key.dtype == value.dtype) or not query.dtype.is_floating_point:
        return False
    heads, kv_heads = query.size(1), key.size(1)
    if value.size(1) != kv_heads or heads % kv_heads or (heads != kv_heads and not enable_gqa):
        return False
    if query.size(0) != key.size(0) or key.size(0) != value.size(0) or query.size(-1) != key.size(-1):
        return False
    if attn_mask is not None:
        if is_causal or attn_mask.dim() > 4:  # torch refuses both: let it say so
            return False
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            return False
    return True


# ---- 2. the aten graph: repeat_kv -----------------------------------------------------------

_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


class FoldRepeatedKV(CustomGraphPass):
    """The attention op reads KV heads that ``repeat_kv`` repeated from where they are."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.find_nodes(op="call_function", target=ATTENTION):
            for index in (1, 2):
                source = repeated_heads(node.args[index])
                if source is not None:
                    node.update_arg(index, source)
        graph.eliminate_dead_code()

    def uuid(self) -> str:
        from ..version import compiler_version

        return compiler_version()


def repeated_heads(node) -> torch.fx.Node | None:
    """x when `node` is x (batch, kv_heads, len, dim) with each head repeated r times in
    a row: ``x[:, :, None].expand(b, kv_heads, r, len, dim).reshape(b, kv_heads * r, len, dim)``."""
    if not _is_call(node, _RESHAPES):
        return None
    inner = node.args[0]
    if _is_call(inner, (aten.clone.default,)):
        inner = inner.args[0]
    if not _is_call(inner, (aten.expand.default,)):
        return None
    unsqueezed = inner.args[0]
    if not _is_call(unsqueezed, (aten.unsqueeze.default,)) or unsqueezed.args[1] != 2:
        return None
    source = unsqueezed.args[0]
    x, out = source.meta.get("val"), node.meta.get("val")
    if x is None or out is None or x.dim() != 4 or out.dim() != 4:
        return None
    b, kv_heads, length, dim = x.shape
    reps = out.shape[1] // kv_heads if out.shape[1] % kv_heads == 0 else 0
    if reps < 1 or tuple(out.shape) != (b, kv_heads * reps, length, dim):
        return None
    return source


def _is_call(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


# ---- 3. the lowering ------------------------------------------------------------------------


class SpyreAttention(ir.ExternKernelOut):
    """Attention as one kernel of the card (see :mod:`spyre_rt.construct.attention`);
    paged (``page`` > 0), its inputs are q, the key and value caches, the mask and the
    block table."""

    def __init__(self, layout, inputs, *, scale: float, causal: bool, page: int = 0):
        name = "spyre_rt.paged_attention" if page else "spyre_rt.attention"
        super().__init__(layout, inputs, python_kernel_name=name)
        self.scale, self.causal, self.page = scale, causal, page

    def spyre_kernel(self, name: str) -> AttentionKernel:
        """Its description: views in logical elements of their buffers."""
        q, k, v = (view_of(x) for x in self.inputs[:3])
        mask = view_of(self.inputs[3]) if len(self.inputs) > 3 else None
        table = view_of(self.inputs[4]) if self.page else None
        if self.page:  # the caches (kv_heads, pages, page, dim) as the kernel reads them: pages first
            k, v = ((b, off, (n[1], n[0], *n[2:]), (st[1], st[0], *st[2:])) for b, off, n, st in (k, v))
        out = buffer_info(self.get_name())
        views = [q, k, v] + ([mask] if mask else []) + ([table] if table else [])
        bufs = {view[0]: buffer_info(view[0]) for view in views}
        bufs[out.name] = out
        return AttentionKernel(
            name=name, q=stored_view(q), k=stored_view(k), v=stored_view(v),
            out=stored_view((out.name, out.offset, out.sizes, out.strides)), dtype=out.dtype,
            scale=self.scale, causal=self.causal, mask=stored_view(mask) if mask else None,
            mask_dtype=dtype_name(self.inputs[3].get_dtype()) if mask else "",
            buffers=tuple(stored_buffer(b) for b in bufs.values()), origins=node_origins(self),
            module=module_of(fx_origins([self])), page=self.page,
            block_table=stored_view(table) if table else None,
            table_dtype=dtype_name(self.inputs[4].get_dtype()) if table else "",
        )


def lower(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """The SpyreAttention node of a call the card takes, else None."""
    inputs = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    if not all(_on_spyre(x) for x in inputs) or not _card_computes(query, key, value, attn_mask):
        return None
    head_dim = query.get_size()[-1]
    if scale is None:
        if not _static(head_dim):
            return None
        scale = 1.0 / math.sqrt(int(head_dim))
    batch, heads, q_len, _ = query.get_size()
    kv_len, v_dim = value.get_size()[-2:]
    if _known(q_len, 0) or _known(kv_len, 0):  # no query or no key: torch's own answer
        return None
    operands = [_rows_contiguous(x) for x in (query, key, value)]
    if attn_mask is not None:
        operands.append(_broadcast_mask(attn_mask, [batch, heads, q_len, kv_len]))
    if not _tiles_fit(operands, attn_mask, is_causal):
        return None
    layout = ir.FixedLayout(query.get_device(), query.get_dtype(), [batch, heads, q_len, v_dim],
                            [q_len * heads * v_dim, v_dim, heads * v_dim, 1])
    return ir.TensorBox.create(SpyreAttention(layout, operands, scale=float(scale), causal=bool(is_causal)))


def lower_paged(query, key_cache, value_cache, block_table, mask, scale):
    """The SpyreAttention node of a paged attention the card takes, else None: the caches
    read in place, a key per storage row (vLLM's cache as serving lays it out)."""
    inputs = [query, key_cache, value_cache, block_table, mask]
    if not all(_on_spyre(x) for x in inputs) or not _card_computes(query, key_cache, value_cache, None):
        return None
    if dtype_name(block_table.get_dtype()) not in ("int64", "int32") or mask.get_dtype() != torch.bool:
        return None
    from torch._inductor.virtualized import V

    # the page and head sizes shape the kernel's gathers: fixed for a server, so a size
    # symbol of them is specialised (a guard) rather than refused
    page = V.graph.sizevars.guard_int(key_cache.get_size()[2])
    if not _known(value_cache.get_size()[2], page):
        return None
    batch, heads, q_len, _ = query.get_size()
    kv_len = block_table.get_size()[1] * page
    caches = [ir.ExternKernel.realize_input(c) for c in (key_cache, value_cache)]
    if not all(_one_row_per_key(c) for c in caches):
        return None
    operands = [_rows_contiguous(query), *caches, _broadcast_mask(mask, [batch, heads, q_len, kv_len]),
                ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(block_table))]
    v_dim = value_cache.get_size()[-1]
    layout = ir.FixedLayout(query.get_device(), query.get_dtype(), [batch, heads, q_len, v_dim],
                            [q_len * heads * v_dim, v_dim, heads * v_dim, 1])
    return ir.TensorBox.create(SpyreAttention(layout, operands, scale=float(scale), causal=False, page=page))


def _one_row_per_key(cache) -> bool:
    """A (kv_heads, pages, page, dim) cache whose keys are rows of its buffer: dim
    contiguous, each key a row's length apart, heads and pages whole pages apart."""
    from torch._inductor.virtualized import V

    dim = V.graph.sizevars.guard_int(cache.get_size()[3])
    heads_stride, page_stride, key_stride, unit = cache.get_stride()
    return _unit(unit) and _known(key_stride, dim) and all(
        V.graph.sizevars.statically_known_multiple_of(s, dim) for s in (heads_stride, page_stride))


def _tiles_fit(operands, attn_mask, is_causal) -> bool:
    """Some tiling of the builder fits the scratchpad (known now for static shapes; a
    dynamic one is tiled at its first call)."""
    from spyre_rt.card import card_set
    from spyre_rt.construct import attention as construct
    from spyre_rt.construct.context import ScratchpadOverflow
    from spyre_rt.cost import CostModel

    sizes = [x.get_size() for x in operands] + [x.get_stride() for x in operands[3:]]
    if not all(_static(v) for dims in sizes for v in dims):
        return True
    (batch, heads, q_len, dim), (_, kv_heads, kv_len, _), (*_, v_dim) = (
        [int(v) for v in x.get_size()] for x in operands[:3])
    mask = "" if attn_mask is None else "bool" if attn_mask.get_dtype() == torch.bool else "add"
    mask_heads = 1 if mask == "" or int(operands[3].get_stride()[1]) == 0 else heads // kv_heads
    shape = construct.Shape(batch, heads, kv_heads, q_len, kv_len, dim, v_dim, dtype_name(operands[0].get_dtype()),
                            mask, dtype_name(attn_mask.get_dtype()) if mask else "", mask_heads, bool(is_causal), 0)
    try:
        construct.choose(shape, CostModel.of_figures(card_set().profile))
    except ScratchpadOverflow:
        return False
    return True


def _card_computes(query, key, value, attn_mask) -> bool:
    names = {dtype_name(x.get_dtype()) for x in (query, key, value)}
    if len(names) != 1 or not names <= dtypes.MATMUL:
        return False
    return attn_mask is None or dtype_name(attn_mask.get_dtype()) in dtypes.FLOATS | {"bool"}


def _on_spyre(x) -> bool:
    device = x.get_device()
    return device is not None and device.type == "spyre"


def _rows_contiguous(x):
    """Realised, its last dimension contiguous (a DMA row of the scratchpad tile)."""
    x = ir.ExternKernel.realize_input(x)
    if _unit(x.get_size()[-1]) or _unit(x.get_stride()[-1]):
        return x
    return ir.ExternKernel.require_contiguous(x)


def _broadcast_mask(mask, sizes):
    """The mask broadcast to (batch, heads, q_len, kv_len): size-1 and missing dimensions
    read with stride 0, so a mask shared by the heads is read once per KV group."""
    mask = ir.ExternKernel.realize_input(mask)
    if not (_unit(mask.get_size()[-1]) or _unit(mask.get_stride()[-1])):
        mask = ir.ExternKernel.require_contiguous(mask)
    mask = ir.ExternKernel.realize_input(ir.ExpandView.create(mask, sizes))
    if _unit(sizes[-1]) or not _known(mask.get_stride()[-1], 0):
        return mask
    return ir.ExternKernel.require_contiguous(mask)  # one value for all keys: made a row of them


def _unit(expr) -> bool:
    return _known(expr, 1)


def _known(expr, n: int) -> bool:
    from torch._inductor.virtualized import V

    return V.graph.sizevars.statically_known_equals(expr, n)


def _static(expr) -> bool:
    return isinstance(expr, int) or getattr(expr, "is_Integer", False)


def install() -> None:
    """The lowering of the attention op (a CPU kernel where the card does not take it)."""
    on_cpu = L.fallback_handler(ATTENTION, add_to_fallback_set=False)

    @L.register_lowering(ATTENTION, type_promotion_kind=None)
    def attention_lowering(query, key, value, attn_mask=None, is_causal=False, scale=None):
        node = lower(query, key, value, attn_mask, is_causal, scale)
        return node if node is not None else on_cpu(query, key, value, attn_mask, is_causal, scale)

    paged_on_cpu = L.fallback_handler(PAGED_ATTENTION, add_to_fallback_set=False)

    @L.register_lowering(PAGED_ATTENTION, type_promotion_kind=None)
    def paged_attention_lowering(query, key_cache, value_cache, block_table, mask, scale):
        node = lower_paged(query, key_cache, value_cache, block_table, mask, scale)
        return node if node is not None else paged_on_cpu(query, key_cache, value_cache, block_table, mask, scale)
