"""The kernels of one Granite 3.3 8B layer, prefill and decode, ready to construct again.

A one-layer Granite 3.3 8B (timing mode: no data) is compiled and run once in
``construct`` mode; every layer of the full model builds the same kernels, so one layer's
are the per-kernel construction work of the whole model. ``kernels(phase)`` gives each
kernel as (its kind, a zero-argument call that constructs and encodes its program), the
call ``construct`` mode makes per launch. Used by the construction benchmark and by
``python benchmarks/granite_kernels.py`` (a per-kind, per-phase table).
"""

from __future__ import annotations

import collections
import time

import torch

from spyre_rt.dispatch import dispatch_mode
from spyre_rt.executor.step import live_steps
from spyre_rt.profiler import run as runmod

MODEL = "granite-3.3-8b"


class GraniteKernels:
    def __init__(self, seq: int = 1024, layers: int = 1):
        before = set(map(id, live_steps()))
        self.session = runmod.Session(runmod.Options(MODEL, seq=seq, layers=layers, sim_mode="timing"))
        with dispatch_mode("construct"), torch.no_grad():
            self.session.cache.reset()
            with self.session.active():
                self.session.prefill()
                prefill = self._new_executables(before)
                before |= set(map(id, live_steps()))
                self.session.decode_step()
                decode = self._new_executables(before)
        self.executables = {"prefill": prefill, "decode": decode}

    @staticmethod
    def _new_executables(before: set) -> list:
        return [exe for s in live_steps() if id(s) not in before for exe in s.executables() if exe.prepared]

    def kernels(self, phase: str) -> list[tuple[str, str, object]]:
        """(kind, kernel name, build call) of every card kernel of `phase`."""
        out = []
        for exe in self.executables[phase]:
            for seg in exe.device_segments():
                for name in seg.kernels:
                    kernel = exe.desc.kernels.get(name)
                    kind = getattr(kernel, "kind", "copy")
                    out.append((kind, name, (lambda e=exe, n=name: e.build(n)[0])))
        return out


def per_kind_us(kernels, rounds: int = 3) -> dict[str, tuple[int, float]]:
    """(kernels, mean of their best µs, CPU time of this thread) by kind."""
    best: dict[str, float] = {}
    for _, name, build in kernels:
        best[name] = min(_cpu_ns(build) for _ in range(rounds))
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for kind, name, _ in kernels:
        by_kind[kind].append(best[name])
    return {k: (len(v), sum(v) / len(v) / 1e3) for k, v in sorted(by_kind.items())}


def _cpu_ns(call) -> int:
    t0 = time.thread_time_ns()
    call()
    return time.thread_time_ns() - t0


if __name__ == "__main__":
    g = GraniteKernels()
    for phase in ("prefill", "decode"):
        ks = g.kernels(phase)
        table = per_kind_us(ks)
        total = sum(n * us for n, us in table.values())
        print(f"{phase}: {len(ks)} kernels, {total / len(ks):.0f} µs/kernel (thread CPU time, best of 3)")
        for kind, (n, us) in table.items():
            print(f"  {kind:10s} {n:3d} kernels  {us:8.0f} µs/kernel  {n * us / total:5.1%}")
