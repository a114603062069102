"""``spyreccl``: the process group of the cards.

torch 2.13 cannot subclass a per-device ``c10d.Backend`` from Python, and a Python
``dist.ProcessGroup`` registered for ``"spyre"`` replaces the whole group, so this group
serves both kinds of tensor: CPU tensors through a gloo group it owns (as
``"cpu:gloo,spyre:spyreccl"`` asks), spyre tensors through the native shared-memory ring
(:mod:`spyre_rt.distributed.ring`), staged through host memory as every copy of the card
is. Every collective completes before its call returns; the Work it gives back is done.

The method names are those torch 2.13 calls on a Python group (``all_gather_single``,
``reduce_scatter_single``, ``all_to_all_single``...); the group names itself through
``getGroupName``/``setGroupName``, which functional collectives resolve it by.
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from .. import card as cards
from .. import tensors
from ..native import check, ffi, lib
from . import interconnect, sockets
from .ring import Ring, SpyreCollectiveError, card_collective, reducible

BACKEND_NAME = "spyreccl"


ffi_null = ffi.NULL


def _done(result) -> dist.Work:
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class _Staged:
    """Contiguous CPU copies of a call's tensors and the way back: spyre tensors are read
    off their card, CPU tensors that are not contiguous are copied."""

    def __init__(self, ts, read: bool = True):
        self.originals = list(ts)
        self.host = [self._host(t, read) for t in self.originals]

    @staticmethod
    def _host(t: torch.Tensor, read: bool) -> torch.Tensor:
        if t.device.type == "spyre":
            return tensors.to_host(t, leaves_card=False) if read else torch.empty(t.shape, dtype=t.dtype)
        return t if t.is_contiguous() else t.contiguous()

    def write_back(self, which=None) -> None:
        for i, (orig, host) in enumerate(zip(self.originals, self.host, strict=True)):
            if (which is None or i in which) and host is not orig:
                if orig.device.type == "spyre":
                    tensors.upload(host, orig)
                else:
                    orig.copy_(host)


def _whole_storage(t: torch.Tensor):
    """(card, base address, stick layout, dtype) of a spyre tensor that is the whole of its
    storage in memory order, or None."""
    if t.device.type != "spyre" or not t.is_contiguous() or t.storage_offset():
        return None
    card, view, base = tensors.geometry(t)
    if view.layout.numel != t.numel() or view.layout.itemsize != t.element_size():
        return None
    return card, base, view.layout, t.dtype


def _kind(ts) -> str:
    """"spyre" or "cpu": the device of every tensor of a call (a mix, or two cards, is an error)."""
    kinds = {t.device.type for t in ts}
    if kinds <= {"cpu"}:
        return "cpu"
    if kinds == {"spyre"}:
        cards_ = {t.device.index for t in ts}
        if len(cards_) > 1:
            raise ValueError("spyreccl: one collective's tensors must be on one card (a rank's card), not on "
                             + " and ".join(f"spyre:{i}" for i in sorted(cards_)))
        return "spyre"
    raise ValueError(f"spyreccl: one collective's tensors must all be on the CPU or all on spyre, not on {sorted(kinds)}")


_JOBS = 256  # card all-reduces a group remembers (one per storage it reduces, say a layer's output)

_OP_NAMES = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "product",
             dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}


def _op_key(op):
    """A hashable key of a ReduceOp (or RedOpType)."""
    return op.op if type(op) is dist.ReduceOp else op


def _op_name(op) -> str:
    return _OP_NAMES[_op_key(op)]


def _equal_splits(splits, total: int, size: int) -> bool:
    return not splits or (len(set(splits)) == 1 and splits[0] * size == total)


class ProcessGroupSpyre(dist.ProcessGroup):
    """One rank's end of a ``spyreccl`` group (see the module's docstring)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, group_name: str = ""):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._group_name = group_name
        self._timeout = timeout
        self._gloo = self._make_gloo(store, rank, size, timeout)
        self._ring = self._open_ring(store, rank, size, timeout)
        self._clock = ffi.new("spy_clock *")
        self._jobs: dict = {}  # (storage base, numel, dtype, op) -> a card all-reduce (see _card_job)
        self._arrival = torch.zeros(1, dtype=torch.float64)
        self._costs: dict = {}  # (profile digest, kind, bytes) -> (ns, trace name) or None

    # ---- set-up ----
    @staticmethod
    def _make_gloo(store, rank, size, timeout) -> dist.ProcessGroup:
        prefix = dist.PrefixStore("gloo/", store)
        backend = dist.ProcessGroupGloo(prefix, rank, size, timeout)
        pg = dist.ProcessGroup(prefix, rank, size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        return pg

    @staticmethod
    def _open_ring(store, rank, size, timeout) -> Ring:
        """The ranks of one machine share a segment: rank 0 makes it and names it in the
        store; once every rank has opened it, rank 0 unlinks the name (the mappings stay), so
        a crash leaves nothing behind. Ranks on several machines (their host ids differ,
        :func:`.sockets.host_id`) connect a socket to each other instead, as NCCL falls back
        to sockets."""
        seconds = timeout.total_seconds()
        if not sockets.one_machine(store, rank, size, timeout):
            return Ring.over_sockets(rank, size, sockets.connect(store, rank, size, timeout), seconds)
        if rank == 0:
            name = f"/spyreccl-{os.getpid()}-{secrets.token_hex(6)}"
            ring = Ring(name, rank, size, True, seconds)
            store.set("ring", name)
        else:
            name = store.get("ring").decode()
            ring = Ring(name, rank, size, False, seconds)
        if store.add("ring_opened", 1) == size:
            store.set("ring_all_opened", "1")
        if rank == 0:
            store.wait(["ring_all_opened"], timeout)
            Ring.unlink(name)
        return ring

    @property
    def ring(self) -> Ring:
        """The group's native ring (what compiled steps' collectives run in)."""
        return self._ring

    # ---- names ----
    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def _backend_name(self) -> str:  # noqa: D401 - torch's helper reads this
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"ProcessGroupSpyre(rank={self._rank}, size={self._size}, name={self._group_name!r})"

    def abort(self) -> None:
        self._ring.abort("the process group was aborted")

    def rearm(self) -> None:
        """Put the group back in service after an abort, on every rank at once (a collective:
        each rank calls it once every rank is out of the ring, after a step that failed on
        some rank, say): the ranks agree through the group's gloo group on the latest round
        any of them reached and resume from it. A group on several machines cannot be
        rearmed (an abort shut its sockets): a :class:`SpyreCollectiveError`."""
        if self._ring.between_machines:
            raise SpyreCollectiveError("spyreccl: a group on several machines cannot be rearmed after an abort "
                                       "(its sockets are shut)", "SPY_E_CCL_PEER")
        latest = torch.tensor([self._ring.rounds], dtype=torch.int64)
        most = dist.AllreduceOptions()
        most.reduceOp = dist.ReduceOp.MAX
        self._gloo.allreduce([latest], most).wait()   # every rank out of the ring
        self._ring.rearm(int(latest.item()))
        self._gloo.barrier().wait()   # every rank rearmed before any rank's next round

    def shutdown(self) -> None:
        pass

    # ---- time on the interconnect ----
    def _on_interconnect(self, kind: str, ts, nbytes: int) -> bool:
        """Put a collective of spyre tensors on the card's timeline: it starts when the last
        rank is ready (the latest of every rank's host clock and card finish) and lasts what
        :mod:`.interconnect` says. Returns whether data must move: not on a timing-mode
        card, which keeps none."""
        if not ts or ts[0].device.type != "spyre":
            return True
        card = tensors.card_of(ts[0])
        check(lib.spy_clock_read(card.handle, self._clock), f"reading the clocks of spyre:{card.index}")
        arrival = self._arrival
        arrival[0] = max(float(self._clock.host_ns), self._clock.finish_ns)
        self._ring.all_reduce(arrival, dist.ReduceOp.MAX)
        key = (card.profile.digest, kind, nbytes)
        timed = self._costs.get(key)
        if timed is None:
            c = interconnect.cost(card.profile, kind, nbytes, self._size, self._ring.between_machines)
            timed = self._costs[key] = None if c is None else (c.ns, f"{kind} ({c.algorithm})")
        if timed is not None:
            check(lib.spy_timed_job(card.handle, float(arrival[0]), timed[0], card.intern(timed[1]), ffi_null),
                  f"putting {kind} on the timeline of spyre:{card.index}")
        return card.functional

    # ---- collectives ----
    def allreduce(self, tensor_list, opts=None):
        if len(tensor_list) == 1:  # one card tensor that is its whole storage: one native call
            t = tensor_list[0]
            if not t.is_cpu and t.is_contiguous() and not t.storage_offset() and t.device.type == "spyre" and \
                    self._card_all_reduce(t, opts.reduceOp if opts is not None else dist.ReduceOp.SUM):
                return _done(tensor_list)
        opts = opts or dist.AllreduceOptions()
        kind = _kind(tensor_list)
        if not self._on_interconnect("all_reduce", tensor_list, sum(t.numel() * t.element_size() for t in tensor_list)):
            return _done(tensor_list)
        if (kind == "cpu" and all(t.is_contiguous() for t in tensor_list)
                and opts.reduceOp != dist.ReduceOp.AVG):  # gloo has no average
            return self._gloo.allreduce(tensor_list, opts)
        whole = [_whole_storage(t) for t in tensor_list]
        if all(w is not None for w in whole) and all(reducible(t.dtype, opts.reduceOp) for t in tensor_list):
            for w in whole:
                self._all_reduce_storage(*w, opts.reduceOp)
            return _done(tensor_list)
        staged = _Staged(tensor_list)
        for t in staged.host:
            if reducible(t.dtype, opts.reduceOp):
                self._ring.all_reduce(t, opts.reduceOp)
            else:
                self._gloo.allreduce([t], opts).wait()
        staged.write_back()
        return _done(tensor_list)

    def _card_all_reduce(self, t: torch.Tensor, op) -> bool:
        """An all-reduce of a card tensor that is its whole storage, in place, as one native
        call (spy_collective_launch): the ranks' readiness and the data in one round of the
        ring, the reduction on the card's memory as it lies, the time on the interconnect.
        False when it is not such a tensor (the general path then runs)."""
        base = t.untyped_storage().data_ptr()
        key = (base, t.numel(), t.dtype, op.op if type(op) is dist.ReduceOp else op)
        job = self._jobs.get(key)
        if job is None:
            job = self._card_job(t, base, op)
            if job is None:
                return False
            if len(self._jobs) >= _JOBS:
                self._jobs.clear()
            self._jobs[key] = job
        status = lib.spy_collective_launch(job[0], self._ring.handle, job[1], base, base, job[2], ffi_null)
        if status == lib.SPY_E_LAYOUT:  # another storage at the same address since: describe it again
            del self._jobs[key]
            return self._card_all_reduce(t, op)
        check(status, "all_reduce")
        return True

    def _card_job(self, t: torch.Tensor, base: int, op):
        """(card handle, spy_collective *, trace name) of an all-reduce of `t`, the whole of its
        storage at `base`, or None when it is not such a tensor. The card checks at every
        launch that the storage at `base` still records the layout it was made for."""
        card = cards.owner(base)
        lay = card.layout_of(base) if card is not None else None
        if lay is None or lay.numel != t.numel() or lay.itemsize != t.element_size() or not reducible(t.dtype, op):
            return None
        kind, nbytes = "all_reduce", t.numel() * t.element_size()
        cost = interconnect.cost(card.profile, kind, nbytes, self._size, self._ring.between_machines)
        name = f"{kind} ({cost.algorithm})" if cost is not None else kind
        coll = card_collective(kind, t.dtype, _op_name(op), self._size, lay, lay,
                               duration_ns=cost.ns if cost is not None else 0.0)
        ptr = ffi.new("spy_collective *")
        ffi.memmove(ptr, coll.tobytes(), ffi.sizeof("spy_collective"))
        return card.handle, ptr, card.intern(name)

    def _all_reduce_storage(self, card, base: int, layout, dtype, op) -> None:
        """An all-reduce of a card tensor that is its whole storage, in its stick layout:
        elementwise, so the storage's bytes (padding included) are reduced as they lie,
        read and written back without a transfer graph. Every rank must hold the same
        layout (the ring compares it with the call)."""
        host = torch.empty(layout.nbytes // layout.itemsize, dtype=dtype)
        check(lib.spy_mem_read(card.handle, base, ffi.cast("void *", host.data_ptr()), layout.nbytes),
              f"reading spyre:{card.index}")
        self._ring.all_reduce(host, op, tag=(layout.rows << 32) | layout.row_len)
        check(lib.spy_mem_write(card.handle, base, ffi.cast("void *", host.data_ptr()), layout.nbytes),
              f"writing spyre:{card.index}")

    def allreduce_coalesced(self, tensor_list, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        ar = dist.AllreduceOptions()
        ar.reduceOp = opts.reduceOp
        return self.allreduce(tensor_list, ar)

    def allgather(self, output_tensors, input_tensor, opts=None):
        for outs, inp in zip(output_tensors, input_tensor, strict=True):
            self._all_gather_list(outs, inp)
        return _done(output_tensors)

    def _all_gather_list(self, outs, inp) -> None:
        _kind([*outs, inp])
        if len(outs) != self._size:
            raise ValueError(f"spyreccl all_gather: {len(outs)} output tensors for a group of {self._size}")
        if any(o.shape != inp.shape or o.dtype != inp.dtype for o in outs):
            raise ValueError("spyreccl all_gather: every output tensor must have the input's shape and dtype "
                             f"({tuple(inp.shape)}, {inp.dtype})")
        if not self._on_interconnect("all_gather", [inp], self._size * inp.numel() * inp.element_size()):
            return
        src = _Staged([inp])
        gathered = torch.empty((self._size, *inp.shape), dtype=inp.dtype)
        self._ring.all_gather(src.host[0], gathered)
        for o, g in zip(outs, gathered, strict=True):
            (tensors.upload(g, o) if o.device.type == "spyre" else o.copy_(g))

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        _kind([output_tensor, input_tensor])
        if output_tensor.numel() != input_tensor.numel() * self._size or output_tensor.dtype != input_tensor.dtype:
            raise ValueError(f"spyreccl all_gather_into_tensor: the output must hold {self._size} inputs of "
                             f"{input_tensor.numel()} {input_tensor.dtype} elements, not {output_tensor.numel()} "
                             f"{output_tensor.dtype}")
        if not self._on_interconnect("all_gather", [input_tensor], output_tensor.numel() * output_tensor.element_size()):
            return _done(output_tensor)
        src, dst = _Staged([input_tensor]), _Staged([output_tensor], read=False)
        dst.host[0] = dst.host[0] if dst.host[0].is_contiguous() else torch.empty_like(dst.host[0])
        self._ring.all_gather(src.host[0], dst.host[0])
        if dst.host[0] is not output_tensor:
            (tensors.upload(dst.host[0], output_tensor) if output_tensor.device.type == "spyre"
             else output_tensor.copy_(dst.host[0].view(output_tensor.shape)))
        return _done(output_tensor)

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs, strict=True):
            self.all_gather_single(o, i, opts)
        return _done(outputs)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            if len(ins) != self._size or any(i.shape != out.shape or i.dtype != out.dtype for i in ins):
                raise ValueError(f"spyreccl reduce_scatter: {self._size} inputs of the output's shape "
                                 f"{tuple(out.shape)} and dtype {out.dtype} are needed")
            staged = _Staged(ins)
            self._reduce_scatter_host(torch.stack(staged.host) if staged.host else staged.host, out, opts.reduceOp)
        return _done(output_tensors)

    def _reduce_scatter_host(self, whole: torch.Tensor, out: torch.Tensor, op) -> None:
        _kind([out])
        result = torch.empty(out.shape, dtype=out.dtype)
        if reducible(out.dtype, op):
            self._ring.reduce_scatter(whole.contiguous(), result, op)
        else:
            parts = list(whole.reshape(self._size, *out.shape).unbind(0))
            o = dist.ReduceScatterOptions()
            o.reduceOp = op
            self._gloo.reduce_scatter([result], [parts], o).wait()
        (tensors.upload(result, out) if out.device.type == "spyre" else out.copy_(result))

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        _kind([output_tensor, input_tensor])
        if input_tensor.numel() != output_tensor.numel() * self._size or output_tensor.dtype != input_tensor.dtype:
            raise ValueError(f"spyreccl reduce_scatter_tensor: the input must hold {self._size} outputs of "
                             f"{output_tensor.numel()} {output_tensor.dtype} elements, not {input_tensor.numel()} "
                             f"{input_tensor.dtype}")
        if not self._on_interconnect("reduce_scatter", [input_tensor], input_tensor.numel() * input_tensor.element_size()):
            return _done(output_tensor)
        self._reduce_scatter_host(_Staged([input_tensor]).host[0], output_tensor, opts.reduceOp)
        return _done(output_tensor)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs, strict=True):
            self.reduce_scatter_single(o, i, opts)
        return _done(outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def broadcast(self, tensor_list, opts=None):
        opts = opts or dist.BroadcastOptions()
        _kind(tensor_list)
        if not self._on_interconnect("broadcast", tensor_list, sum(t.numel() * t.element_size() for t in tensor_list)):
            return _done(tensor_list)
        staged = _Staged(tensor_list, read=self._rank == opts.rootRank)
        for t in staged.host:
            self._ring.broadcast(t, opts.rootRank)
        if self._rank != opts.rootRank:
            staged.write_back()
        return _done(tensor_list)

    def reduce(self, tensor_list, opts=None):
        opts = opts or dist.ReduceOptions()
        _kind(tensor_list)
        staged = _Staged(tensor_list)
        for t in staged.host:
            if t is tensor_list[0] and t.device.type == "cpu":
                t = staged.host[0] = t.clone()  # only the root's tensor changes
            if reducible(t.dtype, opts.reduceOp):
                self._ring.all_reduce(t, opts.reduceOp)
            else:
                ar = dist.AllreduceOptions()
                ar.reduceOp = opts.reduceOp
                self._gloo.allreduce([t], ar).wait()
        if self._rank == opts.rootRank:
            staged.write_back()
        return _done(tensor_list)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        root = opts.rootRank
        for i, inp in enumerate(input_tensors):
            outs = output_tensors[i] if self._rank == root else []
            _kind([*outs, inp])
            if self._rank == root and (len(outs) != self._size or any(o.shape != inp.shape for o in outs)):
                raise ValueError(f"spyreccl gather: the root needs {self._size} outputs of the input's shape")
            gathered = torch.empty((self._size, *inp.shape), dtype=inp.dtype)
            self._ring.all_gather(_Staged([inp]).host[0], gathered)
            for o, g in zip(outs, gathered if outs else (), strict=True):
                (tensors.upload(g, o) if o.device.type == "spyre" else o.copy_(g))
        return _done(output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        root = opts.rootRank
        for i, out in enumerate(output_tensors):
            ins = input_tensors[i] if self._rank == root else []
            _kind([*ins, out])
            whole = torch.empty((self._size, *out.shape), dtype=out.dtype)
            if self._rank == root:
                if len(ins) != self._size or any(t.shape != out.shape or t.dtype != out.dtype for t in ins):
                    raise ValueError(f"spyreccl scatter: the root needs {self._size} inputs of the output's shape")
                whole.copy_(torch.stack(_Staged(ins).host))
            self._ring.broadcast(whole, root)
            mine = whole[self._rank]
            (tensors.upload(mine, out) if out.device.type == "spyre" else out.copy_(mine))
        return _done(output_tensors)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        _kind([*output_tensors, *input_tensors])
        shapes = {(tuple(t.shape), t.dtype) for t in [*output_tensors, *input_tensors]}
        if len(shapes) == 1:
            src = torch.stack(_Staged(input_tensors).host)
            dst = torch.empty_like(src)
            self._ring.all_to_all(src, dst)
            for o, d in zip(output_tensors, dst, strict=True):
                (tensors.upload(d, o) if o.device.type == "spyre" else o.copy_(d))
        else:  # blocks of several sizes: gloo, on host copies
            src, dst = _Staged(input_tensors), _Staged(output_tensors, read=False)
            self._gloo.alltoall(dst.host, src.host, dist.AllToAllOptions()).wait()
            dst.write_back()
        return _done(output_tensors)

    def all_to_all_single(self, output_tensor, input_tensor, output_split_sizes, input_split_sizes, opts=None):
        _kind([output_tensor, input_tensor])
        n = input_tensor.shape[0] if input_tensor.dim() else 0
        src = _Staged([input_tensor]).host[0]
        if (_equal_splits(input_split_sizes, n, self._size) and _equal_splits(output_split_sizes, n, self._size)
                and output_tensor.shape == input_tensor.shape and n % self._size == 0):
            dst = torch.empty_like(src)
            self._ring.all_to_all(src, dst)
        else:  # uneven splits: gloo, on host copies
            dst = torch.empty(output_tensor.shape, dtype=output_tensor.dtype)
            self._gloo.alltoall_base(dst, src, list(output_split_sizes or []), list(input_split_sizes or []),
                                     dist.AllToAllOptions()).wait()
        (tensors.upload(dst, output_tensor) if output_tensor.device.type == "spyre" else output_tensor.copy_(dst))
        return _done(output_tensor)

    alltoall_base = all_to_all_single

    def send(self, tensor_list, dst, tag=0):
        staged = _Staged(tensor_list)
        self._gloo.send(staged.host, dst, tag).wait()  # the staged copies live until it is sent
        return _done(tensor_list)

    def recv(self, tensor_list, src, tag=0):
        staged = _Staged(tensor_list, read=False)
        self._gloo.recv(staged.host, src, tag).wait()
        staged.write_back()
        return _done(tensor_list)

    def barrier(self, opts=None):
        self._ring.barrier()  # no tensor, so no card to time it on
        return _done(None)


def create(backend_options, options=None) -> ProcessGroupSpyre:
    """The creator ``dist.Backend.register_backend`` calls (``extended_api=True``)."""
    return ProcessGroupSpyre(backend_options.store, backend_options.group_rank, backend_options.group_size,
                             backend_options.timeout, backend_options.group_id or "")


__all__ = ["BACKEND_NAME", "ProcessGroupSpyre", "SpyreCollectiveError", "create"]
