"""What a block and a task of attention cost on one core: the estimates tiles are chosen by."""

from __future__ import annotations

from ... import dtypes
from ...cost import CostModel
from .shape import Shape

# A block's SFU work in passes over S (one per instruction over the tile, the exp counted
# as several) and in instructions: an estimate of the program below, for choosing tiles.
SFU_PASSES = 12
SFU_INSTRS = 16


def block_costs(shape: Shape, target: CostModel, rows: int, keys: int, share: float = 1) -> tuple[float, float, float]:
    """(arrays ns, SFU ns, DRAM bytes) of one block of `rows` query rows per head, its keys
    read by one of `share` cores that walk them together."""
    r = shape.group * rows
    arrays = target.matmul_ns(r, keys, shape.dim, shape.fp32) + target.matmul_ns(r, shape.v_dim, keys, shape.fp32)
    # S, O and the row state are fp32
    sfu = target.sfu_ns(r * keys * SFU_PASSES + r * shape.v_dim, fp32=True, instrs=SFU_INSTRS)
    moved = keys * (shape.dim + shape.v_dim) * shape.e_in / share
    if shape.mask:
        moved += shape.mask_heads * rows * keys * dtypes.ITEMSIZE[shape.mask_dtype]
    return arrays, sfu, moved


def task_ns(shape: Shape, target: CostModel, rows: int, keys: int, kv_block: int, rate: float | None = None,
            share: float = 1) -> float:
    """A task's time on one core: its blocks, each as long as its slowest engine, the
    loads of its queries and the store of its output spread over them."""
    rate = rate or target.core_dma_bytes_per_ns
    full, rest = divmod(keys, kv_block)
    tile = shape.group * rows * (shape.dim + shape.v_dim) * shape.e_in / (full + (rest > 0))

    def block_ns(n: int) -> float:
        arrays, sfu, moved = block_costs(shape, target, rows, n, share)
        return max(arrays, sfu, (moved + tile) / rate)

    return full * block_ns(kv_block) + (block_ns(rest) if rest else 0.0)

