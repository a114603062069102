"""The SFU op table is declared once, in C (native/sfu_ops.h): the opcodes Python sees and
the emitter's op names and arities come from it."""

from spyre_rt.construct import sfu
from spyre_rt.native import lib
from spyre_rt.sfu_ops import SFU_OPS


def test_every_table_row_is_an_opcode_constant_and_back():
    for name, op in SFU_OPS.items():
        assert getattr(lib, f"SPY_SFU_{name}") == op.opcode
    constants = {n.removeprefix("SPY_SFU_") for n in dir(lib)
                 if n.startswith("SPY_SFU_") and not n.startswith(("SPY_SFU_COST_", "SPY_SFU_KIND_"))}
    assert constants == set(SFU_OPS)


def test_table_rows_are_well_formed():
    opcodes = [op.opcode for op in SFU_OPS.values()]
    assert opcodes == sorted(set(opcodes))
    for op in SFU_OPS.values():
        assert 1 <= op.arity <= 3
        assert op.kind in {"map", "cast", "test", "reduce", "iota"}
    assert SFU_OPS["EXP"].transcendental and not SFU_OPS["ADD"].transcendental
    assert SFU_OPS["CMP"].aux_max == lib.SPY_CMP_GE


def test_emitter_names_map_to_table_ops_of_their_arity():
    by_opcode = {op.opcode: op for op in SFU_OPS.values()}
    assert sfu.UNARY and sfu.BINARY and sfu.REDUCE
    assert all(by_opcode[code].arity == 1 for code in sfu.UNARY.values())
    assert all(by_opcode[code].arity == 2 for code in sfu.BINARY.values())
    assert all(by_opcode[code].kind == "reduce" for code in sfu.REDUCE.values())
    assert sfu.UNARY["reciprocal"] == lib.SPY_SFU_RECIP and sfu.BINARY["truediv"] == lib.SPY_SFU_DIV
