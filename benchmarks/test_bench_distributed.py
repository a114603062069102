"""Host cost of an all-reduce between two ranks of one machine (issue 21's target: a
decode-sized all-reduce, 8 KiB of fp16, in at most 20 µs of host time).

Rank 0 is this process, rank 1 a peer process (distributed_peer.py) making the same calls;
both meet in the native shared-memory ring. Two paths side by side: the ring alone on a
host tensor (the transport) and ``ProcessGroupSpyre.allreduce`` of a tensor on the card
(the transport, the staging of the card's tensor through host memory and the Python of
the group). Each call is timed on rank 0 from entry to return, in CPU time of the calling
thread and in wall time: rank 0 spins while it waits for its peer, so the two are close,
and both include the time the peer takes to arrive.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import spyre_rt  # noqa: F401

SIZES = {"8k": 8 << 10, "8m": 8 << 20}


def _ring_case(nbytes):
    def make(pg):
        t = torch.ones(nbytes // 2, dtype=torch.float16)
        return lambda: pg._ring.all_reduce(t, dist.ReduceOp.SUM)
    return make


def _card_case(nbytes):
    def make(pg):
        t = torch.ones(nbytes // 2, dtype=torch.float16).to("spyre")
        return lambda: pg.allreduce([t])
    return make


CASES = {f"{path}-{size}": (_ring_case if path == "ring" else _card_case)(n)
         for path in ("ring", "card") for size, n in SIZES.items()}
CALLS = {"8k": 2000, "8m": 20}


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
    call = CASES[case](pg)
    calls = CALLS[case.split("-")[1]]
    warmup = calls // 10
    if benchmark.disabled:  # the default test run calls each benchmark once
        calls, warmup = 1, 0
    peer.stdin.write(f"{case} {calls + warmup}\n")
    peer.stdin.flush()
    for _ in range(warmup):
        call()
    cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
    benchmark.pedantic(call, rounds=calls, iterations=1)
    cpu, wall = time.thread_time_ns() - cpu0, time.perf_counter_ns() - wall0
    assert peer.stdout.readline().strip() == "done"
    benchmark.extra_info.update(bytes=SIZES[case.split("-")[1]], host_cpu_us=cpu / calls / 1e3,
                                host_wall_us=wall / calls / 1e3)
