"""Model parity: Hugging Face families compiled for spyre match CPU eager.

Every family of the compatibility matrix (:mod:`spyre_rt.profiler.models`: small configs,
random weights, no download) runs as :mod:`spyre_rt.profiler.parity` runs it for
``spyre-profile models``: on the CPU in eager mode, and on spyre through
``torch.compile(backend="spyre_rt")``, compiled once and run in each dispatch mode. A
decoder runs a prefill and 16 greedy decode steps with a static KV cache (one prefill
graph, one decode graph that every step reuses); an encoder gives the hidden states of a
padded batch; an encoder-decoder runs generate() under automatic dynamic shapes. Every run
is fed the fp32 reference's greedy tokens, so outputs compare step by step.

The default run compares fp32 in every dispatch mode (``dispatch.NAMES``: four) and fp16 in ``prebuilt``; fp16 in
every mode is marked slow.
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings

import pytest
import torch

import spyre_rt
from spyre_rt.profiler import models, parity
from spyre_rt.profiler.parity import DECODE_STEPS, DTYPES, MODES, Compared, Run


def _families(kind: str | None = None, but: tuple[str, ...] = ()) -> list:
    """The families as test parameters; the slow ones (a fast family covers what they
    bring) marked slow."""
    return [pytest.param(name, marks=[pytest.mark.slow] if fam.slow else [], id=name)
            for name, fam in models.FAMILIES.items() if kind in (None, fam.kind) and name not in but]


FAMILIES = _families()
DECODERS = _families(models.DECODER)
ENCODERS = _families(models.ENCODER)
SEQ2SEQ = _families(models.SEQ2SEQ)
GENERATING = DECODERS + SEQ2SEQ  # the families that decode greedily
FAST_MODES = {"fp32": MODES, "fp16": ("prebuilt",)}  # fp16 in every mode: slow

# The ops each family runs on the CPU inside its compiled steps: element-wise gathers
# (BERT's and RoBERTa's token types, DeBERTa's relative positions; RoBERTa's positions
# counted from the padding, a cumulative sum, run on the card). On the card, computed apart
# from the kernels they fused with (tests/test_gathers_apart.py): MoE's combine (each
# pair's output gathered at the inverse permutation feeds the sum over the top-k along
# that sum's columns) and Gemma 4's per-layer input embeddings (a norm over rows narrower
# than the table's). Anything else falling back is a regression.
CPU_OPS = {"bert": {"aten.gather.default"}, "roberta": {"aten.gather.default"},
           "deberta_v2": {"aten.gather.default"}}


@functools.cache
def reference(family: str) -> Run:
    return parity.reference(models.family(family))


@functools.cache
def compared(family: str, dname: str, modes: tuple[str, ...]) -> Compared:
    # the Granite fp32 run is the one the graph tests count: without fullgraph, a graph
    # break shows up in the counters instead of failing every test of the run
    fullgraph = (family, dname) != ("granite", "fp32")
    return parity.compare(models.family(family), dname, modes, reference(family), fullgraph=fullgraph)


def fast(family: str, dname: str) -> Compared:
    return compared(family, dname, FAST_MODES[dname])


def _check_outputs(c: Compared) -> None:
    """Every mode's outputs are the same bits, of the reference's shape and of the dtype CPU
    eager gives in the run's dtype (the run's, or fp32 where the model casts its logits, as
    Mamba2 does, or generate() does), finite, and within the dtype's tolerance of the fp32
    reference, step by step."""
    dtype = c.cpu.prefill.dtype
    assert dtype in (DTYPES[c.dtype], torch.float32), dtype
    for mode, run in c.card.items():
        assert run.prefill.shape == c.ref.prefill.shape and run.prefill.dtype == dtype, mode
        assert torch.isfinite(run.outputs()).all(), f"{c.family} {c.dtype} {mode}: not finite"
    assert c.modes_agree(), f"{c.family} {c.dtype}: the dispatch modes' outputs differ"
    run, tol = next(iter(c.card.values())), c.tolerance()
    diff = (run.prefill.float() - c.ref.prefill).abs().max().item()
    assert diff <= tol, f"{c.family} {c.dtype}: prefill outputs differ from fp32 by {diff:.3g} (tolerance {tol:.3g})"
    for s, (r, o) in enumerate(zip(c.ref.decode, run.decode, strict=True)):
        diff = (o.float() - r).abs().max().item()
        assert diff <= tol, f"{c.family} {c.dtype}: decode step {s} differs by {diff:.3g} (tolerance {tol:.3g})"


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_outputs_match_cpu_eager_in_every_dispatch_mode(family):
    c = fast(family, "fp32")
    assert set(c.card) == set(MODES)
    _check_outputs(c)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp16_outputs_are_within_the_stated_tolerance_of_fp32(family):
    """The tolerance (:func:`parity.fp16_tolerance`) is stated against CPU eager's own fp16
    error: the card may be at most twice as far from fp32 as CPU eager in fp16 is."""
    _check_outputs(fast(family, "fp16"))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fp16_outputs_are_the_same_bits_in_every_dispatch_mode(family):
    c = compared(family, "fp16", MODES)
    assert set(c.card) == set(MODES)
    _check_outputs(c)


@pytest.mark.parametrize("family", GENERATING)
def test_greedy_decode_picks_cpu_eagers_tokens(family):
    """fp32: the card picks the reference's greedy token at every step (fed the same
    tokens, so this is free-running greedy decoding). fp16's choices may differ from fp32's
    where the top two logits are within fp16 rounding; its logits are compared instead."""
    c = fast(family, "fp32")
    run = c.card[MODES[0]]
    assert len(run.tokens) == len(c.ref.tokens) == DECODE_STEPS + 1
    assert run.tokens == c.ref.tokens, (
        f"{family}: greedy tokens differ\n cpu:   {c.ref.tokens}\n spyre: {run.tokens}\n"
        f" smallest top-1/top-2 margin of the CPU decode steps: {_margin(torch.stack(c.ref.decode)):.3g}")


def _margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


@pytest.mark.parametrize("family", _families(models.DECODER, but=("granite",)) + _families(models.SEQ2SEQ, but=("bart",)))
def test_greedy_decode_visits_many_tokens(family):
    """Guards the strength of the decode tests: a model that repeats one token would let a
    cache written at the wrong position go unnoticed in the tokens. (The tiny Granite, with
    tied embeddings, repeats its first token, and the tiny BART cycles over four, whatever
    its init; their logits are compared step by step, as every family's are, and BART's
    depend on its cache: below.)"""
    tokens = reference(family).tokens
    assert len(set(tokens)) >= DECODE_STEPS // 2, tokens


@pytest.mark.parametrize("family", SEQ2SEQ)
def test_an_encoder_decoders_steps_depend_on_the_decoders_cache(family):
    """Guards the strength of the encoder-decoder tests: each step's logits, had the decoder
    seen only its one new token (no cache), would differ from the reference's, so a card
    that lost or misplaced the decoder's cache would fail them."""
    fam = models.family(family)
    cfg, model = fam.build()
    ref = reference(family)
    ids = parity.prompt_ids(cfg.vocab_size)
    with torch.no_grad():
        for s, logits in enumerate(ref.decode[:4]):
            alone = model(input_ids=ids, decoder_input_ids=torch.tensor([[ref.tokens[s]]])).logits[0, -1]
            assert (alone - logits).abs().max() > 1e-2, s


@pytest.mark.parametrize("family", ENCODERS)
def test_the_padding_mask_changes_what_an_encoder_computes(family):
    """Guards the strength of the encoder tests: without its padding mask, the padded
    sequence's hidden states (at its real tokens) would differ from the reference's, so a
    card that dropped the mask would fail them."""
    fam = models.family(family)
    cfg, model = fam.build()
    ids, mask = parity.encoder_inputs(cfg.vocab_size)
    real = parity.ENCODER_SEQ - parity.ENCODER_PADDING
    with torch.no_grad():
        unmasked = model(input_ids=ids, attention_mask=torch.ones_like(mask)).last_hidden_state
    masked = reference(family).prefill
    assert (masked[1, :real] - unmasked[1, :real]).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_expected_ops_run_on_the_cpu(family):
    """Everything else runs on the card, inside the compiled steps, in every phase."""
    census = fast(family, "fp32").census
    kind = models.family(family).kind
    assert set(census.kernels) == ({"forward"} if kind == models.ENCODER else {"prefill", "decode"})
    assert all(n > 0 for n in census.kernels.values()), census.kernels
    ran = {op for ops in census.cpu_ops.values() for op in ops}
    assert ran == CPU_OPS.get(family, set()), census.cpu_ops


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cpu_share_of_a_step_is_its_cpu_ops_time(family):
    """The matrix's CPU-share column: zero exactly where no op ran on the CPU, a fraction
    of the step's time otherwise."""
    census = fast(family, "fp32").census
    assert set(census.cpu_share) == set(census.kernels)
    for phase, share in census.cpu_share.items():
        assert 0.0 <= share < 1.0
        assert (share > 0) == bool(census.cpu_ops[phase]), (phase, share, census.cpu_ops[phase])


@pytest.fixture(scope="module")
def granite_counts() -> dict:
    return fast("granite", "fp32").card[MODES[0]].counters


def test_granite_prefill_is_one_graph(granite_counts):
    assert granite_counts["prefill"] == {"unique_graphs": 1, "frames": 1, "graph_breaks": 0}


def test_granite_decode_is_one_graph_compiled_once(granite_counts):
    # the first decode step compiles the second (and last) graph; 15 more steps reuse it
    assert granite_counts["first_decode"] == {"unique_graphs": 2, "frames": 2, "graph_breaks": 0}
    assert granite_counts["decode"] == granite_counts["first_decode"]


# ---- the CPU fallback inside a compiled step ----------------------------------------------

class CumprodModel(torch.nn.Module):
    """Device work before and after an op Inductor turns into a fallback kernel on spyre."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 32)

    def forward(self, x):
        y = torch.nn.functional.silu(self.lin(x))
        z = torch.cumprod(y, dim=-1)  # no spyre kernel: the CPU runs it
        return z * 0.5 + y


class KthvalueModel(torch.nn.Module):
    """A fallback op with two outputs (values and int64 indices)."""

    def forward(self, x):
        v, i = torch.kthvalue(x * 3, 4, dim=-1)  # no spyre kernel: the CPU runs it
        return v + 1, i


def _source_line(cls, marker: str) -> int:
    lines, first = inspect.getsourcelines(cls.forward)
    return first + next(i for i, ln in enumerate(lines) if marker in ln)


def _fallback_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, spyre_rt.SpyreFallbackWarning)]


@pytest.mark.parametrize("cls, op, marker", [
    (CumprodModel, "cumprod", "torch.cumprod("),
    (KthvalueModel, "kthvalue", "torch.kthvalue("),
], ids=["cumprod", "kthvalue"])
def test_unsupported_op_falls_back_to_cpu_and_warns_once(cls, op, marker):
    torch._dynamo.reset()  # compile afresh, whatever ran before
    torch.manual_seed(0)
    model, x = cls().eval(), torch.randn(4, 16)
    compiled = torch.compile(copy.deepcopy(model).to("spyre"), backend="spyre_rt", dynamic=False)
    with torch.no_grad(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # count what the library emits, not what Python dedups
        ref = model(x)
        outs = [compiled(x.to("spyre")) for _ in range(2)]
    for out in outs:
        out, expected = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
        for o, e in zip(out, expected, strict=True):
            assert o.device.type == "spyre" and o.dtype == e.dtype and o.shape == e.shape
            torch.testing.assert_close(o.cpu(), e, rtol=1e-5, atol=1e-5)
    messages = _fallback_warnings(record)
    assert len(messages) == 1, messages
    assert f"aten.{op}" in messages[0]
    assert f'line {_source_line(cls, marker)}, in forward' in messages[0], messages[0]


def test_unsupported_op_with_fallback_off_is_a_compile_error_naming_op_and_line():
    torch._dynamo.reset()
    model = CumprodModel().eval().to("spyre")
    compiled = torch.compile(model, backend="spyre_rt", dynamic=False, options={"cpu_fallback": False})
    with torch.no_grad(), pytest.raises(spyre_rt.SpyreCompileError) as info:
        compiled(torch.randn(4, 16).to("spyre"))
    message = str(info.value)
    assert "cumprod" in message
    assert __file__ in message and f"line {_source_line(CumprodModel, 'torch.cumprod(')}" in message, message


# ---- where results go ---------------------------------------------------------------------

def _small_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8)).eval()


def test_cpu_inputs_to_a_spyre_model_are_an_error_naming_both_devices():
    """As with a CUDA model given CPU inputs: the inputs are not moved behind the user's
    back; tracing stops with PyTorch's device-mismatch error, which names both devices
    (eager mode says the same)."""
    torch._dynamo.reset()
    model = _small_mlp()
    x = torch.randn(4, 16)
    on_card = copy.deepcopy(model).to("spyre")
    compiled = torch.compile(on_card, backend="spyre_rt", dynamic=False)
    with torch.no_grad():
        with pytest.raises(RuntimeError) as info:
            compiled(x)
        message = str(info.value)
        assert "same device" in message and "cpu" in message and "spyre:0" in message, message
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", spyre_rt.SpyreFallbackWarning)
            with pytest.raises(RuntimeError, match="same device.*(cpu and spyre:0|spyre:0 and cpu)"):
                on_card(x)
        out = compiled(x.to("spyre"))  # with its inputs on the card, the model runs
    assert out.device.type == "spyre"
    torch.testing.assert_close(out.cpu(), model(x), rtol=1e-4, atol=1e-5)


def test_a_cpu_model_compiled_with_spyre_rt_on_cpu_inputs_gives_cpu_outputs():
    torch._dynamo.reset()
    model = _small_mlp()
    x = torch.randn(4, 16)
    compiled = torch.compile(copy.deepcopy(model), backend="spyre_rt", dynamic=False)
    with torch.no_grad():
        out = compiled(x)
        ref = model(x)
    assert out.device == torch.device("cpu")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---- bad input ----------------------------------------------------------------------------

def test_fp16_overflow_in_a_mamba_intermediate_gives_cpu_eagers_nans():
    """A Mamba2 model in fp16 whose input projection overflows fp16 in a few channels of the
    conv input: the overflow spreads through the scan and the norms as CPU eager fp16's does,
    the same NaN and inf at the same places, prefill and decode, in every dispatch mode."""
    fam = models.family("mamba2")
    cfg, model = fam.build(torch.float16)
    with torch.no_grad():
        model.backbone.layers[0].mixer.in_proj.weight[512:520] *= 1e5  # outputs past 65504
    want = parity.Decoder(model, cfg, torch.float16, "cpu", compiled=False, cache="model").run(steps=2)
    assert not torch.isfinite(want.outputs()).any(), "the overflow must reach the logits"
    torch._dynamo.reset()
    card = parity.Decoder(copy.deepcopy(model).to("spyre"), cfg, torch.float16, "spyre", compiled=True,
                          cache="model")
    for mode in MODES:
        with parity.dispatch_mode(mode):
            got = card.run(steps=2, feed=want.tokens[:-1])
        for w, g in zip([want.prefill, *want.decode], [got.prefill, *got.decode], strict=True):
            assert g.dtype == w.dtype, mode  # Mamba2 casts its logits to fp32
            assert torch.equal(w.isnan(), g.isnan()) and torch.equal(w.isposinf(), g.isposinf()), mode
            assert torch.equal(w.isneginf(), g.isneginf()), mode
