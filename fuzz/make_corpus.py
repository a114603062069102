"""Write the fuzz seed corpus from real compiles and programs.

    python fuzz/make_corpus.py            # rewrites fuzz/corpus/plan_reader and fuzz/corpus/validator

plan_reader/: plan cache files of a few small compiled models (matmuls, fused pointwise
kernels, reductions, gathers), re-encoded without their creation time so that a rerun
writes the same bytes. validator/: every distinct program block of those plans, transfer
graphs (host <-> device DMA with descriptors) and a few hand-made programs for the
commands the models do not use (ring, barrier, strided DMA, transposed matmul).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "corpus"


def compile_models(cache_dir: str) -> None:
    import torch
    import torch.nn.functional as F

    from spyre_rt.dispatch import dispatch_mode

    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    models = {
        "mlp": (lambda x, w1, w2: torch.softmax(F.silu(x @ w1.t()) @ w2.t(), -1), [r(4, 64), r(96, 64), r(40, 96)]),
        "norm": (lambda x, w: (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-5) * w,
                 [r(8, 128), r(128)]),
        "embedding": (lambda idx, table: F.embedding(idx, table) * 2 + 1,
                      [torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]), r(16, 64)]),
        "pointwise": (lambda x, y: torch.where(x > 0, torch.exp(x), y * 0.5).sum(0), [r(3, 70), r(70)]),
    }
    with dispatch_mode("prebuilt"):
        for name, (fn, args) in models.items():
            f = torch.compile(fn, backend="spyre_rt", dynamic=False)
            before = set(os.listdir(cache_dir))
            f(*[a.to("spyre") for a in args])
            for new in sorted(set(os.listdir(cache_dir)) - before):
                if new.endswith(".plan"):
                    shutil.copy(os.path.join(cache_dir, new), os.path.join(cache_dir, f"{name}.seed"))


def transfer_programs() -> dict[str, bytes]:
    from spyre_rt.layout import StickLayout
    from spyre_rt.transfer import ViewGeometry, transfer_program

    out = {}
    views = {"rows": ViewGeometry(StickLayout(3, 100, 4), 0, (3, 100), (100, 1)),
             "transposed": ViewGeometry(StickLayout(16, 70, 2), 5, (60, 16), (1, 70))}
    for vname, view in views.items():
        for direction in ("h2d", "d2h"):
            out[f"transfer-{vname}-{direction}"] = transfer_program(direction, view).tobytes()
    return out


def hand_made_programs() -> dict[str, bytes]:
    from spyre_rt.program import (
        CMD_DMA,
        CMD_MM,
        CMD_RING,
        CORE_CARD,
        MM_TRANS_B,
        OP_BARRIER,
        OP_LOAD,
        OP_MATMUL,
        OP_RING,
        OP_STORE,
        SLOT_DRAM,
        ProgramBuilder,
        empty_cmds,
    )

    out = {}
    # strided loads on 4 cores, a ring pass, a barrier joining them, strided stores
    b = ProgramBuilder()
    src, dst = b.slot(SLOT_DRAM, 4 * 4096), b.slot(SLOT_DRAM, 4 * 4096)
    loads = empty_cmds(4, OP_LOAD, np.arange(4))
    loads["src_slot"], loads["src_off"], loads["run_bytes"] = src, np.arange(4) * 4096, 256
    loads["ndims"], loads["count"][:, 0], loads["src_stride"][:, 0], loads["dst_stride"][:, 0] = 1, 16, 256, 256
    ring = empty_cmds(1, OP_RING, 0, CMD_RING)
    ring["dst_core"], ring["ring_src"], ring["ring_dst"], ring["bytes"] = 3, 0, 8192, 4096
    ring["dep_begin"], ring["ndeps"] = 0, 1
    barrier = empty_cmds(1, OP_BARRIER, CORE_CARD)
    barrier["dep_begin"], barrier["ndeps"] = 1, 4
    stores = empty_cmds(4, OP_STORE, np.arange(4))
    stores["dst_slot"], stores["dst_off"], stores["run_bytes"] = dst, np.arange(4) * 4096, 4096
    stores["dep_begin"], stores["ndeps"] = np.arange(5, 9), 1  # every command has its own dependency window
    b.add(np.concatenate([x.view(CMD_DMA) for x in (loads, ring, barrier, stores)]), np.array([0, 1, 2, 3, 4, 5, 5, 5, 5]))
    out["ring-barrier"] = b.encode().tobytes()
    # a transposed-B matmul in fp32 accumulating into C
    b = ProgramBuilder()
    c = empty_cmds(1, OP_MATMUL, 7, CMD_MM)
    c["flags"] = MM_TRANS_B
    c["a_off"], c["b_off"], c["c_off"] = 0, 8 * 32 * 4, 8 * 32 * 4 + 64 * 32 * 4
    c["m"], c["n"], c["k"], c["lda"], c["ldb"], c["ldc"] = 8, 64, 32, 32, 32, 64
    c["a_dtype"] = c["b_dtype"] = 0
    b.add(c)
    out["matmul-fp32-trans-b"] = b.encode().tobytes()
    return out


def builder_records() -> dict[str, bytes]:
    """Decision records of the native builder: the copy kernels and transfer graphs a
    Granite-sized step makes, and edge cases (no range, a one-element view)."""
    from fuzz_builder import copy_record_bytes, graph_record_bytes

    from spyre_rt.native import ffi, lib

    out = {
        "copy-snapshot": b"C" + copy_record_bytes(32, 128, 256 << 10, 2 << 20, [1 << 20, 1 << 20],
                                                  [(0, 1, 0, 0, 1 << 20)]),
        "copy-two-ranges": b"C" + copy_record_bytes(32, 128, 256 << 10, 2 << 20, [8192, 4096, 1 << 14],
                                                    [(0, 1, 100, 0, 4000), (1, 2, 0, 4096, 4096)]),
        "copy-empty": b"C" + copy_record_bytes(32, 128, 256 << 10, 2 << 20, [], []),
    }
    barrier = bytes([lib.SPY_OP_BARRIER, 0]) + (0xFFFF).to_bytes(2, "little") + bytes(124)
    out["graph-barriers"] = b"G" + graph_record_bytes([5, 1, 1], [(0, 2), (0, 1), (2, 1)], 3 * barrier)
    out["graph-empty"] = b"G" + graph_record_bytes([], [], b"")
    views = {"program": (1, 1 << 16, 1, 0, (1 << 16,), (1,)), "rows": (3, 100, 4, 0, (3, 100), (100, 1)),
             "transposed": (16, 70, 2, 5, (60, 16), (1, 70)), "heads": (64, 128, 2, 0, (4, 64, 32), (32, 128, 1)),
             "scalar": (1, 1, 8, 0, (), ())}
    for name, (rows, row_len, itemsize, offset, sizes, strides) in views.items():
        for direction in (lib.SPY_OP_H2D, lib.SPY_OP_D2H):
            rec = ffi.new("spy_transfer_record *", {
                "direction": direction, "ndims": len(sizes),
                "layout": {"rows": rows, "row_len": row_len, "itemsize": itemsize, "stick_bytes": 128},
                "offset": offset, "sizes": list(sizes), "strides": list(strides)})
            out[f"transfer-{name}-{'h2d' if direction == lib.SPY_OP_H2D else 'd2h'}"] = b"T" + bytes(ffi.buffer(rec))
    return out


def write_builder_corpus() -> None:
    from fuzz_builder import target

    records = builder_records()
    for data in records.values():
        target(data)  # every seed builds and validates
    d = OUT / "builder"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for name, data in sorted(records.items()):
        (d / f"{name}.bin").write_bytes(data)
    print(f"{d.relative_to(HERE.parent)}: {len(records)} files, {sum(map(len, records.values()))} bytes")


def main() -> int:
    if sys.argv[1:] == ["builder"]:  # only the builder's seeds (no models to compile)
        write_builder_corpus()
        return 0
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["SPYRE_RT_CACHE_DIR"] = cache_dir  # before spyre_rt reads its settings
        from blocks import plan_sections

        from spyre_rt import plan_cache
        from spyre_rt.plan import program_offsets

        compile_models(cache_dir)
        plans, programs = {}, {}
        for seed in sorted(Path(cache_dir).glob("*.seed")):
            entry = plan_cache.decode(seed.read_bytes())
            header = {k: v for k, v in entry.header.items()
                      if k not in ("key", "blocks", "pieces", "piece_sizes", "created")}
            plans[seed.stem] = plan_cache.encode(entry.key, header, entry.blocks,
                                                 [program_offsets(b) for b in entry.blocks])
            for block in entry.blocks:
                for off, length in plan_sections(block)["programs"]:
                    blob = block[off: off + length].tobytes()
                    programs.setdefault(hashlib.sha256(blob).hexdigest()[:12], (seed.stem, blob))
        validator = {f"{name}-{digest}": blob for digest, (name, blob) in sorted(programs.items())}
        validator.update(transfer_programs())
        validator.update(hand_made_programs())
    from harness import aligned

    from spyre_rt import card as cards
    from spyre_rt import jobs

    card = cards.get(0)
    for blob in validator.values():
        jobs.validate(card, aligned(blob))  # every seed is a valid program
    for d, files, ext in ((OUT / "plan_reader", plans, ".plan"), (OUT / "validator", validator, ".bin")):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for name, data in sorted(files.items()):
            (d / f"{name}{ext}").write_bytes(data)
        print(f"{d.relative_to(HERE.parent)}: {len(files)} files, {sum(map(len, files.values()))} bytes")
    write_builder_corpus()
    return 0


if __name__ == "__main__":
    sys.exit(main())
