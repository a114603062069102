"""The native builder refuses a corrupt decision record whole, with a typed error naming
the field, before anything is built (native/construct.c and native/build_*.c; the byte
identity of what it builds is tests/test_program_digests.py's)."""

from __future__ import annotations

import types

import pytest

from spyre_rt import device_profile, jobs
from spyre_rt.card import Card
from spyre_rt.construct import copy, loops
from spyre_rt.construct.context import BuildContext
from spyre_rt.cost import CostModel
from spyre_rt.errors import SpyreError, SpyreInvalidCommandError
from spyre_rt.ir import Access, Buffer, LoopKernel, Op
from spyre_rt.layout import StickLayout
from spyre_rt.native import ffi, lib
from spyre_rt.program import JOB_HEADER, built_block
from spyre_rt.transfer import ViewGeometry, transfer_program

MiB = 1 << 20
TARGET = CostModel.of_figures(device_profile.load("spyre"))


@pytest.fixture(scope="module")
def card():
    return Card(device_profile.load("spyre"), "timing", 0)


def copy_record(ranges, extents, num_cores=32, stick_bytes=128, chunk_max=256 << 10, scratchpad=2 * MiB):
    rs = ffi.new("spy_copy_range[]", max(1, len(ranges)))
    for r, values in zip(rs, ranges, strict=False):
        r.src_slot, r.dst_slot, r.src_off, r.dst_off, r.nbytes = values
    ex = ffi.new("uint64_t[]", list(extents) or [0])
    rec = ffi.new("spy_copy_record *", {"num_cores": num_cores, "stick_bytes": stick_bytes, "chunk_max": chunk_max,
                                        "scratchpad_bytes": scratchpad, "nslots": len(extents),
                                        "nranges": len(ranges), "slot_extent": ex, "ranges": rs})
    return rec, (rs, ex)


def build_copy(*args, **kw):
    rec, _keep = copy_record(*args, **kw)
    return built_block(lib.spy_build_copy, rec, "copy")


def transfer_record(layout=(4, 64, 2), offset=0, sizes=(4, 64), strides=(64, 1), direction=None, ndims=None):
    rows, row_len, itemsize = layout
    return ffi.new("spy_transfer_record *", {
        "direction": lib.SPY_OP_H2D if direction is None else direction,
        "ndims": len(sizes) if ndims is None else ndims,
        "layout": {"rows": rows, "row_len": row_len, "itemsize": itemsize, "stick_bytes": 128},
        "offset": offset, "sizes": list(sizes), "strides": list(strides)})


def build_transfer(**kw):
    return built_block(lib.spy_build_transfer, transfer_record(**kw), "transfer")


def test_a_well_formed_copy_record_builds_a_program_the_card_accepts(card):
    blob = build_copy([(0, 1, 128, 0, 3 * MiB)], [4 * MiB, 3 * MiB])
    info = jobs.validate(card, blob)
    assert info["ncmds"] == 2 * 32  # 3 MiB over 32 cores: one chunk each, under the 256 KiB chunk_max
    assert int(blob[:JOB_HEADER.itemsize].view(JOB_HEADER)["total_bytes"][0]) == blob.size


@pytest.mark.parametrize("ranges,extents,kw,status,field", [
    ([(0, 2, 0, 0, 64)], [64, 64], {}, "SPY_E_INVALID_ARG", "ranges[0].dst_slot"),
    ([(0, 1, 0, 0, 64), (5, 1, 0, 0, 64)], [64, 64], {}, "SPY_E_INVALID_ARG", "ranges[1].src_slot"),
    ([(0, 1, 32, 0, 64)], [64, 64], {}, "SPY_E_BAD_ADDRESS", "ranges[0].src_off"),
    ([(0, 1, 0, 8, 64)], [64, 64], {}, "SPY_E_BAD_ADDRESS", "ranges[0].dst_off"),
    ([(0, 1, 2**64 - 8, 0, 64)], [64, 64], {}, "SPY_E_BAD_ADDRESS", "ranges[0].src_off"),  # wraps past 2^64
    ([(0, 1, 0, 0, 64)], [64, 64], {"chunk_max": 2 * MiB}, "SPY_E_SCRATCHPAD", "chunk_max"),
    ([(0, 1, 0, 0, 64)], [64, 64], {"num_cores": 0}, "SPY_E_INVALID_ARG", "num_cores"),
    ([(0, 1, 0, 0, 64)], [64, 64], {"stick_bytes": 96}, "SPY_E_INVALID_ARG", "stick_bytes"),
    ([(0, 1, 0, 0, 1 << 40)], [1 << 40, 1 << 40], {"chunk_max": 128}, "SPY_E_INVALID_ARG", "ranges[0]"),
])
def test_a_corrupt_copy_record_is_refused_naming_its_field(ranges, extents, kw, status, field):
    with pytest.raises(SpyreError) as e:
        build_copy(ranges, extents, **kw)
    assert status in str(e.value) and field in str(e.value), str(e.value)


def test_a_copy_outside_its_buffer_is_refused_before_it_runs(card):
    """Through the kernel builder: a typed error, no program."""
    target = CostModel.of_figures(card.profile)
    ctx = BuildContext(target, {"a": StickLayout(1, 4096, 1), "b": StickLayout(1, 4096, 1)})
    with pytest.raises(SpyreInvalidCommandError, match=r"ranges\[0\]\.src_off 4000 \+ nbytes 200"):
        copy.build(ctx, [copy.Copy("a", 4000, "b", 0, 200)])
    assert ctx.block is None


def test_a_well_formed_transfer_record_builds_a_graph_the_card_accepts(card):
    blob = build_transfer(layout=(16, 70, 2), offset=5, sizes=(60, 16), strides=(1, 70))
    out = ffi.new("spy_transfer **")
    assert lib.spy_transfer_create(card.handle, ffi.from_buffer(blob), blob.size, out) == lib.SPY_OK
    lib.spy_transfer_destroy(out[0])


@pytest.mark.parametrize("kw,status,field", [
    ({"direction": lib.SPY_OP_LOAD}, "SPY_E_INVALID_ARG", "direction"),
    ({"ndims": lib.SPY_TRANSFER_MAX_DIMS + 1}, "SPY_E_INVALID_ARG", "ndims"),
    ({"offset": 1}, "SPY_E_BAD_ADDRESS", "offset 1"),  # one element past the storage
    ({"sizes": (4, 65)}, "SPY_E_BAD_ADDRESS", "of a 256-element storage"),
    ({"sizes": (2**40, 2**40), "strides": (0, 0)}, "SPY_E_INVALID_ARG", "sizes[1]"),  # 2^80 elements
    ({"sizes": (3, 2), "strides": (2**63, 1)}, "SPY_E_BAD_ADDRESS", "strides[0]"),  # reaches past 2^64
    ({"layout": (4, 64, 3)}, "SPY_E_INVALID_ARG", "layout"),
    ({"layout": (1, 2**33, 1), "sizes": (2**33,), "strides": (1,)}, "SPY_E_INVALID_ARG", "descriptors"),
])
def test_a_corrupt_transfer_record_is_refused_naming_its_field(kw, status, field):
    with pytest.raises(SpyreError) as e:
        build_transfer(**kw)
    assert status in str(e.value) and field in str(e.value), str(e.value)


def test_a_view_of_too_many_dimensions_is_a_typed_error():
    sizes = (2,) * (lib.SPY_TRANSFER_MAX_DIMS + 1)
    strides = tuple(2 ** i for i in reversed(range(len(sizes))))
    view = ViewGeometry(StickLayout(1, 2 ** len(sizes), 2), 0, sizes, strides)
    with pytest.raises(SpyreError, match="dimensions longer than 1"):
        transfer_program("h2d", view)
    # unit dimensions do not count
    ones = ViewGeometry(StickLayout(1, 4, 2), 0, (1,) * 12 + (4,), (4,) * 12 + (1,))
    assert transfer_program("h2d", ones).size


def test_a_natively_built_kernel_has_the_facts_of_its_program(card):
    """The profiler's figures (DRAM bytes, cores) come from the block the builder made."""
    from spyre_rt.construct.facts import program_facts

    target = CostModel.of_figures(card.profile)
    ctx = BuildContext(target, {"a": StickLayout(1, MiB, 1), "b": StickLayout(1, MiB, 1)})
    copy.build(ctx, [copy.Copy("a", 0, "b", 0, MiB)])
    assert ctx.ncmds == 64
    assert program_facts(ctx) == {"dram_bytes": 2 * MiB, "cores": 32, "scratchpad_peak": 256 << 10}


def graph_record(ncmds=2, after=(1,), before=(0,), keys=None):
    cmds = ffi.new("spy_cmd[]", max(1, ncmds))
    for i in range(ncmds):
        cmds[i].op, cmds[i].core = lib.SPY_OP_BARRIER, lib.SPY_CORE_CARD
    k = ffi.new("int64_t[]", list(keys or range(ncmds)) or [0])
    a, b = ffi.new("int64_t[]", list(after) or [0]), ffi.new("int64_t[]", list(before) or [0])
    rec = ffi.new("spy_graph_record *", {"ncmds": ncmds, "npairs": len(after), "cmds": cmds, "keys": k,
                                         "after": a, "before": b})
    return rec, (cmds, k, a, b)


def test_a_graph_is_ordered_by_key_and_its_dependencies_renumbered(card):
    rec, _keep = graph_record(3, after=(0, 0, 2), before=(2, 1, 1), keys=(5, 1, 1))
    blob = built_block(lib.spy_build_graph, rec, "graph")
    jobs.validate(card, blob)
    from spyre_rt.program import block_sections
    cmds, _ = block_sections(blob)
    # program order: 1, 2 (key 1, in the order made), then 0 (key 5)
    assert list(cmds["ndeps"]) == [0, 1, 2] and list(cmds["dep_begin"]) == [0, 0, 1]
    deps = blob[JOB_HEADER.itemsize + 3 * 128:][:12].view("u4")
    assert list(deps) == [0, 1, 0]  # 2 waits for 1; 0 waits for 2, then for 1, as given


@pytest.mark.parametrize("kw,field", [
    ({"after": (2,), "before": (0,)}, "after[0] = 2"),
    ({"after": (1, 1), "before": (0, -1)}, "before[1] = -1"),
    ({"ncmds": 1 << 24, "after": (), "before": ()}, "ncmds 16777216"),  # a 2 GiB block, refused on its size
])
def test_a_corrupt_graph_record_is_refused_naming_its_field(kw, field):
    ncmds = kw.pop("ncmds", 2)
    rec, _keep = graph_record(min(ncmds, 2), **kw)
    rec.ncmds = ncmds  # past the arrays: refused before they are read
    with pytest.raises(SpyreError, match="SPY_E_INVALID_ARG") as e:
        built_block(lib.spy_build_graph, rec, "graph")
    assert field in str(e.value)


# ---- matmuls --------------------------------------------------------------------------------

def matmul_decided(card, m=64, n=130, k=200, bias=True):
    """A matmul's decision record (a bias row, a K split over cores) and its context."""
    from spyre_rt.construct import matmul as mm

    target = CostModel.of_figures(card.profile)
    layouts = {"a": StickLayout(m, k, 2), "b": StickLayout(k, n, 2), "o": StickLayout(m, n, 2),
               "bias": StickLayout(1, n, 4)}
    spec = mm.MatmulSpec(mm.View("a", 0, (1, m, k), (0, k, 1)), mm.View("b", 0, (1, k, n), (0, n, 1)),
                         mm.View("o", 0, (1, m, n), (0, n, 1)), lib.SPY_DT_F16, lib.SPY_DT_F16,
                         bias=mm.View("bias", 0, (1, m, n), (0, 0, 1)) if bias else None, bias_dtype=lib.SPY_DT_F32)
    ctx = BuildContext(target, layouts)
    return mm.build(ctx, spec, mm.Tiling(2, 2, 2, 4, 2, 4, 64, 2)), ctx


def test_a_matmul_record_builds_a_program_the_card_accepts(card):
    rec, ctx = matmul_decided(card)
    info = jobs.validate(card, ctx.encode())
    assert info["ncmds"] == ctx.ncmds > 0
    assert bytes(built_block(lib.spy_build_matmul, rec.cdata, "matmul")) == bytes(ctx.encode())  # again, alike


def test_a_later_matmul_build_is_one_native_call_from_the_first_ones_record(card, monkeypatch):
    """The executor hands a builder back what its first build returned: the matmul's whole
    decision record, from which a launch builds without deciding anything again."""
    from spyre_rt import construct
    from spyre_rt.construct.matmul import record
    from spyre_rt.ir import MatmulKernel

    rec, ctx = matmul_decided(card, bias=False)
    kernel = MatmulKernel("k0", ("a", 0, (1, 64, 200), (0, 200, 1)), ("b", 0, (1, 200, 130), (0, 130, 1)),
                          ("o", 0, (1, 64, 130), (0, 130, 1)), "float16", "float16")
    first = BuildContext(ctx.target, ctx.layouts)
    decided = construct.build(first, kernel)
    monkeypatch.setattr(record, "decide", lambda *a, **kw: pytest.fail("a later build decided again"))
    for _ in range(2):
        later = BuildContext(ctx.target, ctx.layouts)
        assert construct.build(later, kernel, decided) is decided
        assert bytes(later.encode()) == bytes(first.encode()) and later.buffers() == first.buffers()
        assert later.scratchpad_peak == first.scratchpad_peak > 0


def _corrupt(rec, path: str, value):
    """A copy of the record (its arrays shared) with the field at `path` set to `value`;
    `name[i]` of an array field replaces the array by a corrupted copy."""
    bad = ffi.new("spy_matmul_record *", rec[0])
    keep = []
    head, _, rest = path.partition(".")
    if "[" in head and head.split("[")[0] in ("m_size", "n_size", "k_slice", "stores", "loads", "program"):
        name, i = head[:-1].split("[")
        ctype = ffi.typeof(getattr(bad, name)).item.cname
        n = {"m_size": bad.m_tiles, "n_size": bad.n_tiles, "k_slice": bad.pk, "stores": bad.nstores,
             "loads": max(bad.nloads, 1), "program": bad.ninstrs}[name]
        arr = ffi.new(f"{ctype}[]", n)
        ffi.memmove(arr, getattr(bad, name), ffi.sizeof(ctype) * n)
        keep.append(arr)
        setattr(bad, name, arr)
        target = arr + int(i)
        if rest:
            *outer, last = rest.split(".")
            for f in outer:
                target = getattr(target, f) if not f.endswith("]") else getattr(target, f.split("[")[0])[
                    int(f.split("[")[1][:-1])]
            _set_field(target, last, value)
        else:
            target[0] = value
        return bad, keep
    *outer, last = path.split(".")
    target = bad
    for f in outer:
        target = getattr(target, f)
    _set_field(target, last, value)
    return bad, keep


def _set_field(obj, field: str, value):
    if field.endswith("]"):
        name, i = field[:-1].split("[")
        getattr(obj, name)[int(i)] = value
    else:
        setattr(obj, field, value)


@pytest.mark.parametrize("path,value,status,field", [
    ("a_lx[1]", (2 << 20) - 256, "SPY_E_SCRATCHPAD", "a_lx[1]"),           # a tile outside the scratchpad
    ("acc_lx", 2 << 20, "SPY_E_SCRATCHPAD", "acc_lx"),
    ("c_pitch", 1 << 20, "SPY_E_SCRATCHPAD", "acc_lx"),
    ("stores[0].lx[1]", (2 << 20) - 128, "SPY_E_SCRATCHPAD", "stores[0].lx[1]"),
    ("loads[0].lx[0]", 1 << 40, "SPY_E_SCRATCHPAD", "loads[0].lx[0]"),
    ("program[1].v1[0]", 3 << 20, "SPY_E_SCRATCHPAD", "program[1].dst"),
    ("a.offset", 1, "SPY_E_BAD_ADDRESS", "a.offset"),                        # a DMA outside its allocation
    ("b.strides[1]", 131, "SPY_E_BAD_ADDRESS", "b.offset"),
    ("stores[0].view.strides[2]", 1 << 62, "SPY_E_BAD_ADDRESS", "stores[0].strides[2]"),
    ("loads[0].view.slot", 7, "SPY_E_INVALID_ARG", "loads[0].slot"),
    ("m_size[1]", 31, "SPY_E_INVALID_ARG", "m_size"),                        # counts that do not add up
    ("k_slice[0]", 0, "SPY_E_INVALID_ARG", "k_slice[0]"),
    ("pm", 8, "SPY_E_INVALID_ARG", "num_cores"),
    ("nbuf", 9, "SPY_E_INVALID_ARG", "nbuf"),
    ("last_depth", 9, "SPY_E_INVALID_ARG", "last_depth"),                   # more chunks than the buffers hold
    ("batch", 1 << 32, "SPY_E_INVALID_ARG", "batch"),                         # counts that overflow
    ("batch", 1 << 31, "SPY_E_INVALID_ARG", "makes more than"),
    ("nslots", 1 << 20, "SPY_E_INVALID_ARG", "nslots"),
    ("ninstrs", 0, "SPY_E_INVALID_ARG", "ninstrs"),
    ("in_dtype", lib.SPY_DT_I64, "SPY_E_INVALID_ARG", "in_dtype"),
])
def test_a_corrupt_matmul_record_is_refused_naming_its_field(card, path, value, status, field):
    rec, _ctx = matmul_decided(card)
    bad, _keep = _corrupt(rec.cdata, path, value)
    if path == "batch" and value == 1 << 31:  # views broadcast over the batch: only the counts are wrong
        bad.a.strides[0] = bad.b.strides[0] = 0
    out = ffi.new("spy_built *")
    with pytest.raises(SpyreError) as e:
        built_block(lib.spy_build_matmul, bad, "matmul")
    assert status in str(e.value) and field in str(e.value), str(e.value)
    assert lib.spy_build_matmul(bad, out) != lib.SPY_OK and out.data == ffi.NULL and out.bytes == 0  # nothing built
# ---- loop kernels (native/build_loop.c) --------------------------------------------------------

def _pointwise(rows=37, cols=96):
    """y = exp(x) over rows x cols fp16, both contiguous."""
    body = (Op("x", "load", (), "float16", Access("x", 0, (cols, 1))), Op("v", "exp", ("x",)),
            Op("y", "store", ("v",), "float16", Access("y", 0, (cols, 1))))
    buffers = tuple(Buffer(b, "float16", (rows, cols), (cols, 1)) for b in ("x", "y"))
    return LoopKernel("k", (rows, cols), 1, False, body, buffers), {b: StickLayout(rows, cols, 2) for b in "xy"}


def _gather(rows=4, table_rows=8, cols=64):
    """out[i] = table[idx[i]] + i: a gather, its index's bounds, an index value (a tile constant)."""
    body = (Op("i", "load", (), "int64", Access("idx", 0, (1, 0))),
            Op("j", "indirect", ("i",), "", None, {"size": table_rows}),
            Op("g", "load", (), "float16", Access("t", 0, (0, 1), (("j", cols),))),
            Op("r", "index", (), "int64", Access("", 0, (1, 0))),
            Op("s", "add", ("g", "r")),
            Op("o", "store", ("s",), "float16", Access("out", 0, (cols, 1))))
    buffers = (Buffer("idx", "int64", (rows,), (1,)), Buffer("t", "float16", (table_rows, cols), (cols, 1)),
               Buffer("out", "float16", (rows, cols), (cols, 1)))
    layouts = {"idx": StickLayout(1, rows, 8), "t": StickLayout(table_rows, cols, 2),
               "out": StickLayout(rows, cols, 2)}
    return LoopKernel("g", (rows, cols), 1, False, body, buffers), layouts


def loop_record(make=_pointwise):
    kernel, layouts = make()
    return loops.record.decide(BuildContext(TARGET, layouts), kernel)


def test_a_loop_record_builds_a_program_the_card_accepts(card):
    for make in (_pointwise, _gather):
        blob = built_block(lib.spy_build_loop, loop_record(make).record, "loop")  # the record keeps its arrays
        info = jobs.validate(card, blob)
        assert info["ncmds"] > 0 and int(blob[:JOB_HEADER.itemsize].view(JOB_HEADER)["total_bytes"][0]) == blob.size


def test_a_later_build_only_hands_the_record_to_the_builder(monkeypatch):
    """Python decides once: a build given the record analyses, tiles and lays out nothing."""
    kernel, layouts = _gather()
    first = BuildContext(TARGET, layouts)
    decided = loops.build(first, kernel)

    def refuse(*_a, **_k):
        raise AssertionError("decided again")

    for name in ("decide",):
        monkeypatch.setattr(loops, name, refuse)
    again = BuildContext(TARGET, layouts)
    assert loops.build(again, kernel, decided) is decided
    assert bytes(again.encode()) == bytes(first.encode()) and again.buffers() == first.buffers()


def _set(path, value, *more):
    """A corruption of the record: `path` (attribute names and indices) set to `value`
    (a function of the record: computed from it); then the same for each (path, value) pair
    in `more`."""
    def apply(rec):
        obj = rec
        for p in path[:-1]:
            obj = obj[p] if isinstance(p, int) else getattr(obj, p)
        v = value(rec) if isinstance(value, types.FunctionType) else value
        if isinstance(path[-1], int):
            obj[path[-1]] = v
        else:
            setattr(obj, path[-1], v)
        if more:
            _set(*more)(rec)
    return apply


@pytest.mark.parametrize("make,corrupt,status,field", [
    # a tile outside the scratchpad
    (_pointwise, _set(("tiles", 0, "size"), 1000), "SPY_E_SCRATCHPAD", "tiles[0].size"),
    (_pointwise, _set(("lx_bytes",), 4 * MiB), "SPY_E_SCRATCHPAD", "lx_bytes"),
    (_pointwise, _set(("accesses", 0, "lx_off", 1), lambda r: r.lx_bytes), "SPY_E_SCRATCHPAD",
     "accesses[0].lx_off[1]"),
    (_pointwise, _set(("instrs", 0, "instr", "dst", "v", "off"), lambda r: r.lx_bytes), "SPY_E_SCRATCHPAD",
     "instrs[0].dst"),
    (_gather, _set(("consts", 0, "lx_off"), lambda r: r.lx_bytes), "SPY_E_SCRATCHPAD", "consts[0].lx_off"),
    (_gather, _set(("accesses", 1, "idx_off", 0), lambda r: r.lx_bytes), "SPY_E_SCRATCHPAD",
     "accesses[1].idx_off[0]"),
    # a DMA pattern outside its slot
    (_pointwise, _set(("accesses", 1, "base"), 96), "SPY_E_BAD_ADDRESS", "accesses[1] moves elements"),
    (_pointwise, _set(("accesses", 0, "coeffs", 0), 97), "SPY_E_BAD_ADDRESS", "accesses[0] moves elements"),
    (_pointwise, _set(("slot_extent", 0), 64), "SPY_E_BAD_ADDRESS", "outside slot 0"),
    # counts that overflow, and fields that name nothing
    (_pointwise, _set(("sizes", 0), 2**41), "SPY_E_INVALID_ARG", "sizes[0]"),
    (_pointwise, _set(("accesses", 0, "coeffs", 1), 2**60), "SPY_E_INVALID_ARG", "accesses[0].coeffs[1]"),
    (_pointwise, _set(("nvars",), 17), "SPY_E_INVALID_ARG", "nvars 17"),
    (_pointwise, _set(("stages", 0, "first", 1), lambda r: r.ninstrs), "SPY_E_INVALID_ARG", "stages[0].first[1]"),
    (_pointwise, _set(("accesses", 0, "slot"), 9), "SPY_E_INVALID_ARG", "accesses[0].slot"),
    (_pointwise, _set(("tiles", 1, "core"), 32), "SPY_E_INVALID_ARG", "tiles[1].core"),
    (_pointwise, _set(("tiles", 1, "start"), 36), "SPY_E_INVALID_ARG", "tiles[1].start"),
    (_pointwise, _set(("block",), 1), "SPY_E_INVALID_ARG", "block 1"),
    (_pointwise, _set(("accesses",), ffi.NULL), "SPY_E_INVALID_ARG", "a count without its array"),
    (_pointwise, _set(("accesses", 0, "masked"), 1, ("accesses", 0, "hi", 0), 38), "SPY_E_INVALID_ARG",
     "accesses[0] masks variable 0 to [lo 0, hi 38)"),
    (_gather, _set(("accesses", 1, "level"), 0), "SPY_E_INVALID_ARG", "accesses[1].level"),
    (_gather, _set(("accesses", 1, "idx_off", 1), lambda r: r.accesses[1].idx_off[1] + 4), "SPY_E_INVALID_ARG",
     "accesses[1].idx_off[1]"),
    (_gather, _set(("consts", 0, "unit"), 0), "SPY_E_INVALID_ARG", "consts[0]"),
])
def test_a_corrupt_loop_record_is_refused_naming_its_field(make, corrupt, status, field):
    decided = loop_record(make)
    corrupt(decided.record)
    with pytest.raises(SpyreError) as e:
        built_block(lib.spy_build_loop, decided.record, "loop")
    assert status in str(e.value) and field in str(e.value), str(e.value)


def test_a_refused_loop_record_leaves_no_program():
    kernel, layouts = _pointwise()
    decided = loop_record()
    decided.record.accesses[1].base = 96
    ctx = BuildContext(TARGET, layouts)
    with pytest.raises(SpyreInvalidCommandError, match="SPY_E_BAD_ADDRESS"):
        loops.build(ctx, kernel, decided)
    assert ctx.block is None
# ---- attention (native/build_attention.c) ----------------------------------------------------


def attention_decision(q_len=1, kv_len=200, mask=False):
    """The decision record of a small grouped attention (4 query heads over 2 KV heads,
    fp16), as its first build makes it."""
    from spyre_rt.construct import attention
    from spyre_rt.ir import AttentionKernel

    views = {"q": ("q", 0, (1, 4, q_len, 64), (256 * q_len, 64 * q_len, 64, 1)),
             "k": ("k", 0, (1, 2, kv_len, 64), (128 * kv_len, 64 * kv_len, 64, 1)),
             "v": ("v", 0, (1, 2, kv_len, 64), (128 * kv_len, 64 * kv_len, 64, 1)),
             "out": ("out", 0, (1, 4, q_len, 64), (256 * q_len, 64, 256, 1))}
    layouts = {"q": StickLayout(4 * q_len, 64, 2), "k": StickLayout(2 * kv_len, 64, 2),
               "v": StickLayout(2 * kv_len, 64, 2), "out": StickLayout(q_len, 256, 2)}
    if mask:
        views["mask"] = ("m", 0, (1, 4, q_len, kv_len), (0, 0, kv_len, 1))
        layouts["m"] = StickLayout(q_len, kv_len, 1)
    kernel = AttentionKernel("attention", views["q"], views["k"], views["v"], views["out"], "float16", 0.125,
                             mask=views.get("mask"), mask_dtype="bool" if mask else "")
    ctx = BuildContext(CostModel.of_figures(device_profile.load("spyre")), layouts)
    return attention.build(ctx, kernel), kernel, ctx


def test_a_well_formed_attention_record_builds_a_program_the_card_accepts(card):
    record, _, ctx = attention_decision(q_len=70, kv_len=300, mask=True)
    info = jobs.validate(card, ctx.block)
    assert info["ncmds"] == ctx.ncmds and info["cores_used"] == len(set(record.tasks[:, 0])) > 1
    again = built_block(lib.spy_build_attention, record.c, "attention")
    assert bytes(again) == bytes(ctx.block)


def _tasks_with(record, **columns):
    """The record's tasks with some cells changed, as a new array it points to."""
    from spyre_rt.construct import attention as A

    tasks = record.tasks.copy()
    for name, (row, value) in columns.items():
        tasks[row, getattr(A, name.upper())] = value
    record._keep.append(tasks)
    record.c.tasks = ffi.cast("spy_attention_task *", ffi.from_buffer(tasks))


ATTENTION_CORRUPTIONS = {
    "a tile outside the scratchpad": (lambda r: r.c.lx.k.__setitem__(1, (2 << 20) - 100),
                                      "SPY_E_SCRATCHPAD", "lx.k[1]"),
    "a view outside its storage": (lambda r: setattr(r.c.q, "offset", 64), "SPY_E_BAD_ADDRESS", "q.offset 64"),
    "a slot smaller than its storage": (lambda r: r.c.slot_extent.__setitem__(1, 128), "SPY_E_BAD_ADDRESS",
                                        "slot 1 of 128 bytes"),
    "a slot that is not one": (lambda r: setattr(r.c, "nslots", 2), "SPY_E_INVALID_ARG", "v.slot 2"),
    "a task on no core": (lambda r: _tasks_with(r, core=(0, 32)), "SPY_E_INVALID_ARG", "tasks[0].core 32"),
    "tasks out of core order": (lambda r: _tasks_with(r, core=(1, 5)), "SPY_E_INVALID_ARG", "tasks[2].core"),
    "a part that leads itself": (lambda r: _tasks_with(r, leader=(1, 1)), "SPY_E_INVALID_ARG", "tasks[1].leader"),
    "keys past the cache": (lambda r: _tasks_with(r, kv1=(0, 201)), "SPY_E_INVALID_ARG", "tasks[0].kv0"),
    "counts that overflow": (lambda r: (setattr(r.c, "kv_len", 2**32 - 1), setattr(r.c, "kv_block", 1),
                                        _tasks_with(r, kv1=(0, 2**32 - 1))), "SPY_E_INVALID_ARG", "blocks of keys"),
    "rows narrower than the head": (lambda r: setattr(r.c.lx, "q_pitch", 32), "SPY_E_INVALID_ARG", "lx.q_pitch"),
    "an unknown mask": (lambda r: setattr(r.c, "mask_kind", 7), "SPY_E_INVALID_ARG", "mask_kind 7"),
}


@pytest.mark.parametrize("case", ATTENTION_CORRUPTIONS)
def test_a_corrupt_attention_record_is_refused_naming_its_field(case):
    corrupt, status, field = ATTENTION_CORRUPTIONS[case]
    record, _, _ = attention_decision()
    corrupt(record)
    with pytest.raises(SpyreError) as e:
        built_block(lib.spy_build_attention, record.c, "attention")
    assert status in str(e.value) and field in str(e.value), str(e.value)


def test_a_refused_attention_record_builds_nothing_into_the_context():
    record, kernel, ctx = attention_decision()
    from spyre_rt.construct import attention

    record.c.lx.stage = 2 << 20
    again = BuildContext(ctx.target, ctx.layouts)
    with pytest.raises(SpyreError, match=r"lx\.stage"):
        attention.build(again, kernel, record)
    assert again.block is None


def test_a_later_attention_build_only_calls_the_native_builder(monkeypatch):
    """The decisions are made once: a build from the record decides nothing again."""
    from spyre_rt.construct import attention

    record, kernel, ctx = attention_decision(q_len=70, kv_len=300, mask=True)

    def decided_again(*args, **kwargs):
        raise AssertionError("decided again")

    for name in ("decide", "choose", "Scratchpad", "Shape"):
        monkeypatch.setattr(attention, name, decided_again)
    again = BuildContext(ctx.target, ctx.layouts)
    assert attention.build(again, kernel, record) is record
    assert bytes(again.block) == bytes(ctx.block) and again.buffers() == ctx.buffers() == ["q", "k", "v", "m", "out"]
    assert again.scratchpad_peak == ctx.scratchpad_peak
