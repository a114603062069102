"""Element types: one table from which every other name of a dtype derives.

Each dtype the card stores has a row: its torch dtype, its name in kernel descriptions
(``"float16"``), its code in the card's command format (``SPY_DT_*``), its size and its
DLPack type code. Construction, the executor and the tensor layer all read this table.

float64 is stored but never computed on: the card has no fp64 arithmetic, so compiled
steps run every operation that reads or makes a float64 on the CPU (code ``None``: no
command ever names it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .native import lib


class DType(NamedTuple):
    torch: torch.dtype
    name: str            # as kernel descriptions name it
    code: int | None     # SPY_DT_* of the command format; None: stored, never computed on
    itemsize: int
    dlpack: tuple[int, int]  # (type code, bits): 0 int, 1 uint, 2 float, 4 bfloat, 6 bool
    is_float: bool


TABLE = (
    DType(torch.float32, "float32", lib.SPY_DT_F32, 4, (2, 32), True),
    DType(torch.float16, "float16", lib.SPY_DT_F16, 2, (2, 16), True),
    DType(torch.bfloat16, "bfloat16", lib.SPY_DT_BF16, 2, (4, 16), True),
    DType(torch.int64, "int64", lib.SPY_DT_I64, 8, (0, 64), False),
    DType(torch.int32, "int32", lib.SPY_DT_I32, 4, (0, 32), False),
    DType(torch.int8, "int8", lib.SPY_DT_I8, 1, (0, 8), False),
    DType(torch.uint8, "uint8", lib.SPY_DT_U8, 1, (1, 8), False),
    DType(torch.bool, "bool", lib.SPY_DT_BOOL, 1, (6, 8), False),
    DType(torch.float64, "float64", None, 8, (2, 64), True),
)
BY_TORCH = {d.torch: d for d in TABLE}
BY_NAME = {d.name: d for d in TABLE}
SUPPORTED = tuple(BY_TORCH)
ITEMSIZE = {d.name: d.itemsize for d in TABLE}
CODE = {d.name: d.code for d in TABLE if d.code is not None}   # the dtypes the card computes on
NAME = {code: name for name, code in CODE.items()}             # the name of a card dtype code
FLOATS = frozenset(d.name for d in TABLE if d.is_float and d.code is not None)
# the systolic arrays' operand types (their accumulators are fp32)
MATMUL = frozenset({"float32", "float16", "bfloat16"})


def of(dtype: torch.dtype) -> DType:
    """The row of a torch dtype; a clear TypeError for one the card cannot hold."""
    try:
        return BY_TORCH[dtype]
    except KeyError:
        raise TypeError(f"spyre tensors cannot hold {dtype}; supported: {[str(d) for d in SUPPORTED]}") from None


def name(dtype: torch.dtype | str) -> str:
    """The description name of a dtype (``torch.float16`` -> ``"float16"``)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name_: str) -> torch.dtype:
    return BY_NAME[name_].torch
