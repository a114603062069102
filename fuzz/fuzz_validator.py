"""Fuzz target: the card's command validator (``spy_job_validate`` through
``spyre_rt.jobs.validate``).

Every input is a program block. It must be accepted or rejected with a typed error
(``SpyreInvalidCommandError``). An accepted block of moderate size is then uploaded,
committed and launched with every slot bound to memory of exactly its declared extent
(device memory for DRAM slots, a host buffer for HOST slots): a program the validator let
through must run, or fail with a typed error, without touching anything outside its slots
(``--asan`` checks that under AddressSanitizer).

    python fuzz/fuzz_validator.py --seconds 600 [--seed N] [--runs N] [--asan]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402, F401, I001 - first: under --asan it swaps in the sanitized native module

import numpy as np  # noqa: E402
from blocks import mutate_program, slot_table  # noqa: E402
from harness import aligned, arguments, mutate_bytes, run, stage  # noqa: E402

from spyre_rt import device_profile, jobs  # noqa: E402
from spyre_rt.card import Card  # noqa: E402
from spyre_rt.program import SLOT_HOST  # noqa: E402

# Accepted programs bigger than this are validated only (their simulation would take long).
WORK_LIMITS = {"macs": 4 << 20, "sfu_elems": 4 << 20, "dma_bytes": 32 << 20}
MAX_SLOT_BYTES = 64 << 20

card = Card(device_profile.load("spyre"), "functional", 0)


def bind(slots) -> tuple[list[int], list[int], list[np.ndarray]]:
    """Memory of exactly each slot's extent: device memory for DRAM slots, host for HOST."""
    bindings, device, host = [], [], []
    try:
        for kind, extent in zip(slots["kind"], slots["extent"], strict=True):
            n = max(int(extent), 1)
            if kind == SLOT_HOST:
                host.append(np.zeros(n, np.uint8))
                bindings.append(host[-1].ctypes.data)
            else:
                device.append(card.malloc(n))
                bindings.append(device[-1])
    except BaseException:
        for addr in device:
            card.free(addr)
        raise
    return bindings, device, host


def target(data: bytes) -> None:
    blob = aligned(data)
    info = stage("validate", jobs.validate, card, blob)
    if any(info[k] > v for k, v in WORK_LIMITS.items()):
        return
    slots = slot_table(blob)
    if sum(int(e) for e in slots["extent"]) > MAX_SLOT_BYTES:
        return
    bindings, device, _host = stage("bind", bind, slots)
    try:
        prog = stage("commit", jobs.ResidentProgram, card, blob)
        try:
            stage("launch", prog.launch, bindings)
        finally:
            prog.free()
    finally:
        for addr in device:
            card.free(addr)


def mutate(rng, parent: bytes, corpus: list[bytes]) -> bytes:
    if rng.random() < 0.8:
        buf = aligned(parent)
        for _ in range(1 + int(rng.random() < 0.3) + int(rng.random() < 0.1)):
            mutate_program(rng, buf)
        return buf.tobytes()
    return mutate_bytes(rng, parent, corpus)


if __name__ == "__main__":
    sys.exit(run("validator", target, mutate, arguments(__doc__.splitlines()[0])))
