"""Rank 1 of the two-rank benchmarks (benchmarks/test_bench_distributed.py starts it).

``python distributed_peer.py PORT``: joins the store on 127.0.0.1:PORT, then for each line
"CASE CALLS" the benchmark sends on stdin makes the same CALLS calls as rank 0.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch.distributed as dist

import spyre_rt  # noqa: F401
from spyre_rt.distributed.group import ProcessGroupSpyre

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_bench_distributed import CASES  # noqa: E402


def main(port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    pg = ProcessGroupSpyre(store, 1, 2, timedelta(seconds=60))
    for line in sys.stdin:
        case, calls = line.split()
        _, call = CASES[case](pg)
        for _ in range(int(calls)):
            call()
        print("done", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
