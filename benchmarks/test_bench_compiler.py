"""The compiler: cold and warm compile of the tiny Granite, beside Inductor's own CPU compile.

A compile here is the first call of a freshly compiled forward (Dynamo, AOT, Inductor,
our kernels and plans, and one run), for prefill and one decode step. Cold: every cache
empty (Inductor's on-disk and in-memory caches, and the plan cache). Warm: Dynamo reset,
caches kept (what a second process sees).
"""

import os
import tempfile
import time

import pytest
import torch
from targets import check_target
from torch._inductor.utils import fresh_cache

from spyre_rt import card as cards
from spyre_rt import config


def _granite_cpu():
    from transformers import GraniteForCausalLM

    from spyre_rt.profiler.run import load_model

    torch.manual_seed(0)
    return GraniteForCausalLM(load_model("granite-tiny").hf_config()).eval()


class _Compiles:
    """Prefill and one decode step of the tiny Granite, compiled on first call."""

    def __init__(self, model, device: str, backend: str):
        from transformers import StaticCache

        self.model, self.backend, self.device = model, backend, device
        cfg = model.config
        self.cache = StaticCache(config=cfg, max_cache_len=16)
        self.cache.early_initialization(batch_size=1, num_heads=cfg.num_key_value_heads,
                                        head_dim=cfg.hidden_size // cfg.num_attention_heads,
                                        dtype=torch.float32, device=device)
        self.mask = torch.ones(1, 16, dtype=torch.long).to(device)  # every cache position unmasked
        self.prefill_in = (torch.zeros(1, 8, dtype=torch.long).to(device), torch.arange(8)[None].to(device))
        self.decode_in = (torch.zeros(1, 1, dtype=torch.long).to(device), torch.tensor([[8]]).to(device))

    def __call__(self) -> float:
        """Compile and run both graphs; the seconds it took."""
        torch._dynamo.reset()
        model, cache = self.model, self.cache
        cache.reset()  # the cache advances its own write position: start every round at 0

        mask = self.mask

        def forward(ids, pos):
            return model(ids, attention_mask=mask, past_key_values=cache, position_ids=pos, use_cache=True).logits

        f = torch.compile(forward, backend=self.backend, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            f(*self.prefill_in)
            f(*self.decode_in)
        return time.perf_counter() - t0


class _FreshPlanCache:
    def __enter__(self):
        self.saved = os.environ.get("SPYRE_RT_CACHE_DIR")
        self.dir = tempfile.TemporaryDirectory(prefix="spyre-rt-cold-")
        os.environ["SPYRE_RT_CACHE_DIR"] = self.dir.name
        config.reload()

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop("SPYRE_RT_CACHE_DIR", None)
        else:
            os.environ["SPYRE_RT_CACHE_DIR"] = self.saved
        config.reload()
        self.dir.cleanup()


@pytest.fixture(scope="module")
def spyre_granite():
    with cards.configured(None, "timing"):
        yield _Compiles(_granite_cpu().to("spyre"), "spyre", "spyre_rt")


def _rounds(benchmark, n: int) -> int:
    return 1 if benchmark.disabled else n


@pytest.mark.benchmark(group="compiler")
def test_cold_compile_tiny_granite_vs_inductor_cpu(benchmark, spyre_granite):
    """Cold compile through spyre_rt and through Inductor's CPU backend, interleaved."""
    cpu = _Compiles(_granite_cpu(), "cpu", "inductor")
    ours: list[float] = []
    theirs: list[float] = []

    def cold_ours():
        with fresh_cache(), _FreshPlanCache():
            ours.append(spyre_granite())

    def cold_inductor():
        with fresh_cache():
            theirs.append(cpu())

    rounds = _rounds(benchmark, 3)
    benchmark.pedantic(cold_ours, setup=cold_inductor, rounds=rounds, iterations=1)
    benchmark.extra_info.update({
        "spyre_rt_cold_s": min(ours), "inductor_cpu_cold_s": min(theirs),
        "spyre_rt_over_inductor_cpu": min(ours) / min(theirs),
    })
    check_target(benchmark, min(ours) < min(theirs),
                 f"cold compile {min(ours):.1f} s, not faster than Inductor's CPU backend's {min(theirs):.1f} s")


@pytest.mark.benchmark(group="compiler")
def test_warm_compile_tiny_granite(benchmark, spyre_granite):
    """Dynamo reset, Inductor's and the plan cache kept: what a second process pays."""
    spyre_granite()  # fills the caches
    times: list[float] = []
    benchmark.pedantic(lambda: times.append(spyre_granite()), rounds=_rounds(benchmark, 3), iterations=1)
    with fresh_cache(), _FreshPlanCache():
        cold = spyre_granite()
    benchmark.extra_info.update({"warm_s": min(times), "cold_s": cold, "warm_over_cold": min(times) / cold})
    check_target(benchmark, min(times) < cold, f"a warm compile ({min(times):.1f} s) must be faster than a cold one")


@pytest.mark.benchmark(group="compiler")
def test_a_new_prompt_length_costs_a_plan_build_not_a_compile(benchmark):
    """The tiny Granite called with twenty prompt lengths (fresh caches): Dynamo compiles
    twice (static, then with symbolic sizes at the second length); every later length
    makes a concrete step and builds its plans. Target: the first call at a new length
    costs at most 0.2x the cold compile of the same model, measured side by side here."""
    from torch._dynamo.utils import counters

    with cards.configured(None, "timing"), fresh_cache(), _FreshPlanCache():
        model = _granite_cpu().to("spyre")
        torch._dynamo.reset()
        counters.clear()
        f = torch.compile(model, backend="spyre_rt")
        lengths = [13, 29] + list(range(30, 48))
        times = []
        with torch.no_grad():
            for n in lengths:
                ids = torch.zeros(1, n, dtype=torch.long).to("spyre")
                t0 = time.perf_counter()
                f(ids)
                times.append(time.perf_counter() - t0)
        compiles = counters["frames"]["ok"]
        new_length = times[2:]
        # the timed round: one more new length (each round a length never seen before)
        extra = iter(range(48, 1000))

        def another_length():
            with torch.no_grad():
                f(torch.zeros(1, next(extra), dtype=torch.long).to("spyre"))

        benchmark.pedantic(another_length, rounds=_rounds(benchmark, 5), iterations=1)
    assert compiles == 2, f"{compiles} Dynamo compiles for twenty lengths"
    benchmark.extra_info.update({
        "dynamo_compiles": compiles, "cold_compile_s": round(times[0], 2),
        "dynamic_compile_s": round(times[1], 2),
        "new_length_median_s": round(sorted(new_length)[len(new_length) // 2], 3),
        "new_length_max_s": round(max(new_length), 3),
        "new_length_over_cold_compile": round(max(new_length) / times[0], 3),
    })
    ratio = max(new_length) / times[0]
    check_target(benchmark, ratio <= 0.2, f"a new prompt length costs {ratio:.2f}x the cold compile, over 0.2x")
