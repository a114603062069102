"""One compile as a user meets it, in a process of its own: prints its figures as JSON.

Run by ``test_bench_compiler.py`` in a fresh process each time, with Inductor's and the plan
cache in directories the caller chose: empty for a cold compile, kept from an earlier run
for a warm start. A compile is the first call of a freshly compiled prefill and of one
decode step (Dynamo, AOT, Inductor, our descriptions and plans, and one run of each).

    python benchmarks/compile_probe.py granite-tiny --seq 8 [--layers N] [--backend inductor] [--regional]
        [--decode-plan-builds N]
    python benchmarks/compile_probe.py granite-tiny --prompt-lengths 13,29,30,31 [--regional]

The split comes from torch's own compile-time spans (``torch._dynamo.utils``) and ours
(``spyre.describe``, ``spyre.plan_build``), timed on the CPU clock of the compiling thread
so that other work on the machine does not move them; ``first_call_s`` is what the two
calls cost beyond Dynamo's compiles (the runs, and plans loaded or built at a first call).
``total_s`` is the two calls on that clock, ``total_wall_s`` the same on the wall clock, and
``setup_s`` what came before them (imports, the model built on the card). With
``--decode-plan-builds N`` the decode step's plans are then built N more times from its
kernels' descriptions, the plan cache left out (``decode_plan_build_s``: each build).

``--prompt-lengths`` instead calls the model compiled as a user compiles it
(``torch.compile(model, backend="spyre_rt")``: Dynamo's automatic dynamic shapes) with a
prompt of each length in turn, and prints each first call's time on the same clock
(``first_call_s``), Dynamo's compiles so far and, with ``--regional``, the regions
compiled and the graphs that compiled their regions inlined.
"""

from __future__ import annotations

import time

_START = time.thread_time()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402
import torch._dynamo.utils  # noqa: E402

# torch's compile spans read time.time_ns(): here they read the thread's CPU clock
torch._dynamo.utils.time = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
torch._dynamo.utils.time.time_ns = time.thread_time_ns

# Span names whose time is summed into each phase (every call of the span in the process).
PHASES = {
    "dynamo_s": ("_compile.compile_inner",),  # the whole compile of a frame, backend included
    "aot_s": ("create_aot_dispatcher_function",),
    "inductor_s": ("compile_fx_inner",),
    "describe_s": ("spyre.describe",),
    "plan_build_s": ("spyre.plan_build",),
}


def _model(name: str, layers: int | None, device: str):
    from transformers import GraniteForCausalLM

    from spyre_rt.profiler.run import load_model

    profile = load_model(name)
    cfg = profile.hf_config(layers)
    torch.manual_seed(0)
    if device == "spyre":  # timing mode: the card keeps no data, the weights need none
        with torch.device("meta"):
            model = GraniteForCausalLM(cfg).to(profile.dtype).eval()
        return model.to_empty(device="spyre"), profile.dtype
    return GraniteForCausalLM(cfg).to(profile.dtype).eval(), profile.dtype


def compile_once(name: str, seq: int, layers: int | None, backend: str, regional: bool = False,
                 plan_builds: int = 0) -> dict:
    from transformers import StaticCache

    from spyre_rt import card as cards

    device = "spyre" if backend == "spyre_rt" else "cpu"
    with cards.configured(None, "timing") if device == "spyre" else _nothing():
        model, dtype = _model(name, layers, device)
        if regional:
            try:
                from spyre_rt.regional import compile_layers_once
            except ImportError:  # a revision from before it moved (base_package.py runs older ones)
                from spyre_rt.compiler.regional import compile_layers_once

            compile_layers_once(model)
        cfg = model.config
        length = seq + 2
        cache = StaticCache(config=cfg, max_cache_len=length)
        cache.early_initialization(batch_size=1, num_heads=cfg.num_key_value_heads,
                                   head_dim=cfg.hidden_size // cfg.num_attention_heads, dtype=dtype, device=device)
        mask = torch.ones(1, length, dtype=torch.long).to(device)  # every position unmasked

        def forward(ids, pos):
            return model(ids, attention_mask=mask, past_key_values=cache, position_ids=pos, use_cache=True,
                         logits_to_keep=1).logits

        f = torch.compile(forward, backend=backend, fullgraph=True, dynamic=False)
        prefill = (torch.zeros(1, seq, dtype=torch.long).to(device), torch.arange(seq)[None].to(device))
        decode = (torch.zeros(1, 1, dtype=torch.long).to(device), torch.tensor([[seq]]).to(device))
        setup = time.thread_time() - _START
        t0, c0 = time.perf_counter(), time.thread_time()
        with torch.no_grad():
            f(*prefill)
            f(*decode)
        wall, total = time.perf_counter() - t0, time.thread_time() - c0
        out = {"total_s": total, "total_wall_s": wall, "setup_s": setup, **split(total)}
        if plan_builds:
            out["decode_plan_build_s"] = decode_plan_builds(plan_builds)
    return out


def decode_plan_builds(n: int) -> list[float]:
    """The decode step's plans built `n` times afresh, with no plan cache: thread CPU of each."""
    import dataclasses

    from spyre_rt import dispatch
    from spyre_rt.executor import CompiledStep, live_steps
    from spyre_rt.executor.executable import Executable

    # the decode step: the one called with one token
    step = next(s for s in live_steps() if any(b.dtype == "int64" and tuple(b.sizes) == (1, 1)
                                                for b, _ in s.desc.inputs))
    (exe,) = step.executables()
    geometry = tuple((exe.bindings.layouts[n], exe.bindings.offsets[n]) for n in exe.bindings.names[1:1 + len(step.desc.inputs)
                                                                                  + len(step.desc.constants)])
    fresh = CompiledStep(step.desc, step.digest, settings=dataclasses.replace(step.settings, cache_enabled=False))
    times = []
    for _ in range(n):
        again = Executable(fresh, exe.card, geometry)
        c0 = time.thread_time()
        again.prepare(dispatch.named("prebuilt"))
        times.append(time.thread_time() - c0)
    return times


def prompt_lengths(name: str, lengths: list[int], layers: int | None = None, regional: bool = False) -> dict:
    """The first call at each prompt length of a model compiled as a user compiles it."""
    from torch._dynamo.utils import counters

    from spyre_rt import card as cards

    with cards.configured(None, "timing"):
        model, _ = _model(name, layers, "spyre")
        if regional:
            from spyre_rt.regional import compile_layers_once

            compile_layers_once(model)
        f = torch.compile(model, backend="spyre_rt")
        calls = []
        with torch.no_grad():
            for n in lengths:
                ids = torch.zeros(1, n, dtype=torch.long).to("spyre")
                c0 = time.thread_time()
                f(ids)
                calls.append({"length": n, "first_call_s": time.thread_time() - c0,
                              "dynamo_compiles": counters["frames"]["ok"],
                              "regions_compiled": counters["spyre_rt"]["regions_compiled"],
                              "graphs_inlined": counters["spyre_rt"]["graphs_inlined"]})
    return {"calls": calls}


def split(total: float) -> dict:
    from torch._dynamo.utils import compilation_time_metrics

    out = {phase: sum(sum(compilation_time_metrics.get(k, ())) for k in keys) for phase, keys in PHASES.items()}
    out["first_call_s"] = total - out["dynamo_s"]
    out["caches"] = _cache_counters()
    return out


def _cache_counters() -> dict:
    """Hits and misses of torch's caches (AOT's and Inductor's FX graph cache) in this compile."""
    from torch._dynamo.utils import counters

    return {f"{group}.{k}": v for group in ("aot_autograd", "inductor") for k, v in counters[group].items()
            if "cache" in k}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--backend", default="spyre_rt", choices=("spyre_rt", "inductor"))
    p.add_argument("--regional", action="store_true", help="decoder layers compiled once (compile_layers_once)")
    p.add_argument("--decode-plan-builds", type=int, default=0, metavar="N",
                   help="then build the decode step's plans N times, no plan cache")
    p.add_argument("--prompt-lengths", default="", metavar="N,N,...",
                   help="instead: the first call at each prompt length (automatic dynamic shapes)")
    p.add_argument("--spans", action="store_true", help="every span's total too (to stderr)")
    args = p.parse_args(argv)
    if args.prompt_lengths:
        print(json.dumps(prompt_lengths(args.model, [int(n) for n in args.prompt_lengths.split(",")], args.layers,
                                        args.regional)))
        return 0
    print(json.dumps(compile_once(args.model, args.seq, args.layers, args.backend, args.regional,
                                  args.decode_plan_builds)))
    if args.spans:
        from torch._dynamo.utils import compilation_time_metrics

        for k, v in sorted(compilation_time_metrics.items(), key=lambda kv: -sum(kv[1])):
            print(f"{sum(v):9.3f} s  {len(v):5d}  {k}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
