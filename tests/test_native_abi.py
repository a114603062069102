"""The Python copies of spyre.h's structures and constants match the compiled module.

spyre_rt.program builds program and plan blocks with numpy dtypes, and spyre_rt.card reads
the trace through one: each must agree with its C structure field by field (name, offset,
type, array length) and in size, or blocks would be misread by the card and plan files
would mean something else in C than in Python.
"""

import numpy as np
import pytest

from spyre_rt import card, program
from spyre_rt.native import ffi, lib

_CMD_HEADER = {"op", "flags", "core", "dep_begin", "ndeps", "reserved", "pad"}
# numpy dtype -> (C struct, C union member of spy_cmd or None, numpy name -> C name)
MIRRORS = {
    "CMD_DMA": ("spy_cmd", "dma", {}),
    "CMD_MM": ("spy_cmd", "mm", {"mm_reserved": "reserved"}),
    "CMD_SFU": ("spy_cmd", "sfu", {"sfu_reserved": "reserved"}),
    "CMD_RING": ("spy_cmd", "ring", {"ring_src": "src_off", "ring_dst": "dst_off", "ring_reserved": "reserved"}),
    "CMD_GATHER": ("spy_cmd", "gather", {"g_reserved": "reserved"}),
    "OPERAND": ("spy_operand", None, {}),
    "INSTR": ("spy_instr", None, {}),
    "SLOT": ("spy_slot", None, {}),
    "DESC": ("spy_desc", None, {}),
    "JOB_HEADER": ("spy_job_header", None, {}),
    "PLAN_HEADER": ("spy_plan_header", None, {}),
    "PLAN_JOB": ("spy_plan_job", None, {}),
    "COLLECTIVE": ("spy_collective", None, {}),
    "RELOC": ("spy_reloc", None, {}),
    "LAYOUT": ("spy_layout", None, {}),
    "LOOP_INSTR": ("spy_loop_instr", None, {}),
    "LOOP_TILE": ("spy_loop_tile", None, {}),
    "LOOP_MERGE": ("spy_loop_merge", None, {}),
}
_C_SCALAR = {"uint8_t": ("u", 1), "uint16_t": ("u", 2), "uint32_t": ("u", 4), "uint64_t": ("u", 8),
             "int32_t": ("i", 4), "int64_t": ("i", 8), "double": ("f", 8)}


def _c_path(variant: str | None, renames: dict[str, str], name: str) -> tuple[str, ...]:
    if variant is None or name in _CMD_HEADER:
        return (renames.get(name, name),)
    return ("u", variant, renames.get(name, name))


def _c_field(ctype: str, path: tuple[str, ...]):
    """Offset from the start of ctype and the C type of the field at path."""
    t, offset = ffi.typeof(ctype), 0
    for name in path:
        fields = dict(t.fields)
        assert name in fields, f"{ctype} has no field {'.'.join(path)}"
        offset += fields[name].offset
        t = fields[name].type
    return offset, t


def _same_type(np_type: np.dtype, c_type, where: str) -> None:
    if np_type.subdtype is not None:
        base, shape = np_type.subdtype
        assert c_type.kind == "array" and (c_type.length,) == shape, f"{where}: {c_type.cname} vs {np_type}"
        _same_type(base, c_type.item, where)
    elif np_type.fields is not None:
        assert c_type.kind == "struct", f"{where}: {c_type.cname} vs a numpy record"
        _same_layout(np_type, c_type.cname, None, {})
    elif c_type.kind == "union":  # spy_operand.v: one 8-byte word, read as off/imm_f/imm_i
        assert np_type.itemsize == ffi.sizeof(c_type), where
    else:
        assert c_type.kind == "primitive", f"{where}: {c_type.cname}"
        assert (np_type.kind, np_type.itemsize) == _C_SCALAR[c_type.cname], f"{where}: {c_type.cname} vs {np_type}"


def _leaf_paths(c_type, prefix: tuple[str, ...], variant: str | None) -> set[tuple[str, ...]]:
    """Every field path of a C struct, down into spy_cmd's union member `variant`."""
    out = set()
    for name, field in c_type.fields:
        if field.type.kind == "union" and variant is not None:
            out |= {(name, variant, n) for n, _ in dict(field.type.fields)[variant].type.fields}
        else:
            out.add((*prefix, name))
    return out


def _same_layout(dtype: np.dtype, ctype: str, variant: str | None, renames: dict[str, str]) -> None:
    assert dtype.itemsize == ffi.sizeof(ctype), f"{ctype}: {ffi.sizeof(ctype)} bytes, numpy {dtype.itemsize}"
    covered = set()
    for name, (np_type, offset) in dtype.fields.items():
        path = _c_path(variant, renames, name)
        c_offset, c_type = _c_field(ctype, path)
        where = f"{ctype}.{'.'.join(path)} (numpy {name!r})"
        assert offset == c_offset, f"{where}: offset {c_offset} in C, {offset} in numpy"
        _same_type(np_type, c_type, where)
        covered.add(path)
    missing = _leaf_paths(ffi.typeof(ctype), (), variant) - covered
    assert not missing, f"{ctype}: fields without a numpy copy: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(MIRRORS))
def test_program_dtype_matches_its_c_structure(name):
    ctype, variant, renames = MIRRORS[name]
    _same_layout(getattr(program, name), ctype, variant, renames)


def test_trace_event_matches_its_c_structure():
    _same_layout(card.TRACE_EVENT, "spy_trace_event", None, {})


def test_constants_restated_in_python_match_spyre_h():
    operands = (program.OPND_NONE, program.OPND_TILE, program.OPND_ROW, program.OPND_COL,
                program.OPND_SCALAR, program.OPND_IMM)
    assert operands == (lib.SPY_OPND_NONE, lib.SPY_OPND_TILE, lib.SPY_OPND_ROW, lib.SPY_OPND_COL,
                        lib.SPY_OPND_SCALAR, lib.SPY_OPND_IMM)
    assert (card.EV_JOB, card.EV_CMD, card.EV_HOST, card.EV_LAUNCH) == (
        lib.SPY_EV_JOB, lib.SPY_EV_CMD, lib.SPY_EV_HOST, lib.SPY_EV_LAUNCH)
    assert (card.MEM_DATA, card.MEM_CONTROL, card.CORE_CARD) == (lib.SPY_MEM_DATA, lib.SPY_MEM_CONTROL,
                                                                 lib.SPY_CORE_CARD)
    assert len(card.ENGINE_NAMES) == lib.SPY_ENG_PER_CORE
    assert (lib.SPY_ENG_H2D, lib.SPY_ENG_D2H, lib.SPY_ENG_CTRL) == tuple(range(len(card.CARD_ENGINE_NAMES)))
