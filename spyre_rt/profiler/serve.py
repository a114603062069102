"""``spyre-profile serve``: a Granite model served by vLLM, measured a step at a time.

vLLM's offline engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
scheduler, the runner and the card share the one thread whose host clock the card keeps),
with the model of a profile built from its config alone: no weights are read, and on a
timing-mode card none are written (``load_format="spyre_timing"``). For each concurrency
``C`` it sends ``C`` requests of ``input_len`` random tokens, each asking for ``output_len``
tokens with ``ignore_eos``, and records every engine step:

- **vLLM's host time**: the engine step's host work (the card's host clock, its waits for the
  card left out) less ours: scheduling, input preparation, sampling, output bookkeeping;
- **our dispatch host time**: the host work inside the model's forward and logits calls: the
  step driver's grids, copies to and from the card, Dynamo's guards and the plan launches,
  or a replay;
- **device time**: the card's busy time in the step; and the step's **latency** on the host
  clock (host work and the waits for the card), what a real card would take with this host.

Decode steps (every request one token) at batch ``C`` are reported as medians, with the
decode grids replayed from their captures and, interleaved in the same engine, through the
compiled call. Throughput is the output tokens over the run's latency, against the card's
roofline of the same work (:func:`roofline_of`: a prefill of the ``C`` prompts and each
decode step of the batch, every weight read once per step). ``--engine host`` runs the same
vLLM runner with the model eager on the host CPU: the per-step anchor of vLLM's own cost.

This module imports vLLM; ``spyre-profile`` imports it only for this command.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ..cost import CostModel
from ..errors import SpyreProfileError
from . import analytic, host

ENGINES = ("card", "host")
MODES = ("replay", "compiled")   # how a card's decode grids run
FORMAT = 1   # of the JSON `--json` writes


@dataclasses.dataclass
class Options:
    model: str
    concurrency: tuple[int, ...] = (1, 8, 32)
    input_len: int = 256
    output_len: int = 128
    engine: str = "card"
    layers: int | None = None
    sim_mode: str | None = None          # the card's; None: the model profile's default
    # a step's tokens (prefill chunks of several requests): vLLM's default for `vllm serve` on
    # a device of 70 GiB or more, as the card is (its engine arguments' defaults by memory)
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None     # the engine's longest length; None: a request's, rounded to a stick
    modes: tuple[str, ...] = MODES
    compare_output: int | None = None    # output tokens of the runs through the compiled call
    trace: str | None = None             # a card trace of prefill steps and decode steps at the largest batch
    seed: int = 0

    def output_of(self, mode: str) -> int:
        """Output tokens of a run: the compiled call's runs are for the per-step comparison
        and may be shorter (a full-size model's step costs seconds of simulation)."""
        return self.compare_output if mode == "compiled" and self.compare_output else self.output_len


@dataclasses.dataclass
class Step:
    """One engine step's figures, in ms (host figures: CPU time of the engine's thread)."""

    requests: int
    tokens: int
    decode: bool          # every request one token
    host_ms: float        # the step's host work, all of it
    ours_ms: float        # of which inside the model's forward and logits calls
    device_ms: float
    latency_ms: float     # host work and waits for the card
    wall_ms: float        # wall time, the simulator's own work and other processes included

    @property
    def vllm_ms(self) -> float:
        return self.host_ms - self.ours_ms


class _HostClock:
    """The clocks a step is read on: the card's host clock and counters, or (on the host
    engine, where nothing calls into a card) the thread's CPU time alone."""

    def __init__(self, card) -> None:
        self.card = card

    def read(self) -> tuple[float, float, float]:
        """(host work ns, latency ns, device busy ns) since some origin."""
        if self.card is None:
            t = time.thread_time_ns()
            return t, t, 0.0
        c = self.card.clock()
        k = self.card.counters()
        return c.host_ns - k["wait_ns"], c.host_ns, k["device_busy_ns"]


class _Recorder:
    """Wraps the engine's step and the model's calls, and keeps a :class:`Step` per step."""

    def __init__(self, clock: _HostClock) -> None:
        self.clock = clock
        self.steps: list[Step] = []
        self.spans = False   # each step a host span of the card's trace, named for its batch
        self._ours = 0.0
        self._shape = (0, 0, False)

    def engine_step(self, step_fn):
        def step():
            self._ours, self._shape = 0.0, (0, 0, False)
            w0 = time.perf_counter()
            h0, l0, d0 = self.clock.read()
            out = step_fn()
            h1, l1, d1 = self.clock.read()
            if self._shape[0]:
                self.steps.append(Step(*self._shape, (h1 - h0) / 1e6, self._ours / 1e6, (d1 - d0) / 1e6,
                                       (l1 - l0) / 1e6, (time.perf_counter() - w0) * 1e3))
                if self.spans:
                    n, tokens, decode = self._shape
                    self.clock.card.trace_host_span(
                        f"{'decode' if decode else 'step'} {len(self.steps)} [{n} requests, {tokens} tokens]",
                        int(l0), int(l1))
            return out
        return step

    def model_call(self, fn, forward: bool):
        def call(*args, **kwargs):
            if forward:
                self._shape = _batch_shape(kwargs.get("input_ids"))
            h0 = self.clock.read()[0]
            try:
                return fn(*args, **kwargs)
            finally:
                self._ours += self.clock.read()[0] - h0
        return call


class _Timed:
    """The runner's model with its calls timed; every other attribute is the model's."""

    def __init__(self, inner, call) -> None:
        self.__dict__["inner"], self.__dict__["call"] = inner, call

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["inner"], name)


def _batch_shape(input_ids) -> tuple[int, int, bool]:
    from spyre_rt.serving.steps import step_batch

    batch = step_batch()
    if batch is None:
        return (0, 0, False)
    qlen = batch.query_lens
    qlen = qlen[qlen > 0]   # vLLM pads a decode batch to a capture size with requests of no token
    return int(qlen.numel()), int(qlen.sum()), bool(qlen.numel() and (qlen == 1).all())


def model_dir(opts: Options, path: Path) -> Path:
    """The model profile's config as a Hugging Face model directory (config only)."""
    from .run import load_model

    profile = load_model(opts.model)
    cfg = profile.hf_config(opts.layers)
    cfg.architectures = ["GraniteForCausalLM"]   # vLLM picks its model class (and runner) by it
    cfg.dtype = str(profile.dtype).removeprefix("torch.")
    cfg.save_pretrained(path)
    return path


def _env(opts: Options, sim_mode: str) -> None:
    """vLLM in this process, on the plugin, before vLLM is imported."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["SPYRE_RT_VLLM"] = "1"
    os.environ["SPYRE_RT_SIM_MODE"] = sim_mode
    if opts.engine == "host":
        os.environ["SPYRE_RT_VLLM_DEVICE"] = "cpu"


def request_len(opts: Options) -> int:
    """A request's tokens, prompt and output, rounded up to a stick."""
    return -(-(opts.input_len + opts.output_len) // 64) * 64


def max_model_len(opts: Options) -> int:
    return opts.max_model_len or request_len(opts)


def token_budget(opts: Options) -> int:
    """The engine's tokens per step: at least a whole request's."""
    return max(opts.max_num_batched_tokens, request_len(opts))


def start(opts: Options, directory: Path, dtype: str):
    """The engine, and the seconds it took to be ready (the LLM constructor: compiling,
    building the step shapes, capturing the decode steps)."""
    from vllm import LLM

    args: dict[str, Any] = dict(
        model=str(directory), skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len(opts),
        max_num_seqs=max(opts.concurrency), max_num_batched_tokens=token_budget(opts),
        seed=opts.seed, enable_prefix_caching=False,
    )
    if opts.engine == "card" and os.environ["SPYRE_RT_SIM_MODE"] == "timing":
        import spyre_rt.serving.loader as loader

        args["load_format"] = loader.LOAD_FORMAT
    else:
        args["load_format"] = "dummy"
    t0 = time.perf_counter()
    llm = LLM(**args)
    return llm, time.perf_counter() - t0


def instrument(llm, engine: str) -> _Recorder:
    import torch

    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    clock = _HostClock(None if engine == "host" else _card_of(torch.spyre.current_device()))
    rec = _Recorder(clock)
    core.step_fn = rec.engine_step(core.step_fn)
    bare = runner.get_model()
    bare.compute_logits = rec.model_call(bare.compute_logits, forward=False)
    runner.model = _Timed(runner.model, rec.model_call(runner.model, forward=True))
    return rec


def _card_of(index: int):
    from spyre_rt import card as cards

    return cards.get(index)


def card_model(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner._card_model


def run_batch(llm, rec: _Recorder, concurrency: int, input_len: int, output_len: int, seed: int) -> list[Step]:
    """`concurrency` requests of `input_len` random tokens, `output_len` tokens each: the steps."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(seed)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(3, vocab, (input_len,), generator=g).tolist())
               for _ in range(concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    rec.steps = []
    outs = llm.generate(prompts, params, use_tqdm=False)
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    if made != concurrency * output_len:
        raise SpyreProfileError(f"the engine made {made} tokens, not {concurrency * output_len}")
    return rec.steps


def traced(llm, rec: _Recorder, concurrency: int, opts: Options, driver) -> None:
    """Prefill steps and decode steps of `concurrency` requests (replayed), traced on the card
    (jobs, with their kernel info) with a host span per engine step: for `spyre-profile view
    --span`, which sets the card's time of each op beside its roofline."""
    from .. import trace

    card = rec.clock.card
    driver.replay = True
    card.trace_enable(True, commands=False)
    rec.spans, first = True, card.trace_count()
    # enough tokens that, once every prompt is in, a few steps decode the whole batch together
    prefill_steps = -(-concurrency * opts.input_len // token_budget(opts)) + 1
    try:
        run_batch(llm, rec, concurrency, opts.input_len, min(prefill_steps + 2, opts.output_len),
                  opts.seed + concurrency)
    finally:
        rec.spans = False
        card.trace_enable(False)
    trace.export(card.trace_events(first), card.name_of, opts.trace,
                 metadata={"model": opts.model, "concurrency": concurrency, "engine": "vllm"},
                 card_index=card.index, device=card.profile)


def summarise(steps: list[Step], concurrency: int, output_len: int) -> dict[str, Any]:
    decode = [s for s in steps if s.decode and s.requests == concurrency]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    latency = sum(s.latency_ms for s in steps)
    return {
        "steps": len(steps), "decode_steps": len(decode),
        "decode": {k: med([getattr(s, k) for s in decode])
                   for k in ("vllm_ms", "ours_ms", "device_ms", "latency_ms", "host_ms")},
        "output_len": output_len, "wall_s": sum(s.wall_ms for s in steps) / 1e3,
        "latency_ms": latency, "device_ms": sum(s.device_ms for s in steps),
        "host_ms": sum(s.host_ms for s in steps), "ours_ms": sum(s.ours_ms for s in steps),
        "tokens_per_s": concurrency * output_len / (latency / 1e3) if latency else float("nan"),
        "each_step": [dataclasses.asdict(s) for s in steps],
    }


def roofline_of(config: dict, layers: int, concurrency: int, input_len: int, output_len: int, dtype: str,
                roof: CostModel) -> dict[str, float]:
    """The least time of a run's work: the prefill of the prompts (one step, the weights
    read once) and each decode step of the batch (the weights read once per step, the
    KV cache of every position so far), from the analytic model of the config."""
    cfg = dict(config) | {"num_hidden_layers": layers}
    prefill = analytic.granite_step(cfg, concurrency, input_len, "prefill", dtype).roofline_ms(roof)
    steps = [analytic.granite_step(cfg, concurrency, input_len + i, "decode", dtype).roofline_ms(roof)
             for i in range(output_len - 1)]
    total = prefill + sum(steps)
    return {"prefill_ms": prefill, "decode_ms": sum(steps), "decode_step_ms": statistics.median(steps) if steps else 0.0,
            "latency_ms": total, "tokens_per_s": concurrency * output_len / (total / 1e3)}


def measure(opts: Options, console=None) -> dict[str, Any]:
    """Start the engine, run every concurrency (and, on the card, each way of running the
    decode grids, interleaved), and return every figure as plain data."""
    from .run import load_model

    if opts.engine not in ENGINES:
        raise SpyreProfileError(f"engine must be one of {ENGINES}, not {opts.engine!r}")
    profile = load_model(opts.model)
    sim_mode = opts.sim_mode or profile.default_mode
    _env(opts, sim_mode)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SpyreProfileError("spyre-profile serve needs vLLM: sh requirements/install-vllm.sh .venv/bin/pip") from None
    modes = opts.modes if opts.engine == "card" else ("eager",)
    with tempfile.TemporaryDirectory(prefix="spyre-serve-") as tmp:
        directory = model_dir(opts, Path(tmp) / profile.name)
        llm, ready_s = start(opts, directory, str(profile.dtype).removeprefix("torch."))
        rec = instrument(llm, opts.engine)
        driver = card_model(llm) if opts.engine == "card" else None
        runs: dict[str, dict[str, Any]] = {m: {} for m in modes}
        loads: list[float] = []
        for c in opts.concurrency:
            for mode in modes:   # interleaved: the machine's drift is shared
                if driver is not None:
                    driver.replay = mode == "replay"
                if console is not None:
                    console.print(f"[dim]concurrency {c}, decode {mode} ...[/]")
                # untimed: a short run of the same batch, so that no first call of a shape in
                # this way of running (the compiled call's first bind of a plan) is measured
                run_batch(llm, rec, c, min(opts.input_len, 64), min(opts.output_of(mode), 3), opts.seed + 7)
                steps = run_batch(llm, rec, c, opts.input_len, opts.output_of(mode), opts.seed + c)
                runs[mode][str(c)] = summarise(steps, c, opts.output_of(mode))
                loads.append(os.getloadavg()[0])
        if opts.trace and driver is not None:
            traced(llm, rec, max(opts.concurrency), opts, driver)
    layers = opts.layers or int(profile.config["num_hidden_layers"])
    dtype = str(profile.dtype).removeprefix("torch.")
    roofline: dict[str, dict[str, Any]] = {}
    if opts.engine == "card":
        roof = CostModel.of_figures(_card_of(0).profile)
        roofline = {mode: {str(c): roofline_of(profile.config, layers, c, opts.input_len, opts.output_of(mode), dtype,
                                               roof) for c in opts.concurrency} for mode in modes}
    return {
        "format": FORMAT, "model": profile.name, "layers": layers, "dtype": dtype, "engine": opts.engine,
        "sim_mode": sim_mode if opts.engine == "card" else None, "concurrency": list(opts.concurrency),
        "input_len": opts.input_len, "output_len": opts.output_len,
        "max_num_batched_tokens": opts.max_num_batched_tokens, "max_model_len": max_model_len(opts),
        "ready_s": ready_s, "runs": runs,
        "roofline": roofline, "host": host.describe(), "load_during_runs": loads,
    }


def _ms(v: float) -> str:
    return "—" if v != v else (f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}")


def render(console, out: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table

    where = (f"a {out['sim_mode']}-mode card" if out["engine"] == "card" else "the host CPU, eager")
    outputs = sorted({r["output_len"] for by_c in out["runs"].values() for r in by_c.values()})
    t = Table(title=f"{out['model']} ({out['layers']} layers, {out['dtype']}) served by vLLM on {where}, input "
                    f"{out['input_len']}, output {'/'.join(map(str, outputs))}: a decode step (medians, ms) and "
                    "the throughput",
              title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1),
              caption=host.label(out["host"]) + "\nhost figures: CPU time of the engine's thread, the card's "
                      "own work left out; step: host work and waits for the card", caption_justify="left",
              caption_style="dim")
    for col in ("batch", "decode", "vLLM", "ours", "card", "step", "tokens/s", "roofline", "of it"):
        t.add_column(col, justify="left" if col == "decode" else "right", no_wrap=True)
    for mode, by_c in out["runs"].items():
        for c, r in by_c.items():
            d = r["decode"]
            roof = out["roofline"].get(mode, {}).get(c)
            t.add_row(c, mode, _ms(d["vllm_ms"]), _ms(d["ours_ms"]), _ms(d["device_ms"]), _ms(d["latency_ms"]),
                      f"{r['tokens_per_s']:,.0f}", f"{roof['tokens_per_s']:,.0f}" if roof else "—",
                      f"{r['tokens_per_s'] / roof['tokens_per_s'] * 100:.0f} %" if roof else "—")
    console.print(t)
    console.print(f"[dim]ready in {out['ready_s']:.1f} s (the LLM constructor: compile, step shapes, captures)[/]")


def write_json(out: dict[str, Any], path: str) -> None:
    from .run import write_json as write

    write(out, path)
