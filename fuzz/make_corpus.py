"""Write the fuzz seeds from real compiles and programs (fuzz/seeds; the kept corpus of
fuzz/corpus is written by the targets' --merge).

    python fuzz/make_corpus.py                         # rewrites fuzz/seeds/plan_reader, validator and builder
    python fuzz/make_corpus.py plan_reader --out DIR   # only the plan files, into DIR/plan_reader
    python fuzz/make_corpus.py builder                 # only the builder's records (no models to compile)

plan_reader/: plan cache files of a few small compiled models (matmuls, fused pointwise
kernels, reductions, gathers), re-encoded without their creation time so that a rerun
writes the same bytes. They are plan caches, so they are generated, never kept in git
(tests/test_fuzz.py writes them into a temporary directory before the plan reader runs).
validator/: every distinct program block of those plans, transfer graphs (host <-> device
DMA with descriptors) and a few hand-made programs for the commands the models do not use
(ring, barrier, strided DMA, transposed matmul). builder/: decision records of the native
builder.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import harness  # noqa: I001 - first, as in the targets: the seeds are checked on the module they fuzz
import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "seeds"


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


def loop_kernels() -> dict:
    """Small loop kernels, each with its buffers' layouts: a pointwise one, a gather with
    an index value (a tile constant, two stages), a masked load, a load of every third
    column (a descriptor list), a row reduction, and row sums whose tiles merge their stores
    (on a scratchpad of MERGED_SCRATCHPAD bytes)."""
    from spyre_rt.ir import Access, Buffer, LoopKernel, Op
    from spyre_rt.layout import StickLayout

    def buf(name, dtype, sizes, strides):
        return Buffer(name, dtype, sizes, strides)

    h = "float16"
    out = {"pointwise": (LoopKernel("p", (37, 96), 1, False, (
        Op("x", "load", (), h, Access("x", 0, (96, 1))), Op("v", "exp", ("x",)),
        Op("y", "store", ("v",), h, Access("y", 0, (96, 1)))),
        (buf("x", h, (37, 96), (96, 1)), buf("y", h, (37, 96), (96, 1)))),
        {"x": StickLayout(37, 96, 2), "y": StickLayout(37, 96, 2)})}
    out["gather"] = (LoopKernel("g", (4, 64), 1, False, (
        Op("i", "load", (), "int64", Access("idx", 0, (1, 0))),
        Op("j", "indirect", ("i",), "", None, {"size": 8}),
        Op("g", "load", (), h, Access("t", 0, (0, 1), (("j", 64),))),
        Op("r", "index", (), "int64", Access("", 0, (1, 0))), Op("s", "add", ("g", "r")),
        Op("o", "store", ("s",), h, Access("out", 0, (64, 1)))),
        (buf("idx", "int64", (4,), (1,)), buf("t", h, (8, 64), (64, 1)), buf("out", h, (4, 64), (64, 1)))),
        {"idx": StickLayout(1, 4, 8), "t": StickLayout(8, 64, 2), "out": StickLayout(4, 64, 2)})
    out["masked"] = (LoopKernel("m", (12, 64), 1, False, (
        Op("x", "load", (), h, Access("x", -128, (64, 1), (), ((0, 2, 10),))),
        Op("y", "store", ("x",), h, Access("y", 0, (64, 1)))),
        (buf("x", h, (8, 64), (64, 1)), buf("y", h, (12, 64), (64, 1)))),
        {"x": StickLayout(8, 64, 2), "y": StickLayout(12, 64, 2)})
    out["strided"] = (LoopKernel("t", (37, 100), 1, False, (
        Op("x", "load", (), h, Access("x", 0, (300, 3))),
        Op("y", "store", ("x",), h, Access("y", 0, (100, 1)))),
        (buf("x", h, (37, 300), (300, 1)), buf("y", h, (37, 100), (100, 1)))),
        {"x": StickLayout(37, 300, 2), "y": StickLayout(37, 100, 2)})
    out["row-sums"] = (LoopKernel("r", (50, 200), 1, True, (
        Op("x", "load", (), "float32", Access("x", 0, (200, 1))),
        Op("s", "reduction", ("x",), "float32", None, {"kind": "sum"}),
        Op("y", "store", ("s",), "float32", Access("y", 0, (1, 0)))),
        (buf("x", "float32", (50, 200), (200, 1)), buf("y", "float32", (50,), (1,)))),
        {"x": StickLayout(50, 200, 4), "y": StickLayout(1, 50, 4)})
    out["merged-row-sums"] = (LoopKernel("ms", (40, 2000), 1, True, (
        Op("x", "load", (), "float32", Access("x", 0, (2000, 1))),
        Op("s", "reduction", ("x",), "float32", None, {"kind": "sum"}),
        Op("y", "store", ("s",), "float32", Access("y", 0, (1, 0)))),
        (buf("x", "float32", (40, 2000), (2000, 1)), buf("y", "float32", (40,), (1,)))),
        {"x": StickLayout(40, 2000, 4), "y": StickLayout(1, 40, 4)})
    return out


# a scratchpad whose tiles hold fewer rows of "merged-row-sums" than a stick of its sums (32):
# the tiles of a stick's rows merge their stores
MERGED_SCRATCHPAD = 64 << 10


def builder_records() -> dict[str, bytes]:
    """Decision records of the native builder: the copy kernels and transfer graphs a
    Granite-sized step makes, small loop kernels of each kind of access, and edge cases
    (no range, a one-element view)."""
    from fuzz_builder import copy_record_bytes, graph_record_bytes, loop_record_bytes

    from spyre_rt import device_profile
    from spyre_rt.construct.context import BuildContext
    from spyre_rt.construct.loops.record import decide
    from spyre_rt.cost import CostModel
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
    out.update(matmul_records())
    target = CostModel.of_figures(device_profile.load("spyre"))
    for name, (kernel, layouts) in loop_kernels().items():
        small = dataclasses.replace(target, scratchpad_bytes=MERGED_SCRATCHPAD)
        decided = decide(BuildContext(small if name.startswith("merged") else target, layouts), kernel)
        assert name.startswith("merged") == bool(decided.record.nmerges), name  # the record owns the arrays
        out[f"loop-{name}"] = b"L" + loop_record_bytes(decided.record)
    out.update(attention_records())
    out.update(tiling_records())
    return out


def tiling_records() -> dict[str, bytes]:
    """The matmul tiling search's arguments: Granite 3.3 8B's prefill up projection with its
    SwiGLU epilogue, a decode GEMV split over K, an fp32 GEMM with A transposed and a bias,
    and a small prompt-length GEMM, each with the tiling it chooses and one other."""
    from spyre_rt import device_profile
    from spyre_rt.construct.matmul import tiling as tl
    from spyre_rt.construct.matmul.spec import Problem
    from spyre_rt.cost import CostModel
    from spyre_rt.native import ffi

    target = CostModel.of_figures(device_profile.load("spyre"))
    problems = {
        "tiling-prefill-swiglu": Problem(1, 1024, 12800, 4096, 2, 2, 0, False, True, False, stores=(2,), epi_tiles=(2,),
                                         epi_temps=2, epi_instrs=8),
        "tiling-decode-split-k": Problem(1, 1, 64, 49155, 2, 2, 0, False, True, False),
        "tiling-fp32-bias": Problem(2, 7, 100, 4097, 4, 4, 4, True, False, True, stores=(4,)),
        "tiling-prompt-length": Problem(1, 31, 1000, 256, 4, 4, 0, False, True, True),
    }
    out = {}
    for name, p in problems.items():
        t = tl.choose(target, p)
        other = ffi.new("spy_mm_tiling *", {"groups": 32, "pk": 1, "pm": 1, "pn": 1, "m_tiles": 1, "n_tiles": 1, "tk": 64,
                                            "nbuf": 2})
        chosen = ffi.new("spy_mm_tiling *", dict(zip(tl._TILING_FIELDS, (getattr(t, f) for f in tl._TILING_FIELDS),
                                                     strict=True)))
        out[name] = (b"S" + bytes(ffi.buffer(tl._cost(target))) + bytes(ffi.buffer(tl._problem(p)))
                     + bytes(ffi.buffer(chosen)) + bytes(ffi.buffer(other)))
    return out


def matmul_records() -> dict[str, bytes]:
    """Decision records of matmuls: a bias row, split-K, a fused epilogue, an A prologue (a
    norm's rewrite of each chunk, split-K), a group of three with a prologue, a transposed
    weight, rows that wrap in their storage (descriptor lists), an empty K, nothing to
    compute, last tiles in pieces that walk three K chunks."""

    from fuzz_builder import matmul_record_bytes

    from spyre_rt import device_profile
    from spyre_rt.construct import matmul as mm
    from spyre_rt.construct.context import BuildContext
    from spyre_rt.cost import CostModel
    from spyre_rt.ir import Epilogue, Op, Prologue
    from spyre_rt.layout import StickLayout
    from spyre_rt.native import lib

    target = CostModel.of_figures(device_profile.load("spyre"))
    f16 = lib.SPY_DT_F16

    def record(m, n, k, *, a=None, b=None, bias=False, epilogue=False, prologue=False, parts=0, tiling=None,
               layouts=None, sliced=False, last_depth=0):
        lay = {"a": StickLayout(m, k, 2), "b": StickLayout(k, n, 2), "o": StickLayout(m, n, 2),
               "bias": StickLayout(1, n, 4), "r": StickLayout(m, n, 2), "s": StickLayout(1, m, 4),
               "w": StickLayout(1, k, 2), "c": StickLayout(m, 128, 2)} | (layouts or {})
        ep = None
        if sliced:  # a rotation of each 128 columns' halves by a table per row and per column, scaled per row
            def half(shift, at, sign):
                return (Op("p", "product", dtype="float16"),
                        Op("x", "product", dtype="float16", attrs={"shift": shift}),
                        *((Op("n", "neg", ("x",)),) if sign else ()),
                        Op("c", "load", dtype="float16", attrs={"input": 1, "at": at}),
                        Op("y", "mul", ("p", "c")), Op("w", "load", dtype="float16", attrs={"input": 2, "at": 0}),
                        Op("z", "mul", ("n" if sign else "x", "w")), Op("r", "load", dtype="float32", attrs={"input": 0}),
                        Op("t", "add", ("y", "z")), Op("u", "mul", ("t", "r")),
                        Op("v", "store", ("u",), attrs={"output": 0}))
            ep = Epilogue((), (mm.View("s", 0, (1, m, n), (0, 1, 0)), mm.View("c", 0, (1, m, 128), (0, 128, 1)),
                               mm.View("w", 0, (1, 1, 64), (0, 0, 1))), ("float32", "float16", "float16"),
                          (mm.View("o", 0, (1, m, n), (0, n, 1)),), ("float16",),
                          slices=(half(64, 0, True), half(-64, 64, False)), slice_cols=64, periodic=(1, 2))
        if epilogue:  # (product + r) as fp16, the SiLU of it
            ops = (Op("p", "product", dtype="float16"), Op("r", "load", dtype="float16", attrs={"input": 0}),
                   Op("s", "add", ("p", "r"), "float32"), Op("y", "silu", ("s",), "float32"),
                   Op("w", "store", ("y",), attrs={"output": 0}))
            ep = Epilogue(ops, (mm.View("r", 0, (1, m, n), (0, n, 1)),), ("float16",),
                          (mm.View("o", 0, (1, m, n), (0, n, 1)),), ("float16",))
        a = a or mm.View("a", 0, (1, m, k), (0, k, 1))
        pro = None
        if prologue:  # RMSNorm's elementwise part: w * fp16(x * rstd)
            ops = (Op("x", "load", dtype="float16", attrs={"input": 0}), Op("s", "load", dtype="float32",
                                                                           attrs={"input": 1}),
                   Op("y", "mul", ("x", "s")), Op("h", "to_dtype", ("y",), "float16"),
                   Op("w", "load", dtype="float16", attrs={"input": 2}), Op("z", "mul", ("w", "h")),
                   Op("a", "store", ("z",), "float16", attrs={"output": 0}))
            pro = Prologue(ops, (a, mm.View("s", 0, (1, m, k), (0, 1, 0)), mm.View("w", 0, (1, m, k), (0, 0, 1))),
                           ("float16", "float32", "float16"))
        more = []
        for i in range(parts):  # a grouped matmul: more weights and outputs beside b and o
            lay[f"b{i}"], lay[f"o{i}"] = StickLayout(k, n, 2), StickLayout(m, n, 2)
            more.append((mm.View(f"b{i}", 0, (1, k, n), (0, n, 1)), mm.View(f"o{i}", 0, (1, m, n), (0, n, 1))))
        spec = mm.MatmulSpec(a, b or mm.View("b", 0, (1, k, n), (0, n, 1)),
                             mm.View("o", 0, (1, m, n), (0, n, 1)), f16, f16,
                             bias=mm.View("bias", 0, (1, m, n), (0, 0, 1)) if bias else None,
                             bias_dtype=lib.SPY_DT_F32 if bias else 0, epilogue=ep, prologue=pro, parts=tuple(more))
        ctx = BuildContext(target, lay)
        decided = mm.build(ctx, spec, tiling)  # owns the arrays its record points at
        if last_depth:
            decided.cdata.last_depth = last_depth
        return b"M" + matmul_record_bytes(decided.cdata)

    return {
        "matmul-bias": record(64, 130, 200, bias=True),
        "matmul-split-k": record(1, 256, 1024, tiling=mm.Tiling(2, 4, 1, 4, 1, 4, 128, 3)),
        "matmul-epilogue": record(40, 96, 64, epilogue=True),
        "matmul-sliced-epilogue": record(40, 256, 64, sliced=True),
        "matmul-prologue": record(70, 64, 512, prologue=True, tiling=mm.Tiling(4, 2, 2, 2, 4, 2, 128, 2)),
        "matmul-grouped": record(40, 128, 256, prologue=True, parts=2, tiling=mm.Tiling(2, 1, 2, 4, 2, 12, 128, 3)),
        "matmul-transposed-weight": record(16, 64, 128, b=mm.View("b", 0, (1, 128, 64), (0, 1, 128)),
                                           layouts={"b": StickLayout(64, 128, 2)}),
        "matmul-wrapping-rows": record(4, 70, 192, a=mm.View("a", 0, (1, 4, 192), (0, 192, 1)),
                                       layouts={"a": StickLayout(8, 96, 2)}),
        "matmul-empty-k": record(8, 64, 0, layouts={"a": StickLayout(8, 1, 2), "b": StickLayout(1, 64, 2)}),
        "matmul-nothing": record(0, 64, 64),
        "matmul-pieces-deep": record(256, 128, 256, tiling=mm.Tiling(2, 1, 2, 2, 4, 4, 64, 3), last_depth=3),
    }


def attention_records() -> dict[str, bytes]:
    """The decision records of a few attentions: decode split over the cores, prefill whose
    cores share a KV head's keys, causal, fp32, and a mask whose tiles move as descriptor
    lists."""
    from fuzz_builder import attention_record_bytes

    from spyre_rt import device_profile
    from spyre_rt.construct import attention
    from spyre_rt.construct.context import BuildContext
    from spyre_rt.cost import CostModel
    from spyre_rt.ir import AttentionKernel
    from spyre_rt.layout import StickLayout

    target = CostModel.of_figures(device_profile.load("spyre"))

    def record(q_len, kv_len, dtype="float16", causal=False, mask=None):
        e = 4 if dtype == "float32" else 2
        views = {"q": ("q", 0, (1, 8, q_len, 64), (512 * q_len, 64 * q_len, 64, 1)),
                 "k": ("k", 0, (1, 2, kv_len, 64), (128 * kv_len, 64 * kv_len, 64, 1)),
                 "v": ("v", 0, (1, 2, kv_len, 64), (128 * kv_len, 64 * kv_len, 64, 1)),
                 "out": ("out", 0, (1, 8, q_len, 64), (512 * q_len, 64, 512, 1))}
        layouts = {"q": StickLayout(8 * q_len, 64, e), "k": StickLayout(2 * kv_len, 64, e),
                   "v": StickLayout(2 * kv_len, 64, e), "out": StickLayout(q_len, 512, e)}
        if mask:
            (name, off, sizes, strides), layouts["m"] = mask
            views["mask"] = (name, off, sizes, strides)
        kernel = AttentionKernel("attention", views["q"], views["k"], views["v"], views["out"], dtype, 0.125,
                                 causal, 0, views.get("mask"), "bool" if mask else "")
        r = attention.build(BuildContext(target, layouts), kernel)
        extents = [r.c.slot_extent[i] for i in range(r.c.nslots)]
        return b"A" + attention_record_bytes(r.c, r.tasks.tobytes(), extents)

    def paged(batch, q_len, width, page=64, pages=50):
        """Keys and values through a block table: a cache (2, 2 KV heads, pages, page, 64)."""
        kv_len = width * page
        views = {"q": ("q", 0, (batch, 8, q_len, 64), (512 * q_len, 64, 512, 1)),
                 "out": ("out", 0, (batch, 8, q_len, 64), (512 * q_len, 64, 512, 1)),
                 "m": ("m", 0, (batch, 8, q_len, kv_len), (q_len * kv_len, 0, kv_len, 1)),
                 "t": ("t", 0, (batch, width), (width, 1))}
        kv = [("c", half * 2 * pages * page * 64, (pages, 2, page, 64), (page * 64, pages * page * 64, 64, 1))
              for half in (0, 1)]
        layouts = {"q": StickLayout(batch * q_len, 512, 2), "out": StickLayout(batch * q_len, 512, 2),
                   "c": StickLayout(2 * 2 * pages * page, 64, 2), "m": StickLayout(batch * q_len, kv_len, 1),
                   "t": StickLayout(batch, width, 8)}
        kernel = AttentionKernel("attention", views["q"], *kv, views["out"], "float16", 0.125, mask=views["m"],
                                 mask_dtype="bool", page=page, block_table=views["t"], table_dtype="int64")
        r = attention.build(BuildContext(target, layouts), kernel)
        extents = [r.c.slot_extent[i] for i in range(r.c.nslots)]
        return b"A" + attention_record_bytes(r.c, r.tasks.tobytes(), extents)

    def padding(q_len, kv_len):  # a row of keys per query, broadcast over the heads
        return ("m", 0, (1, 8, q_len, kv_len), (0, 0, kv_len, 1)), StickLayout(q_len, kv_len, 1)

    return {
        "attention-decode-split": record(1, 300, mask=padding(1, 300)),
        "attention-prefill-shared": record(300, 310, mask=padding(300, 310)),
        "attention-causal": record(40, 40, causal=True),
        "attention-causal-resident": record(520, 530, causal=True),  # each core keeps its KV head's keys
        "attention-fp32": record(17, 129, dtype="float32"),
        # mask rows 3 elements apart in a one-row storage: no compact pattern, descriptor lists
        "attention-mask-listed": record(5, 40, mask=(("m", 1, (1, 8, 5, 40), (0, 0, 43, 1)),
                                                     StickLayout(40, 7, 1))),
        "attention-paged-decode": paged(4, 1, 5),
        "attention-paged-chunk": paged(1, 37, 9),
    }


def write(d: Path, files: dict[str, bytes], ext: str) -> None:
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for name, data in sorted(files.items()):
        (d / f"{name}{ext}").write_bytes(data)
    print(f"{d}: {len(files)} files, {sum(map(len, files.values()))} bytes")


def write_builder_corpus(out: Path) -> None:
    from fuzz_builder import target

    records = builder_records()
    for data in records.values():
        target(data)  # every seed builds and validates
    write(out / "builder", records, ".bin")


def compiled_seeds() -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The plan files of the small models and every distinct program block in them."""
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["SPYRE_RT_CACHE_DIR"] = cache_dir  # before spyre_rt reads its settings
        from spyre_rt import plan_cache
        from spyre_rt.plan import program_offsets
        from spyre_rt.program import plan_tables

        compile_models(cache_dir)
        plans, programs = {}, {}
        for seed in sorted(Path(cache_dir).glob("*.seed")):
            entry = plan_cache.decode(seed.read_bytes())
            header = {k: v for k, v in entry.header.items()
                      if k not in ("key", "blocks", "pieces", "piece_sizes", "created")}
            plans[seed.stem] = plan_cache.encode(entry.key, header, entry.blocks,
                                                 [program_offsets(b) for b in entry.blocks])
            for block in entry.blocks:
                for job in plan_tables(block).jobs:
                    blob = block[int(job["prog_off"]): int(job["prog_off"]) + int(job["prog_len"])].tobytes()
                    programs.setdefault(hashlib.sha256(blob).hexdigest()[:12], (seed.stem, blob))
    return plans, {f"{name}-{digest}": blob for digest, (name, blob) in sorted(programs.items())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("targets", nargs="*", choices=("plan_reader", "validator", "builder"),
                   help="whose seeds to write (default: all three)")
    p.add_argument("--out", type=Path, default=OUT, help="the seeds' root directory (default fuzz/seeds)")
    p.add_argument("--asan", action="store_true", help="compile on the sanitized instrumented module, as the "
                   "targets' --asan runs (read when harness is imported)")
    args = p.parse_args()
    targets = set(args.targets or ("plan_reader", "validator", "builder"))
    if targets & {"plan_reader", "validator"}:
        plans, validator = compiled_seeds()
        if "plan_reader" in targets:
            write(args.out / "plan_reader", plans, ".plan")
        if "validator" in targets:
            validator.update(transfer_programs())
            validator.update(hand_made_programs())
            from spyre_rt import card as cards
            from spyre_rt import jobs

            card = cards.get(0)
            for blob in validator.values():
                jobs.validate(card, harness.aligned(blob))  # every seed is a valid program
            write(args.out / "validator", validator, ".bin")
    if "builder" in targets:
        write_builder_corpus(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
