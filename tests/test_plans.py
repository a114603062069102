"""Dispatch modes and graph plans: same results, same device work, less host work; the
plan cache on disk."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from spyre_rt import card as cards
from spyre_rt import dispatch, plan_cache
from spyre_rt import executor as step_mod
from spyre_rt.card import EV_CMD, EV_JOB
from spyre_rt.dispatch import dispatch_mode

MODES = dispatch.NAMES  # every dispatch mode, from the table


def mlp(x, w1, w2, w3):
    h = F.silu(x @ w1.t()) * (x @ w2.t())
    return torch.softmax(h @ w3.t(), -1)


def _args(layers_in=64, hidden=96):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, layers_in, generator=g), torch.randn(hidden, layers_in, generator=g),
            torch.randn(hidden, layers_in, generator=g), torch.randn(40, hidden, generator=g)]


def _kernel_jobs(card, fn, args, mode):
    """(name, number of commands, per-command (op, core, duration)) of each kernel job."""
    card.trace_clear()
    card.trace_enable(True, True)
    try:
        with dispatch_mode(mode):
            out = fn(*args)
    finally:
        card.trace_enable(False)
    ev = card.trace_events()
    names = {}
    for e in ev[ev["kind"] == EV_JOB]:
        names[int(e["job"])] = card.name_of(int(e["a"]))
    jobs = {}
    for e in ev[ev["kind"] == EV_CMD]:
        name = names.get(int(e["job"]), "")
        if name.startswith("k"):  # kernel jobs; uploads and copies are named h2d/d2h
            jobs.setdefault(int(e["job"]), (name, []))[1].append(
                (int(e["a"]), int(e["core"]), round(e["end_ns"] - e["start_ns"], 6)))
    return out, [jobs[j] for j in sorted(jobs)]


def test_modes_give_identical_results_and_device_work():
    card = cards.get(0)
    f = torch.compile(mlp, backend="spyre_rt", dynamic=False)
    args = [a.to("spyre") for a in _args()]
    results = {m: _kernel_jobs(card, f, args, m) for m in MODES}
    ref = mlp(*_args())
    outs = {m: r[0].cpu() for m, r in results.items()}
    assert torch.allclose(outs["prebuilt"], ref, rtol=1e-5, atol=1e-6)
    for m in MODES:
        assert torch.equal(outs[m], outs["construct"]), m
        assert results[m][1] == results["construct"][1], f"{m} ran other device commands"
    # three matmuls (the SiLU·mul as the second's epilogue) and the softmax
    assert len(results["construct"][1]) >= 4


def test_each_mode_builds_on_the_paths_its_record_says():
    """In the steady state of a step fed host data and read back, a mode with plans launches
    them and builds no kernel (the others build every kernel and launch no plan); a mode
    with prebuilt transfers takes every transfer graph from the card's cache (the others
    build one per copy, the constructed kernels' program uploads included). prebuilt-compute
    is plans with transfers built per launch."""
    from spyre_rt.executor.stats import stats

    assert dispatch.named("prebuilt-compute") == dispatch.DispatchMode(
        "prebuilt-compute", prebuilt_transfers=False, plans=True, summary=dispatch.MODES["prebuilt-compute"].summary)
    card = cards.get(0)
    f = torch.compile(mlp, backend="spyre_rt", dynamic=False)
    args, ref = _args(), None
    for mode in dispatch.MODES.values():
        with dispatch_mode(mode.name):
            f(*[a.to("spyre") for a in args]).cpu()  # warm: plans and cached transfer graphs exist
            cache, built, c0 = card.transfers, stats["kernels_built"], card.counters()
            looked_up = cache.hits + cache.misses
            out = f(*[a.to("spyre") for a in args]).cpu()
            c1 = card.counters()
        ref = out if ref is None else ref
        assert torch.equal(out, ref), mode.name
        assert (c1["plan_launches"] > c0["plan_launches"]) == mode.plans, mode.name
        assert (stats["kernels_built"] > built) == (not mode.plans), mode.name
        assert (cache.hits + cache.misses > looked_up) == mode.prebuilt_transfers, mode.name


def test_an_unknown_dispatch_mode_is_a_clear_error(monkeypatch):
    from spyre_rt import config

    every = ", ".join(dispatch.NAMES)
    assert "prebuilt-compute" in every
    with pytest.raises(ValueError, match=f"dispatch mode must be one of {every}, not 'prebuilt_compute'"):
        with dispatch_mode("prebuilt_compute"):
            pass
    with pytest.raises(ValueError, match=f"dispatch must be one of {every}, not 'fast'"):
        config.with_options({"dispatch": "fast"})
    monkeypatch.setenv("SPYRE_RT_DISPATCH", "fast")
    with pytest.raises(ValueError, match=f"dispatch must be one of {every}, not 'fast'"):
        config.from_environment()
    with pytest.raises(ValueError, match=f"unknown dispatch mode 'fast'; the modes are {every}"):
        dispatch.named("fast")


def test_prebuilt_transfer_does_the_construct_work_less_the_transfer_graph_builds():
    """In the steady state, a call in prebuilt-transfer uploads each constructed kernel's
    program with a cached transfer graph (every upload a hit, none built or validated)
    and otherwise does what construct does: the same jobs, kernels and commits, one native
    call fewer per upload (construct's spy_transfer_create), and fewer commands validated
    by exactly the transfer graphs' (a cached graph is validated once, at its creation)."""
    from spyre_rt.executor.stats import stats

    card = cards.get(0)
    f = torch.compile(mlp, backend="spyre_rt", dynamic=False)
    args = [a.to("spyre") for a in _args()]
    seen = {}
    for mode in ("construct", "prebuilt-transfer", "construct", "prebuilt-transfer"):
        with dispatch_mode(mode):
            f(*args)  # warm: the mode's transfer graphs are cached
            card.synchronize()
            cache, built, c0 = card.transfers, stats["kernels_built"], card.counters()
            hits, misses = cache.hits, cache.misses
            f(*args)
            card.synchronize()
            c1 = card.counters()
        seen[mode] = {k: c1[k] - c0[k] for k in ("native_calls", "jobs", "commits", "validated_commands",
                                                 "commands")}
        seen[mode].update(kernels=stats["kernels_built"] - built, hits=cache.hits - hits,
                          misses=cache.misses - misses)
    c, t = seen["construct"], seen["prebuilt-transfer"]
    uploads = c["commits"]
    assert uploads >= 4 and c["hits"] == c["misses"] == 0
    assert t["misses"] == 0 and t["hits"] == uploads  # one cached graph per upload, none built
    for same in ("jobs", "commits", "kernels", "commands"):
        assert t[same] == c[same], same
    assert c["native_calls"] - t["native_calls"] == uploads
    # construct validates every command it runs (each kernel's program at its commit, each
    # upload's new transfer graph at its creation); prebuilt-transfer all but the uploads'
    upload_graph_commands = c["validated_commands"] - t["validated_commands"]
    assert upload_graph_commands >= uploads
    assert c["validated_commands"] == c["commands"]
    assert t["validated_commands"] == t["commands"] - upload_graph_commands


def _native_calls(card, fn, args, mode) -> int:
    with dispatch_mode(mode):
        fn(*args)  # warm: plans and transfer graphs exist
        before = card.counters()["native_calls"]
        fn(*args)
        return card.counters()["native_calls"] - before


def test_prebuilt_native_calls_do_not_grow_with_kernels():
    card = cards.get(0)

    def chain(n):
        def f(x):
            for i in range(n):
                x = torch.tanh(x @ x.t()[:, : x.shape[1]] + i)
            return x
        return torch.compile(f, backend="spyre_rt", dynamic=False)

    x = [torch.randn(16, 16).to("spyre")]
    short, long = chain(2), chain(6)
    assert _native_calls(card, short, x, "prebuilt") == _native_calls(card, long, x, "prebuilt")
    c_short, c_long = _native_calls(card, short, x, "construct"), _native_calls(card, long, x, "construct")
    assert c_long > c_short + 4 * 4  # several native calls per extra kernel


def test_outputs_of_a_step_survive_the_next_step():
    f = torch.compile(lambda x: torch.exp(x) + 1, backend="spyre_rt", dynamic=False)
    a, b = torch.randn(4, 70), torch.randn(4, 70)
    out_a = f(a.to("spyre"))
    out_b = f(b.to("spyre"))
    assert out_a.untyped_storage().data_ptr() != out_b.untyped_storage().data_ptr()
    assert torch.allclose(out_a.cpu(), torch.exp(a) + 1) and torch.allclose(out_b.cpu(), torch.exp(b) + 1)


# ---- the plan cache --------------------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import json, sys, torch, spyre_rt
    from spyre_rt import executor as step
    from spyre_rt import plan_cache
    w = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) / 1000
    f = torch.compile(lambda x, w: torch.relu(x @ w) * 0.5, backend="spyre_rt", dynamic=False)
    x = torch.arange(5 * 64, dtype=torch.float32).reshape(5, 64) / 100
    out = f(x.to("spyre"), w.to("spyre")).cpu()
    ok = torch.allclose(out, torch.relu(x @ w) * 0.5, rtol=1e-5)
    print(json.dumps({"ok": bool(ok), "step": step.stats, "cache": plan_cache.stats.as_dict()}))
""")


def _run(cache_dir, extra_env=None):
    env = dict(os.environ, SPYRE_RT_CACHE_DIR=str(cache_dir), **(extra_env or {}))
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_plans_and_builds_nothing(tmp_path):
    first = _run(tmp_path)
    assert first["ok"] and first["step"]["kernels_built"] > 0 and first["cache"]["writes"] == 1
    second = _run(tmp_path)
    assert second["ok"]
    assert second["step"]["kernels_built"] == 0 and second["step"]["plans_loaded"] >= 1
    assert second["cache"]["hits"] == 1 and second["cache"]["misses"] == 0


def _one_plan(tmp_path):
    files = [p for p in tmp_path.iterdir() if p.suffix == ".plan"]
    assert len(files) == 1
    return files[0]


@pytest.mark.parametrize("damage", ["flip", "truncate", "version", "foreign", "empty"])
def test_damaged_files_are_detected_and_rebuilt(tmp_path, damage):
    _run(tmp_path)
    p = _one_plan(tmp_path)
    data = bytearray(p.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "version":
        data[8] = 99  # the format field after the magic
    elif damage == "foreign":
        other = plan_cache.decode(bytes(data))
        data = bytearray(plan_cache.encode("0" * 64, {k: v for k, v in other.header.items() if k != "key"},
                                           other.blocks))
    else:
        data = bytearray()
    p.write_bytes(bytes(data))
    again = _run(tmp_path)
    assert again["ok"]  # results right
    assert again["cache"]["corrupt"] == 1 and again["step"]["kernels_built"] > 0
    assert again["cache"]["writes"] == 1
    assert plan_cache.decode(_one_plan(tmp_path).read_bytes()).header["kernels"] > 0  # a valid file again


def test_corrupt_file_is_logged(tmp_path, caplog):
    cache = plan_cache.PlanCache(tmp_path, 1 << 20)
    (tmp_path / ("a" * 64 + ".plan")).write_bytes(b"not a plan file, " * 8)
    with caplog.at_level(logging.WARNING, logger="spyre_rt.plan_cache"):
        assert cache.load("a" * 64) is None
    assert "unusable" in caplog.text and "bad magic" in caplog.text
    assert not (tmp_path / ("a" * 64 + ".plan")).exists()


def _executables(before):
    """Executables of the steps compiled since `before` was taken."""
    for obj in set(step_mod.live_steps()) - before:
        yield from obj.executables()


def test_two_processes_compiling_at_once_leave_one_valid_file(tmp_path):
    env = dict(os.environ, SPYRE_RT_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", SCRIPT], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1000:] for o in outs]
    assert all('"ok": true' in o[0] for o in outs)
    plan_cache.decode(_one_plan(tmp_path).read_bytes())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_the_cache_stays_within_its_bound(tmp_path):
    cache = plan_cache.PlanCache(tmp_path, 10_000)
    import numpy as np

    block = np.zeros(3000, dtype=np.uint8)
    for i in range(8):
        cache.store(f"{i:064x}", {"n": i}, [block])
        os.utime(cache.path(f"{i:064x}"), (1000 + i, 1000 + i))
    total = sum(p.stat().st_size for p in tmp_path.iterdir() if p.suffix == ".plan")
    assert total <= 10_000
    left = sorted(p.stem for p in tmp_path.iterdir() if p.suffix == ".plan")
    assert left and left[-1] == f"{7:064x}"  # the most recent survive


def test_a_write_lists_the_directory_only_when_it_may_be_over_its_bound(tmp_path, monkeypatch):
    """A write counts its bytes in the counters file; the files are listed (a stat each)
    at the process's first write and when the count passes the bound, not at every write.
    A count left short (a writer killed between its rename and its count) is made right
    at the next process's first write, and the bound holds."""
    import numpy as np

    monkeypatch.setattr(plan_cache, "_TRIMMED", set())
    cache = plan_cache.PlanCache(tmp_path, 20_000)
    listings = []
    listing = plan_cache.PlanCache._listing
    monkeypatch.setattr(plan_cache.PlanCache, "_listing", lambda self, temps: listings.append(temps) or listing(self, temps))
    block = np.zeros(3000, dtype=np.uint8)

    def write(i: int) -> int:
        listings.clear()
        cache.store(f"{i:064x}", {"n": i}, [block])
        os.utime(cache.path(f"{i:064x}"), (1000 + i, 1000 + i))
        return len(listings)

    size = lambda: sum(p.stat().st_size for p in tmp_path.iterdir() if p.suffix == ".plan")  # noqa: E731
    assert write(0) == 2  # the first write of the process: temps and plans listed
    assert [write(i) for i in range(1, 6)] == [0] * 5  # 6 files of about 3 KB: under 20 KB
    assert cache.persistent_stats()[plan_cache.TRACKED_BYTES] == size()
    assert write(6) == 2 and size() <= 20_000  # past the bound: listed and trimmed, oldest first
    assert sorted(p.stem for p in tmp_path.iterdir() if p.suffix == ".plan")[-1] == f"{6:064x}"
    assert cache.persistent_stats()[plan_cache.TRACKED_BYTES] == size()

    # a writer killed before its count: the file is there, the count does not hold it
    counts = cache.persistent_stats()
    extra = np.ones(9000, dtype=np.uint8)
    (tmp_path / f"{99:064x}.plan").write_bytes(plan_cache.encode(f"{99:064x}", {}, [extra]))
    (tmp_path / plan_cache.STATS_FILE).write_text(__import__("json").dumps(counts))
    monkeypatch.setattr(plan_cache, "_TRIMMED", set())  # a new process
    assert write(7) == 2 and size() <= 20_000
    assert cache.persistent_stats()[plan_cache.TRACKED_BYTES] == size()


def test_timing_mode_runs_the_same_commands(small_cards=None):
    """Timing and functional cards give the same device time for a compiled step."""
    f = torch.compile(mlp, backend="spyre_rt", dynamic=False)
    times = {}
    for mode in ("functional", "timing"):
        with cards.configured(None, mode):
            card = cards.get(0)
            args = [a.to("spyre") for a in _args()]
            f(*args)
            before = card.counters()["device_busy_ns"]
            f(*args)
            times[mode] = card.counters()["device_busy_ns"] - before
    assert times["functional"] == times["timing"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_an_input_made_again_at_its_address_in_another_layout_is_read_in_its_own(mode):
    """A call that repeats the last call's geometry takes a fast path that checks inputs by
    address window and offset, and leaves their stick layout to the card's allocation
    records. Here the second input is a (64, 128) view of a (128, 64) storage made where
    the first input's storage was: the same address, shape, strides and offset, and the
    same bytes cut into other rows. Read through the first layout, its values would come
    out scrambled."""
    g = torch.Generator().manual_seed(3)
    a, b, w = torch.randn(64, 128, generator=g), torch.randn(128, 64, generator=g), torch.randn(128, 32, generator=g)
    f = torch.compile(lambda x, w: torch.relu(x @ w) + x.sum(-1, keepdim=True), backend="spyre_rt", dynamic=False)
    wd = w.to("spyre")
    with dispatch_mode(mode):
        x = a.to("spyre")
        for _ in range(2):  # the second call takes the fast path
            assert torch.allclose(f(x, wd).cpu(), torch.relu(a @ w) + a.sum(-1, keepdim=True), rtol=1e-4, atol=1e-4)
        addr = x.untyped_storage().data_ptr()
        del x
        held = []  # the allocator reuses freed blocks of a size newest first: take them to x's
        while (y := b.to("spyre")).untyped_storage().data_ptr() != addr and len(held) < 4096:
            held.append(y)
        assert y.untyped_storage().data_ptr() == addr, "the allocator never gave the address again"
        assert cards.get(0).layout_of(addr).row_len == 64
        v, ref = y.view(64, 128), b.view(64, 128)
        assert torch.allclose(f(v, wd).cpu(), torch.relu(ref @ w) + ref.sum(-1, keepdim=True), rtol=1e-4, atol=1e-4)


def _layers(x, *ws):
    """Layers of one shape: the plan build constructs one program for the inner ones."""
    for w in ws:
        x = torch.relu(x @ w.t()) * 0.5
    return x


def test_jobs_of_one_program_share_one_resident_copy(tmp_path):
    """A plan block holds each distinct program once and its jobs name it by offset; the
    card uploads it once. Each job still works on its own buffers (its relocations)."""
    from spyre_rt.plan import GraphPlan
    from spyre_rt.program import plan_tables

    g = torch.Generator().manual_seed(3)
    args = [torch.randn(8, 64, generator=g)] + [torch.randn(64, 64, generator=g) for _ in range(5)]
    before = set(step_mod.live_steps())
    f = torch.compile(_layers, backend="spyre_rt", dynamic=False, options={"cache_dir": str(tmp_path)})
    with dispatch_mode("prebuilt"):
        out = f(*[a.to("spyre") for a in args]).cpu()
    torch.testing.assert_close(out, _layers(*args), rtol=1e-4, atol=1e-5)
    (step,) = set(step_mod.live_steps()) - before
    (exe,) = step.executables()
    (block,) = plan_cache.decode(plan_cache.PlanCache(tmp_path, 1 << 30).path(exe.cache_key()).read_bytes()).blocks
    jobs = plan_tables(block).jobs
    programs = {int(o): int(n) for o, n in zip(jobs["prog_off"], jobs["prog_len"], strict=True)}
    assert len(programs) < len(jobs), "no job shares a program: the layers were built apart"
    assert block.size < int(jobs["prog_off"].min()) + int(jobs["prog_len"].sum())  # stored once, not per job
    card = cards.get(0)
    sent = card.counters()["bytes_h2d"]
    GraphPlan(card, block)
    assert card.counters()["bytes_h2d"] - sent == sum(programs.values())  # uploaded once per program
