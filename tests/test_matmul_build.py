"""The matmul builder on a functional card, against torch: every dtype path, transposed
operands, views with offsets and odd row lengths, a bias, split-K, M = 1, and the empty
(K = 0) and one-element (K = 1) contractions, under the tiling the cost model chooses and
under random ones. Inputs are small integers, so every sum is exact in fp32 and the card
must agree with torch bit for bit, whatever order split-K adds in. Every program is also
checked for scratchpad races (``scratchpad_races``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scratchpad_races import decode, races

from spyre_rt import device_profile, dtypes, jobs
from spyre_rt.card import Card
from spyre_rt.construct.context import BuildContext
from spyre_rt.construct.matmul import MatmulSpec, Problem, Tiling, View, build, choose
from spyre_rt.construct.matmul.tiling import divisors
from spyre_rt.cost import CostModel
from spyre_rt.layout import StickLayout
from spyre_rt.program import CMD_MM, OP_MATMUL, OP_SFU

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.fixture(scope="module")
def card():
    return Card(device_profile.load("spyre"), "functional", 0)


@dataclass
class Operand:
    """A host storage of `rows x row_len` elements and a (batch, rows, cols) view of it."""

    values: torch.Tensor  # flat storage
    row_len: int
    view: View

    @property
    def layout(self) -> StickLayout:
        return StickLayout(self.values.numel() // self.row_len, self.row_len, self.values.element_size())

    def tensor(self) -> torch.Tensor:
        v = self.view
        return torch.as_strided(self.values, v.sizes, v.strides, v.offset)


def operand(name, dtype, batch, rows, cols, *, transposed=False, broadcast=False, col0=0, row0=0, pad=0,
            gen=None, integers=True) -> Operand:
    """A view of (batch, rows, cols) whose `cols` (or, transposed, `rows`) is the storage's
    contiguous dimension, starting `row0` storage rows and `col0` columns in, with `pad`
    unused columns per storage row."""
    inner, outer = (rows, cols) if transposed else (cols, rows)
    row_len = max(1, col0 + inner + pad)
    per_batch = outer * row_len
    nrows = row0 + outer * (1 if broadcast else batch) + 1
    if integers:
        values = torch.randint(-3, 4, (nrows * row_len,), generator=gen).to(dtype)
    else:
        values = torch.randn(nrows * row_len, generator=gen).to(dtype)
    strides = (0 if broadcast else per_batch, 1, row_len) if transposed else (0 if broadcast else per_batch,
                                                                              row_len, 1)
    return Operand(values, row_len, View(name, row0 * row_len + col0, (batch, rows, cols), strides))


def upload(card, op: Operand) -> int:
    lay = op.layout
    raw = np.zeros(lay.nbytes, np.uint8)
    e = lay.itemsize
    phys = lay.phys(np.arange(op.values.numel()))
    raw[(phys[:, None] + np.arange(e)).ravel()] = op.values.view(torch.uint8).numpy()
    addr = card.malloc(lay.nbytes)
    card.write(addr, raw.tobytes())
    return addr


def download(card, addr: int, op: Operand) -> torch.Tensor:
    lay = op.layout
    raw = np.frombuffer(card.read(addr, lay.nbytes), np.uint8)
    phys = lay.phys(np.arange(op.values.numel()))
    flat = raw[(phys[:, None] + np.arange(lay.itemsize)).ravel()].copy()
    return torch.from_numpy(flat).view(op.values.dtype)


def run(card, a: Operand, b: Operand, out: Operand, bias: Operand | None = None,
        tiling: Tiling | None = None) -> tuple[torch.Tensor, Tiling, np.ndarray]:
    """The card's result (the whole output storage), the tiling and the program."""
    ops = {"a": a, "b": b, "o": out} | ({"bias": bias} if bias is not None else {})
    code = dtypes.of(a.values.dtype).code
    spec = MatmulSpec(a.view, b.view, out.view, code, dtypes.of(out.values.dtype).code,
                      bias=bias.view if bias is not None else None,
                      bias_dtype=dtypes.of(bias.values.dtype).code if bias is not None else 0)
    ctx = BuildContext(CostModel.of_figures(card.profile), {n: o.layout for n, o in ops.items()})
    tiling = build(ctx, spec, tiling).tiling
    blob = ctx.encode()
    return launch_built(card, ctx, blob, ops, ["o"])["o"], tiling, blob


def launch_built(card, ctx: BuildContext, blob: np.ndarray, ops: dict, read: list[str]) -> dict[str, torch.Tensor]:
    """Upload the operands, launch the built program (an empty one launches nothing) and
    read back the storages named in `read`."""
    addrs = {n: upload(card, o) for n, o in ops.items()}
    try:
        if ctx.ncmds:
            prog = jobs.ResidentProgram(card, blob, "matmul")
            prog.launch([addrs[n] for n in ctx.buffers()])
            card.synchronize()
            prog.free()
        return {n: download(card, addrs[n], ops[n]) for n in read}
    finally:
        for addr in addrs.values():
            card.free(addr)


def expected(a: Operand, b: Operand, out: Operand, bias: Operand | None = None) -> torch.Tensor:
    """The whole output storage after the matmul, computed by torch in float64."""
    ref = a.tensor().double() @ b.tensor().double()
    if bias is not None:
        ref = ref + bias.tensor().double()
    storage = out.values.clone()
    torch.as_strided(storage, out.view.sizes, out.view.strides, out.view.offset).copy_(ref.to(out.values.dtype))
    return storage


def check(card, a, b, out, bias=None, tiling=None) -> Tiling:
    got, tiling, blob = run(card, a, b, out, bias, tiling)
    assert races(blob) == [], f"scratchpad races under {tiling}"
    want = expected(a, b, out, bias)
    assert torch.equal(got, want), f"{tiling}: {(got.double() - want.double()).abs().max()} off"
    return tiling


# ---- random shapes, layouts, dtypes and tilings ------------------------------------------

@st.composite
def tilings(draw, batch: int, m: int, n: int, k: int):
    """A random tiling of all the cores (None: the one the cost model chooses)."""
    if draw(st.booleans()):
        return None
    pk = draw(st.sampled_from([d for d in divisors(32) if d <= max(k, 1)]))
    pm = draw(st.sampled_from([d for d in divisors(32 // pk) if d <= m]))
    pn = draw(st.sampled_from([d for d in divisors(32 // (pk * pm)) if d <= n]))
    wm = draw(st.integers(1, max(1, min(4, m // pm))))
    wn = draw(st.integers(1, max(1, min(4, n // pn))))
    return Tiling(32 // (pk * pm * pn), pk, pm, pn, pm * wm, pn * wn, draw(st.sampled_from([64, 128, 192])),
                  draw(st.sampled_from([2, 3])))


@st.composite
def matmuls(draw):
    batch = draw(st.sampled_from([1, 1, 2, 3]))
    m = draw(st.sampled_from([1, 1, 7, 33, 65, 130]))
    n = draw(st.sampled_from([1, 5, 64, 100, 130]))
    k = draw(st.sampled_from([0, 1, 3, 64, 100, 300]))
    dtype = draw(st.sampled_from(DTYPES))
    out_dtype = draw(st.sampled_from([dtype, torch.float32]))
    layout = {x: dict(transposed=draw(st.booleans()), col0=draw(st.sampled_from([0, 0, 3, 64])),
                      row0=draw(st.sampled_from([0, 2])), pad=draw(st.sampled_from([0, 0, 5])))
              for x in ("a", "b", "o")}
    layout["o"]["transposed"] = False
    broadcast_b = batch > 1 and draw(st.booleans())  # one weight for every batch entry
    bias = draw(st.sampled_from([None, torch.float32, dtype]))
    tiling = draw(tilings(batch, m, n, k))
    seed = draw(st.integers(0, 2**16))
    return batch, m, n, k, dtype, out_dtype, layout, broadcast_b, bias, tiling, seed


def _build_case(case):
    batch, m, n, k, dtype, out_dtype, layout, broadcast_b, bias_dtype, tiling, seed = case
    g = torch.Generator().manual_seed(seed)
    a = operand("a", dtype, batch, m, k, gen=g, **layout["a"])
    b = operand("b", dtype, batch, k, n, gen=g, broadcast=broadcast_b, **layout["b"])
    out = operand("o", out_dtype, batch, m, n, gen=g, **layout["o"])
    bias = None
    if bias_dtype is not None:
        bias = operand("bias", bias_dtype, 1, 1, n, gen=g, col0=3)
        bias.view = View("bias", bias.view.offset, (batch, m, n), (0, 0, 1))
    return a, b, out, bias, tiling


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(matmuls())
# split-K over four slices with a bias, fp16 into fp32; a transposed A with unaligned rows
@example((1, 7, 100, 300, torch.float16, torch.float32,
          {"a": dict(transposed=False, col0=0, row0=0, pad=0), "b": dict(transposed=True, col0=0, row0=0, pad=0),
           "o": dict(transposed=False, col0=0, row0=0, pad=0)}, False, torch.float32,
          Tiling(1, 4, 1, 8, 1, 8, 64, 2), 1))
@example((2, 65, 130, 100, torch.bfloat16, torch.bfloat16,
          {"a": dict(transposed=True, col0=3, row0=2, pad=5), "b": dict(transposed=False, col0=64, row0=0, pad=0),
           "o": dict(transposed=False, col0=3, row0=2, pad=5)}, True, None, None, 2))
def test_random_matmuls_equal_torch_exactly(card, case):
    check(card, *_build_case(case))


# ---- the shapes the issue names -------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_empty_and_one_element_contractions_are_built_directly(card, k, dtype, transposed):
    """K = 0: zeros plus the bias; K = 1: an outer product. Batched, with a weight read
    transposed, a bias, an output view into a wider storage."""
    g = torch.Generator().manual_seed(k)
    a = operand("a", dtype, 2, 37, k, gen=g, transposed=transposed, col0=3)
    b = operand("b", dtype, 2, k, 70, gen=g, transposed=not transposed, broadcast=True)
    out = operand("o", dtype, 2, 37, 70, gen=g, col0=64, pad=1)
    bias = operand("bias", torch.float32, 1, 1, 70, gen=g)
    bias.view = View("bias", 0, (2, 37, 70), (0, 0, 1))
    check(card, a, b, out, bias)
    check(card, a, b, out)


@pytest.mark.parametrize("k", [0, 1])
def test_decode_shaped_empty_and_one_element_contractions(card, k):
    g = torch.Generator().manual_seed(5)
    a = operand("a", torch.float16, 1, 1, k, gen=g)
    b = operand("b", torch.float16, 1, k, 4100, gen=g, transposed=True)
    out = operand("o", torch.float16, 1, 1, 4100, gen=g)
    check(card, a, b, out)


def test_decode_splits_k_and_adds_the_partial_sums_on_the_card(card):
    """M = 1 with few columns: K is cut over the cores and the partial sums added over the
    ring (exactly: the inputs are integers)."""
    g = torch.Generator().manual_seed(1)
    a = operand("a", torch.float16, 1, 1, 4097, gen=g)
    b = operand("b", torch.float16, 1, 4097, 64, gen=g, transposed=True)
    out = operand("o", torch.float32, 1, 1, 64, gen=g)
    tiling = check(card, a, b, out)
    assert tiling.pk > 1


def test_a_cores_tiles_are_finished_in_pieces_of_rows(card):
    """Each tile's last matmul, program and stores go in pieces of rows, so that a piece's
    program and stores run while the arrays compute the next piece: the arrays do not wait
    for a whole tile's program before the next tile (which overwrites the one accumulator),
    and the job does not end with every core storing a whole tile at once. Exact, with no
    scratchpad races, and with a residual-like epilogue (a bias) read by each piece at its
    rows."""
    g = torch.Generator().manual_seed(7)
    a = operand("a", torch.float16, 1, 1024, 64, gen=g)
    b = operand("b", torch.float16, 1, 64, 256, gen=g, transposed=True)
    out = operand("o", torch.float16, 1, 1024, 256, gen=g)
    bias = operand("bias", torch.float32, 1, 1, 256, gen=g)
    bias.view = View("bias", 0, (1, 1024, 256), (0, 0, 1))
    for with_bias in (None, bias):
        tiling = Tiling(2, 1, 4, 4, 16, 4, 64, 2)  # tiles of 64 x 64, two waves of 32
        assert check(card, a, b, out, with_bias, tiling) == tiling
        _, _, blob = run(card, a, b, out, with_bias, tiling)
        cmds, _, _, _ = decode(blob)
        mms = cmds[cmds["op"] == OP_MATMUL].view(CMD_MM)
        rows = sorted(int(m) for m in mms["m"])
        assert rows == [16] * 256, "the tiles' matmuls are not in four pieces of 16 rows"
        assert int((cmds["op"] == OP_SFU).sum()) == 64 * 4


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_the_pieces_of_a_last_tile_walk_its_last_chunks_in_turn(card, monkeypatch, out_dtype):
    """Deeper pieces (``last_depth``): each piece of a core's last tile walks the tile's last
    K chunks before the next piece begins, so that the first rows are done, and stored,
    chunks before the end. Each row still adds its chunks in order: every depth gives the
    bits of the whole last matmul (normal values, which another order of the sums would
    round otherwise), with no scratchpad races."""
    from spyre_rt.construct.matmul import record

    g = torch.Generator().manual_seed(11)
    a = operand("a", torch.float16, 1, 1024, 256, gen=g, integers=False)
    b = operand("b", torch.float16, 1, 256, 256, gen=g, transposed=True, integers=False)
    out = operand("o", out_dtype, 1, 1024, 256, gen=g)
    tiling = Tiling(2, 1, 4, 4, 16, 4, 64, 3)  # tiles of 64 x 64, two waves of 32; four K chunks, three buffers
    results = {}
    for depth in (1, 2, 3):
        monkeypatch.setattr(record, "last_depth", lambda *_, d=depth: d)
        results[depth], got, blob = run(card, a, b, out, None, tiling)
        assert got == tiling and races(blob) == [], f"scratchpad races at depth {depth}"
        cmds, _, _, _ = decode(blob)
        mms = cmds[cmds["op"] == OP_MATMUL].view(CMD_MM)
        mine = mms[mms["core"] == 5]  # in program order
        assert [int(m) for m in mine["m"][:7]] == [64] * 3 + [16] * 4, "the first tile's pieces walk one chunk"
        last = mine[7:]
        assert [int(m) for m in last["m"]] == [64] * (4 - depth) + [16] * (4 * depth)
        pieces = last[4 - depth:]
        chunks, rows = [int(x) for x in pieces["b_off"]], [int(x) for x in pieces["c_off"]]  # buffer; rows
        assert chunks == chunks[:depth] * 4 and len(set(chunks[:depth])) == depth, "a piece does not walk the chunks"
        assert rows == [r for r in sorted(set(rows)) for _ in range(depth)], "the pieces are not one after the other"
    assert torch.equal(results[1], results[2]) and torch.equal(results[1], results[3])
    want = expected(a, b, out).double()
    assert torch.allclose(results[1].double(), want, rtol=1e-2, atol=1e-2)


def test_fp16_gemm_of_normal_values_is_close_to_torch(card):
    """Ordinary values: fp32 accumulation, then fp16 rounding, as torch does on the CPU."""
    g = torch.Generator().manual_seed(2)
    a = operand("a", torch.float16, 1, 70, 700, gen=g, integers=False)
    b = operand("b", torch.float16, 1, 700, 300, gen=g, transposed=True, integers=False)
    out = operand("o", torch.float16, 1, 70, 300, gen=g, integers=False)
    got, tiling, _ = run(card, a, b, out, tiling=Tiling(1, 2, 4, 4, 4, 8, 64, 3))
    ref = (a.tensor().float() @ b.tensor().float()).half()
    got = torch.as_strided(got, out.view.sizes, out.view.strides, out.view.offset)
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-2)


def test_rows_that_wrap_in_storage_are_moved_by_descriptor_lists(card):
    """A reshaped input: an operand row spans two storage rows, so its boxes have no
    compact DMA pattern."""
    g = torch.Generator().manual_seed(3)
    x = operand("a", torch.float16, 1, 4, 96, gen=g)  # storage rows of 96
    a = Operand(x.values, 96, View("a", 0, (1, 2, 192), (0, 192, 1)))
    b = operand("b", torch.float16, 1, 192, 70, gen=g)
    out = operand("o", torch.float16, 1, 2, 70, gen=g)
    check(card, a, b, out)


def test_an_empty_result_builds_nothing():
    target = CostModel.of_figures(device_profile.load("spyre"))
    layouts = {"a": StickLayout(0, 8, 2), "b": StickLayout(8, 4, 2), "o": StickLayout(0, 4, 2)}
    ctx = BuildContext(target, layouts)
    code = dtypes.of(torch.float16).code
    build(ctx, MatmulSpec(View("a", 0, (1, 0, 8), (0, 8, 1)), View("b", 0, (1, 8, 4), (0, 4, 1)),
                          View("o", 0, (1, 0, 4), (0, 4, 1)), code, code))
    assert ctx.ncmds == 0


def test_construction_is_deterministic():
    """The same matmul builds the same program: what keeps the dispatch modes bit for bit
    alike."""
    target = CostModel.of_figures(device_profile.load("spyre"))
    a = operand("a", torch.float16, 1, 130, 300, gen=torch.Generator().manual_seed(0))
    b = operand("b", torch.float16, 1, 300, 100, transposed=True, gen=torch.Generator().manual_seed(0))
    out = operand("o", torch.float16, 1, 130, 100)
    code = dtypes.of(torch.float16).code
    spec = MatmulSpec(a.view, b.view, out.view, code, code)
    blobs = []
    for _ in range(2):
        ctx = BuildContext(target, {"a": a.layout, "b": b.layout, "o": out.layout})
        build(ctx, spec, choose(target, Problem.of(spec)))
        blobs.append(ctx.encode())
    assert np.array_equal(*blobs)


@pytest.mark.parametrize("m,k,n", [(5, 1, 7), (64, 1, 130), (5, 0, 7), (1, 1, 1)])
@pytest.mark.parametrize("mode", ["construct", "prebuilt"])
def test_a_compiled_matmul_of_one_or_no_contraction_is_the_matmul_kernel(m, k, n, mode):
    """mm, addmm and bmm with K = 1 or K = 0, compiled, equal torch: the lowering hands them
    to the matmul builder as they are (Inductor's own decompositions may still make an outer
    product a multiply)."""
    from spyre_rt.dispatch import dispatch_mode

    g = torch.Generator().manual_seed(m * 100 + k * 10 + n)
    a, b, c = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g), torch.randn(n, generator=g)
    torch._dynamo.reset()
    with dispatch_mode(mode):
        out = torch.compile(lambda a, b, c: (a @ b, torch.addmm(c, a, b), torch.bmm(a[None], b[None])),
                            backend="spyre_rt", dynamic=False)(a.to("spyre"), b.to("spyre"), c.to("spyre"))
    want = (a @ b, torch.addmm(c, a, b), torch.bmm(a[None], b[None]))
    for got, w in zip(out, want, strict=True):
        torch.testing.assert_close(got.cpu(), w, atol=1e-5, rtol=1e-5)
