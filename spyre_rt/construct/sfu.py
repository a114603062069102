"""SFU programs: a kernel's SSA body as vector instructions over scratchpad tiles.

Values have a *shape* within a tile of R rows x C columns: ``tile`` (R x C), ``row`` (one
per row), ``col`` (one per column) or ``scalar``, and a storage type: fp32 for float
arithmetic (results round to fp16/bf16 only at explicit conversions and stores, like
Inductor's own backends), int64 for integers, bool. Every instruction reads operands of
any shape and type and writes one destination.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from .. import dtypes
from ..native import lib
from ..program import INSTR, OPND_COL, OPND_IMM, OPND_NONE, OPND_ROW, OPND_SCALAR, OPND_TILE

TILE, ROW, COL, SCALAR = "tile", "row", "col", "scalar"
KIND_CODE = {TILE: OPND_TILE, ROW: OPND_ROW, COL: OPND_COL, SCALAR: OPND_SCALAR}

DTYPE = dtypes.CODE
ITEMSIZE = dtypes.ITEMSIZE
FLOATS = dtypes.FLOATS

UNARY = {
    "neg": lib.SPY_SFU_NEG, "abs": lib.SPY_SFU_ABS, "exp": lib.SPY_SFU_EXP, "log": lib.SPY_SFU_LOG,
    "sqrt": lib.SPY_SFU_SQRT, "rsqrt": lib.SPY_SFU_RSQRT, "tanh": lib.SPY_SFU_TANH,
    "sigmoid": lib.SPY_SFU_SIGMOID, "sin": lib.SPY_SFU_SIN, "cos": lib.SPY_SFU_COS,
    "reciprocal": lib.SPY_SFU_RECIP, "erf": lib.SPY_SFU_ERF, "floor": lib.SPY_SFU_FLOOR,
    "ceil": lib.SPY_SFU_CEIL, "trunc": lib.SPY_SFU_TRUNC, "round": lib.SPY_SFU_ROUND,
    "sign": lib.SPY_SFU_SIGN, "log1p": lib.SPY_SFU_LOG1P, "expm1": lib.SPY_SFU_EXPM1,
    "atan": lib.SPY_SFU_ATAN, "logical_not": lib.SPY_SFU_NOT, "bitwise_not": lib.SPY_SFU_NOT,
    "isnan": lib.SPY_SFU_ISNAN, "identity": lib.SPY_SFU_MOV, "to_dtype": lib.SPY_SFU_MOV,
    "silu": lib.SPY_SFU_SILU,
}
BINARY = {
    "add": lib.SPY_SFU_ADD, "sub": lib.SPY_SFU_SUB, "mul": lib.SPY_SFU_MUL, "truediv": lib.SPY_SFU_DIV,
    "div": lib.SPY_SFU_DIV, "int_truediv": lib.SPY_SFU_DIV, "floordiv": lib.SPY_SFU_FLOORDIV,
    "mod": lib.SPY_SFU_MOD, "fmod": lib.SPY_SFU_MOD, "remainder": lib.SPY_SFU_REMAINDER,
    "maximum": lib.SPY_SFU_MAX, "minimum": lib.SPY_SFU_MIN, "pow": lib.SPY_SFU_POW,
    "logical_and": lib.SPY_SFU_AND, "logical_or": lib.SPY_SFU_OR, "logical_xor": lib.SPY_SFU_XOR,
    "bitwise_and": lib.SPY_SFU_AND, "bitwise_or": lib.SPY_SFU_OR, "bitwise_xor": lib.SPY_SFU_XOR,
    "and_": lib.SPY_SFU_AND, "or_": lib.SPY_SFU_OR, "xor": lib.SPY_SFU_XOR,
}
COMPARE = {"eq": lib.SPY_CMP_EQ, "ne": lib.SPY_CMP_NE, "lt": lib.SPY_CMP_LT, "le": lib.SPY_CMP_LE,
           "gt": lib.SPY_CMP_GT, "ge": lib.SPY_CMP_GE}
REDUCE = {"sum": lib.SPY_SFU_RSUM, "max": lib.SPY_SFU_RMAX, "min": lib.SPY_SFU_RMIN,
          "prod": lib.SPY_SFU_RPROD, "any": lib.SPY_SFU_RANY, "argmax": lib.SPY_SFU_RARGMAX,
          "argmin": lib.SPY_SFU_RARGMIN}


def compute_type(dtype: str) -> str:
    """Storage type of a computed value in the scratchpad."""
    if dtype in FLOATS:
        return "float32"
    if dtype == "bool":
        return "bool"
    return "int64"


def parse_constant(value, dtype: str):
    if isinstance(value, str):
        v = float(value)  # 'inf', '-inf', 'nan'
    else:
        v = value
    if dtype in FLOATS or (dtype == "" and isinstance(v, float)):
        return float(v)
    if dtype == "bool":
        return int(bool(v))
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"integer constant {v}")
        return int(v)
    return int(v)


_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")


class Operand:
    """Where a value lives: a scratchpad region (kind, dtype, byte offset, pitch) or an
    immediate."""

    __slots__ = ("kind", "dtype", "off", "pitch", "imm", "_enc")

    def __init__(self, kind: str, dtype: str, off: int = 0, pitch: int = 0, imm=None):
        self.kind, self.dtype, self.off, self.pitch, self.imm = kind, dtype, off, pitch, imm
        self._enc = None

    def encode(self):
        enc = self._enc
        if enc is None:
            dt = DTYPE[self.dtype]
            if self.imm is not None:
                packed = _F64.pack(float(self.imm)) if self.dtype in FLOATS else _I64.pack(int(self.imm))
                enc = (OPND_IMM, dt, 0, 0, _U64.unpack(packed)[0])
            else:
                enc = (KIND_CODE[self.kind], dt, 0, self.pitch, self.off)
            self._enc = enc
        return enc

    def at(self, off: int) -> Operand:
        return Operand(self.kind, self.dtype, off, self.pitch, self.imm)


NONE = (OPND_NONE, 0, 0, 0, 0)


class Program:
    """Instructions of one SFU command under construction."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def emit(self, op: int, rows: int, cols: int, dst: Operand, *srcs: Operand, aux: int = 0) -> None:
        enc = [s.encode() for s in srcs] + [NONE] * (3 - len(srcs))
        self.rows.append((op, aux, 0, 0, rows, cols, dst.encode(), enc))

    def __len__(self) -> int:
        return len(self.rows)

    def array(self) -> np.ndarray:
        return np.array(self.rows, dtype=INSTR)
