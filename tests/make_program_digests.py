"""Regenerate tests/program_digests.json: the programs construction builds, as digests.

    python tests/make_program_digests.py

Compiles a few tiny model families and a two-layer Granite 3.3 8B (prefill and decode; its
layers compiled once, as the main job compiles them, the norms as the projections' prologues),
on a timing-mode card, in ``construct`` mode, and records every distinct card kernel it
builds (loop, matmul with its epilogues, attention, the snapshot copies) as plain data: the
kernel's description (JSON), the stick layouts and logical offsets of its buffers, and
the sha256 of the program it encodes. Transfer graphs of a few view geometries are
recorded the same way. ``tests/test_program_digests.py`` builds each again from the
record and compares the digest: the proof that a change to construction keeps every
program byte for byte. Regenerate only when a change means to alter programs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

from spyre_rt import ir as kdesc
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.executor.executable import RESTORE, SNAPSHOT
from spyre_rt.executor.step import live_steps

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "program_digests.json")
FAMILIES = ("granite", "gemma2", "gpt2", "bert")  # a decoder each with its own features, an encoder
PER_KIND = 12  # kernels of a tiny family kept per kind (the distinct ones, in build order: the row
# saves of the KV caches come first, then the layer's kernels, its rotary embeddings among them)
# transfer graphs: (rows, row_len, itemsize, offset, sizes, strides)
TRANSFERS = [
    (1024, 4096, 2, 0, (1024, 4096), (4096, 1)),       # a Granite 8B hidden state
    (1, 4096, 2, 0, (1, 4096), (4096, 1)),             # its decode row
    (1024, 128, 2, 0, (8, 128, 128), (128, 1024, 1)),  # a head-major view of a KV slice
    (256, 96, 4, 32, (30, 64), (96, 1)),               # fp32, rows not a whole stick, offset
    (64, 256, 2, 0, (256, 64), (1, 256)),              # a transposed view
]


def digest(blob) -> str:
    return hashlib.sha256(bytes(blob)).hexdigest()


def record(exe, name: str) -> dict:
    """A kernel's build inputs as plain data, with its program's digest."""
    blob, bufs = exe.build(name)
    layouts = {b: list(exe.bindings.layouts[b]) for b in bufs}
    if name in (SNAPSHOT, RESTORE):
        copies = exe.snapshots if name == SNAPSHOT else [
            (c.dst, c.dst_off, c.src, c.src_off, c.nbytes) for c in exe.snapshots]
        return {"kind": "copy", "copies": [list(c) for c in copies], "layouts": layouts, "sha256": digest(blob)}
    kernel = exe.kernels[name]   # the step's kernels and its row saves' and restores'
    return {"kind": kernel.kind, "kernel": kdesc.to_json(kernel), "layouts": layouts,
            "offsets": {b: exe.bindings.offsets[b] for b in bufs if exe.bindings.offsets.get(b)}, "sha256": digest(blob)}


def collect(source: str, run, out: list, seen: set, per_kind: int = PER_KIND) -> None:
    before = set(map(id, live_steps()))
    with dispatch_mode("construct"), torch.no_grad():
        run()
    counts: dict[str, int] = {}
    for step in live_steps():
        if id(step) in before:
            continue
        for exe in step.executables():
            if not exe.prepared:
                continue
            for seg in exe.device_segments():
                for name in seg.kernels:
                    r = record(exe, name)
                    key = json.dumps({k: v for k, v in r.items() if k != "sha256"}, sort_keys=True)
                    if key in seen or counts.get(r["kind"], 0) >= per_kind:
                        continue
                    seen.add(key)
                    counts[r["kind"]] = counts.get(r["kind"], 0) + 1
                    out.append({"source": source, **r})
    print(f"{source}: {counts}", file=sys.stderr)


def main() -> None:
    from spyre_rt import card as cards
    from spyre_rt.layout import StickLayout
    from spyre_rt.profiler import models, parity
    from spyre_rt.profiler import run as runmod
    from spyre_rt.transfer import ViewGeometry, transfer_program

    out: list[dict] = []
    seen: set[str] = set()
    with cards.configured(sim_mode="timing"):
        for name in FAMILIES:
            fam = models.family(name)
            cfg, model = fam.build(torch.float16)
            model = model.to("spyre")
            r = parity.runner(fam, model, cfg, torch.float16, "spyre", compiled=True)
            torch._dynamo.reset()
            collect(name, lambda r=r: r.run(steps=1), out, seen)
    session = runmod.Session(runmod.Options("granite-3.3-8b", seq=1024, layers=2, sim_mode="timing"))

    def granite():
        with session.active():
            session.cache.reset()
            session.prefill()
            session.decode_step()

    collect("granite-3.3-8b", granite, out, seen, per_kind=1 << 30)  # every kernel of a layer
    transfers = []
    for rows, row_len, itemsize, off, sizes, strides in TRANSFERS:
        view = ViewGeometry(StickLayout(rows, row_len, itemsize), off, sizes, strides)
        for direction in ("h2d", "d2h"):
            transfers.append({"layout": [rows, row_len, itemsize], "offset": off, "sizes": list(sizes),
                              "strides": list(strides), "direction": direction,
                              "sha256": digest(transfer_program(direction, view))})
    with open(OUT, "w") as f:
        json.dump({"kernels": out, "transfers": transfers}, f, indent=0, sort_keys=True)
        f.write("\n")
    print(f"{len(out)} kernels, {len(transfers)} transfer graphs -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
