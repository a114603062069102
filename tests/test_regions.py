"""Regional compilation: a decoder's layers compiled once per distinct layer, results unchanged.

Decoders of the compatibility matrix (:mod:`spyre_rt.profiler.models`) with their layers
marked (:func:`spyre_rt.regional.compile_layers_once`), compiled with empty
Inductor caches, run as ``spyre-profile models`` runs them (a prefill and greedy decode
steps on a static cache), against the same model compiled whole and against CPU eager.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch._dynamo.utils import compilation_time_metrics, counters
from torch._inductor.utils import fresh_cache

from spyre_rt import executor
from spyre_rt.profiler import models, parity
from spyre_rt.profiler.parity import Run
from spyre_rt.regional import compile_layers_once, decoder_layers

STEPS = 3


def _family(name: str, layers: int | None = None) -> models.Family:
    fam = models.FAMILIES[name]
    if layers is None:
        return fam
    return dataclasses.replace(fam, config={**fam.config, "num_hidden_layers": layers})


def _run(fam: models.Family, model, cfg, device: str, compiled: bool, feed=None) -> Run:
    torch._dynamo.reset()
    counters["spyre_rt"].clear()
    return parity.runner(fam, model, cfg, torch.float32, device, compiled).run(STEPS, feed=feed)


def _compiled(fam, base, cfg, regional: bool, feed) -> tuple[Run, dict]:
    """The run of `base` compiled for the card (its layers marked, or not), and what the
    compile counted: regions Inductor compiled and called, region traces Dynamo made and
    stamped out, and kernels the plan builds constructed and took from a kernel of their form."""
    model = copy.deepcopy(base)
    compile_layers_once(model, enabled=regional)
    built, reused = executor.stats["kernels_built"], executor.stats["kernels_reused"]
    with fresh_cache():
        compilation_time_metrics.clear()
        run = _run(fam, model.to("spyre"), cfg, "spyre", True, feed)
    count = dict(counters["spyre_rt"])
    count["dynamo_traces"] = len(compilation_time_metrics.get("invoke_subgraph_trace", ()))
    count["dynamo_stamps"] = len(compilation_time_metrics.get("invoke_subgraph_reuse_stamp_out", ()))
    count["kernels_built"] = executor.stats["kernels_built"] - built
    count["kernels_reused"] = executor.stats["kernels_reused"] - reused
    return run, count


def test_four_layers_compile_one_region_and_match_the_whole_compile(quiet_functional_compile):
    fam = _family("granite", layers=4)
    cfg, base = fam.build()
    ref = _run(fam, base, cfg, "cpu", False)
    regional, count = _compiled(fam, base, cfg, True, ref.tokens[:-1])
    whole, whole_count = _compiled(fam, base, cfg, False, ref.tokens[:-1])
    # per graph (the prefill's and the decode step's): Dynamo traces one layer and stamps
    # that trace out for the other three; Inductor compiles one region, called four times
    assert {k: count[k] for k in ("regions_compiled", "region_calls", "dynamo_traces", "dynamo_stamps")} == \
        {"regions_compiled": 2, "region_calls": 8, "dynamo_traces": 2, "dynamo_stamps": 6}, count
    assert "regions_compiled" not in whole_count and whole_count["dynamo_traces"] == 0, whole_count
    # the plan builds construct each distinct kernel once: the layers after the first take
    # their programs, whether the layers were compiled once or whole
    for c in (count, whole_count):
        assert c["kernels_reused"] > c["kernels_built"], c
    torch.testing.assert_close(regional.outputs(), whole.outputs(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(regional.outputs(), ref.outputs(), rtol=1e-4, atol=1e-4)
    assert regional.tokens == ref.tokens


def test_a_region_the_card_cannot_call_compiles_inlined_and_right(quiet_functional_compile):
    """Gemma 2: AOT gives a region a copy of a cache tensor it writes, a copy the card's
    region call cannot order before the copy back. The graph compiles again with its
    regions inlined: Dynamo still traces one layer, and the logits are CPU eager's."""
    fam = _family("gemma2", layers=2)
    cfg, base = fam.build()
    ref = _run(fam, base, cfg, "cpu", False)
    regional, count = _compiled(fam, base, cfg, True, ref.tokens[:-1])
    assert "regions_compiled" not in count and count["dynamo_traces"] == 2 and count["dynamo_stamps"] == 2, count
    assert count["graphs_inlined"] >= 1, count
    torch.testing.assert_close(regional.outputs(), ref.outputs(), rtol=1e-4, atol=1e-4)
    assert regional.tokens == ref.tokens


def test_marking_is_undone_and_leaves_the_transformers_class_alone():
    fam = _family("granite", layers=2)
    _, model = fam.build()
    cls = type(model.model.layers[0])
    assert compile_layers_once(model) == 2
    assert all(type(layer) is not cls and isinstance(layer, cls) for layer in model.model.layers)
    assert type(model.model.layers[0]) is type(model.model.layers[1])  # one region for both
    assert compile_layers_once(model) == 0  # already marked
    assert compile_layers_once(model, enabled=False) == 2
    assert all(type(layer) is cls for layer in model.model.layers)
    assert cls.forward is type(fam.build()[1].model.layers[0]).forward
    assert len(decoder_layers(model)) == 2


@pytest.mark.slow
def test_a_hybrid_of_mamba_and_attention_layers_gets_a_region_each(quiet_functional_compile):
    """Granite 4's hybrid: a Mamba layer and an attention layer, one class, two graphs. An
    attention layer's region is traced once and stamped out for the other; a Mamba layer's
    cache keeps state outside its tensors, so Dynamo traces each (Inductor still compiles
    one region for both)."""
    fam = _family("granite_moe_hybrid", layers=4)
    fam = dataclasses.replace(fam, config={**fam.config, "layer_types": ["linear_attention", "full_attention"] * 2})
    cfg, base = fam.build()
    ref = _run(fam, base, cfg, "cpu", False)
    regional, count = _compiled(fam, base, cfg, True, ref.tokens[:-1])
    assert {k: count[k] for k in ("regions_compiled", "region_calls", "dynamo_traces", "dynamo_stamps")} == \
        {"regions_compiled": 4, "region_calls": 8, "dynamo_traces": 6, "dynamo_stamps": 2}, count
    torch.testing.assert_close(regional.outputs(), ref.outputs(), rtol=1e-4, atol=1e-4)


def test_a_node_refused_outside_a_region_leaves_the_regions_node_of_that_name_on_the_card():
    """A region's graph names its nodes as the outer graph does. The outer ``div``, fused
    with an argmax whose row does not fit the scratchpad (1,100,000 fp16 columns, 2.2 MB),
    is refused and runs on the CPU; the region's own ``div``
    stays on the card (it once went to the CPU too: at batch 8, Granite 3.3 8B's SiLU,
    420 MB a call, ran on the host)."""
    import warnings

    from spyre_rt.errors import forget_warnings

    @torch.compiler.nested_compile_region
    def act(h):
        return h / (1 + torch.exp(-h))

    def f(h, x):
        return act(act(h)), (x / 2).argmax(-1)

    g = torch.Generator().manual_seed(0)
    h, x = torch.randn(4, 64, generator=g), torch.randn(2, 1_100_000, generator=g).half()
    torch._dynamo.reset()
    forget_warnings("aten.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, idx = torch.compile(f, backend="spyre_rt", fullgraph=True)(h.to("spyre"), x.to("spyre"))
    on_cpu = [str(w.message) for w in caught if "runs on the CPU inside a compiled step" in str(w.message)]
    assert on_cpu and all("invoke_subgraph" not in m for m in on_cpu), on_cpu
    want_out, want_idx = f(h, x)
    assert torch.allclose(out.cpu(), want_out, atol=1e-6) and torch.equal(idx.cpu(), want_idx)


def _matmul_modules(run_compile) -> set[str]:
    before = set(executor.live_steps())
    run_compile()
    return {k.module for s in set(executor.live_steps()) - before for k in s.desc.kernels.values()
            if type(k).__name__ == "MatmulKernel"}


def test_each_call_of_a_region_names_its_own_layers_modules(quiet_functional_compile):
    """The region's kernels are described at its first call; a profile by layer still sees
    each layer's own kernels. (A region that writes a cache reaches Inductor wrapped by AOT
    with the call's module only, so its kernels name the layer, where the whole compile
    names the projection inside it.)"""
    fam = _family("granite", layers=3)
    cfg, base = fam.build()
    ref = _run(fam, base, cfg, "cpu", False)
    regional = _matmul_modules(lambda: _compiled(fam, base, cfg, True, ref.tokens[:-1]))
    whole = _matmul_modules(lambda: _compiled(fam, base, cfg, False, ref.tokens[:-1]))
    layers = {".".join(m.split(".")[:3]) for m in regional if m.startswith("model.layers.")}
    assert layers == {f"model.layers.{i}" for i in range(3)}
    assert all(any(w == r or w.startswith(r + ".") for w in whole) for r in regional), (regional, whole)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_layers_given_a_cache_that_cannot_be_flattened_are_traced_inline_and_right(family, quiet_functional_compile):
    """Hugging Face's default dynamic cache of a model with a sliding window grows by
    rebinding its tensors and counts its tokens in Python ints: a side effect no region can
    hold (Dynamo failed on it inside one). Such layers are traced inline, and generate()
    picks the CPU's tokens."""
    import transformers as T

    torch.manual_seed(0)
    small = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=500, sliding_window=16)
    cfg = T.MistralConfig(**small) if family == "mistral" else T.Gemma2Config(**small, head_dim=32)
    model = (T.MistralForCausalLM if family == "mistral" else T.Gemma2ForCausalLM)(cfg).eval()
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    on_card = copy.deepcopy(model).to("spyre")
    assert compile_layers_once(on_card) == 2
    torch._dynamo.reset()
    on_card.forward = torch.compile(on_card.forward, backend="spyre_rt")
    with torch.no_grad():
        got = on_card.generate(ids.to("spyre"), attention_mask=torch.ones_like(ids).to("spyre"), **kw)
    assert got.cpu().tolist() == want.tolist()


def test_a_calls_copy_of_a_fused_matmul_names_its_own_product():
    """The epilogue pass takes a fused matmul's product out of the region's buffers; the
    matmul still names it, and each call's copy names its own (two layers' copies shared
    one name)."""
    from spyre_rt.compiler.fusion import fuse_epilogues
    from spyre_rt.compiler.regions import inline
    from test_epilogue_fusion import _add, _matmul, _step

    step = fuse_epilogues(_step([_matmul(), _add("add", "p", "s", "o")], ["mm", "add"]))
    assert "p" not in step.buffers and step.kernels["mm"].out[0] == "p"
    operands = [(f"caller_{b.name}", 0, b.sizes, b.strides) for b, _ in step.inputs]
    one, two = inline(step, "buf3", operands), inline(step, "buf9", operands)
    assert one.kernels["buf3_mm"].out[0] == "buf3_p" and two.kernels["buf9_mm"].out[0] == "buf9_p"


def test_a_layer_given_an_input_that_is_not_plain_data_still_writes_its_cache():
    """A keyword argument a region cannot take flat (an object of the caller's, which a
    decoder hands its layers in ``**kwargs``) sends the layer to a region traced every time:
    with the call's own cache, which it writes as eager does."""
    import transformers as T

    class Note:  # what the layers pass on untouched
        pass

    torch.manual_seed(0)
    cfg = T.GraniteConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=100)
    model = T.GraniteForCausalLM(cfg).eval()
    marked = copy.deepcopy(model)
    assert compile_layers_once(marked) == 2
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(1))

    def run(m, compiled: bool):
        cache = T.StaticCache(config=cfg, max_cache_len=8)
        # initialized, as generate() has it: a region takes such a cache's layer flat
        cache.early_initialization(batch_size=1, num_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
        f = torch.compile(m, backend="aot_eager", fullgraph=True) if compiled else m
        with torch.no_grad():
            logits = f(ids, attention_mask=torch.ones(1, 8, dtype=torch.long), position_ids=torch.arange(6)[None],
                       past_key_values=cache, use_cache=True, note=Note()).logits
        return logits, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]

    torch._dynamo.reset()
    want, want_cache = run(model, False)
    got, got_cache = run(marked, True)
    torch.testing.assert_close(got, want)
    for (k, v), (wk, wv) in zip(got_cache, want_cache, strict=True):
        assert wk.abs().sum() > 0
        torch.testing.assert_close(k, wk)
        torch.testing.assert_close(v, wv)


@pytest.mark.parametrize("batch,heads,head_dim,length,dtype", [(1, 2, 16, 8, torch.float32), (3, 4, 8, 33, torch.float16)])
def test_a_static_cache_layer_reaches_a_region_as_its_tensors_alone(batch, heads, head_dim, length, dtype):
    """A region gets a static cache layer's tensors, not its other fields, and sets those from
    the tensors: what it sets is what transformers' own layer holds."""
    import transformers as T

    from spyre_rt import regional

    cfg = T.GraniteConfig(hidden_size=heads * head_dim * 2, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=heads * 2, num_key_value_heads=heads, vocab_size=100)
    model = T.GraniteForCausalLM(cfg)
    assert compile_layers_once(model) == 2
    cache = T.StaticCache(config=cfg, max_cache_len=length)
    cache.early_initialization(batch_size=batch, num_heads=heads, head_dim=head_dim, dtype=dtype, device="cpu")
    flat = regional._flat_cache(cache, model.model.layers[1])
    tensors = flat[5 + 2 * flat[4]:]  # after the cache's own constants
    entry = cache.layers[1]
    assert tensors[0] == 3 and tensors[1::2] == ["keys", "values", "cumulative_length"]
    assert all(t is getattr(entry, k) for k, t in zip(tensors[1::2], tensors[2::2], strict=True))
    fields = regional._static_fields(entry.keys, entry.values)
    assert set(fields) | {"keys", "values", "cumulative_length"} == set(vars(entry))
    assert all(getattr(entry, k) == v and type(getattr(entry, k)) is type(v) for k, v in fields.items()), fields


def test_a_cache_layer_whose_fields_are_not_known_is_not_handed_to_a_region_by_its_tensors():
    """A static layer class with a field beyond the ones read off its tensors, or whose fields
    differ from them, is not trusted to be rebuilt from its tensors."""
    from transformers.cache_utils import StaticLayer

    from spyre_rt import regional

    class MoreFields(StaticLayer):
        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            self.window = 4

    class OtherLength(StaticLayer):
        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            self.max_cache_len += 1

    assert regional._static_layer_is_as_known(StaticLayer)
    assert not regional._static_layer_is_as_known(MoreFields)
    assert not regional._static_layer_is_as_known(OtherLength)


def _marked_granite(layers: int):
    import transformers as T

    torch.manual_seed(0)
    cfg = T.GraniteConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=100)
    model = T.GraniteForCausalLM(cfg).eval()
    on_card = copy.deepcopy(model).to("spyre")
    assert compile_layers_once(on_card) == layers
    return model, on_card


def _region_counts() -> tuple[int, int]:
    return counters["spyre_rt"]["regions_compiled"], counters["spyre_rt"]["region_calls"]


def test_layers_compiled_once_at_a_second_prompt_length_compile_and_stay_right(quiet_functional_compile):
    """A second prompt length makes Dynamo compile the model again with a symbolic length
    (automatic dynamic shapes): the regions then take that size, or tensors of that many
    tokens. The layer is still compiled once, for every length (the card's kernels are
    described for each length at its first call, as any step of dynamic sizes is), and
    every length gives CPU eager's logits."""
    model, on_card = _marked_granite(3)
    torch._dynamo.reset()
    counters["spyre_rt"].clear()
    fast = torch.compile(on_card.forward, backend="spyre_rt")
    seen = []
    for n in (7, 33, 20):
        ids = torch.randint(0, 100, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            want = model(ids).logits
            got = fast(ids.to("spyre")).logits.cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        seen.append(_region_counts())
    # 7 tokens: one region, called by the three layers; 33: the graph of symbolic length,
    # one region again; 20: that graph, no compile
    assert seen == [(1, 3), (2, 6), (2, 6)], seen
    assert "graphs_inlined" not in counters["spyre_rt"]


def test_a_region_given_its_own_symbols_for_the_callers_length_is_written_in_the_callers():
    """With a static cache, Dynamo hands the region of symbolic length each size it takes as
    a symbol of the region's own (the length as an int argument, twice, besides the
    tensors' sizes): each call's copy is written in the caller's symbol; one size bound to
    two different sizes in a call is refused, and the graph compiles with its regions
    inlined."""
    from spyre_rt.compiler.describe import Sym
    from spyre_rt.compiler.errors import CompileFailed
    from spyre_rt.compiler.regions import inline

    from spyre_rt.ir import Buffer, StepDesc

    x = Buffer("x", "float32", (Sym("s9"), 4), (4, 1))
    step = StepDesc(inputs=((x, False),), outputs=(("y", 0, (Sym("s9"), 4), (4, 1)),),
                    buffers={"y": Buffer("y", "float32", (Sym("s9"), 4), (4, 1))}, aliases={}, constants={},
                    kernels={}, sequence=(), symbols=(("s7", "int", 0, 0), ("s9", "size", 1, 0)))
    caller_x = ("buf1", 0, (Sym("s0"), 4), (4, 1))
    call = inline(step, "c", [("int", Sym("s0 + 1")), caller_x])
    assert call.buffers["c_y"].sizes == (Sym("s0"), 4) and call.outputs == [("c_y", 0, (Sym("s0"), 4), (4, 1))]
    assert call.aliases["c_x"] == caller_x
    same = inline(step, "d", [("int", Sym("s7")), ("buf1", 0, (Sym("s9"), 4), (4, 1))])
    assert same.buffers["d_y"].sizes == (Sym("s9"), 4)  # the caller's own symbols: nothing to write
    twice = dataclasses.replace(step, symbols=(("s9", "int", 0, 0), ("s9", "size", 1, 0)))
    with pytest.raises(CompileFailed) as refused:
        inline(twice, "c", [("int", Sym("s1")), caller_x])
    assert refused.value.inline_regions


def test_generate_on_a_static_cache_at_a_second_prompt_length_keeps_its_layers_compiled_once(quiet_functional_compile):
    """generate() on a static cache at prompts of 7, 33 and 20 tokens, the layers marked:
    the decode step of symbolic cache length calls one region (its own symbols written in
    the caller's) and the tokens are the CPU's. The prefill's layers are traced inline:
    generate()'s static cache initializes its layers in that first call."""
    model, on_card = _marked_granite(2)
    torch._dynamo.reset()
    counters["spyre_rt"].clear()
    on_card.forward = torch.compile(on_card.forward, backend="spyre_rt")
    kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, cache_implementation="static")
    for n in (7, 33, 20):
        ids = torch.randint(0, 100, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            got = on_card.generate(ids.to("spyre"), attention_mask=torch.ones_like(ids).to("spyre"), **kw)
        assert got.cpu().tolist() == want.tolist(), n
    # the decode step at 7 tokens, and at 33 the decode step of symbolic length (20: no compile)
    assert _region_counts() == (2, 4) and "graphs_inlined" not in counters["spyre_rt"], dict(counters["spyre_rt"])


def test_a_layer_that_hands_back_its_input_compiles_once_and_right(quiet_functional_compile):
    """T5's blocks after the first hand back the position bias they were given, and a
    region's outputs may not alias its inputs (Dynamo refused the whole compile): the
    region returns a copy of it. The encoder-decoder's logits are CPU eager's. (A T5 block
    also returns None where it has no cross-attention bias, so Dynamo reuses no block's
    trace and inlines each region it called once: the layers are compiled whole.)"""
    fam = _family("t5")
    cfg, model = fam.build()
    on_card = copy.deepcopy(model)
    assert compile_layers_once(on_card) == 2 * cfg.num_layers
    torch._dynamo.reset()
    counters["spyre_rt"].clear()
    fast = torch.compile(on_card.to("spyre"), backend="spyre_rt")
    ids = torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(0))
    dec = torch.full((1, 1), cfg.decoder_start_token_id)
    with torch.no_grad(), fresh_cache():
        want = model(ids, decoder_input_ids=dec).logits
        got = fast(ids.to("spyre"), decoder_input_ids=dec.to("spyre")).logits.cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_regions_result_that_is_its_input_or_repeats_is_copied():
    from spyre_rt.regional import _unaliased

    x, y, z = torch.ones(2), torch.zeros(2), torch.full((2,), 3.0)
    out = _unaliased((z, x, z), [x, y])
    assert out[0] is z and out[1] is not x and out[2] is not z
    assert torch.equal(out[1], x) and torch.equal(out[2], z)
    assert _unaliased(x, [x]) is not x and _unaliased(z, [x]) is z
    assert isinstance(_unaliased([x], [x]), list)
    kept = (z, y)
    assert _unaliased(kept, [x]) is kept  # nothing aliased: the result as it was


def test_a_step_called_with_a_size_no_kernel_reads_takes_it_out(quiet_functional_compile):
    """Mamba2's layers compiled once, generate() on a static cache at a second prompt length
    and then a batch of two: Dynamo hands the step a size among its tensors (the batch, made
    a symbol) that no kernel of the step reads, the regions' kernels being of fixed sizes.
    The step takes it out of its call (it was handed on as a tensor and the call failed) and
    the tokens are the CPU's."""
    fam = _family("mamba2", layers=1)
    cfg, model = fam.build()
    on_card = copy.deepcopy(model)
    assert compile_layers_once(on_card) == 1
    on_card = on_card.to("spyre")
    on_card.forward = torch.compile(on_card.forward, backend="spyre_rt")
    kw = dict(max_new_tokens=2, min_new_tokens=2, do_sample=False, cache_implementation="static")
    for batch, n in ((1, 7), (1, 9), (2, 7)):
        ids = torch.randint(3, 100, (batch, n), generator=torch.Generator().manual_seed(batch))
        mask = torch.ones_like(ids)
        with torch.no_grad():
            want = model.generate(ids, attention_mask=mask, **kw)
            got = on_card.generate(ids.to("spyre"), attention_mask=mask.to("spyre"), **kw)
        assert got.cpu().tolist() == want.tolist(), (batch, n)
