"""The native builder refuses a corrupt decision record whole, with a typed error naming
the field, before anything is built (native/construct.c; the byte identity of what it
builds is tests/test_program_digests.py's)."""

from __future__ import annotations

import pytest

from spyre_rt import jobs, profile
from spyre_rt.card import Card
from spyre_rt.construct import copy
from spyre_rt.construct.context import BuildContext, Target
from spyre_rt.errors import SpyreError, SpyreInvalidCommandError
from spyre_rt.layout import StickLayout
from spyre_rt.native import ffi, lib
from spyre_rt.program import JOB_HEADER, built_block
from spyre_rt.transfer import ViewGeometry, transfer_program

MiB = 1 << 20


@pytest.fixture(scope="module")
def card():
    return Card(profile.load("spyre"), "timing", 0)


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
    target = Target.from_profile(card.profile)
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

    target = Target.from_profile(card.profile)
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


# ---- attention (native/build_attention.c) ----------------------------------------------------


def attention_decision(q_len=1, kv_len=200, mask=False):
    """The decision record of a small grouped attention (4 query heads over 2 KV heads,
    fp16), as its first build makes it."""
    from spyre_rt.construct import attention
    from spyre_rt.kernels import AttentionKernel

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
    ctx = BuildContext(Target.from_profile(profile.load("spyre")), layouts)
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
