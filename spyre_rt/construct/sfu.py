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
from ..program import INSTR, OPND_COL, OPND_FIXED, OPND_IMM, OPND_NONE, OPND_ROW, OPND_SCALAR, OPND_TILE
from ..sfu_ops import SFU_OPS

TILE, ROW, COL, SCALAR = "tile", "row", "col", "scalar"
KIND_CODE = {TILE: OPND_TILE, ROW: OPND_ROW, COL: OPND_COL, SCALAR: OPND_SCALAR}

DTYPE = dtypes.CODE
ITEMSIZE = dtypes.ITEMSIZE
FLOATS = dtypes.FLOATS

# Inductor's names for the card's SFU ops; opcodes and arities come from the card's op
# table (native/sfu_ops.h, read through spyre_rt.sfu_ops).
_CARD_OP = {name: name.upper() for name in (
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos", "erf", "floor", "ceil",
    "trunc", "round", "sign", "log1p", "expm1", "atan", "isnan", "silu", "signbit",
    "add", "sub", "mul", "div", "floordiv", "mod", "remainder", "pow", "xor",
)} | {
    "reciprocal": "RECIP", "logical_not": "NOT", "bitwise_not": "NOT", "identity": "MOV", "to_dtype": "MOV",
    "truediv": "DIV", "int_truediv": "DIV", "fmod": "MOD", "maximum": "MAX", "minimum": "MIN",
    "logical_and": "AND", "logical_or": "OR", "logical_xor": "XOR", "bitwise_and": "AND", "bitwise_or": "OR",
    "bitwise_xor": "XOR", "and_": "AND", "or_": "OR",
}
UNARY = {name: SFU_OPS[op].opcode for name, op in _CARD_OP.items() if SFU_OPS[op].arity == 1}
TESTS = frozenset(name for name, op in _CARD_OP.items() if SFU_OPS[op].kind == "test")  # bool results
BINARY = {name: SFU_OPS[op].opcode for name, op in _CARD_OP.items() if SFU_OPS[op].arity == 2}
COMPARE = {"eq": lib.SPY_CMP_EQ, "ne": lib.SPY_CMP_NE, "lt": lib.SPY_CMP_LT, "le": lib.SPY_CMP_LE,
           "gt": lib.SPY_CMP_GT, "ge": lib.SPY_CMP_GE}
REDUCE = {kind: SFU_OPS["R" + kind.upper()].opcode
          for kind in ("sum", "max", "min", "prod", "any", "argmax", "argmin")}


def compute_type(dtype: str) -> str:
    """Storage type of a computed value in the scratchpad."""
    if dtype in FLOATS:
        return "float32"
    if dtype == "bool":
        return "bool"
    if dtype in DTYPE:  # the integer types
        return "int64"
    raise ValueError(f"the card does not compute in {dtype}")


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

    __slots__ = ("kind", "dtype", "off", "pitch", "imm", "fixed", "_enc")

    def __init__(self, kind: str, dtype: str, off: int = 0, pitch: int = 0, imm=None, fixed: bool = False):
        self.kind, self.dtype, self.off, self.pitch, self.imm = kind, dtype, off, pitch, imm
        self.fixed = fixed  # (a matmul's programs) it stays put in every strip: it holds one
        self._enc = None

    def encode(self):
        enc = self._enc
        if enc is None:
            dt = DTYPE[self.dtype]
            if self.imm is not None:
                packed = _F64.pack(float(self.imm)) if self.dtype in FLOATS else _I64.pack(int(self.imm))
                enc = (OPND_IMM, dt, 0, 0, _U64.unpack(packed)[0])
            else:
                enc = (KIND_CODE[self.kind], dt, OPND_FIXED if self.fixed else 0, self.pitch, self.off)
            self._enc = enc
        return enc

    def at(self, off: int) -> Operand:
        return Operand(self.kind, self.dtype, off, self.pitch, self.imm, self.fixed)


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
