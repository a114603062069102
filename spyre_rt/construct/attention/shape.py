"""The numbers of an attention that shape its tiles."""

from __future__ import annotations

from dataclasses import dataclass

from ... import dtypes
from ...ir import View


@dataclass(frozen=True)
class Shape:
    """The numbers of an attention that shape its tiles."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    dim: int
    v_dim: int
    dtype: str          # of q, k, v and out
    mask: str           # "" (none), "bool" (keep where true) or "add"
    mask_dtype: str
    mask_heads: int     # mask rows per query: 1 when the heads share them, else the group
    causal: bool
    q_offset: int
    page: int = 0           # paged keys and values: keys per page (0: dense)
    table_dtype: str = ""   # of the block table
    blocks: tuple = ()      # (query rows or 0: any, keys per block) the tiling must take, if any

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def e_in(self) -> int:
        return dtypes.ITEMSIZE[self.dtype]

    @property
    def fp32(self) -> bool:
        return self.dtype == "float32"

    @property
    def guarded(self) -> bool:
        """Rows may see no key in a block: the running max may be -inf."""
        return self.causal or bool(self.mask)

    @property
    def table_width(self) -> int:
        """Pages per batch element (paged)."""
        return self.kv_len // self.page if self.page else 0

    @classmethod
    def of(cls, k, q: View, kv: View, v: View, mask: View | None, table: View | None = None) -> Shape:
        batch, heads, q_len, dim = q.sizes
        _, kv_heads, kv_len, _ = kv.sizes
        page = int(k.page)
        if page:  # k is (pages, kv_heads, page, dim): the keys are the table's pages
            kv_len = table.sizes[1] * page
        kind = "" if mask is None else "bool" if k.mask_dtype == "bool" else "add"
        mask_heads = 1 if mask is None or mask.strides[1] == 0 else heads // kv_heads
        return cls(batch, heads, kv_heads, q_len, kv_len, dim, v.sizes[3], k.dtype, kind, k.mask_dtype,
                   mask_heads, bool(k.causal), int(k.q_offset), page, k.table_dtype if page else "",
                   tuple(getattr(k, "blocks", ())))
