"""Running programs on a card: upload through the transfer path, commit, launch.

A compute program (a kernel's job graph with its arguments) runs from device memory: the
host uploads its program block with a transfer graph, the card validates the resident
copy once (commit) and then launches it as often as wanted with new slot bindings.
"""

from __future__ import annotations

import numpy as np

from . import torch_ranges
from .card import MEM_CONTROL, Card
from .layout import StickLayout
from .native import check, ffi, lib
from .transfer import H2D, ViewGeometry, graph_for


def program_view(nbytes: int) -> ViewGeometry:
    """A program block seen by the transfer path: one row of bytes (linear on the card)."""
    return ViewGeometry(StickLayout(1, nbytes, 1), 0, (nbytes,), (1,))


class ResidentProgram:
    """A committed program in a control allocation of a card.

    It remembers the card's reset epoch it was made in: after a reset the program is gone
    and :meth:`free` leaves whatever newer allocation took its address alone."""

    __slots__ = ("card", "addr", "epoch", "nbytes", "nslots", "info", "name")

    def __init__(self, card: Card, blob: np.ndarray, name: str = "", prebuilt_transfer: bool = True):
        self.card = card
        self.nbytes = int(blob.size)
        self.name = card.intern(name) if name else 0
        self.epoch = card.epoch  # before the allocation: a reset in between makes it stale
        self.addr = card.malloc(self.nbytes, MEM_CONTROL)
        try:
            graph_for(card, H2D, program_view(self.nbytes), prebuilt_transfer).run(
                blob.ctypes.data, self.addr)
            info = ffi.new("spy_job_info *")
            check(lib.spy_program_commit(card.handle, self.addr, info), f"committing {name or 'a program'}")
        except BaseException:
            self.free()  # and forget the address: __del__ must not free it again
            raise
        self.info = info
        self.nslots = int(info.nslots)

    def launch(self, bindings) -> float:
        if torch_ranges.active():
            with torch_ranges.launch_range(self.card, self.name):
                return self._launch(bindings)
        return self._launch(bindings)

    def _launch(self, bindings) -> float:
        end = ffi.new("double *")
        arr = ffi.new("uint64_t[]", list(bindings)) if self.nslots else ffi.NULL
        status = lib.spy_launch(self.card.handle, self.addr, arr, self.nslots, self.name, end)
        if status != lib.SPY_OK:  # the job's name is looked up for the message only
            check(status, "launching " + (self.card.name_of(self.name) or "a program"))
        return end[0]

    def free(self) -> None:
        if self.addr:
            addr, self.addr = self.addr, 0
            self.card.free(addr, self.epoch)

    def __del__(self):
        try:
            self.free()
        except Exception:  # the card may already be gone at interpreter exit
            pass


def run_once(card: Card, blob: np.ndarray, bindings, name: str = "", prebuilt_transfer: bool = False) -> float:
    """Upload, commit, launch and free a program: the construct-mode path of one launch."""
    prog = ResidentProgram(card, blob, name, prebuilt_transfer)
    try:
        return prog.launch(bindings)
    finally:
        prog.free()


def validate(card: Card, blob: np.ndarray) -> dict:
    info = ffi.new("spy_job_info *")
    check(lib.spy_job_validate(card.handle, ffi.from_buffer(blob), blob.size, info), "validating a program")
    return {name: getattr(info, name) for name, _ in ffi.typeof("spy_job_info").fields}


def time_alone(card: Card, blob: np.ndarray, nbytes: list[int]) -> tuple[float, dict]:
    """Device time of one launch of a program on its own (fresh buffers of `nbytes`, one a
    slot, nothing else running), and the figures the card validated it with. For cost-model
    checks and kernel benchmarks: a timing-mode card gives the time without arithmetic."""
    prog = ResidentProgram(card, blob, "alone")
    addrs = []
    try:
        addrs = [card.malloc(n) for n in nbytes]
        card.synchronize()
        before = card.counters()["device_busy_ns"]
        prog.launch(addrs)
        card.synchronize()
        info = {name: getattr(prog.info, name) for name, _ in ffi.typeof("spy_job_info").fields}
        return card.counters()["device_busy_ns"] - before, info
    finally:
        prog.free()
        for a in addrs:
            card.free(a)
