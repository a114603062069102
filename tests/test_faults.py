"""Fault injection: a command error, a DMA error and a lost card surface as typed errors in
raw programs, eager copies and compiled steps (every dispatch mode); the card is usable
again at once (or, once lost, refuses every call until reset); no fault and no killed
writer leaves a corrupt plan cache file behind.

Faults run on ``spyre:1`` of a private two-card set, so that resetting a lost card never
touches the session's own ``spyre:0`` and its tensors.
"""

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from small_profiles import small_profile_text

import spyre_rt
from spyre_rt import (
    SpyreDeviceError,
    SpyreDeviceLostError,
    SpyreDMAError,
    SpyrePlanCacheError,
    dispatch,
    jobs,
    plan_cache,
)
from spyre_rt import card as cards
from spyre_rt import executor as step_mod
from spyre_rt.card import EV_CMD
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.plan import GraphPlan, PlanJob
from spyre_rt.plan import encode as encode_plan
from spyre_rt.program import (
    CMD_MM,
    OP_D2H,
    OP_GATHER,
    OP_H2D,
    OP_LOAD,
    OP_MATMUL,
    OP_SCATTER,
    OP_STORE,
    SLOT_DRAM,
    ProgramBuilder,
    empty_cmds,
)

MODES = dispatch.NAMES  # every dispatch mode, from the table
DMA_OPS = (OP_H2D, OP_D2H, OP_LOAD, OP_STORE, OP_GATHER, OP_SCATTER)
FAULTS = {
    "command": (SpyreDeviceError, "SPY_E_COMMAND_FAULT"),
    "dma": (SpyreDMAError, "SPY_E_DMA"),
    "lost": (SpyreDeviceLostError, "SPY_E_DEVICE_LOST"),
}
DEV = "spyre:1"


@pytest.fixture
def card(tmp_path):
    """spyre:1 of a fresh two-card set; no fault is left armed after the test."""
    path = tmp_path / "two-cards.toml"
    path.write_text(textwrap.dedent(small_profile_text(dram_gib=1 / 64, count=2)))
    with cards.configured(str(path)) as cs:
        c = cs.cards[1]
        try:
            yield c
        finally:
            c.fault_inject("none")


def expect(kind, excinfo) -> None:
    """The error is exactly the type of the fault, with its status and a clear message."""
    cls, status = FAULTS[kind]
    assert type(excinfo.value) is cls, f"{kind} fault raised {type(excinfo.value).__name__}: {excinfo.value}"
    assert excinfo.value.status == status
    assert ("lost" if kind == "lost" else "injected") in str(excinfo.value)


def allocated(card) -> int:
    gc.collect()
    return int(card.mem_stats()["allocated"])


# ---- raw programs ------------------------------------------------------------------------

def copy_program(nbytes: int) -> np.ndarray:
    """LOAD slot 0 into core 0's scratchpad, then STORE it into slot 1."""
    b = ProgramBuilder()
    src, dst = b.slot(SLOT_DRAM, nbytes), b.slot(SLOT_DRAM, nbytes)
    load = empty_cmds(1, OP_LOAD, 0)
    load["src_slot"], load["run_bytes"] = src, nbytes
    store = empty_cmds(1, OP_STORE, 0)
    store["dst_slot"], store["run_bytes"] = dst, nbytes
    store["dep_begin"], store["ndeps"] = 0, 1
    b.add(np.concatenate([load, store]), np.array([0]))
    return b.encode()


def matmul_program(m=8, n=64, k=16) -> np.ndarray:
    b = ProgramBuilder()
    c = empty_cmds(1, OP_MATMUL, 0, CMD_MM)
    c["a_off"], c["b_off"], c["c_off"] = 0, m * k * 2, m * k * 2 + k * n * 2
    c["m"], c["n"], c["k"] = m, n, k
    c["lda"], c["ldb"], c["ldc"] = k, n, n
    c["a_dtype"] = c["b_dtype"] = 1  # F16
    b.add(c)
    return b.encode()


def test_raw_program_command_fault_is_a_device_error_and_the_next_launch_works(card):
    prog = jobs.ResidentProgram(card, matmul_program(), "mm")
    jobs_before = card.counters()["jobs"]
    card.fault_inject("command", 0)
    with pytest.raises(SpyreDeviceError) as e:
        prog.launch([])
    expect("command", e)
    assert e.value.command == 0 and "launching mm" in str(e.value)
    prog.launch([])
    assert card.counters()["jobs"] == jobs_before + 2  # the failed job ran up to its fault
    prog.free()


def test_raw_program_dma_fault_stops_the_job_and_the_next_launch_copies(card):
    n = 4096
    src, dst = card.malloc(n), card.malloc(n)
    data = bytes(range(256)) * (n // 256)
    card.write(src, data)
    card.write(dst, bytes(n))
    prog = jobs.ResidentProgram(card, copy_program(n))
    card.fault_inject("dma", 1)  # the LOAD runs, the STORE fails
    with pytest.raises(SpyreDMAError) as e:
        prog.launch([src, dst])
    expect("dma", e)
    assert e.value.command == 1
    assert card.read(dst, n) == bytes(n)  # the failed STORE had no effect
    prog.launch([src, dst])
    assert card.read(dst, n) == data
    prog.free()
    card.free(src)
    card.free(dst)


def test_a_program_whose_upload_failed_frees_its_memory_once(card):
    """A fault in a program's upload frees its allocation; the program's finalizer must
    not free that address again, when another allocation may hold it."""
    blob = matmul_program()
    card.fault_inject("dma", 0)  # the upload's first DMA fails
    with pytest.raises(SpyreDMAError) as e:  # its traceback keeps the failed program alive
        jobs.ResidentProgram(card, blob, "mm")
    other = jobs.ResidentProgram(card, blob, "mm")  # takes the freed address
    del e
    gc.collect()  # the failed program's finalizer runs
    other.launch([])  # its program is still committed and resident
    other.free()


def test_raw_program_on_a_lost_card_every_call_fails_until_reset(card):
    n = 4096
    src, dst = card.malloc(n), card.malloc(n)
    prog = jobs.ResidentProgram(card, copy_program(n))
    card.fault_inject("lost", 0)
    with pytest.raises(SpyreDeviceLostError) as e:
        prog.launch([src, dst])
    expect("lost", e)
    refused = {
        "launch": lambda: prog.launch([src, dst]),
        "malloc": lambda: card.malloc(128),
        "upload a program": lambda: jobs.ResidentProgram(card, copy_program(n)),
        "synchronize": card.synchronize,
        "create a plan": lambda: GraphPlan(card, encode_plan([PlanJob(matmul_program(), (), "mm")], [], card.intern)),
    }
    for what, call in refused.items():
        with pytest.raises(SpyreDeviceLostError, match="device 1 is lost; reset it"):
            call()
            pytest.fail(f"{what} worked on a lost card")
    prog.free()  # release what the lost card held, then reset it
    card.free(src)
    card.free(dst)
    card.reset()
    src, dst = card.malloc(n), card.malloc(n)
    data = bytes(range(256)) * (n // 256)
    card.write(src, data)
    jobs.run_once(card, copy_program(n), [src, dst])
    assert card.read(dst, n) == data
    assert card.mem_stats()["num_allocs"] == 2


def test_direct_memory_access_on_a_lost_card_is_refused(card):
    addr = card.malloc(4096)
    card.write(addr, b"before")
    prog = jobs.ResidentProgram(card, matmul_program(), "mm")
    card.fault_inject("lost", 0)  # the card is lost at its next command
    with pytest.raises(SpyreDeviceLostError):
        prog.launch([])
    with pytest.raises(SpyreDeviceLostError):
        card.malloc(1)
    for call in (lambda: card.read(addr, 16), lambda: card.write(addr, b"x" * 16)):
        with pytest.raises(SpyreDeviceLostError, match="device 1 is lost; reset it"):
            call()
    prog.free()
    card.free(addr)
    card.reset()
    addr = card.malloc(4096)
    card.write(addr, b"after")
    assert card.read(addr, 5) == b"after"
    card.free(addr)


# ---- eager copies ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["command", "dma"])
def test_eager_copy_faults_are_typed_and_the_next_copy_is_whole(card, kind):
    x = torch.arange(3 * 200, dtype=torch.float32).reshape(3, 200)
    start = allocated(card)
    card.fault_inject(kind, 0)  # host -> device
    with pytest.raises(SpyreDeviceError) as e:
        x.to(DEV)
    expect(kind, e)
    del e
    assert allocated(card) == start  # the half-made tensor is gone
    d = x.to(DEV)
    assert torch.equal(d.cpu(), x)

    card.fault_inject(kind, 0)  # device -> host
    with pytest.raises(SpyreDeviceError) as e:
        d.cpu()
    expect(kind, e)
    assert torch.equal(d.cpu(), x)

    dst = torch.zeros(3, 200).to(DEV)
    card.fault_inject(kind, 1)  # device -> device goes through the host: its upload fails
    with pytest.raises(SpyreDeviceError) as e:
        dst.copy_(d)
    expect(kind, e)
    assert torch.equal(dst.cpu(), torch.zeros(3, 200))  # untouched, not half written
    dst.copy_(d)
    assert torch.equal(dst.cpu(), x)
    del d, dst, e
    assert allocated(card) == start


def test_eager_copies_on_a_lost_card_fail_until_reset(card):
    x = torch.randn(4, 70, generator=torch.Generator().manual_seed(3))
    d = x.to(DEV)
    card.fault_inject("lost", 0)
    with pytest.raises(SpyreDeviceLostError):
        d.cpu()
    for call in (lambda: x.to(DEV), lambda: d.cpu(), lambda: d.copy_(x),
                 lambda: torch.empty(8, device=DEV), lambda: torch.spyre.synchronize(1)):
        with pytest.raises(SpyreDeviceLostError, match="lost; reset it"):
            call()
    card.reset()
    assert torch.equal(x.to(DEV).cpu(), x)


# ---- compiled steps ----------------------------------------------------------------------

def model(x, w1, w2):
    return torch.softmax(torch.relu(x @ w1.t()) @ w2.t(), -1)


_G = torch.Generator().manual_seed(11)
ARGS = [torch.randn(6, 64, generator=_G), torch.randn(96, 64, generator=_G), torch.randn(40, 96, generator=_G)]
REF = model(*ARGS)


@pytest.fixture(scope="module")
def compiled():
    return torch.compile(model, backend="spyre_rt", dynamic=False)


def commands_of_a_call(card, call) -> tuple[int, int]:
    """(commands, DMA commands) the card executes for one call."""
    card.trace_clear()
    card.trace_enable(True, True)
    try:
        call()
    finally:
        card.trace_enable(False)
    ev = card.trace_events()
    cmds = ev[ev["kind"] == EV_CMD]
    card.trace_clear()
    return len(cmds), int(np.isin(cmds["a"], DMA_OPS).sum())


@pytest.mark.parametrize("kind", ["command", "dma"])
@pytest.mark.parametrize("mode", MODES)
def test_compiled_step_fault_is_typed_and_the_next_call_is_right(card, compiled, mode, kind):
    args = [a.to(DEV) for a in ARGS]
    with dispatch_mode(mode):
        clean = compiled(*args).cpu()  # warm: plans and transfer graphs exist
        assert torch.allclose(clean, REF, rtol=1e-4, atol=1e-6)
        total, dma = commands_of_a_call(card, lambda: compiled(*args))
        n = total if kind == "command" else dma
        assert n >= 4
        start = allocated(card)
        for after in sorted({0, 1, n // 2, n - 1}):
            card.fault_inject(kind, after)
            with pytest.raises(SpyreDeviceError) as e:
                compiled(*args)
            expect(kind, e)
            del e
            assert allocated(card) == start, f"a failed call (fault after {after}) leaked device memory"
            assert torch.equal(compiled(*args).cpu(), clean)
        assert allocated(card) == start


def mutating(a, b, x, idx, rows):
    """Mutates three inputs: one in full, one in place twice, one through a scatter (as a
    static KV cache is updated)."""
    a.add_(torch.tanh(x))
    b.mul_(2)
    b.add_(1)
    rows.index_copy_(0, idx, x[:2])
    return a * 3


_M = torch.Generator().manual_seed(12)
M_ARGS = [torch.randn(256, 192, generator=_M), torch.randn(40, 64, generator=_M),
          torch.randn(256, 192, generator=_M), torch.tensor([5, 1]), torch.randn(16, 192, generator=_M)]


@pytest.mark.parametrize("kind", ["command", "dma"])
@pytest.mark.parametrize("mode", MODES)
def test_a_failed_call_leaves_every_mutated_input_as_it_was(card, mode, kind):
    """A fault anywhere in a step that mutates its inputs (including inside the snapshot
    job, and in the last command) leaves all of them as they were; a clean call after it
    updates all of them."""
    f = torch.compile(mutating, backend="spyre_rt", dynamic=False)
    expected = [t.clone() for t in M_ARGS]
    mutating(*expected)
    args = [t.to(DEV) for t in M_ARGS]
    with dispatch_mode(mode):
        f(*args)  # warm: plans and transfer graphs exist
        for t, orig in zip(args, M_ARGS, strict=True):
            t.copy_(orig)
        total, dma = commands_of_a_call(card, lambda: f(*args))
        for t, orig in zip(args, M_ARGS, strict=True):
            t.copy_(orig)
        n = total if kind == "command" else dma
        for after in sorted({0, 1, 2, n // 4, n // 2, 3 * n // 4, n - 2, n - 1}):
            card.fault_inject(kind, after)
            with pytest.raises(SpyreDeviceError) as e:
                f(*args)
            expect(kind, e)
            del e
            for t, orig in zip(args, M_ARGS, strict=True):
                assert torch.equal(t.cpu(), orig), f"a fault after {after} of {n} commands changed an input"
        f(*args)
        for t, want in zip(args, expected, strict=True):
            assert torch.allclose(t.cpu(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_compiled_step_on_a_lost_card_fails_every_call_until_reset(card, compiled, mode):
    args = [a.to(DEV) for a in ARGS]
    with dispatch_mode(mode):
        compiled(*args)
        card.fault_inject("lost", 2)
        with pytest.raises(SpyreDeviceLostError) as e:
            compiled(*args)
        expect("lost", e)
        refused = {
            "the compiled step": lambda: compiled(*args),
            "host to device": lambda: ARGS[0].to(DEV),
            "device to host": lambda: args[0].cpu(),
            "allocation": lambda: torch.empty(8, device=DEV),
            "synchronize": lambda: torch.spyre.synchronize(1),
        }
        for what, call in refused.items():
            with pytest.raises(SpyreDeviceLostError) as e:
                call()
            assert "lost; reset it" in str(e.value), what
        card.reset()
        fresh = ARGS[0].to(DEV)  # the card works again for new tensors
        assert torch.equal(fresh.cpu(), ARGS[0])


def test_a_function_compiled_after_a_reset_runs(card):
    card.fault_inject("lost", 0)
    with pytest.raises(SpyreDeviceLostError):
        ARGS[0].to(DEV)
    card.reset()
    f = torch.compile(lambda x, w: torch.tanh(x @ w.t()) * 2, backend="spyre_rt", dynamic=False)
    out = f(ARGS[0].to(DEV), ARGS[1].to(DEV))
    assert torch.allclose(out.cpu(), torch.tanh(ARGS[0] @ ARGS[1].t()) * 2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_a_compiled_step_works_after_reset_and_touches_only_its_own_memory(card, compiled, mode):
    with dispatch_mode(mode):
        compiled(*[a.to(DEV) for a in ARGS])
        card.fault_inject("lost", 0)
        with pytest.raises(SpyreDeviceLostError):
            compiled(*[a.to(DEV) for a in ARGS])
        epoch = card.epoch
        spyre_rt.reset_device(DEV)
        assert card.epoch == epoch + 1
        sentinel = torch.full((64, 1024), 7.0).to(DEV)  # takes the low addresses again
        built, loaded = step_mod.stats["kernels_built"], step_mod.stats["plans_loaded"]
        args = [a.to(DEV) for a in ARGS]
        out = compiled(*args)
        assert torch.allclose(out.cpu(), REF, rtol=1e-4, atol=1e-6)
        assert bool((sentinel.cpu() == 7.0).all()), "the step wrote into a tensor it does not own"
        if dispatch.named(mode).plans:  # new plans on the card, from the plan cache: nothing rebuilt
            assert step_mod.stats["plans_loaded"] > loaded
            assert step_mod.stats["kernels_built"] == built
        del out
        start = allocated(card)
        for _ in range(3):  # the new arena is pooled: later calls allocate nothing more
            assert torch.allclose(compiled(*args).cpu(), REF, rtol=1e-4, atol=1e-6)
        assert allocated(card) == start
        assert bool((sentinel.cpu() == 7.0).all())


def test_a_plan_made_before_a_reset_frees_nothing_after_it(card):
    plan = GraphPlan(card, encode_plan([PlanJob(matmul_program(), (), "mm")], [], card.intern))
    card.reset()
    mine = card.malloc(256)  # a new allocation at the plan program's old address
    del plan
    gc.collect()
    assert card.mem_stats()["num_allocs"] == 1
    card.write(mine, b"still mine")


def test_a_program_made_before_a_reset_frees_nothing_after_it(card):
    prog = jobs.ResidentProgram(card, matmul_program())
    old = prog.addr
    card.reset()
    mine = card.malloc(prog.nbytes)  # a new allocation at the program's old address
    assert mine == old
    prog.free()
    assert card.mem_stats()["num_allocs"] == 1
    card.write(mine, b"still mine")
    assert card.read(mine, 10) == b"still mine"
    # a program made after the reset frees its memory as before
    prog = jobs.ResidentProgram(card, matmul_program())
    assert card.mem_stats()["num_allocs"] == 2
    prog.free()
    assert card.mem_stats()["num_allocs"] == 1


def test_a_tensor_made_before_a_reset_frees_nothing_when_it_dies(card):
    x = torch.ones(4, 64).to(DEV)
    old = x.untyped_storage().data_ptr()
    card.reset()
    y = torch.full((4, 64), 3.0).to(DEV)  # a new tensor at the old tensor's address
    assert y.untyped_storage().data_ptr() == old
    del x
    gc.collect()
    assert card.mem_stats()["num_allocs"] == 1
    assert torch.equal(y.cpu(), torch.full((4, 64), 3.0))


# ---- the plan cache survives faults --------------------------------------------------------

def _plan_files(directory) -> list:
    return sorted(p for p in directory.glob("*.plan") if not p.name.startswith(".tmp-"))


def test_faults_leave_every_plan_file_valid(card):
    """Faults in a step's first prebuilt call (a cache miss: build, store, launch) and in
    later calls; afterwards every plan file written or changed meanwhile decodes, and the
    card accepts its plans."""
    f = torch.compile(lambda x, w: torch.exp(x @ w.t()) - 1, backend="spyre_rt", dynamic=False)
    args = [ARGS[0].to(DEV), ARGS[1].to(DEV)]
    ref = torch.exp(ARGS[0] @ ARGS[1].t()) - 1
    with dispatch_mode("construct"):
        f(*args)  # compiled; no plan yet
    directory = plan_cache.default().dir
    before = {p: p.read_bytes() for p in _plan_files(directory)}
    with dispatch_mode("prebuilt"):
        for kind, after in (("command", 1), ("dma", 0), ("command", 0), ("dma", 2)):
            card.fault_inject(kind, after)
            with pytest.raises(SpyreDeviceError) as e:
                f(*args)
            expect(kind, e)
            assert torch.allclose(f(*args).cpu(), ref, rtol=1e-4, atol=1e-5)
    touched = [p for p in _plan_files(directory) if before.get(p) != p.read_bytes()]
    assert len(touched) == 1, "the step's plans were not cached (or other files changed)"
    for p in touched:
        entry = plan_cache.decode(p.read_bytes(), p.stem)
        for block in entry.blocks:
            GraphPlan(card, block)  # the card accepts every plan of the file


# ---- a cache writer killed at any moment ---------------------------------------------------

KILLER = textwrap.dedent(r"""
    import itertools, json, os, random, signal, sys, time
    import numpy as np
    from spyre_rt import plan_cache

    directory, seed, rounds, writers, mib = sys.argv[1], *map(int, sys.argv[2:6])
    SHARED = "5" * 64

    def write_forever(me):
        cache = plan_cache.PlanCache(directory, 1 << 40)
        for i in itertools.count():
            fill = (me * 31 + i) % 251
            key = SHARED if i % 2 else f"{me:064x}"
            cache.store(key, {"writer": me, "i": i, "fill": fill}, [np.full(mib << 20, fill, np.uint8)])

    rng = random.Random(seed)
    kills = 0
    for r in range(rounds):
        pids = []
        for w in range(writers):
            pid = os.fork()
            if pid == 0:
                try:
                    write_forever(r * writers + w)
                finally:
                    os._exit(1)
            pids.append(pid)
        for pid in pids:
            time.sleep(rng.uniform(0.01, 0.3))
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            kills += os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    print(json.dumps({"kills": kills}))
""")


def _check_cache_dir(directory) -> dict:
    """Every entry decodes, matches its key and its contents; temp files are not entries."""
    cache = plan_cache.PlanCache(directory, 1 << 40)
    files = _plan_files(directory)
    temps = [p for p in directory.iterdir() if p.name.startswith(".tmp-")]
    listed = sorted(p for p, _ in cache.entries())
    assert listed == files, "entries() lists something that is not a finished plan file"
    for p in files:
        entry = plan_cache.decode(p.read_bytes(), p.stem)
        (block,) = entry.blocks
        assert block.size and bool((block == entry.header["fill"]).all()), f"{p.name}: header and payload disagree"
        assert cache.load(p.stem) is not None
    json.loads((directory / plan_cache.STATS_FILE).read_text())  # the shared counters are whole
    return {"entries": len(files), "temps": len(temps)}


def test_writers_killed_at_random_times_leave_no_corrupt_file(tmp_path):
    rounds, writers = 6, 3
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", KILLER, str(tmp_path), "20240611", str(rounds),
                          str(writers), "4"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["kills"] == rounds * writers
    seen = _check_cache_dir(tmp_path)
    assert seen["entries"] >= 1
    print(f"{rounds * writers} writers killed; {seen['entries']} entries valid, "
          f"{seen['temps']} stray temp files ignored")


HOLDER = textwrap.dedent(r"""
    import os, sys, time
    import numpy as np
    from spyre_rt import plan_cache

    directory, point = sys.argv[1], sys.argv[2]
    cache = plan_cache.PlanCache(directory, 1 << 40)
    key = "7" * 64
    cache.store(key, {"fill": 1}, [np.full(1 << 20, 1, np.uint8)])   # a good entry

    def hold():
        print("at", point, flush=True)
        time.sleep(600)

    class HalfWriter:   # writes half of what it is given, then the process is killed
        def __init__(self, fd):
            self.fd = fd
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            os.close(self.fd)
        def write(self, data):
            os.write(self.fd, bytes(memoryview(data)[: len(data) // 2]))
            hold()

    if point == "mid-write":
        os.fdopen = lambda fd, *a, **k: HalfWriter(fd)
    else:  # written and synced, not yet renamed
        os.replace = lambda src, dst: hold()
    cache.store(key, {"fill": 2}, [np.full(1 << 20, 2, np.uint8)])
""")


@pytest.mark.parametrize("point", ["mid-write", "before-rename"])
def test_a_writer_killed_mid_write_leaves_the_old_entry_and_an_ignored_temp_file(tmp_path, point):
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-c", HOLDER, str(tmp_path), point],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == f"at {point}", proc.stderr.read()[-2000:]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    seen = _check_cache_dir(tmp_path)
    assert seen == {"entries": 1, "temps": 1}
    entry = plan_cache.PlanCache(tmp_path, 1 << 40).load("7" * 64)
    assert entry.header["fill"] == 1  # the old entry, whole
    (temp,) = tmp_path.glob(".tmp-*")
    if point == "mid-write":
        with pytest.raises(SpyrePlanCacheError, match="truncated"):
            plan_cache.decode(temp.read_bytes())
    else:  # a whole new file that was never put in place
        assert plan_cache.decode(temp.read_bytes(), "7" * 64).header["fill"] == 2


def _stray(directory, name: str, nbytes: int, age: float):
    p = directory / name
    p.write_bytes(b"half a plan file".ljust(nbytes, b"\0"))
    then = time.time() - age
    os.utime(p, (then, then))
    return p


def test_clear_removes_temp_files_left_by_killed_writers(tmp_path):
    cache = plan_cache.PlanCache(tmp_path, 1 << 20)
    cache.store("a" * 64, {}, [np.zeros(1000, np.uint8)])
    stale = _stray(tmp_path, ".tmp-killedwriter.plan", 100, 3600)
    fresh = _stray(tmp_path, ".tmp-justkilled.plan", 100, 0)
    stats_temp = _stray(tmp_path, f".{plan_cache.STATS_FILE}.12345", 10, 3600)
    assert cache.clear() == 4
    assert not list(tmp_path.glob("*.plan")) and not list(tmp_path.glob(".tmp-*"))
    assert not stale.exists() and not fresh.exists() and not stats_temp.exists()
    assert not (tmp_path / plan_cache.STATS_FILE).exists()


def test_trim_removes_stale_temp_files_and_counts_live_ones(tmp_path):
    cache = plan_cache.PlanCache(tmp_path, 10_000)
    for i, key in enumerate(("a" * 64, "b" * 64)):
        cache.store(key, {"i": i}, [np.zeros(3000, np.uint8)])
        then = time.time() - 100 + i  # "a" is the least recently used
        os.utime(cache.path(key), (then, then))
    stale = _stray(tmp_path, ".tmp-killedwriter.plan", 50_000, plan_cache.STALE_TEMP_SECONDS + 60)
    assert cache.trim() == 1  # the stale temp file only: the entries fit
    assert not stale.exists() and len(cache.entries()) == 2
    live = _stray(tmp_path, ".tmp-writing.plan", 5000, 0)  # a writer busy right now
    evictions = plan_cache.stats.evictions
    assert cache.trim() == 1  # its bytes count against the bound: the LRU entry goes
    assert live.exists(), "trim removed the temp file of a live writer"
    assert [p.stem for p, _ in cache.entries()] == ["b" * 64]
    assert plan_cache.stats.evictions == evictions + 1
    assert cache.load("b" * 64).header["i"] == 1
