"""The native shared-memory ring of one process group (native/ccl.h), on host tensors.

Every call takes contiguous CPU tensors and hands their memory to one native call: the
collective's rounds, waits and reductions all happen in C. A failure is a
:class:`SpyreCollectiveError` naming the collective and the rank, and aborts the group for
every rank (NCCL's behaviour), so that no survivor waits for a rank that left.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..errors import SpyreCollectiveError
from ..layout import StickLayout
from ..native import ffi, lib
from ..program import COLLECTIVE

# The per-rank slot: a message longer than this takes several rounds.
DEFAULT_SLOT_BYTES = 4 << 20

_CCL_DTYPES = {
    torch.float32: lib.SPY_CCL_F32, torch.float16: lib.SPY_CCL_F16, torch.bfloat16: lib.SPY_CCL_BF16,
    torch.float64: lib.SPY_CCL_F64, torch.int32: lib.SPY_CCL_I32, torch.int64: lib.SPY_CCL_I64,
}
_CCL_OPS = {
    dist.ReduceOp.SUM: lib.SPY_CCL_SUM, dist.ReduceOp.PRODUCT: lib.SPY_CCL_PROD, dist.ReduceOp.MAX: lib.SPY_CCL_MAX,
    dist.ReduceOp.MIN: lib.SPY_CCL_MIN, dist.ReduceOp.AVG: lib.SPY_CCL_AVG,
}


COLLECTIVES = {"all_reduce": lib.SPY_COLL_ALL_REDUCE, "all_gather": lib.SPY_COLL_ALL_GATHER,
               "reduce_scatter": lib.SPY_COLL_REDUCE_SCATTER, "broadcast": lib.SPY_COLL_BROADCAST}
# functional collectives name their reductions so (torch.distributed._functional_collectives)
REDUCTIONS = {"sum": lib.SPY_CCL_SUM, "avg": lib.SPY_CCL_AVG, "product": lib.SPY_CCL_PROD, "max": lib.SPY_CCL_MAX,
              "min": lib.SPY_CCL_MIN}


def card_collective(kind: str, dtype: torch.dtype, op: str, ranks: int, inp: StickLayout, out: StickLayout, *,
                    root: int = 0, group: int = 0, duration_ns: float = 0.0) -> np.ndarray:
    """The ``spy_collective`` of `kind` between whole card storages of the stick layouts
    `inp` and `out` (a ValueError says why they do not fit it). The ring moves a storage's
    bytes as they lie: an all-reduce or a broadcast any layout, every rank holding the same;
    a gather along the first dimension interleaves the ranks' stick columns (their rows
    share a row length), or concatenates single rows of whole sticks."""
    if kind not in COLLECTIVES or dtype not in _CCL_DTYPES:
        raise ValueError(f"no {kind} of {dtype} on the cards' ring")
    if op not in REDUCTIONS or (op == "avg" and not dtype.is_floating_point):
        raise ValueError(f"no {op} reduction of {dtype} on the cards' ring")
    if dtype.itemsize != inp.itemsize or dtype.itemsize != out.itemsize:
        raise ValueError(f"{dtype} in storages of {inp.itemsize}- and {out.itemsize}-byte elements")
    chunk = 0
    if kind in ("all_reduce", "broadcast"):
        if inp != out:
            raise ValueError("an in-place collective of two storages")
    else:
        whole, part = (out, inp) if kind == "all_gather" else (inp, out)
        if whole.row_len == part.row_len and whole.rows == ranks * part.rows:
            chunk = part.stick_stride  # a stick column of the part: its rows' sticks of one column
        elif not (whole.rows == part.rows == 1 and whole.row_len == ranks * part.row_len
                  and part.row_len % part.stick_elems == 0):
            raise ValueError(f"a {kind} of {ranks} storages of {part.rows} x {part.row_len} elements "
                             f"into {whole.rows} x {whole.row_len}: their rows do not line up")
    c = np.zeros(1, dtype=COLLECTIVE)
    c["kind"], c["dtype"], c["op"], c["nranks"] = COLLECTIVES[kind], _CCL_DTYPES[dtype], REDUCTIONS[op], ranks
    c["root"], c["group"], c["in_bytes"], c["out_bytes"] = root, group, inp.nbytes, out.nbytes
    c["chunk_bytes"], c["tag"], c["duration_ns"] = chunk, (inp.rows << 32) | inp.row_len, duration_ns
    return c


def reducible(dtype: torch.dtype, op) -> bool:
    """Whether the ring reduces this dtype with this op (others go through gloo)."""
    op = _op(op)
    return dtype in _CCL_DTYPES and op in _CCL_OPS and not (op == dist.ReduceOp.AVG and not dtype.is_floating_point)


def _op(op):
    """The RedOpType of a ReduceOp (or the RedOpType itself)."""
    return op.op if type(op) is dist.ReduceOp else op


def _ptr(t: torch.Tensor):
    return ffi.cast("void *", t.data_ptr())


class Ring:
    """One rank's end of a group's ring: a shared-memory segment between the processes of one
    machine, or (:meth:`over_sockets`) a socket to each peer between machines."""

    between_machines = False  # the group's ranks are on several machines (its time is the network's)

    def __init__(self, name: str, rank: int, size: int, create: bool, timeout_s: float,
                 slot_bytes: int = DEFAULT_SLOT_BYTES):
        out = ffi.new("spy_ccl **")
        self.name, self.rank, self.size = name, rank, size
        self._check(lib.spy_ccl_open(name.encode(), rank, size, slot_bytes, int(create),
                                     max(1, int(timeout_s * 1e9)), out), "opening the ring")
        self.handle = ffi.gc(out[0], lib.spy_ccl_close)

    @classmethod
    def over_sockets(cls, rank: int, size: int, fds: list[int], timeout_s: float,
                     slot_bytes: int = DEFAULT_SLOT_BYTES) -> Ring:
        """The ring of a group whose ranks are on several machines: `fds[j]` a connected
        stream socket to rank j (the ring takes them)."""
        ring = cls.__new__(cls)
        ring.name, ring.rank, ring.size, ring.between_machines = "", rank, size, True
        out = ffi.new("spy_ccl **")
        ring._check(lib.spy_ccl_open_tcp(rank, size, ffi.new("int32_t[]", fds), slot_bytes,
                                         max(1, int(timeout_s * 1e9)), out), "joining the ranks' sockets")
        ring.handle = ffi.gc(out[0], lib.spy_ccl_close)
        return ring

    def _check(self, status: int, what: str) -> None:
        if status == lib.SPY_OK:
            return
        message = ffi.string(lib.spy_last_error()).decode(errors="replace")
        name = ffi.string(lib.spy_status_name(status)).decode()
        text = f"spyreccl rank {self.rank} of {self.size}, {what}: {message} [{name}]"
        if status == lib.SPY_E_INVALID_ARG:
            raise ValueError(text)
        raise SpyreCollectiveError(text, name)

    @staticmethod
    def unlink(name: str) -> None:
        lib.spy_ccl_unlink(name.encode())

    def abort(self, reason: str) -> None:
        lib.spy_ccl_abort(self.handle, reason.encode())

    @property
    def rounds(self) -> int:
        return int(lib.spy_ccl_rounds(self.handle))

    def rearm(self, round_: int) -> None:
        """This rank's end of an aborted ring back in service from `round_` (see
        :meth:`ProcessGroupSpyre.rearm`, which agrees on it)."""
        self._check(lib.spy_ccl_rearm(self.handle, round_), "rearming the ring")

    def all_reduce(self, t: torch.Tensor, op, tag: int = 0) -> None:
        """In place, on a contiguous CPU tensor; `tag` must be the same on every rank."""
        self._check(lib.spy_ccl_allreduce(self.handle, _ptr(t), _ptr(t), t.numel(), _CCL_DTYPES[t.dtype],
                                          _CCL_OPS[_op(op)], tag), "all_reduce")

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        """out (size × inp's bytes) = every rank's inp in rank order."""
        nbytes = inp.numel() * inp.element_size()
        self._check(lib.spy_ccl_allgather(self.handle, _ptr(inp), _ptr(out), nbytes, nbytes), "all_gather")

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op) -> None:
        """out = the reduction over ranks of their block `rank` of inp (size × out's elements)."""
        self._check(lib.spy_ccl_reduce_scatter(self.handle, _ptr(inp), _ptr(out), out.numel(), out.numel(),
                                               _CCL_DTYPES[out.dtype], _CCL_OPS[_op(op)]), "reduce_scatter")

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        self._check(lib.spy_ccl_broadcast(self.handle, _ptr(t), t.numel() * t.element_size(), root), "broadcast")

    def all_to_all(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        """Equal blocks: out block j = rank j's inp block `rank`."""
        self._check(lib.spy_ccl_alltoall(self.handle, _ptr(inp), _ptr(out),
                                         inp.numel() * inp.element_size() // self.size), "all_to_all")

    def barrier(self) -> None:
        self._check(lib.spy_ccl_barrier(self.handle), "barrier")
