"""What a matmul computes, as plain data: its views, dtypes and the shape they imply."""

from __future__ import annotations

from dataclasses import dataclass

from ... import dtypes
from ...ir import Epilogue, Prologue, View
from ...native import lib
from ..sfu import COL, ROW
from . import epilogue

ITEMSIZE = {dtypes.CODE[n]: dtypes.ITEMSIZE[n] for n in dtypes.MATMUL}  # by SPY_DT_* code
# rows of A a prologue rewrites at a time: its temporaries hold a strip, not a chunk
PRO_STRIP = 32
EPI_STRIP = 32  # rows of a tile an epilogue's program runs on at a time (its temporaries hold them)


@dataclass(frozen=True)
class MatmulSpec:
    a: View          # (batch, M, K)
    b: View          # (batch, K, N)
    out: View        # (batch, M, N)
    in_dtype: int    # spy dtype of A and B
    out_dtype: int
    bias: View | None = None  # broadcast to (batch, M, N)
    bias_dtype: int = 0
    alpha: float = 1.0
    beta: float = 1.0
    epilogue: Epilogue | None = None  # its views in logical elements of the storages, as the others
    prologue: Prologue | None = None  # A made from its inputs (`a` is its first), views as the others
    parts: tuple[tuple[View, View], ...] = ()  # more (B, out) column blocks after `b`/`out`: a grouped matmul


@dataclass(frozen=True)
class Problem:
    """The shape of a matmul as tiling sees it: sizes, element sizes, orientations."""

    batch: int
    m: int
    n: int
    k: int
    e_in: int
    e_out: int
    e_bias: int      # 0: no bias
    trans_a: bool    # A is read with M contiguous (its K dimension is the strided one)
    trans_b: bool    # B is read with K contiguous (a weight used as W.t())
    fp32: bool       # fp32 operands: the systolic arrays run at a fraction of their rate
    # a fused epilogue (see .epilogue): the element sizes of the tiles it stores (the
    # product's when empty), of the tiles and rows it loads, its temporaries and instructions
    stores: tuple[int, ...] = ()
    epi_tiles: tuple[int, ...] = ()
    epi_rows: tuple[int, ...] = ()
    epi_temps: int = 0
    epi_temp_e: int = 4
    epi_instrs: int = 0
    # an A prologue (see .epilogue.prologue_plan): its temporaries, instructions per chunk and
    # the element sizes of its vectors per row of A and per column
    pro_temps: int = 0
    pro_temp_e: int = 4
    pro_instrs: int = 0
    pro_rows: tuple[int, ...] = ()
    pro_cols: tuple[int, ...] = ()
    pro_strip: int = 0
    epi_strip: int = 0  # rows an epilogue's temporaries hold (0: a whole tile's)

    @classmethod
    def of(cls, spec: MatmulSpec) -> Problem:
        batch, m, k = spec.a.sizes
        extra = {}
        if spec.epilogue is not None:
            ep = spec.epilogue
            pl = epilogue.plan(ep)
            # (a periodic table of the tile's rows: at most a tile's worth)
            tiled = ("tile", epilogue.PERIODIC_ROWS)
            tiles = [e for e, kind in zip(ep.input_dtypes, pl.input_kinds, strict=True) if kind in tiled]
            rows = [e for e, kind in zip(ep.input_dtypes, pl.input_kinds, strict=True) if kind not in tiled]
            extra = {"stores": tuple(dtypes.ITEMSIZE[d] for d in ep.output_dtypes),
                     "epi_tiles": tuple(dtypes.ITEMSIZE[d] for d in tiles),
                     # (an 8-byte vector, per row or per column: two 4-byte rows for the estimate)
                     "epi_rows": tuple(e for d in rows for e in ((4, 4) if dtypes.ITEMSIZE[d] == 8
                                                                  else (dtypes.ITEMSIZE[d],))),
                     **_temps("epi", pl), "epi_instrs": pl.instrs,
                     "epi_strip": EPI_STRIP if pl.ntemps else 0}
        if spec.prologue is not None:
            pro = spec.prologue
            pl = epilogue.prologue_plan(pro, dtypes.NAME[spec.in_dtype])
            vectors = list(zip(pro.input_dtypes[1:], pl.input_kinds[1:], strict=True))
            extra.update({**_temps("pro", pl), "pro_instrs": pl.instrs,
                          "pro_rows": tuple(dtypes.ITEMSIZE[d] for d, kind in vectors if kind == ROW),
                          "pro_cols": tuple(dtypes.ITEMSIZE[d] for d, kind in vectors if kind == COL),
                          "pro_strip": PRO_STRIP})
        return cls(batch, m, spec.b.sizes[2] + sum(b.sizes[2] for b, _ in spec.parts), k, ITEMSIZE[spec.in_dtype],
                   ITEMSIZE[spec.out_dtype],
                   ITEMSIZE.get(spec.bias_dtype, 4) if spec.bias is not None else 0,
                   transposed(spec.a, contiguous_inner=2, other=1),
                   transposed(spec.b, contiguous_inner=2, other=1),
                   spec.in_dtype == lib.SPY_DT_F32, **extra)

    @property
    def e_stores(self) -> tuple[int, ...]:
        """Element sizes of the tiles each output tile stores."""
        return self.stores or (self.e_out,)

    @property
    def macs(self) -> int:
        return self.batch * self.m * self.n * self.k

    @property
    def min_bytes(self) -> int:
        """Each operand read once and the output written once."""
        return self.batch * ((self.m * self.k + self.k * self.n) * self.e_in
                             + self.m * self.n * (sum(self.e_stores) + sum(self.epi_tiles)) + self.n * sum(self.epi_rows))


def _temps(prefix: str, pl) -> dict:
    """A plan's temporaries for the estimate, which knows elements of at most 4 bytes: an
    8-byte one (an int64 value, per element) as two of 4 bytes (the same room)."""
    wide = pl.temp_itemsize == 8
    return {f"{prefix}_temps": pl.ntemps * (2 if wide else 1), f"{prefix}_temp_e": 4 if wide else pl.temp_itemsize}


def transposed(view: View, contiguous_inner: int, other: int) -> bool:
    """True when the view must be loaded transposed (its `other` dim is the contiguous one)."""
    if view.strides[contiguous_inner] == 1 or view.sizes[contiguous_inner] == 1:
        return False
    if view.strides[other] == 1 or view.sizes[other] == 1:
        return True
    raise ValueError(f"matmul operand {view.buf} has no contiguous dimension (strides {view.strides}) {view}")
