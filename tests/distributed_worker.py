"""One rank of the multi-card tests (tests/test_distributed.py runs it under torchrun).

``python distributed_worker.py SUITE``: runs every case of SUITE in order and prints
``CASE <name> OK`` (or the failure) for each; the exit status is 1 if any case failed.
Every rank checks its own results against what a single process computes on the CPU.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import spyre_rt
import spyre_rt.distributed  # noqa: F401  (registers spyreccl)

warnings.simplefilter("ignore")
R = W = 0
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def value(rank: int, shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Rank `rank`'s input: the same on every process, so each can compute the expected result."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=g).to(dtype)


def expect(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 0.0) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    if tol:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=what)
    else:
        assert torch.equal(got, want), f"{what}: {got} != {want}"


def spyre(t: torch.Tensor) -> torch.Tensor:
    return t.to("spyre")


# ---- the collectives suite ----

def case_device_of_rank():
    assert torch.spyre.current_device() == int(os.environ["LOCAL_RANK"])
    assert torch.accelerator.current_device_index() == R
    assert torch.ones(2).to("spyre").device == torch.device("spyre", R)
    assert torch.zeros(2, device="spyre").device == torch.device("spyre", R)
    for make in (torch.tensor, torch.as_tensor, torch.asarray):  # made in C++ from the data
        assert make([1.0, 2.0], device="spyre").device == torch.device("spyre", R), make
    assert torch.tensor(3, device=torch.device("spyre")).device == torch.device("spyre", R)
    assert torch.tensor([1.0], device="spyre:0").device == torch.device("spyre", 0)  # an index is kept


def case_all_reduce_ops():
    for dtype in DTYPES:
        for op, fold in ((dist.ReduceOp.SUM, torch.add), (dist.ReduceOp.MAX, torch.maximum),
                         (dist.ReduceOp.MIN, torch.minimum), (dist.ReduceOp.PRODUCT, torch.mul)):
            t = spyre(value(R, (5, 70), dtype))
            dist.all_reduce(t, op=op)
            want = value(0, (5, 70)).to(dtype).float()
            for r in range(1, W):
                want = fold(want, value(r, (5, 70)).to(dtype).float())
            expect(t, want.to(dtype), f"all_reduce {op} {dtype}")
        t = spyre(value(R, (33,), dtype))
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        want = (sum(value(r, (33,), dtype).float() for r in range(W)) / W).to(dtype)
        expect(t, want, f"all_reduce avg {dtype}")


def case_all_reduce_noncontiguous_and_cpu():
    base = spyre(value(R, (8, 6)))
    view = base.t()[1:5]  # a strided view of the card's storage
    dist.all_reduce(view)
    want = sum(value(r, (8, 6)) for r in range(W)).t()[1:5]
    expect(view, want, "non-contiguous view")
    untouched = value(R, (8, 6)).t().clone()
    untouched[1:5] = want
    expect(base.t(), untouched, "the rest of the storage")
    c = value(R, (4, 4))
    dist.all_reduce(c)
    expect(c, sum(value(r, (4, 4)) for r in range(W)), "cpu through gloo")


def case_all_gather():
    for dtype in DTYPES:
        x = spyre(value(R, (3, 5), dtype))
        outs = [torch.empty(3, 5, dtype=dtype, device="spyre") for _ in range(W)]
        dist.all_gather(outs, x)
        for r in range(W):
            expect(outs[r], value(r, (3, 5), dtype), f"all_gather {dtype} from {r}")
        out = torch.empty(3 * W, 5, dtype=dtype, device="spyre")
        dist.all_gather_into_tensor(out, x)
        expect(out, torch.cat([value(r, (3, 5), dtype) for r in range(W)]), f"all_gather_into_tensor {dtype}")


def case_reduce_scatter():
    ins = [spyre(value(R, (4,), seed=j)) for j in range(W)]
    out = torch.empty(4, device="spyre")
    dist.reduce_scatter(out, ins)
    expect(out, sum(value(r, (4,), seed=R) for r in range(W)), "reduce_scatter")
    whole = spyre(value(R, (2 * W, 3)))
    out = torch.empty(2, 3, device="spyre")
    dist.reduce_scatter_tensor(out, whole)
    expect(out, sum(value(r, (2 * W, 3)) for r in range(W))[2 * R:2 * R + 2], "reduce_scatter_tensor")


def case_broadcast_reduce_gather_scatter():
    t = spyre(value(R, (6,)))
    dist.broadcast(t, src=1)
    expect(t, value(1, (6,)), "broadcast")
    t = spyre(value(R, (6,)))
    dist.reduce(t, dst=0)
    expect(t, sum(value(r, (6,)) for r in range(W)) if R == 0 else value(R, (6,)), "reduce")
    x = spyre(value(R, (2, 2)))
    outs = [torch.empty(2, 2, device="spyre") for _ in range(W)] if R == 0 else None
    dist.gather(x, outs, dst=0)
    if R == 0:
        for r in range(W):
            expect(outs[r], value(r, (2, 2)), f"gather from {r}")
    out = torch.empty(3, device="spyre")
    dist.scatter(out, [spyre(value(9, (3,), seed=j)) for j in range(W)] if R == 1 else None, src=1)
    expect(out, value(9, (3,), seed=R), "scatter")


def case_all_to_all():
    ins = [spyre(value(R, (2, 3), seed=j)) for j in range(W)]
    outs = [torch.empty(2, 3, device="spyre") for _ in range(W)]
    dist.all_to_all(outs, ins)
    for j in range(W):
        expect(outs[j], value(j, (2, 3), seed=R), f"all_to_all from {j}")
    x = spyre(value(R, (2 * W, 3)))
    out = torch.empty(2 * W, 3, device="spyre")
    dist.all_to_all_single(out, x)
    expect(out, torch.cat([value(j, (2 * W, 3))[2 * R:2 * R + 2] for j in range(W)]), "all_to_all_single")
    # uneven splits: rank r sends j+1 rows to rank j
    x = spyre(value(R, (sum(range(1, W + 1)),)))
    out = torch.empty(W * (R + 1), device="spyre")
    dist.all_to_all_single(out, x, output_split_sizes=[R + 1] * W, input_split_sizes=list(range(1, W + 1)))
    start = sum(range(1, R + 1))
    expect(out, torch.cat([value(j, (sum(range(1, W + 1)),))[start:start + R + 1] for j in range(W)]),
           "all_to_all_single, uneven")


def case_send_recv_barrier():
    if R == 0:
        dist.send(spyre(value(7, (5,))), dst=1)
    elif R == 1:
        t = torch.empty(5, device="spyre")
        dist.recv(t, src=0)
        expect(t, value(7, (5,)), "recv")
    dist.barrier()


def case_functional_collectives():
    x = spyre(value(R, (4, 8)))
    y = funcol.all_reduce(x, "sum", dist.group.WORLD)
    expect(funcol.wait_tensor(y), sum(value(r, (4, 8)) for r in range(W)), "funcol all_reduce")
    g = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    expect(funcol.wait_tensor(g), torch.cat([value(r, (4, 8)) for r in range(W)]), "funcol all_gather")
    s = funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD)
    expect(funcol.wait_tensor(s), sum(value(r, (4, 8)) for r in range(W))[4 // W * R:4 // W * (R + 1)],
           "funcol reduce_scatter")
    expect(x, value(R, (4, 8)), "funcol leaves its input")


def case_sub_groups():
    groups = [dist.new_group([r]) for r in range(W)]  # every rank makes every group, in the same order
    mine = groups[R]
    t = spyre(value(R, (3,)))
    dist.all_reduce(t, group=mine)
    expect(t, value(R, (3,)), "a group of one")
    pair = dist.new_group(list(range(W)))
    t = spyre(value(R, (3,)))
    dist.all_reduce(t, group=pair)
    expect(t, sum(value(r, (3,)) for r in range(W)), "a new group of every rank")


def case_large_message():
    n = (9 << 20) // 2  # 9 MiB of fp16: three rounds of the 4 MiB slots
    t = spyre(torch.full((n,), float(R + 1), dtype=torch.float16))
    dist.all_reduce(t)
    expect(t, torch.full((n,), float(sum(range(1, W + 1))), dtype=torch.float16), "9 MiB all_reduce")


def case_interconnect_time():
    """A collective is a job on each card's timeline: it starts when the last rank is ready
    and lasts the interconnect model's time; on timing-mode cards no data moves."""
    from spyre_rt.distributed import interconnect
    from spyre_rt.native import lib

    pg = dist.distributed_c10d._get_default_group()
    for mode in ("functional", "timing"):
        with spyre_rt.card.configured(sim_mode=mode):
            t = torch.ones(4096, dtype=torch.float16).to("spyre")  # 8 KiB, a decode step's all-reduce
            card = spyre_rt.tensors.card_of(t)
            assert card.index == int(os.environ["LOCAL_RANK"]) and card.sim_mode == mode
            c = card.clock()
            ready = max(c.host_ns, c.finish_ns)
            rounds = int(lib.spy_ccl_rounds(pg._ring.handle))
            dist.all_reduce(t)
            end = torch.tensor([card.device_finish_ns()], dtype=torch.float64)
            moved = int(lib.spy_ccl_rounds(pg._ring.handle)) - rounds
            ends = [torch.empty_like(end) for _ in range(W)]
            dist.all_gather(ends, end)
            machines = pg.ring.between_machines  # the network's figures then, else the cards' links
            cost = interconnect.cost(card.profile, "all_reduce", 8192, W, machines)
            assert cost.algorithm == "ring" and (15000 < cost.ns < 60000 if machines else 1000 < cost.ns < 10000), cost
            assert all(float(e) == float(end) for e in ends), f"the collective ends apart: {ends}"
            assert float(end) >= ready + cost.ns, (float(end), ready, cost)
            assert moved == 1, f"{mode}: {moved} rounds"  # the ranks' readiness goes with the data
            if mode == "functional":
                expect(t, torch.full((4096,), float(W), dtype=torch.float16), "the all_reduce's data")


def _collectives_step(x, w, b):
    """Every collective a compiled graph can hold as a job of its plan, between card kernels."""
    y = x @ w
    y = funcol.all_reduce(y, "sum", dist.group.WORLD)
    m = funcol.all_reduce(y * 0.5, "max", dist.group.WORLD)
    h = funcol.all_reduce(y.half(), "sum", dist.group.WORLD)
    g = funcol.all_gather_tensor(y + 1, 0, dist.group.WORLD)  # rows of 40 fp32: two stick columns
    s = funcol.reduce_scatter_tensor(g * 2, "sum", 0, dist.group.WORLD)
    c = funcol.broadcast(b + 1, 1, dist.group.WORLD)
    return torch.relu(y), m, h, g, s, c


def _collectives_inputs(seeds):
    """Every rank's x (4, 40), w (40, 40) and b (4, 40)."""
    return [[value(r, shape, seed=s) for r in range(W)] for s, shape in zip(seeds, ((4, 40), (40, 40), (4, 40)),
                                                                             strict=True)]


def _collectives_expected(xs, ws, bs):
    y = sum(x @ w for x, w in zip(xs, ws, strict=True))
    m = torch.stack([0.5 * y] * W).amax(0)
    h = sum(y.half().float() for _ in range(W)).half()
    g = torch.cat([y + 1] * W)
    s = (2 * W * (y + 1))
    return [torch.relu(y), m, h, g, s, bs[1] + 1]


def case_compiled_collectives():
    """A compiled graph's functional collectives are jobs of its one plan (no CPU op), in
    every dispatch mode, and a torch.spyre.graph replay runs them again."""
    from spyre_rt.dispatch import dispatch_mode
    from spyre_rt.executor import live_steps

    step = torch.compile(_collectives_step, backend="spyre_rt", fullgraph=True)
    every = _collectives_inputs((1, 2, 3))
    args = [vals[R] for vals in every]
    want = _collectives_expected(*every)
    dev = [spyre(a) for a in args]
    with warnings.catch_warnings():
        warnings.simplefilter("error", spyre_rt.fallback.SpyreFallbackWarning)  # no collective on the CPU
        for mode in ("prebuilt", "construct"):
            with dispatch_mode(mode):
                outs = step(*dev)
            for i, (o, w) in enumerate(zip(outs, want, strict=True)):
                expect(o, w, f"output {i} in {mode}", tol=1e-5 if o.dtype == torch.float32 else 1e-3)
    exes = [e for st in live_steps() for e in st.executables()
            if any(k.kind == "collective" for k in e.desc.kernels.values())]
    assert len(exes) == 1 and len(exes[0].segments) == 1, [e.segments for e in exes]
    assert sum(k.kind == "collective" for k in exes[0].desc.kernels.values()) == 6
    g = torch.spyre.SpyreGraph()
    with torch.spyre.graph(g):
        outs = step(*dev)
    assert g.launches == 1, g.launches
    new = _collectives_inputs((4, 5, 6))
    for d, vals in zip(dev, new, strict=True):
        d.copy_(spyre(vals[R]))
    g.replay()
    for i, (o, w) in enumerate(zip(outs, _collectives_expected(*new), strict=True)):
        expect(o, w, f"output {i} of a replay", tol=1e-5 if o.dtype == torch.float32 else 1e-3)


def _gather_rows(x):
    return funcol.all_gather_tensor(x * 2, 0, dist.group.WORLD)


def case_compiled_gather_of_dynamic_rows():
    """A gather whose rows are a symbol (vLLM's logits of a batch: `dynamic=True`) is a job
    of the plan, for each number of rows the one compiled graph meets."""
    step = torch.compile(_gather_rows, backend="spyre_rt", fullgraph=True, dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", spyre_rt.fallback.SpyreFallbackWarning)  # no collective on the CPU
        for rows in (2, 5, 8):
            got = step(spyre(value(R, (rows, 64))))
            expect(got, torch.cat([2 * value(r, (rows, 64)) for r in range(W)]), f"a gather of {rows} rows")


def case_collective_the_ring_cannot_move():
    """A gather of single rows that are not whole sticks (33 fp32 elements) does not line
    up for the ring: refused like a kernel the card cannot build, it runs through the group
    on the host, with the same result; the reference evaluation of a collective (what a
    kernel refused at a call runs) is the group's functional collective."""
    from spyre_rt import reference
    from spyre_rt.ir import CollectiveKernel

    step = torch.compile(_gather_rows, backend="spyre_rt", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = step(spyre(value(R, (33,))))
    expect(got, torch.cat([2 * value(r, (33,)) for r in range(W)]), "a gather of unaligned rows")
    assert any("all_gather" in str(w.message) for w in caught), [str(w.message) for w in caught]
    group = dist.group.WORLD.group_name
    kernel = CollectiveKernel("k0", "all_reduce", group, W, ("x", 0, (6,), (1,)), ("x", 0, (6,), (1,)), "float32")
    flat = torch.zeros(8)
    flat[1:7] = value(R, (6,))
    reference.run(kernel, {"x": reference.Place(flat, 1)})
    expect(flat[1:7], sum(value(r, (6,)) for r in range(W)), "the reference all_reduce", tol=1e-6)
    assert flat[0] == 0 and flat[7] == 0


def case_compiled_collectives_time():
    """In timing mode a compiled step's collectives move no data and put each card's
    collectives at the same time: the ranks' steps end together."""
    with spyre_rt.card.configured(sim_mode="timing"):
        step = torch.compile(_collectives_step, backend="spyre_rt", fullgraph=True)
        dev = [spyre(vals[R]) for vals in _collectives_inputs((1, 2, 3))]
        card = spyre_rt.tensors.card_of(dev[0])
        start = card.device_finish_ns()
        step(*dev)
        end = torch.tensor([card.device_finish_ns()], dtype=torch.float64)
        ends = [torch.empty_like(end) for _ in range(W)]
        dist.all_gather(ends, end)
        assert all(float(e) == float(end) for e in ends), f"the ranks' steps end apart: {ends}"
        assert float(end) > start


def case_between_machines():
    """Ranks told they are on two machines (SPYRE_RT_HOST_ID) join their groups' rings over
    sockets; one machine's ranks share memory."""
    pg = dist.distributed_c10d._get_default_group()
    machines = os.environ.get("SPYRE_RT_HOST_ID", "").startswith("node")
    assert pg.ring.between_machines == machines, (pg.ring.between_machines, machines)
    lone = dist.new_group([R], use_local_synchronization=True)  # one rank: one machine
    assert not lone.ring.between_machines


# ---- the faults suite ----

def case_mismatched_shapes():
    t = spyre(torch.ones(4 + R))
    try:
        dist.all_reduce(t)
    except spyre_rt.distributed.SpyreCollectiveError as e:
        assert "mismatched collectives" in str(e), e
        expect(t, torch.ones(4 + R), "the tensor of a refused call")
    else:
        raise AssertionError("a mismatched all_reduce succeeded")
    try:  # the group is aborted from then on, as NCCL's is
        dist.all_reduce(spyre(torch.ones(2)))
    except spyre_rt.distributed.SpyreCollectiveError as e:
        assert "aborted" in str(e), e
    else:
        raise AssertionError("an aborted group ran a collective")


def case_tensors_of_two_cards():
    """A collective on tensors of two cards is refused before anything moves, on every rank;
    the group goes on."""
    pg = dist.new_group(list(range(W)))
    x = torch.ones(4).to(f"spyre:{R}")
    outs = [torch.empty(4, device=f"spyre:{1 - R}") for _ in range(W)]
    for call in (lambda: dist.all_gather(outs, x, group=pg),
                 lambda: pg.allreduce([x, torch.ones(4).to(f"spyre:{1 - R}")])):
        try:
            call()
        except ValueError as e:
            assert "one card" in str(e) and "spyre:0" in str(e) and "spyre:1" in str(e), e
        else:
            raise AssertionError("a collective of tensors on two cards ran")
    dist.all_reduce(x, group=pg)
    expect(x, torch.full((4,), float(W)), "the group after a refused call")


def _cached_matmul_all_reduce(cache, x, w, group):
    """A tensor-parallel step's shape: a cache the step updates in place, a matmul, and the
    all-reduce of its product, last."""
    cache.add_(x)
    return funcol.all_reduce(cache @ w, "sum", group)


def case_card_fault_in_a_compiled_step():
    """A card fault on rank 0 in the middle of a compiled tensor-parallel step: rank 0 gets
    the card's error, rank 1 (waiting in the step's all-reduce) a SpyreCollectiveError
    naming it, the group is aborted, and every rank's cache is as it was before the call.
    Rearmed by every rank, the group runs the step again (on one machine)."""
    pg = dist.new_group(list(range(W)), timeout=timedelta(seconds=60))
    step = torch.compile(_cached_matmul_all_reduce, backend="spyre_rt", fullgraph=True)
    cache, x, w = spyre(value(R, (8, 64))), spyre(value(R, (8, 64), seed=1)), spyre(value(R, (64, 64), seed=2))
    step(cache, x, w, pg)  # warm: compiled, plans built
    card = spyre_rt.tensors.card_of(cache)
    card.trace_clear()
    card.trace_enable(True, True)
    step(cache, x, w, pg)
    card.trace_enable(False)
    commands = int((card.trace_events()["kind"] == spyre_rt.card.EV_CMD).sum())
    card.trace_clear()
    before = cache.cpu()
    if R == 0:
        card.fault_inject("command", commands // 2)
    try:
        step(cache, x, w, pg)
    except spyre_rt.distributed.SpyreCollectiveError as e:
        assert R != 0 and "its card failed" in str(e), e
    except spyre_rt.errors.SpyreDeviceError as e:
        assert R == 0, e
    else:
        raise AssertionError(f"rank {R}: the step with a card fault on rank 0 succeeded")
    expect(cache, before, "the cache the failed step mutates")
    try:
        step(cache, x, w, pg)
    except spyre_rt.distributed.SpyreCollectiveError as e:
        assert "aborted" in str(e), e
    else:
        raise AssertionError("a step ran in an aborted group")
    expect(cache, before, "the cache after a step refused by the aborted group")
    if pg.ring.between_machines:   # an abort shut the sockets for good
        try:
            pg.rearm()
        except spyre_rt.distributed.SpyreCollectiveError as e:
            assert "several machines" in str(e), e
        else:
            raise AssertionError("a group between machines was rearmed")
        return
    pg.rearm()   # every rank, together: the group serves again
    out = step(cache, x, w, pg)
    expect(cache, before + x.cpu(), "the cache the step after the rearm mutates")
    want = cache.cpu() @ w.cpu()
    dist.all_reduce(want, group=pg)   # through the group's gloo
    expect(out, want, "the step after the rearm", tol=1e-4)


def case_rank_dies():
    pg = dist.new_group(list(range(W)), timeout=timedelta(seconds=30))
    dist.barrier(group=pg)
    if R == 1:
        os._exit(0)  # leaves without a word, mid-run
    t0 = time.monotonic()
    try:
        dist.all_reduce(spyre(torch.ones(3)), group=pg)
    except spyre_rt.distributed.SpyreCollectiveError as e:
        assert any(w in str(e) for w in ("exited", "timeout", "closed its connection")), e
    else:
        raise AssertionError("an all_reduce without its peer succeeded")
    assert time.monotonic() - t0 < 30, "the survivor waited past the group's timeout"


# ---- the tensor-parallel suite ----

def tiny_checkpoint(family: str, layers: int = 2) -> str:
    """A model of `family` from its config, random weights, saved by rank 0 to a directory
    every rank then loads (the path comes through the store)."""
    import tempfile

    from transformers import (
        GraniteConfig,
        GraniteForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    store = dist.distributed_c10d._get_default_store()
    key = f"checkpoint/{family}/{layers}"
    if R == 0:
        cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig), "granite": (GraniteForCausalLM, GraniteConfig),
                    "mixtral": (MixtralForCausalLM, MixtralConfig)}[family]
        moe = {"num_local_experts": 4, "num_experts_per_tok": 2} if family == "mixtral" else {}
        torch.manual_seed(0)
        model = cls(cfg(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=False, **moe))
        path = tempfile.mkdtemp(prefix=f"spyre-tp-{family}-")
        model.save_pretrained(path)
        store.set(key, path)
    return store.get(key).decode()


def _ring_rounds() -> int:
    from spyre_rt.native import lib

    return sum(int(lib.spy_ccl_rounds(pg._ring.handle)) for pg in dist.distributed_c10d._world.pg_map
               if isinstance(pg, spyre_rt.distributed.ProcessGroupSpyre))


def _tp_parity(family: str):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(family)
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 3, 7]])
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mesh = init_device_mesh("spyre", (W,))
    tp = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto", device_mesh=mesh).eval()
    up = tp.model.layers[0].mlp.up_proj.weight
    local = up.to_local() if hasattr(up, "to_local") else up
    assert local.device.type == "spyre" and local.shape[0] == 128 // W, f"up_proj is not sharded: {local.shape}"
    rounds = _ring_rounds()
    with torch.no_grad():
        want = ref(ids).logits
        got = tp(ids.to("spyre")).logits
        assert _ring_rounds() > rounds, "the forward made no collective on the cards' ring"
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        expect(got.float(), want, f"{family} logits under tp_plan=auto", tol=1e-5)
        want_tokens = ref.generate(ids, max_new_tokens=4, do_sample=False)
        got_tokens = tp.generate(ids.to("spyre"), max_new_tokens=4, do_sample=False)
    assert torch.equal(got_tokens.cpu(), want_tokens), f"{family} generate: {got_tokens} != {want_tokens}"
    dist.barrier()
    if R == 0:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def case_tp_llama():
    _tp_parity("llama")


def case_tp_granite():
    _tp_parity("granite")


def _tp_compiled(family: str, generate: bool = False, replay: bool = False):
    """from_pretrained(tp_plan="auto") compiled for the card: every collective a job of the
    step's one plan, logits within 1e-4 of one CPU process; optionally generate()'s tokens
    on a static cache equal, and a torch.spyre.graph replay of the forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from spyre_rt.executor import live_steps

    path = tiny_checkpoint(family, layers=1)
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 3, 7]])
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mesh = init_device_mesh("spyre", (W,))
    tp = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto", device_mesh=mesh).eval()
    sharded = tp.model.layers[0].mlp.experts.gate_up_proj if family == "mixtral" else tp.model.layers[0].mlp.up_proj.weight
    local = sharded.to_local() if hasattr(sharded, "to_local") else sharded
    whole = ref.model.layers[0].mlp.experts.gate_up_proj if family == "mixtral" else ref.model.layers[0].mlp.up_proj.weight
    assert local.device.type == "spyre" and local.numel() * W == whole.numel(), f"not sharded: {local.shape}"
    tp.forward = torch.compile(tp.forward, backend="spyre_rt")
    before = {id(st) for st in live_steps()}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", spyre_rt.fallback.SpyreFallbackWarning)  # nothing of the step on the CPU
        got = tp(ids.to("spyre"), use_cache=False).logits
        expect(got.float(), ref(ids).logits, f"{family} compiled logits under tp_plan=auto", tol=1e-4)
    exes = [e for st in live_steps() if id(st) not in before for e in st.executables()]
    assert exes and all(len(e.segments) == 1 for e in exes), [e.segments for e in exes]
    assert sum(k.kind == "collective" for e in exes for k in e.desc.kernels.values()) >= 2
    with torch.no_grad():
        if generate:
            want = ref.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
            got = tp.generate(ids.to("spyre"), max_new_tokens=4, do_sample=False, cache_implementation="static")
            assert torch.equal(got.cpu(), want), f"{family} compiled generate: {got} != {want}"
        if replay:
            static = ids.to("spyre")
            g = torch.spyre.SpyreGraph()
            with torch.spyre.graph(g):
                out = tp(static, use_cache=False).logits
            assert g.launches == 1, g.launches
            other = torch.tensor([[2, 4, 8, 16, 32, 64, 5, 9]])
            static.copy_(other.to("spyre"))
            g.replay()
            expect(out, ref(other).logits, f"{family} replayed logits", tol=1e-4)
    dist.barrier()


def case_tp_compiled_llama():
    _tp_compiled("llama", generate=True, replay=True)


def case_tp_compiled_granite():
    _tp_compiled("granite")


def case_tp_compiled_mixtral():
    _tp_compiled("mixtral")


def case_tp_compiled_generate_granite():
    _tp_compiled("granite", generate=True)


def case_tp_compiled_generate_mixtral():
    _tp_compiled("mixtral", generate=True, replay=True)


SUITES = {
    "collectives": [case_device_of_rank, case_all_reduce_ops, case_all_reduce_noncontiguous_and_cpu,
                    case_all_gather, case_reduce_scatter, case_broadcast_reduce_gather_scatter, case_all_to_all,
                    case_send_recv_barrier, case_functional_collectives, case_sub_groups, case_large_message,
                    case_interconnect_time, case_compiled_collectives, case_collective_the_ring_cannot_move,
                    case_compiled_gather_of_dynamic_rows, case_compiled_collectives_time],
    "faults": [case_mismatched_shapes, case_tensors_of_two_cards, case_card_fault_in_a_compiled_step, case_rank_dies],
    "tp": [case_tp_llama, case_tp_granite, case_tp_compiled_llama, case_tp_compiled_granite,
           case_tp_compiled_mixtral],
    "tp_generate": [case_tp_compiled_generate_granite, case_tp_compiled_generate_mixtral],
    # two nodes (torchrun --nnodes 2, a process each, told they are on different hosts)
    "nodes": [case_between_machines, case_all_reduce_ops, case_all_gather, case_reduce_scatter,
              case_broadcast_reduce_gather_scatter, case_functional_collectives, case_large_message,
              case_interconnect_time, case_compiled_collectives, case_card_fault_in_a_compiled_step, case_rank_dies],
}


def main(suite: str) -> int:
    global R, W
    dist.init_process_group(backend="cpu:gloo,spyre:spyreccl", timeout=timedelta(seconds=60))
    R, W = dist.get_rank(), dist.get_world_size()
    failed = 0
    for case in SUITES[suite]:
        try:
            case()
            print(f"CASE {case.__name__} OK", flush=True)
        except Exception:
            failed += 1
            print(f"CASE {case.__name__} FAILED on rank {R}\n{traceback.format_exc()}", flush=True)
    if suite in ("collectives", "tp", "tp_generate"):  # the others leave groups that cannot be torn down
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(1 if failed else 0)  # faults suites leave groups that cannot be torn down cleanly


if __name__ == "__main__":
    main(sys.argv[1])
