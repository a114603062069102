"""Host cost of an all-reduce between two ranks of one machine (issue 21's target: a
decode-sized all-reduce, 8 KiB of fp16, in at most 20 µs of host time).

Rank 0 is this process, rank 1 a peer process (distributed_peer.py) making the same calls;
both meet in the native shared-memory ring. Three paths side by side:

- ``ring``: the ring alone on a host tensor (the transport, Python's ctypes-free cffi call);
- ``card``: ``ProcessGroupSpyre.allreduce`` of a card tensor that is its whole storage (the
  eager path: one native call that exchanges the ranks' readiness with the data, reduces the
  card's memory in place and puts the job on the card's timeline);
- ``plan``: a graph plan of one all-reduce job launched (what a compiled tensor-parallel
  step's collectives are: jobs of its plan).

Each is timed on rank 0 over its calls with three clocks: the card's host clock (CPU time
of the calling thread less the card's own work, here the ring's walk, which stands in for
the interconnect: the host's cost of a call), the thread's CPU time (the host's cost plus
the ring's walk and its spinning while the peer arrives) and wall time (plus the time the
peer's process is not scheduled, on a loaded machine most of it).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import spyre_rt  # noqa: F401
from spyre_rt import tensors
from spyre_rt.native import ffi

SIZES = {"8k": 8 << 10, "8m": 8 << 20}
CALLS = {"8k": 2000, "8m": 20}


def _ring_case(nbytes):
    def make(pg):
        t = torch.ones(nbytes // 2, dtype=torch.float16)
        return None, lambda: pg.ring.all_reduce(t, dist.ReduceOp.SUM)
    return make


def _card_case(nbytes):
    def make(pg):
        t = torch.ones(nbytes // 2, dtype=torch.float16).to("spyre")
        return tensors.card_of(t), lambda: pg.allreduce([t])
    return make


def _plan_case(nbytes):
    def make(pg):
        from spyre_rt.distributed import interconnect
        from spyre_rt.distributed.ring import card_collective
        from spyre_rt.plan import COLLECTIVE, GraphPlan, PlanJob, encode

        t = torch.ones(nbytes // 2, dtype=torch.float16).to("spyre")
        card, view, base = tensors.geometry(t)
        cost = interconnect.cost(card.profile, "all_reduce", nbytes, pg.size())
        coll = card_collective("all_reduce", torch.float16, "sum", pg.size(), view.layout, view.layout,
                               duration_ns=cost.ns)
        block = encode([PlanJob(coll.view(np.uint8), ((0, 0), (0, 0)), "all_reduce", COLLECTIVE)], [view.layout],
                       card.intern, ngroups=1)
        plan = GraphPlan(card, block, groups=[pg.ring])
        table = ffi.new("uint64_t[]", [base])
        plan.tensor = t  # the storage the table binds lives as long as the plan
        return card, lambda: plan.launch(table)
    return make


_MAKERS = {"ring": _ring_case, "card": _card_case, "plan": _plan_case}
CASES = {f"{path}-{size}": _MAKERS[path](n) for path in _MAKERS for size, n in SIZES.items()}


@pytest.fixture(scope="module")
def pair():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("distributed_peer.py")), str(port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    from spyre_rt.distributed.group import ProcessGroupSpyre

    pg = ProcessGroupSpyre(store, 0, 2, timedelta(seconds=60))
    yield pg, peer
    peer.stdin.close()
    peer.wait(timeout=30)


@pytest.mark.benchmark(group="distributed")
@pytest.mark.parametrize("case", list(CASES))
def test_all_reduce_two_ranks(benchmark, pair, case):
    pg, peer = pair
    card, call = CASES[case](pg)
    calls = CALLS[case.split("-")[1]]
    warmup = calls // 10
    if benchmark.disabled:  # the default test run calls each benchmark once
        calls, warmup = 1, 0
    peer.stdin.write(f"{case} {calls + warmup}\n")
    peer.stdin.flush()
    for _ in range(warmup):
        call()
    host0 = card.clock().host_ns if card is not None else 0
    cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
    benchmark.pedantic(call, rounds=calls, iterations=1)
    cpu, wall = time.thread_time_ns() - cpu0, time.perf_counter_ns() - wall0
    host = card.clock().host_ns - host0 if card is not None else None
    assert peer.stdout.readline().strip() == "done"
    benchmark.extra_info.update(bytes=SIZES[case.split("-")[1]], host_cpu_us=cpu / calls / 1e3,
                                host_wall_us=wall / calls / 1e3,
                                host_clock_us=None if host is None else host / calls / 1e3)
