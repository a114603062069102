"""The decision record of an attention: what Python decides once per kernel, as the native
builder (``spy_build_attention``, native/build_attention.c) reads it."""

from __future__ import annotations

import numpy as np

from ... import dtypes
from ...cost import CostModel
from ...ir import View
from ...native import ffi, lib
from ...program import built_block
from ..context import BuildContext
from .scratchpad import Scratchpad
from .shape import Shape
from .tasks import Tiling

MASK_KIND = {"": lib.SPY_ATTN_MASK_NONE, "bool": lib.SPY_ATTN_MASK_BOOL, "add": lib.SPY_ATTN_MASK_ADD}
OPERANDS = ("q", "k", "v", "mask", "out", "table")  # the order their buffers take slots in


class Record:
    """Everything a build of one attention kernel needs, decided at its first build: the
    tiling (its tasks on their cores), one core's scratchpad regions, each operand's slot
    and view, held as a ``spy_attention_record`` (with the arrays it points into). Every
    build, every launch in ``construct`` mode among them, hands it to the native builder
    as it is, which makes the commands, DMA patterns, SFU programs, dependencies and the
    encoded program."""

    def __init__(self, target: CostModel, shape: Shape, tiling: Tiling, lx: Scratchpad, views: dict[str, View | None],
                 layouts: dict, scale: float):
        self.shape, self.tiling, self.lx, self.views, self.layouts = shape, tiling, lx, views, layouts
        self.scratchpad_peak = lx.top
        tasks = np.ascontiguousarray(tiling.tasks, dtype=np.int64)
        self.slot_of: dict[str, int] = {}
        if len(tasks):  # a program without commands binds no buffer
            for name in OPERANDS:
                if views[name] is not None:
                    self.slot_of.setdefault(views[name].buf, len(self.slot_of))
        extents = [layouts[buf].nbytes for buf in self.slot_of]
        self._keep = [tasks, ffi.new("uint64_t[]", extents or [0])]
        self.c = ffi.new("spy_attention_record *", {
            "num_cores": target.num_cores, "nslots": len(extents), "scratchpad_bytes": target.scratchpad_bytes,
            "batch": shape.batch, "heads": shape.heads, "kv_heads": shape.kv_heads, "q_len": shape.q_len,
            "kv_len": shape.kv_len, "dim": shape.dim, "v_dim": shape.v_dim, "dtype": dtypes.CODE[shape.dtype],
            "mask_kind": MASK_KIND[shape.mask],
            "mask_dtype": dtypes.CODE[shape.mask_dtype] if shape.mask else 0,
            "mask_heads": shape.mask_heads, "causal": int(shape.causal), "q_offset": shape.q_offset,
            "scale": float(scale), "q_rows": tiling.q_rows, "kv_block": tiling.kv_block, "ntasks": len(tasks),
            "tasks": ffi.cast("spy_attention_task *", ffi.from_buffer(tasks)) if len(tasks) else ffi.NULL,
            "slot_extent": self._keep[1],
            **{name: self._view(views[name], layouts) for name in OPERANDS},
            "lx": self._regions(lx),
            "page": shape.page, "table_dtype": dtypes.CODE[shape.table_dtype] if shape.page else 0,
            "lx_table": lx.table, "table_pitch": lx.table_pitch, "table_rows": lx.table_rows,
        })

    def _view(self, view: View | None, layouts: dict) -> dict:
        if view is None or view.buf not in self.slot_of:
            return {}
        pad = 4 - len(view.sizes)  # the block table is (batch, pages): (batch, pages, 1, 1)
        return {"slot": self.slot_of[view.buf], "layout": tuple(layouts[view.buf]), "offset": view.offset,
                "sizes": list(view.sizes) + [1] * pad, "strides": list(view.strides) + [1] * pad}

    @staticmethod
    def _regions(lx: Scratchpad) -> dict:
        if lx.recv != [lx.recv[0] + i * lx.state_bytes for i in range(len(lx.recv))]:
            raise ValueError("the record holds the received states as one run of regions")
        return {"q": lx.q, "k": lx.k, "v": lx.v, "mask": lx.mask, "s": lx.s, "p": lx.p or 0, "state": lx.state,
                "recv": lx.recv[0] if lx.recv else 0, "mn": lx.mn, "safe": lx.safe, "alpha": lx.alpha, "t": lx.t,
                "flag": lx.flag, "diag": lx.diag, "diag_flag": lx.diag_flag, "stage": lx.stage,
                "q_pitch": lx.q_pitch, "k_pitch": lx.k_pitch, "v_pitch": lx.v_pitch, "m_pitch": lx.m_pitch,
                "s_pitch": lx.s_pitch, "p_pitch": lx.p_pitch, "o_pitch": lx.o_pitch, "flag_pitch": lx.flag_pitch,
                "stage_pitch": lx.stage_pitch, "row_bytes": lx.row_bytes, "state_bytes": lx.state_bytes,
                "kv_slots": lx.kv_slots}

    @property
    def tasks(self) -> np.ndarray:
        return self.tiling.tasks

    def build(self, ctx: BuildContext) -> None:
        """The kernel's program, built natively into the context."""
        ctx.slot_of = dict(self.slot_of)
        ctx.block = built_block(lib.spy_build_attention, self.c, "building an attention kernel")
        ctx.scratchpad_peak = self.scratchpad_peak
