"""The scratchpad layout of a loop kernel for tiles of a given number of rows.

Every core uses the same offsets. From the bottom up:

* two slots per load and store (tile t uses slot t % 2, so tile t+1 loads while tile t
  computes), and two slots of buffer rows per gather and scatter;
* one int64 per tile constant, written by the tile's prologue;
* the temporaries of computed values, reused by liveness (a linear scan over the SFU
  stages in order: a region is free again once its value's last reader has run);
* the scratch areas some instructions need as working space (see :func:`scratch_needs`);
* with merged stores (see :mod:`.tiling`), the regions of the groups a core stores, one per
  group, each holding a group's rows of every merged store.

Every region starts on a stick boundary. The layout grows with the rows, which is what
lets the tiling find the largest tile that fits by laying it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...cost import round_up
from ..context import LX_ALIGN
from ..sfu import COL, ITEMSIZE, ROW, SCALAR, TILE, Operand, compute_type, parse_constant
from .analysis import Analysis, Value

# A scratch area is named (what it holds, which of them): "f32", "i64" and "bool" areas
# are a tile of that type, "row" one int64 per row.
ScratchNeed = tuple[str, int]


@dataclass(frozen=True)
class Slots:
    """A value with two scratchpad copies, one per tile slot."""

    kind: str
    dtype: str
    off: tuple[int, int]
    pitch: int  # elements from one row to the next

    def operand(self, slot: int) -> Operand:
        return Operand(self.kind, self.dtype, self.off[slot], self.pitch)


@dataclass(frozen=True)
class ScratchpadLayout:
    """Where everything a tile's commands touch lives in each core's scratchpad."""

    rows_per_tile: int                          # rows of the largest tile it holds
    slots: dict[str, Slots]                     # per load and store
    index_slots: dict[str, Slots]               # per gather and scatter: the buffer row of each tile row
    tile_consts: tuple[tuple[str, str], ...]    # (value id, "index" or "rowbase"), in prologue order
    const_off: dict[tuple[str, str], int]       # where each tile constant lives
    temporaries: dict[str, Operand]             # computed values (constants are immediates)
    scratch: dict[ScratchNeed, int]             # where each scratch area starts
    peak: int                                   # bytes used
    merge_base: int = 0                         # the first group region
    merge_stride: int = 0                       # bytes from one group region to the next
    merge_off: dict[str, int] = field(default_factory=dict)  # per merged store: its rows in a region

    def merge_region(self, region: int) -> int:
        """Where a core's group region `region` starts."""
        return self.merge_base + region * self.merge_stride

    def operand(self, vid: str, slot: int) -> Operand:
        """Where the value `vid` is read in tile slot `slot`."""
        slots = self.slots.get(vid)
        return slots.operand(slot) if slots is not None else self.temporaries[vid]


def scratch_needs(a: Analysis) -> frozenset[ScratchNeed]:
    """The scratch areas the SFU stages of `a` will use (see :mod:`.stages`)."""
    needs: set[ScratchNeed] = set()
    for v in a.values.values():
        op = v.op
        if op.op == "index":
            needs.add(("i64", 0))           # the affine term
            if v.dtype != "int64":
                needs.add(("i64", 1))       # the int64 result before its conversion
        elif op.op == "indirect" and op.attrs.get("wrap_neg", True):
            needs |= {("bool", 0), ("i64", 1)}
        elif op.op == "reduction":
            if a.values[op.args[0]].kind != TILE:  # broadcast over the columns first
                src = a.values[op.args[0]].dtype
                needs.add(("f32", 0) if compute_type(src) == "float32" else ("i64", 1))
            if op.attrs.get("kind") == "m2":
                needs.add(("f32", 1))
        if op.op in ("load", "store") and op.access.ind:
            needs |= {("i64", 0), ("row", 0), ("row", 1)}  # ("row", 1): the index range check
    return frozenset(needs)


def lay_out(a: Analysis, rows: int, needs: frozenset[ScratchNeed], stick_bytes: int, merge_rows: int = 0,
            merge_regions: int = 0, merged: frozenset[str] = frozenset()) -> ScratchpadLayout:
    """The layout of `a` for tiles of at most `rows` rows, and `merge_regions` group regions
    of `merge_rows` rows of the `merged` stores (it is not checked against the scratchpad's
    size: its ``peak`` says what it takes)."""
    stack = _Stack()
    slots, index_slots = _access_slots(a, rows, stick_bytes, stack)
    tile_consts = _tile_consts(a)
    const_off = {c: stack.take(8) for c in tile_consts}
    temporaries = _temporaries(a, rows, stack)
    cells = rows * round_up(a.columns, 8)
    sizes = {"f32": cells * 4, "i64": cells * 8, "bool": cells, "row": rows * 8}
    scratch = {need: stack.take(sizes[need[0]]) for need in sorted(needs)}
    merge_base, region, merge_off = stack.top, _Stack(), {}
    for vid in sorted(merged):
        s = slots[vid]
        merge_off[vid] = region.take(merge_rows * (s.pitch if s.kind == TILE else 1) * ITEMSIZE[s.dtype])
    stack.take(merge_regions * region.top)
    return ScratchpadLayout(rows, slots, index_slots, tile_consts, const_off, temporaries, scratch, stack.top,
                            merge_base, region.top, merge_off)


class _Stack:
    """Regions taken from the bottom of the scratchpad up, each on a stick boundary."""

    def __init__(self) -> None:
        self.top = 0

    def take(self, nbytes: int) -> int:
        off = self.top
        self.top += round_up(nbytes, LX_ALIGN)
        return off


def _region_bytes(kind: str, dtype: str, pitch: int, rows: int) -> int:
    e = ITEMSIZE[dtype]
    return {TILE: rows * pitch * e, ROW: rows * e, COL: pitch * e, SCALAR: e}[kind]


def _access_slots(a: Analysis, rows: int, stick_bytes: int, stack: _Stack) -> tuple[dict, dict]:
    slots: dict[str, Slots] = {}
    index_slots: dict[str, Slots] = {}
    for v in a.values.values():
        op = v.op
        if op.op not in ("load", "store"):
            continue
        # DMAs move whole sticks: a tile row in a slot is padded to them
        pitch = round_up(a.columns, stick_bytes // ITEMSIZE[v.dtype]) if v.kind in (TILE, COL) else 1
        n = max(1, _region_bytes(v.kind, v.dtype, pitch, rows))  # even an empty tile gets its own slots
        slots[op.id] = Slots(v.kind, v.dtype, (stack.take(n), stack.take(n)), pitch)
        if op.access.ind:
            n = max(1, rows * 8)
            index_slots[op.id] = Slots(ROW, "int64", (stack.take(n), stack.take(n)), 1)
    return slots, index_slots


def _tile_consts(a: Analysis) -> tuple[tuple[str, str], ...]:
    """What the prologue writes per tile: the tile's origin for index arithmetic, and the
    first buffer row of each gather and scatter."""
    out = []
    for v in a.values.values():
        if v.op.op == "index":
            out.append((v.op.id, "index"))
        if v.op.op in ("load", "store") and v.op.access.ind:
            out.append((v.op.id, "rowbase"))
    return tuple(out)


@dataclass
class _Region:
    off: int
    size: int


def _temporaries(a: Analysis, rows: int, stack: _Stack) -> dict[str, Operand]:
    """A region per computed value, first fit among the regions of values no longer live."""
    order = [v for lvl in range(a.levels) for v in a.values.values()
             if v.level == lvl and v.op.op not in ("load", "store")]
    last_use = _last_uses(a, order)
    operands: dict[str, Operand] = {}
    regions: dict[str, _Region] = {}
    free: list[_Region] = []
    live: list[tuple[int, str]] = []
    for i, v in enumerate(order):
        for end, vid in list(live):
            if end < i:
                free.append(regions[vid])
                live.remove((end, vid))
        if v.op.op == "constant":
            operands[v.op.id] = Operand(SCALAR, v.dtype, imm=parse_constant(v.op.attrs.get("value"), v.dtype))
            continue
        pitch = round_up(a.columns, 8) if v.kind in (TILE, COL) else 1
        n = round_up(_region_bytes(v.kind, v.dtype, pitch, rows), LX_ALIGN)
        reg = next((r for r in free if r.size >= n), None)
        if reg is not None:
            free.remove(reg)
        else:
            reg = _Region(stack.take(n), n)
        regions[v.op.id] = reg
        operands[v.op.id] = Operand(v.kind, v.dtype, reg.off, pitch)
        live.append((last_use.get(v.op.id, i), v.op.id))
    return operands


def _last_uses(a: Analysis, order: list[Value]) -> dict[str, int]:
    """Per value, the position in `order` of its last reader; past the end for values that
    stores and gathers read after the last stage."""
    after_stages = len(order) + 1
    last_use: dict[str, int] = {}
    for i, v in enumerate(order):
        for arg in v.op.args:
            last_use[arg] = i
    for v in a.values.values():
        if v.op.op == "store":
            for arg in v.op.args:
                last_use[arg] = after_stages  # read by the staging move after the program
        if v.op.op in ("load", "store"):
            for idx, _ in v.op.access.ind:
                last_use[idx] = after_stages
    return last_use
