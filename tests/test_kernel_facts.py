"""Every kernel knows what it computes: its kind, aten ops, module, FLOPs, the DRAM bytes it
must move and the bytes it did move, its cores and scratchpad; trace job events carry them
(what spyre-profile's per-op table and roofline read)."""

from __future__ import annotations

import torch

from spyre_rt import card as cards
from spyre_rt import executor, job_facts, trace
from spyre_rt.dispatch import dispatch_mode


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 96, bias=False)

    def forward(self, x):
        return torch.relu(self.proj(x)) * 2


def _compiled_block():
    torch._dynamo.reset()
    torch.manual_seed(0)
    return torch.compile(Block().eval().to("spyre"), backend="spyre_rt", dynamic=False)


def _infos(step) -> list[tuple[str, dict]]:
    (exe,) = step.executables()
    names = [exe.job_name(k) for seg in exe.device_segments() for k in seg.kernels]
    return [(n, job_facts.lookup(n)) for n in names if job_facts.lookup(n)]


def test_a_matmul_knows_its_flops_bytes_module_and_cores():
    before = set(executor.live_steps())
    f = _compiled_block()
    with torch.no_grad():
        f(torch.randn(10, 64).to("spyre"))
    (step,) = set(executor.live_steps()) - before
    mm = [info for _, info in _infos(step) if info["op"] == ["mm"]]
    assert len(mm) == 1
    info = mm[0]
    assert info["kind"] == "matmul" and info["module"] == "proj"
    assert info["flops"] == 2 * 10 * 64 * 96
    assert info["dram_bytes_min"] == (10 * 64 + 64 * 96 + 10 * 96) * 4
    assert info["dram_bytes"] >= info["dram_bytes_min"]
    assert 1 <= info["cores"] <= 32 and info["scratchpad_peak"] > 0
    assert info["dtype"] == "float32"


def test_a_gather_must_move_every_row_it_reads():
    """A paged cache's keys and values gathered by a block table: the gather reads a row of
    the cache per index and writes it, so its fewest bytes are both, once; and a table
    lookup (an embedding) reads a row per token, not the whole table."""
    before = set(executor.live_steps())
    torch._dynamo.reset()

    def gather(cache, table, ids, emb):
        return cache[0][:, table] * 1, cache[1][:, table] * 1, emb[ids] * 1

    cache = torch.randn(2, 2, 9, 4, 64)               # [K/V, heads, blocks, block, dim]
    table = torch.tensor([[1, 3], [8, 0], [2, 2]])    # 3 requests of 2 blocks (a block may repeat)
    ids = torch.tensor([5, 1, 5, 7])
    emb = torch.randn(1000, 64)
    f = torch.compile(gather, backend="spyre_rt", dynamic=False)
    outs = f(*(t.to("spyre") for t in (cache, table, ids, emb)))
    for got, want in zip(outs, gather(cache, table, ids, emb), strict=True):
        assert torch.equal(got.cpu(), want)
    (step,) = set(executor.live_steps()) - before
    infos = [info for _, info in _infos(step)]
    context = 2 * 3 * 2 * 4 * 64 * 4                  # heads x requests x blocks x block x dim, fp32
    by_kind = {}
    for info in infos:
        by_kind.setdefault(info["kind"], []).append(info["dram_bytes_min"])
    table_bytes, ids_bytes, rows = table.numel() * 8, ids.numel() * 8, 4 * 64 * 4
    want = [2 * context + 2 * context + table_bytes,  # K and V read a row per index and written
            rows + rows + ids_bytes]                  # the embedding: a row per token, read and written
    assert sorted(by_kind.get("gather", [])) == sorted(want), by_kind


def test_trace_job_events_carry_what_each_kernel_computes():
    f = _compiled_block()
    card = cards.get(0)
    x = torch.randn(10, 64).to("spyre")
    with torch.no_grad(), dispatch_mode("prebuilt"):
        f(x)  # plans exist
        with trace.recording(card, commands=False) as cap:
            f(x)
    events = cap.export()["traceEvents"]
    jobs = [e for e in events if e.get("ph") == "X" and "flops" in e.get("args", {})]
    assert jobs, "no job event carries kernel info"
    for key in ("op", "module", "flops", "dram_bytes_min", "dram_bytes", "cores"):
        assert all(key in e["args"] for e in jobs), key


def test_a_warm_start_knows_its_kernels_from_the_plan_file():
    """A step whose plans come from the plan cache builds nothing: what its kernels compute
    comes from the plan file."""
    torch._dynamo.reset()
    before = set(executor.live_steps())
    f = torch.compile(lambda x, w: torch.relu(x @ w) * 2, backend="spyre_rt", dynamic=False)
    x, w = torch.randn(10, 64).to("spyre"), torch.randn(64, 96).to("spyre")
    with dispatch_mode("prebuilt"):
        f(x, w)
    (step,) = set(executor.live_steps()) - before
    names = [n for n, _ in _infos(step)]
    assert names
    job_facts.clear()
    built = executor.stats["kernels_built"]
    fresh = executor.CompiledStep(step.desc, step.digest)  # as a new process would make it
    with dispatch_mode("prebuilt"):
        fresh([x, w], {})
    assert executor.stats["kernels_built"] == built, "the plans were built, not loaded"
    assert all(job_facts.lookup(n) for n in names)


def test_dram_bytes_count_descriptor_lists_by_their_entries():
    """A plain DMA moves its runs times its counts; one with a descriptor list the bytes of
    its entries (desc_count of them from src_off); a gather its indices' rows."""
    import numpy as np

    from spyre_rt.construct.facts import dram_bytes
    from spyre_rt.program import CMD, CMD_DMA, CMD_GATHER, DESC, DMA_DESCS, OP_GATHER, OP_LOAD, OP_STORE

    cmds = np.zeros(4, dtype=CMD)
    dma = cmds.view(CMD_DMA)
    dma["op"][0], dma["run_bytes"][0], dma["ndims"][0], dma["count"][0] = OP_LOAD, 64, 2, (3, 2, 7)
    dma["op"][1], dma["flags"][1], dma["src_off"][1], dma["desc_count"][1] = OP_LOAD, DMA_DESCS, 1, 2
    dma["op"][2], dma["flags"][2], dma["src_off"][2], dma["desc_count"][2] = OP_STORE, DMA_DESCS, 0, 1
    gather = cmds[3:].view(CMD_GATHER)
    gather["op"], gather["nidx"], gather["run_bytes"], gather["ndims"], gather["count"] = OP_GATHER, 5, 16, 1, (2, 9)
    descs = np.zeros(4, dtype=DESC)
    descs["bytes"] = (10, 20, 30, 40)
    assert dram_bytes(cmds, descs) == 64 * 6 + (20 + 30) + 10 + 5 * 16 * 2
