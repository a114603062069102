"""What a constructed kernel computes and moves: the facts the profiler places against the
card's roofline (:mod:`spyre_rt.job_facts`).

From the description: its kind, aten ops and module, the FLOPs it must do (a multiply-add
counts as 2) and the fewest DRAM bytes it must move (every buffer it touches, once). From
the program construction made: the DRAM bytes its commands move, the cores they run on and
the scratchpad each core holds at most.
"""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes
from ..native import check, ffi, lib
from .context import BuildContext

# loop-body operations that are not arithmetic: data movement and index bookkeeping
_NOT_ARITHMETIC = {"load", "store", "constant", "index", "indirect", "to_dtype", "where"}


# aten ops that only rearrange or make constants: not what a kernel is named by
_PLUMBING = {"view", "_unsafe_view", "reshape", "permute", "expand", "unsqueeze", "squeeze", "slice", "select",
             "t", "transpose", "alias", "clone", "convert_element_type", "iota", "full", "scalar_tensor",
             "_to_copy", "copy_"}
_MATMULS = {"mm", "bmm", "addmm", "baddbmm"}


def principal_ops(kernel) -> list[str]:
    """The aten ops a kernel is named by: the matmul of a matmul kernel, the computing ops of
    a loop kernel (without views and constants), each once."""
    def name(origin: str) -> str:  # "aten.mm.default" -> "mm"
        parts = origin.split(".")
        return parts[1] if len(parts) > 2 else parts[-1]

    ops = sorted({name(o) for o in kernel.origins})
    if kernel.kind == "matmul":
        return [o for o in ops if o in _MATMULS] or ops
    return [o for o in ops if o not in _PLUMBING] or ops


def kernel_facts(kernel, ctx: BuildContext) -> dict:
    facts = {"kind": getattr(kernel, "shape", None) or kernel.kind, "op": principal_ops(kernel),
             "module": getattr(kernel, "module", ""), "flops": flops(kernel),
             "dram_bytes_min": min_bytes(kernel), **program_facts(ctx)}
    dtype = getattr(kernel, "in_dtype", "") or next((b.dtype for b in kernel.buffers if b.dtype in dtypes.FLOATS), "")
    if dtype:
        facts["dtype"] = dtype
    return facts


def flops(kernel) -> int:
    if kernel.kind == "matmul":
        batch, m, k = kernel.a[2]
        return 2 * batch * m * k * sum(b[2][2] for b in (kernel.b, *(b for b, _ in kernel.parts)))
    if kernel.kind == "attention":
        return attention_flops(kernel)
    arithmetic = sum(1 for op in kernel.ops if op.op not in _NOT_ARITHMETIC)
    return math.prod(kernel.sizes) * arithmetic


def attention_flops(kernel) -> int:
    """Q K^T and P V over the (query, key) pairs the result depends on: with a causal
    mask the keys up to each query's diagonal; with a mask tensor, every pair (which it
    keeps is known only when it runs)."""
    batch, heads, q_len, dim = kernel.q[2]
    kv_len, v_dim = kernel.v[2][2], kernel.v[2][3]
    if kernel.page:  # paged: the keys are the table's pages
        kv_len = kernel.block_table[2][1] * kernel.page
    if kernel.causal:
        seen = np.clip(np.arange(q_len) + 1 + kernel.q_offset, 0, kv_len)
        pairs = int(seen.sum())
    else:
        pairs = q_len * kv_len
    return 2 * batch * heads * pairs * (dim + v_dim)


def min_bytes(kernel) -> int:
    """Each buffer once: the largest box through which the kernel touches it. A loop
    kernel's indirect accesses (gathers and scatters) move an element per iteration over the
    variables the access and its indices vary with; a buffer's indirect accesses are summed
    (a paged cache gives its keys and its values to one gather), at most the buffer whole."""
    itemsize = {b.name: dtypes.ITEMSIZE.get(b.dtype, 4) for b in kernel.buffers}
    per_buffer: dict[str, int] = {}
    indirect = _indirect_elements(kernel) if kernel.kind == "loop" else {}
    for buf, sizes in _direct_views(kernel):
        per_buffer[buf] = max(per_buffer.get(buf, 0), math.prod(sizes) * itemsize.get(buf, 4))
    whole = {b.name: math.prod(b.sizes) * itemsize[b.name] for b in kernel.buffers}
    if kernel.kind == "attention" and kernel.page:  # the pages the table names, not the cache
        indirect = _paged_elements(kernel)
        for buf in indirect:
            per_buffer.pop(buf, None)
    for buf, elements in indirect.items():
        moved = elements * itemsize.get(buf, 4)
        per_buffer[buf] = max(per_buffer.get(buf, 0), min(moved, whole.get(buf, moved)))
    return sum(per_buffer.values())


def _paged_elements(kernel) -> dict[str, int]:
    """A paged attention's keys and values: each batch element's pages, once per KV head."""
    batch, width = kernel.block_table[2]
    moved: dict[str, int] = {}
    for buf, _, (_, kv_heads, page, dim), _ in (kernel.k, kernel.v):
        moved[buf] = moved.get(buf, 0) + batch * width * kv_heads * page * dim
    return moved


def _direct_views(kernel) -> list[tuple[str, tuple[int, ...]]]:
    """(buffer, box sizes) of every access that is not indirect (a dimension it is broadcast
    along, a stride of 0, is not part of the box)."""
    if kernel.kind != "loop":
        return [(buf, tuple(n for n, s in zip(sizes, strides, strict=True) if s and n > 1))
                for buf, _, sizes, strides in kernel.views()]
    return [(op.access.buf, tuple(n for n, c in zip(kernel.sizes, op.access.coeffs, strict=True) if c and n > 1))
            for op in kernel.ops if op.access is not None and op.access.buf and not op.access.ind]


def _indirect_elements(kernel) -> dict[str, int]:
    """Elements each buffer's indirect accesses move: per access, the iterations over the
    loop variables that it or the values indexing it vary with."""
    ops = {op.id: op for op in kernel.ops}

    def variables(op_id: str, seen: set[str]) -> set[int]:
        if op_id in seen or op_id not in ops:
            return set()
        seen.add(op_id)
        op = ops[op_id]
        out: set[int] = set()
        if op.access is not None:
            out |= {v for v, c in enumerate(op.access.coeffs) if c}
            for ind, _ in op.access.ind:
                out |= variables(ind, seen)
        for arg in op.args:
            if isinstance(arg, str):
                out |= variables(arg, seen)
        return out

    moved: dict[str, int] = {}
    for op in kernel.ops:
        if op.access is not None and op.access.buf and op.access.ind:
            dims = variables(op.id, set())
            moved[op.access.buf] = moved.get(op.access.buf, 0) + math.prod(kernel.sizes[v] for v in dims)
    return moved


def program_facts(ctx: BuildContext) -> dict:
    dram, cores = footprint(*ctx.sections())
    return {"dram_bytes": dram, "cores": cores, "scratchpad_peak": int(ctx.scratchpad_peak)}


def footprint(cmds: np.ndarray, descs: np.ndarray) -> tuple[int, int]:
    """(bytes the program's DMA, gather and scatter commands move between DRAM and the
    scratchpads, distinct cores its commands run on): ``spy_program_footprint``."""
    cmds, descs = np.ascontiguousarray(cmds), np.ascontiguousarray(descs)
    out, cores = ffi.new("uint64_t *"), ffi.new("uint32_t *")
    check(lib.spy_program_footprint(ffi.from_buffer("spy_cmd[]", cmds), len(cmds),
                                    ffi.from_buffer("spy_desc[]", descs), len(descs), out, cores),
          "counting a program's DRAM bytes")
    return int(out[0]), int(cores[0])


def dram_bytes(cmds: np.ndarray, descs: np.ndarray) -> int:
    """Bytes the program's DMA, gather and scatter commands move between DRAM and the
    scratchpads."""
    return footprint(cmds, descs)[0]
