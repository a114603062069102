"""The card's SFU op table, as the native module declares it (``native/sfu_ops.h``).

Opcodes, arities, cost classes and kinds are declared once, in C; construction code
reads them here instead of restating them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .native import check, ffi, lib

_KINDS = {lib.SPY_SFU_KIND_MAP: "map", lib.SPY_SFU_KIND_CAST: "cast", lib.SPY_SFU_KIND_TEST: "test",
          lib.SPY_SFU_KIND_REDUCE: "reduce", lib.SPY_SFU_KIND_IOTA: "iota"}


@dataclass(frozen=True)
class SfuOp:
    """One row of the op table: ``name`` is the opcode's name without ``SPY_SFU_``."""

    name: str
    opcode: int
    arity: int
    aux_max: int
    transcendental: bool
    kind: str  # map, cast, test, reduce or iota (see sfu_ops.h)


def _read() -> dict[str, SfuOp]:
    table, n = ffi.new("const spy_sfu_op **"), ffi.new("uint32_t *")
    check(lib.spy_sfu_ops(table, n), "reading the SFU op table")
    ops = {}
    for row in (table[0][i] for i in range(n[0])):
        name = ffi.string(row.name).decode()
        ops[name] = SfuOp(name, int(row.opcode), int(row.arity), int(row.aux_max),
                          row.cost == lib.SPY_SFU_COST_TRANSCENDENTAL, _KINDS[row.kind])
    return ops


SFU_OPS: dict[str, SfuOp] = _read()
