"""Regional compilation: a decoder's layers compiled once per distinct layer, results unchanged.

Decoders of the compatibility matrix (:mod:`spyre_rt.profiler.models`) with their layers
marked (:func:`spyre_rt.compiler.regional.compile_layers_once`), compiled with empty
Inductor caches, run as ``spyre-profile models`` runs them (a prefill and greedy decode
steps on a static cache), against the same model compiled whole and against CPU eager.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from spyre_rt.compiler.regional import compile_layers_once, decoder_layers
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

from spyre_rt import SpyreCompileError
from spyre_rt.profiler import models, parity
from spyre_rt.profiler.parity import Run

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
    model = copy.deepcopy(base)
    compile_layers_once(model, enabled=regional)
    with fresh_cache():
        run = _run(fam, model.to("spyre"), cfg, "spyre", True, feed)
    return run, dict(counters["spyre_rt"])


def test_four_layers_compile_one_region_and_match_the_whole_compile(quiet_functional_compile):
    fam = _family("granite", layers=4)
    cfg, base = fam.build()
    ref = _run(fam, base, cfg, "cpu", False)
    regional, count = _compiled(fam, base, cfg, True, ref.tokens[:-1])
    whole, whole_count = _compiled(fam, base, cfg, False, ref.tokens[:-1])
    # one region per graph (the prefill's and the decode step's), called for every layer
    assert count == {"regions_compiled": 2, "region_calls": 8}, count
    assert whole_count == {}, whole_count
    torch.testing.assert_close(regional.outputs(), whole.outputs(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(regional.outputs(), ref.outputs(), rtol=1e-4, atol=1e-4)
    assert regional.tokens == ref.tokens


def test_a_region_that_writes_a_copy_is_refused_not_wrong(quiet_functional_compile):
    """Gemma 2's decode step: AOT gives the first layer's region a copy of a tensor the
    region writes, and the copy back is not ordered after the call. The compile says so
    (naming the way out) instead of computing wrong logits."""
    fam = _family("gemma2", layers=2)
    cfg, base = fam.build()
    model = copy.deepcopy(base)
    compile_layers_once(model)
    runner = parity.runner(fam, model.to("spyre"), cfg, torch.float32, "spyre", True)
    with fresh_cache(), pytest.raises(SpyreCompileError, match="writes a copy"):
        runner.run(1)


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
    """Granite 4's hybrid: a Mamba layer and an attention layer, one class, two graphs."""
    fam = _family("granite_moe_hybrid", layers=4)
    fam = dataclasses.replace(fam, config={**fam.config, "layer_types": ["linear_attention", "full_attention"] * 2})
    cfg, base = fam.build()
    ref = _run(fam, base, cfg, "cpu", False)
    regional, count = _compiled(fam, base, cfg, True, ref.tokens[:-1])
    assert count == {"regions_compiled": 4, "region_calls": 8}, count
    torch.testing.assert_close(regional.outputs(), ref.outputs(), rtol=1e-4, atol=1e-4)
