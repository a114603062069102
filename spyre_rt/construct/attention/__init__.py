"""Attention construction: flash attention over the cores, S and P in the scratchpads.

The work is cut into *tasks*: one KV head of one batch element and a tile of query rows.
The query heads that share the KV head (its group) are folded into the rows of one tile,
head-major (row ``g * rows + i`` is query ``q0 + i`` of the group's head g), so each block
of K and V is read once for the group and each matmul is group times taller. A task walks
its keys in blocks, keeping S and P in the scratchpad (FlashAttention's online softmax):

    S  = Q K^T                    systolic arrays, fp32 sums; K read transposed in place
    S  = S * scale (+ mask)       SFU; causal blocks across the diagonal masked by an iota
    m' = max(m, rowmax S)         the running max m and sum l of each row
    P  = exp(S - m')              rounded to the operands' dtype for the arrays
    l  = l * exp(m - m') + rowsum P
    O  = O * exp(m - m') + P V

and stores ``O / l`` once. Blocks above the causal diagonal are never visited. When there
are fewer tasks than cores (decode: one query row per head), the keys of a task are split
into *parts* on several cores; each part sends its (m, l, O) over the ring to the core of
the first part, which combines them and stores.

Per core the engines overlap: loads of the next blocks (two scratchpad slots each for Q, K,
V and mask), the matmul S of the next block while the SFU works on this one, then PV. The
cores of a KV head walk its keys together, step by step, one loading each block and sending
it to the others; where the steps are several and the keys fit, each core keeps them (a
slot for every block of the keys, ``Tiling.resident``), so that a step loads only the keys
past those of the steps before.
Every core lays its scratchpad out alike, so one SFU program serves every block of a kind.
Tile sizes and the tasks of each core come from a small cost model over the card's
figures (:func:`choose`).

Python decides, once per kernel, and C builds: :func:`decide` makes the kernel's decision
record (the tiling, one core's scratchpad regions, each operand's slot and view), and every
build hands it to the native builder (``spy_build_attention``, native/build_attention.c),
which makes the commands, the DMA patterns, the SFU programs, the dependencies and the
encoded program. The rooms:

* :mod:`.shape` — the numbers of the attention that shape its tiles;
* :mod:`.cost` — what a block and a task cost on one core;
* :mod:`.tasks` — the tasks of a tiling and the cores they run on;
* :mod:`.scratchpad` — one core's scratchpad regions;
* :mod:`.tiling` — the choice: every candidate estimated, the fastest that fits;
* :mod:`.record` — the decisions as the native builder reads them.
"""

from __future__ import annotations

from ... import dtypes
from ...ir import View
from ..context import BuildContext, Refused
from .cost import SFU_INSTRS, SFU_PASSES, block_costs, task_ns
from .record import Record
from .scratchpad import Scratchpad
from .shape import Shape
from .tasks import (
    BATCH,
    COLUMNS,
    CORE,
    GROUP,
    KV0,
    KV1,
    KV_HEAD,
    LEADER,
    PART,
    PARTS,
    Q0,
    ROWS,
    STEP,
    Tiling,
    make_tasks,
)
from .tiling import choose, estimate

__all__ = ["BATCH", "COLUMNS", "CORE", "GROUP", "KV0", "KV1", "KV_HEAD", "LEADER", "PART", "PARTS", "Q0", "ROWS",
           "SFU_INSTRS", "SFU_PASSES", "STEP", "Record", "Scratchpad", "Shape", "Tiling", "block_costs", "build",
           "choose", "decide", "estimate", "make_tasks", "task_ns"]


def decide(ctx: BuildContext, kernel) -> Record:
    """The decisions of an :class:`~spyre_rt.ir.AttentionKernel` on the context's card:
    its tiling, scratchpad regions and operands, as the native builder's record."""

    def view(v) -> View | None:
        if v is None:
            return None
        name, off, sizes, strides = v
        return View(name, off + ctx.offset(name), tuple(sizes), tuple(strides))

    for dt in (kernel.dtype,):
        if dt not in dtypes.MATMUL:
            raise Refused(f"attention in {dt}")
    views = {n: view(getattr(kernel, n)) for n in ("q", "k", "v", "out", "mask")}
    views["table"] = view(kernel.block_table) if kernel.page else None
    shape = Shape.of(kernel, views["q"], views["k"], views["v"], views["mask"], views["table"])
    if shape.page:
        _paged_fits(ctx, shape, views)
    tiling = choose(shape, ctx.target)
    lx = Scratchpad(shape, ctx.target, tiling)
    return Record(ctx.target, shape, tiling, lx, views, ctx.layouts, kernel.scale)


def _paged_fits(ctx: BuildContext, shape: Shape, views: dict) -> None:
    """Paged keys and values are gathered a key per storage row, whole sticks from column 0
    (native/build_attention.c): refuse a cache or table laid out otherwise."""
    if shape.causal:
        raise Refused("paged attention with a causal diagonal (paged attention masks by positions)")
    if shape.table_dtype not in ("int64", "int32"):
        raise Refused(f"a block table of {shape.table_dtype}")
    for name in ("k", "v"):
        v = views[name]
        row_len = ctx.layouts[v.buf].row_len
        if v.strides[3] != 1 or v.strides[2] != row_len or v.offset % row_len or any(
                s % row_len for s in v.strides[:2]):
            raise Refused(f"a paged {name} cache that is not one storage row per key")


def build(ctx: BuildContext, kernel, record: Record | None = None) -> Record:
    """Build an :class:`~spyre_rt.ir.AttentionKernel` into the context's program;
    returns its decision record (pass it back to build it again on the same target: the
    native builder alone then runs)."""
    record = record or decide(ctx, kernel)
    record.build(ctx)
    return record
