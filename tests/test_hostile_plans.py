"""Hostile plan files: a cache file whose payload was altered and re-checksummed (so it
passes the file checksum) with oversized counts, out-of-range addresses or offsets, or bad
program blocks is rejected before any command runs, and the step rebuilds its plans and
gives the right results."""

import hashlib
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from spyre_rt import SpyreInvalidCommandError, SpyreLayoutError, SpyrePlanCacheError, plan_cache
from spyre_rt import card as cards
from spyre_rt import executor as step_mod
from spyre_rt.dispatch import dispatch_mode
from spyre_rt.native import lib
from spyre_rt.plan import GraphPlan, PlanJob, binding_layouts
from spyre_rt.plan import encode as encode_plan
from spyre_rt.program import (
    CMD_DMA,
    CMD_MM,
    CMD_SFU,
    CORE_CARD,
    OP_D2H,
    OP_LOAD,
    OP_MATMUL,
    OP_SFU,
    PLAN_HEADER,
    SLOT_DRAM,
    SLOT_HOST,
    ProgramBuilder,
    empty_cmds,
    job_program,
    plan_tables,
)

U64_MAX = (1 << 64) - 1


def model(x, w1, w2):
    return torch.softmax(torch.relu(x @ w1.t()) @ w2.t(), -1) * 3


_G = torch.Generator().manual_seed(5)
ARGS = [torch.randn(6, 64, generator=_G), torch.randn(96, 64, generator=_G), torch.randn(40, 96, generator=_G)]
REF = model(*ARGS)


class Compiled:
    """A compiled step, its inputs in graph order, and its pristine plan file."""

    def __init__(self, cache_dir):
        before = set(step_mod.live_steps())
        f = torch.compile(model, backend="spyre_rt", dynamic=False, options={"cache_dir": str(cache_dir)})
        args = [a.to("spyre") for a in ARGS]
        with dispatch_mode("prebuilt"):
            assert torch.allclose(f(*args).cpu(), REF, rtol=1e-4, atol=1e-6)
        (self.step,) = set(step_mod.live_steps()) - before
        (exe,) = self.step.executables()
        self.key = exe.cache_key()
        by_shape = {tuple(a.shape): a for a in args}
        self.inputs = [by_shape[tuple(b.sizes)] for b, _ in self.step.desc.inputs]
        self.cache = plan_cache.PlanCache(cache_dir, 1 << 30)
        self.pristine = self.cache.path(self.key).read_bytes()
        entry = plan_cache.decode(self.pristine, self.key)
        self.header = {k: v for k, v in entry.header.items() if k != "key"}
        (self.block,) = entry.blocks

    def install(self, block: np.ndarray, **header) -> None:
        """Write a plan file holding `block`, sealed with a valid checksum."""
        data = plan_cache.encode(self.key, {**self.header, **header}, [block])
        self.cache.path(self.key).write_bytes(data)

    def run_fresh(self):
        """A new step for the same graph and settings (as in a new process): loads the plan file."""
        with dispatch_mode("prebuilt"):
            return step_mod.CompiledStep(self.step.desc, settings=self.step.settings)(list(self.inputs), {})[0]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return Compiled(tmp_path_factory.mktemp("hostile-plans"))


@pytest.fixture
def step(compiled):
    yield compiled
    compiled.cache.path(compiled.key).write_bytes(compiled.pristine)


# ---- views into a plan block ---------------------------------------------------------------

def header(block):
    return plan_tables(block).header


def job_table(block):
    return plan_tables(block).jobs


def relocs(block):
    return plan_tables(block).relocs


def program(block, j):
    """(job header, slots, commands, instructions, dependencies) views of job j's program."""
    t = job_program(block, j)
    return t.header, t.slots, t.cmds, t.instrs, t.deps


def depend(block, on) -> None:
    """Make a command that has dependencies depend first on `on`: "self" (itself),
    "successor" (a command that depends on it: a cycle) or a command number."""
    for j in range(len(job_table(block))):
        cmds, deps = program(block, j)[2], program(block, j)[4]
        for i in np.flatnonzero(cmds["ndeps"] > 0):
            succ = [k for k in range(len(cmds))
                    if i in deps[cmds["dep_begin"][k]: cmds["dep_begin"][k] + cmds["ndeps"][k]]]
            if on != "successor" or succ:
                deps[cmds["dep_begin"][i]] = {"self": i, "successor": succ[0] if succ else 0}.get(on, on)
                return
    raise LookupError("no command fits")


def dependent(block) -> tuple[int, int]:
    """(job, command) of the first command that has dependencies."""
    for j in range(len(job_table(block))):
        hits = np.flatnonzero(program(block, j)[2]["ndeps"] > 0)
        if hits.size:
            return j, int(hits[0])
    raise LookupError("no command has dependencies")


def first(block, op):
    """(job, command index) of the first command with opcode `op`."""
    for j in range(len(job_table(block))):
        hits = np.flatnonzero(program(block, j)[2]["op"] == op)
        if hits.size:
            return j, int(hits[0])
    raise LookupError(op)


def cmd(block, op, variant=CMD_DMA):
    """The first command with opcode `op`, viewed as `variant`."""
    j, i = first(block, op)
    return program(block, j)[2][i: i + 1].view(variant)


def set_(view, field, value):
    view[field] = value


def sfu_operand(block):
    """The destination operand of the first SFU instruction (a view)."""
    return program(block, first(block, OP_SFU)[0])[3][0:1]["dst"]


def _share_first_program(block, slots_fewer: int) -> None:
    """The last job names the first job's program (jobs of one program share its resident
    copy), with `slots_fewer` relocations fewer than that program has slots."""
    t = job_table(block)
    t["prog_off"][-1], t["prog_len"][-1] = t["prog_off"][0], t["prog_len"][0]
    t["nslots"][-1] = t["nslots"][0] - slots_fewer


# Each mutation edits a copy of a real plan block in place. Expected: the status the card
# rejects it with when the plan is created.
MUTATIONS = {
    "njobs at the cap": (lambda b: set_(header(b), "njobs", 1 << 20), "SPY_E_BAD_PROGRAM"),
    "njobs over the cap": (lambda b: set_(header(b), "njobs", (1 << 20) + 1), "SPY_E_BAD_PROGRAM"),
    "njobs zero": (lambda b: set_(header(b), "njobs", 0), "SPY_E_BAD_PROGRAM"),
    "nrelocs oversized": (lambda b: set_(header(b), "nrelocs", 1 << 24), "SPY_E_BAD_PROGRAM"),
    "nrelocs max": (lambda b: set_(header(b), "nrelocs", 0xFFFFFFFF), "SPY_E_BAD_PROGRAM"),
    "total bytes": (lambda b: set_(header(b), "total_bytes", b.size + 8), "SPY_E_BAD_PROGRAM"),
    "plan magic": (lambda b: set_(header(b), "magic", 0x4E4C5054), "SPY_E_BAD_PROGRAM"),
    "plan version": (lambda b: set_(header(b), "version", lib.SPY_PLAN_VERSION + 1), "SPY_E_BAD_PROGRAM"),
    "binding layout of other sticks": (lambda b: set_(binding_layouts(b)[1:2], "stick_bytes", 64), "SPY_E_BAD_PROGRAM"),
    "binding layout malformed": (lambda b: set_(binding_layouts(b)[1:2], "itemsize", 3), "SPY_E_BAD_PROGRAM"),
    "program past the end": (lambda b: set_(job_table(b)[-1:], "prog_off", b.size), "SPY_E_BAD_PROGRAM"),
    "program misaligned": (lambda b: set_(job_table(b)[-1:], "prog_off", int(job_table(b)["prog_off"][-1]) + 4),
                           "SPY_E_BAD_PROGRAM"),
    "program over the tables": (lambda b: set_(job_table(b)[0:1], "prog_off", 0), "SPY_E_BAD_PROGRAM"),
    "program length wraps": (lambda b: set_(job_table(b)[0:1], "prog_len", U64_MAX - 7), "SPY_E_BAD_PROGRAM"),
    "program length short": (lambda b: set_(job_table(b)[0:1], "prog_len", 16), "SPY_E_BAD_PROGRAM"),
    "program length off by 8": (lambda b: set_(job_table(b)[0:1], "prog_len", int(job_table(b)["prog_len"][0]) - 8),
                                "SPY_E_BAD_PROGRAM"),
    "relocations outside": (lambda b: set_(job_table(b)[-1:], "reloc_begin", len(relocs(b))), "SPY_E_BAD_PROGRAM"),
    "relocation window wraps": (lambda b: set_(job_table(b)[0:1], "reloc_begin", 0xFFFFFFFF), "SPY_E_BAD_PROGRAM"),
    "relocations for fewer slots": (lambda b: set_(job_table(b)[0:1], "nslots", int(job_table(b)["nslots"][0]) - 1),
                                    "SPY_E_BAD_PROGRAM"),
    "job shares a program of more slots": (lambda b: _share_first_program(b, slots_fewer=1), "SPY_E_BAD_PROGRAM"),
    "binding out of range": (lambda b: set_(relocs(b)[0:1], "binding", int(header(b)["nbindings"][0])),
                             "SPY_E_BAD_PROGRAM"),
    "relocation offset wraps": (lambda b: set_(relocs(b)[0:1], "offset", U64_MAX), "SPY_E_BAD_PROGRAM"),
    "program magic": (lambda b: set_(program(b, -1)[0], "magic", 0), "SPY_E_BAD_PROGRAM"),
    "program command count": (lambda b: set_(program(b, -1)[0], "ncmds", (1 << 26) + 1), "SPY_E_BAD_PROGRAM"),
    "program counts and size disagree": (lambda b: set_(program(b, 0)[0], "ninstrs", 1000), "SPY_E_BAD_PROGRAM"),
    "program flags": (lambda b: set_(program(b, -1)[0], "flags", 1), "SPY_E_BAD_PROGRAM"),
    "slot kind": (lambda b: set_(program(b, 0)[1][0:1], "kind", 7), "SPY_E_BAD_PROGRAM"),
    "slot extent shrunk": (lambda b: set_(program(b, 0)[1], "extent", 64), "SPY_E_BAD_ADDRESS"),
    "opcode": (lambda b: set_(cmd(b, OP_SFU), "op", 99), "SPY_E_BAD_COMMAND"),
    "core": (lambda b: set_(cmd(b, OP_LOAD), "core", 999), "SPY_E_BAD_COMMAND"),
    "card core on a core command": (lambda b: set_(cmd(b, OP_LOAD), "core", CORE_CARD), "SPY_E_BAD_COMMAND"),
    "DMA source past its slot": (lambda b: set_(cmd(b, OP_LOAD), "src_off", 1 << 40), "SPY_E_BAD_ADDRESS"),
    "DMA source offset wraps": (lambda b: set_(cmd(b, OP_LOAD), "src_off", U64_MAX - 63), "SPY_E_BAD_ADDRESS"),
    "DMA run past the scratchpad": (lambda b: set_(cmd(b, OP_LOAD), "dst_off", (2 << 20) - 8), "SPY_E_SCRATCHPAD"),
    "DMA slot out of range": (lambda b: set_(cmd(b, OP_LOAD), "src_slot", 40), "SPY_E_BAD_COMMAND"),
    "DMA strides overflow": (lambda b: (set_(cmd(b, OP_LOAD), "ndims", 1), set_(cmd(b, OP_LOAD), "count", [1 << 25, 1, 1]),
                                        set_(cmd(b, OP_LOAD), "src_stride", [1 << 44, 0, 0])), "SPY_E_BAD_COMMAND"),
    "matmul shape": (lambda b: set_(cmd(b, OP_MATMUL, CMD_MM), "m", 0), "SPY_E_BAD_COMMAND"),
    "matmul past the scratchpad": (lambda b: set_(cmd(b, OP_MATMUL, CMD_MM), "c_off", 0xFFFFFF00), "SPY_E_SCRATCHPAD"),
    "matmul C misaligned": (lambda b: set_(cmd(b, OP_MATMUL, CMD_MM), "c_off", int(cmd(b, OP_MATMUL, CMD_MM)["c_off"][0]) + 8193),
                            "SPY_E_BAD_COMMAND"),
    "matmul A misaligned": (lambda b: set_(cmd(b, OP_MATMUL, CMD_MM), "a_off", int(cmd(b, OP_MATMUL, CMD_MM)["a_off"][0]) + 1),
                            "SPY_E_BAD_COMMAND"),
    "SFU operand misaligned": (lambda b: sfu_operand(b)["v"].__iadd__(1), "SPY_E_BAD_COMMAND"),
    "SFU program outside": (lambda b: set_(cmd(b, OP_SFU, CMD_SFU), "instr_begin", 1 << 30), "SPY_E_BAD_COMMAND"),
    "SFU instruction opcode": (lambda b: set_(program(b, first(b, OP_SFU)[0])[3][0:1], "op", 200), "SPY_E_BAD_COMMAND"),
    "dependency on itself": (lambda b: depend(b, "self"), "SPY_E_BAD_COMMAND"),
    "dependency out of range": (lambda b: depend(b, 1 << 20), "SPY_E_BAD_COMMAND"),
    "dependency cycle": (lambda b: depend(b, "successor"), "SPY_E_CYCLE"),
    "dependency list outside": (lambda b: set_(program(b, dependent(b)[0])[2][dependent(b)[1]:][:1], "dep_begin",
                                               1 << 31), "SPY_E_BAD_COMMAND"),
}


def hostile(step, name) -> np.ndarray:
    block = step.block.copy()
    MUTATIONS[name][0](block)
    assert not np.array_equal(block, step.block)
    return block


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_the_card_rejects_a_hostile_plan_before_any_command_runs(step, name):
    card = cards.get(0)
    block = hostile(step, name)
    before, mem = card.counters(), card.mem_stats()["allocated"]
    with pytest.raises(SpyreInvalidCommandError) as e:
        GraphPlan(card, block)
    assert e.value.status == MUTATIONS[name][1], str(e.value)
    after = card.counters()
    for counter in ("jobs", "commands", "plan_launches", "bytes_h2d", "bytes_d2h"):
        assert after[counter] == before[counter], f"{counter} moved: a rejected plan did work"
    assert card.mem_stats()["allocated"] == mem  # its programs' memory was given back


@pytest.mark.parametrize("name", ["njobs over the cap", "program past the end", "binding out of range",
                                  "relocation offset wraps", "slot extent shrunk", "DMA source past its slot",
                                  "DMA run past the scratchpad", "SFU instruction opcode"])
def test_a_step_rejects_a_hostile_plan_file_and_rebuilds(step, name):
    step.install(hostile(step, name))
    corrupt = plan_cache.stats.corrupt
    out = step.run_fresh()
    assert torch.allclose(out.cpu(), REF, rtol=1e-4, atol=1e-6)
    assert plan_cache.stats.corrupt == corrupt + 1
    rebuilt = plan_cache.decode(step.cache.path(step.key).read_bytes(), step.key)
    assert np.array_equal(rebuilt.blocks[0][:PLAN_HEADER.itemsize], step.block[:PLAN_HEADER.itemsize])
    assert rebuilt.blocks[0].size == step.block.size


def test_a_plan_file_with_another_binding_count_is_rebuilt(step):
    block = step.block.copy()
    header(block)["nbindings"] += 1
    step.install(block)
    corrupt = plan_cache.stats.corrupt
    assert torch.allclose(step.run_fresh().cpu(), REF, rtol=1e-4, atol=1e-6)
    assert plan_cache.stats.corrupt == corrupt + 1


def _bind_like_a_call(card, exe, layout_of=None):
    """Allocations a call of the step binds: the arena (no layout), then every input,
    constant and output storage with its stick layout (`layout_of` may change one)."""
    layouts = exe.bindings.stick_layouts()
    if layout_of:
        layouts = [layout_of(b, x) for b, x in enumerate(layouts)]
    sizes = exe.bindings.limits()
    return [card.malloc(max(n, 1), layout=x) for n, x in zip(sizes, layouts, strict=True)]


# Plans the card accepts but whose bindings need more memory than the step's buffers: the
# card refuses every launch before any command runs, so a step rejects such a plan file
# when it loads it and rebuilds.
OVERSIZED = {
    "relocation offset far out": lambda b: set_(relocs(b)[0:1], "offset", 1 << 40),
    "slot extent inflated": lambda b: set_(program(b, 0)[1][0:1], "extent", 1 << 36),
}


@pytest.mark.parametrize("name", sorted(OVERSIZED))
def test_an_oversized_plan_is_refused_before_any_command_runs(step, name):
    card = cards.get(0)
    block = step.block.copy()
    OVERSIZED[name](block)
    plan = GraphPlan(card, block)  # accepted: extents are checked against each launch's memory
    (exe,) = step.step.executables()
    bufs = _bind_like_a_call(card, exe)
    before = card.counters()
    try:
        with pytest.raises(SpyreInvalidCommandError, match="not inside a live allocation"):
            plan.launch(bufs)
    finally:
        for addr in bufs:
            card.free(addr)
    assert card.counters()["jobs"] == before["jobs"]


@pytest.mark.parametrize("name", sorted(OVERSIZED))
def test_an_oversized_plan_file_is_rebuilt(step, name, caplog):
    block = step.block.copy()
    OVERSIZED[name](block)
    step.install(block)
    corrupt, loaded = plan_cache.stats.corrupt, step_mod.stats["plans_loaded"]
    with caplog.at_level("WARNING", logger="spyre_rt.plan_cache"):
        assert torch.allclose(step.run_fresh().cpu(), REF, rtol=1e-4, atol=1e-6)
    assert plan_cache.stats.corrupt == corrupt + 1
    assert step_mod.stats["plans_loaded"] == loaded  # rejected, not used
    assert any("unusable" in r.getMessage() and "bytes of" in r.getMessage() for r in caplog.records)
    rebuilt = plan_cache.decode(step.cache.path(step.key).read_bytes(), step.key)
    assert np.array_equal(rebuilt.blocks[0], step.block)
    assert torch.allclose(step.run_fresh().cpu(), REF, rtol=1e-4, atol=1e-6)  # the rebuilt file loads
    assert plan_cache.stats.corrupt == corrupt + 1


def test_a_plan_bound_to_a_storage_of_another_layout_is_refused_before_any_command_runs(step):
    """The programs address each storage through the stick layout they were built for: the
    card refuses a binding whose allocation records another (here a storage of the same
    bytes, cut into twice the rows of half the length), before any job runs."""
    card = cards.get(0)
    plan = GraphPlan(card, step.block)
    (exe,) = step.step.executables()

    def halve_rows(b, layout):
        return layout._replace(rows=layout.rows * 2, row_len=layout.row_len // 2) if b == 1 else layout

    assert exe.bindings.layouts[exe.bindings.names[1]].row_len % 2 == 0
    for layout_of, refused in ((None, False), (halve_rows, True)):
        bufs = _bind_like_a_call(card, exe, layout_of)
        before = card.counters()
        try:
            if refused:
                with pytest.raises(SpyreLayoutError, match="plan binding 1: the plan was built for a storage of"):
                    plan.launch(bufs)
                assert card.counters()["jobs"] == before["jobs"]
            else:
                plan.launch(bufs)
                assert card.counters()["jobs"] > before["jobs"]
        finally:
            for addr in bufs:
                card.free(addr)


def test_a_plan_file_for_storages_of_other_layouts_is_rebuilt(step, caplog):
    block = step.block.copy()
    table = binding_layouts(block)
    table[1:2]["rows"], table[1:2]["row_len"] = table["rows"][1] * 2, table["row_len"][1] // 2
    step.install(block)
    corrupt, loaded = plan_cache.stats.corrupt, step_mod.stats["plans_loaded"]
    with caplog.at_level("WARNING", logger="spyre_rt.plan_cache"):
        assert torch.allclose(step.run_fresh().cpu(), REF, rtol=1e-4, atol=1e-6)
    assert plan_cache.stats.corrupt == corrupt + 1
    assert step_mod.stats["plans_loaded"] == loaded
    assert any("other stick layouts" in r.getMessage() for r in caplog.records)
    rebuilt = plan_cache.decode(step.cache.path(step.key).read_bytes(), step.key)
    assert np.array_equal(rebuilt.blocks[0], step.block)


def test_plan_errors_name_the_job_and_the_command(step):
    """The card prefixes a job's validation message with the job (once, not garbled)."""
    block = hostile(step, "DMA source past its slot")
    j, i = first(block, OP_LOAD)
    with pytest.raises(SpyreInvalidCommandError) as e:
        GraphPlan(cards.get(0), block)
    assert f"creating a graph plan: plan job {j}: command {i}: source range [{1 << 40}, +" in str(e.value)
    assert str(e.value).count("plan job") == 1
    assert e.value.command == i


# ---- a plan job with a host slot ---------------------------------------------------------

HOST_SLOT = textwrap.dedent(r"""
    import sys
    import numpy as np
    import torch
    from spyre_rt import SpyreError, card as cards, plan_cache
    from spyre_rt.plan import GraphPlan

    entry = plan_cache.PlanCache(sys.argv[1], 1 << 30).load(sys.argv[2])
    card = cards.get(0)
    try:
        plan = GraphPlan(card, entry.blocks[0])
        # bind every binding to device memory of its declared extent, as a step does
        bufs = [card.malloc(max(plan.extent(b), 1)) for b in range(plan.nbindings)]
        plan.launch(bufs)
    except SpyreError as e:
        print("rejected:", type(e).__name__, e)
        sys.exit(0)
    print("accepted")
    sys.exit(1)
""")


def test_a_plan_file_with_a_host_slot_is_rejected_without_a_crash(step):
    """A launch would use the bound device address as a host pointer: plans bind device
    memory only, so the card refuses a plan job with a host slot when the plan is made."""
    card = cards.get(0)
    b = ProgramBuilder()
    dram, host = b.slot(SLOT_DRAM, 4096), b.slot(SLOT_HOST, 4096)
    d2h = empty_cmds(1, OP_D2H, CORE_CARD)
    d2h["src_slot"], d2h["dst_slot"], d2h["run_bytes"] = dram, host, 4096
    b.add(d2h)
    nbindings = int(header(step.block)["nbindings"][0])
    # the host slot takes binding 0 (the step binds its arena there), the DRAM slot an input
    block = encode_plan([PlanJob(b.encode(), ((1, 0), (0, 0)), "evil")], [None] * nbindings, card.intern)
    step.install(block, names=[["evil"]])
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", HOST_SLOT, str(step.cache.dir), step.key],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stdout[-500:]} {out.stderr[-1000:]}"
    assert "rejected: SpyreInvalidCommandError" in out.stdout
    assert "plan job 0 slot 1 is a host slot; plans bind device memory only" in out.stdout
    assert "[SPY_E_BAD_PROGRAM]" in out.stdout
    # and in this process: refused before anything is uploaded or run, then rebuilt
    card = cards.get(0)
    before, mem = card.counters(), card.mem_stats()["allocated"]
    with pytest.raises(SpyreInvalidCommandError, match="host slot"):
        GraphPlan(card, block)
    assert card.counters()["jobs"] == before["jobs"] and card.mem_stats()["allocated"] == mem
    corrupt = plan_cache.stats.corrupt
    assert torch.allclose(step.run_fresh().cpu(), REF, rtol=1e-4, atol=1e-6)
    assert plan_cache.stats.corrupt == corrupt + 1


def _sealed(step, header: dict | bytes) -> bytes:
    """The step's plan file with another header, resealed with a valid checksum."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    payload = step.pristine[plan_cache._PREFIX.size + plan_cache._PREFIX.unpack_from(step.pristine)[2]:]
    check = hashlib.sha256(head + payload).digest()
    return plan_cache._PREFIX.pack(plan_cache.MAGIC, plan_cache.FORMAT, len(head), len(payload), check) + head + payload


def test_a_plan_file_with_a_deeply_nested_header_is_rebuilt(step):
    entry = plan_cache.decode(step.pristine, step.key)
    head = json.dumps({**entry.header, "names": None}).replace("null", "[" * 100_000 + "]" * 100_000).encode()
    data = _sealed(step, head)
    for key in (None, step.key):
        with pytest.raises(SpyrePlanCacheError, match="nested too deeply"):
            plan_cache.decode(data, key)
    step.cache.path(step.key).write_bytes(data)
    corrupt = plan_cache.stats.corrupt
    assert torch.allclose(step.run_fresh().cpu(), REF, rtol=1e-4, atol=1e-6)
    assert plan_cache.stats.corrupt == corrupt + 1
    assert plan_cache.decode(step.cache.path(step.key).read_bytes(), step.key).header["names"] == entry.header["names"]


@pytest.mark.parametrize("change", ["no key", "key not a string", "block size a bool", "names not strings"])
def test_a_plan_file_with_a_malformed_header_is_rejected_with_a_typed_error(step, change):
    header = dict(plan_cache.decode(step.pristine, step.key).header)
    if change == "no key":
        del header["key"]
    elif change == "key not a string":
        header["key"] = [step.key]
    elif change == "block size a bool":
        header["blocks"] = [True] * len(header["blocks"])
    else:
        header["names"] = [[["nested"]] * len(n) for n in header["names"]]
    data = _sealed(step, header)
    if change != "names not strings":  # a header the reader refuses, with or without a key
        for key in (None, step.key):
            with pytest.raises(SpyrePlanCacheError):
                plan_cache.decode(data, key)
    step.cache.path(step.key).write_bytes(data)
    corrupt = plan_cache.stats.corrupt
    assert torch.allclose(step.run_fresh().cpu(), REF, rtol=1e-4, atol=1e-6)
    assert plan_cache.stats.corrupt == corrupt + 1
