"""``spyre-profile run``: prefill and decode of a Granite model in each dispatch mode.

The model is Hugging Face ``GraniteForCausalLM`` built from a model profile with random
weights (no download), compiled with ``torch.compile(backend="spyre_rt")`` and driven as a
greedy decode loop with a static KV cache. Every mode runs the same compiled graphs; only
when graph construction happens differs. Time is the card's: host time is host work, CPU
time of the dispatching thread with the card's own work (simulating, walking plans) left out
(:data:`CLOCK`), device time is simulated from the profile. Another process taking a core
does not move it; the wall-clock twin of every host figure is reported beside it.

Per mode and phase the report gives the latency (host clock from the start of the phase
until the card has finished it), the host's own work, the device's busy time and the time
the device sat idle waiting for the host; then the same latencies, host work and speedups in
wall time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import torch

from .. import card as cards
from .. import device_profile as profiles
from .. import job_facts
from .. import trace as trace_format
from ..cost import CostModel
from ..dispatch import NAMES as DISPATCH
from ..dispatch import dispatch_mode
from ..errors import SpyreProfileError
from ..regional import compile_layers_once
from . import analytic, efficiency, host, published
from .roofline import assumptions as roofline_assumptions

# The dispatch modes (DISPATCH, from spyre_rt.dispatch's table), and "replay": the prebuilt
# plans driven by captured graphs (torch.spyre.graph), prefill and decode each one replay
MODES = (*DISPATCH, "replay")
PHASES = ("prefill", "decode")
FORMAT = 3  # of the JSON `--json` writes; 2 had no "clock" or wall figures, 1 no "format",
#            phases, efficiency or spread
# The clock host figures are counted in (the JSON's "clock"); "wall" names the twin beside it.
CLOCK = {"host": "thread-cpu", "wall": "monotonic",
         "description": "host work is CPU time of the dispatching thread (CLOCK_THREAD_CPUTIME_ID), "
                        "the card's own work left out; wall time (CLOCK_MONOTONIC) beside it"}


# ---- model profiles --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    name: str
    dtype: torch.dtype
    default_mode: str
    config: dict[str, Any]
    path: str

    def hf_config(self, layers: int | None = None):
        from transformers import GraniteConfig

        cfg = dict(self.config)
        if layers is not None:
            cfg["num_hidden_layers"] = layers
        return GraniteConfig(**cfg)


_CONFIG_KEYS = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "embedding_multiplier",
    "residual_multiplier", "attention_multiplier", "logits_scaling", "tie_word_embeddings", "hidden_act",
    "attention_bias", "mlp_bias",
}


def known_models() -> list[str]:
    return profiles.known("models")


def load_model(name_or_path: str) -> ModelProfile:
    found = profiles.read_profile(name_or_path, "models")
    if found is None:
        raise SpyreProfileError(f"no model profile named {name_or_path!r}; known: {known_models()}")
    path, text = found
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpyreProfileError(f"{path}: not valid TOML: {e}") from None
    model, config = doc.get("model"), doc.get("config")
    if not isinstance(model, dict) or not isinstance(config, dict):
        raise SpyreProfileError(f"{path}: needs [model] and [config] tables")
    unknown = set(config) - _CONFIG_KEYS
    missing = _CONFIG_KEYS - set(config)
    if unknown or missing:
        raise SpyreProfileError(f"{path}: [config] missing {sorted(missing)}, unknown {sorted(unknown)}")
    if model.get("architecture") != "GraniteForCausalLM":
        raise SpyreProfileError(f"{path}: architecture must be GraniteForCausalLM")
    dtype = getattr(torch, str(model.get("dtype", "float16")), None)
    if dtype not in (torch.float16, torch.float32, torch.bfloat16):
        raise SpyreProfileError(f"{path}: dtype must be float16, bfloat16 or float32")
    mode = model.get("default_mode", "timing")
    if mode not in ("timing", "functional"):
        raise SpyreProfileError(f"{path}: default_mode must be timing or functional")
    return ModelProfile(str(model.get("name", Path(path).stem)), dtype, mode, config, path)


def load_reference(model: str, batch: int, seq: int) -> dict | None:
    """Published figures for this model and size, if the profiles carry them."""
    found = None if profiles.is_path(model) else profiles.read_profile(model, "reference")
    if found is None:
        return None
    doc = tomllib.loads(found[1])
    ref = doc.get("reference", {})
    if ref.get("batch") != batch or ref.get("seq") != seq:
        return None
    speedups = doc.get("speedups", {})
    return {"source": ref.get("source", ""), "speedups": speedups,
            "compute_share": published_compute_share(speedups)}


def published_compute_share(speedups: dict) -> dict:
    """The compute path's share of the gain implied by published speedups, by the formula
    of :func:`compute_share_of` (latencies relative to construct: 1 / speedup). The
    published text says "about three quarters"; its own figures give 78 % and 79.5 %."""
    transfer, both = speedups.get("prebuilt-transfer", {}), speedups.get("prebuilt", {})
    results = {"construct": {}, "prebuilt-transfer": {}, "prebuilt": {}}
    for phase, key in (("prefill", "prefill_ms"), ("decode", "decode_ms_per_token")):
        if phase not in transfer or phase not in both:
            return {}
        results["construct"][key] = 1.0
        results["prebuilt-transfer"][key] = 1 / transfer[phase]
        results["prebuilt"][key] = 1 / both[phase]
    return compute_share_of(results)


# ---- measuring ---------------------------------------------------------------------------


@dataclasses.dataclass
class Options:
    model: str
    batch: int = 1
    seq: int = 1024
    decode_steps: int = 4
    repeats: int = 5              # measured rounds, the modes interleaved in each; medians reported
    modes: tuple[str, ...] = MODES
    sim_mode: str | None = None   # None: the model profile's default
    layers: int | None = None     # override the number of layers (quick runs)
    trace: str | None = None
    trace_detail: str = "jobs"    # jobs: one event per kernel, plus counters; commands: every command too
    whatif_plot: str | None = None  # a PNG of the what-if curve (with matplotlib)
    py_spy: str | None = None
    seed: int = 0
    tp: int = 1                   # cards the model is sharded over (tensor parallelism: see .tp)
    regional: bool = True         # decoder layers compiled once (spyre_rt.regional)


class Phase:
    """Card figures over one phase, from the card's counters and clocks."""

    def __init__(self, card: cards.Card):
        self.card = card

    def __enter__(self):
        self.card.synchronize()
        self.c0 = self.card.counters()
        self.clock0 = self.card.clock()
        self.h0 = self.clock0.host_ns
        return self

    def __exit__(self, *exc):
        self.card.synchronize()
        c1 = self.card.counters()
        clock1 = self.card.clock()
        self.latency = (clock1.host_ns - self.h0) / 1e6
        waited = (c1["wait_ns"] - self.c0["wait_ns"]) / 1e6
        self.host = self.latency - waited
        # on the wall twin: the same, with the host's time off the CPU put back
        self.latency_wall = (clock1.host_wall_ns - self.clock0.host_wall_ns) / 1e6
        self.host_wall = self.latency_wall - waited
        self.device = (c1["device_busy_ns"] - self.c0["device_busy_ns"]) / 1e6
        self.wait_host = (c1["device_idle_host_ns"] - self.c0["device_idle_host_ns"]) / 1e6
        self.native_calls = c1["native_calls"] - self.c0["native_calls"]
        self.jobs = c1["jobs"] - self.c0["jobs"]
        return False

    def figures(self) -> dict[str, float]:
        return {"latency_ms": self.latency, "host_ms": self.host, "device_ms": self.device,
                "device_wait_host_ms": self.wait_host, "native_calls": self.native_calls, "jobs": self.jobs,
                "latency_wall_ms": self.latency_wall, "host_wall_ms": self.host_wall}


class Session:
    """A model on the card, compiled, with its static KV cache."""

    def __init__(self, opts: Options, progress=None):
        self.opts = opts
        self.profile = load_model(opts.model)
        mode = opts.sim_mode or self.profile.default_mode
        self.sim_mode = mode
        # Cards of its own, current only while the session works (see active): a process
        # that runs a session (a benchmark, a test) keeps the cards it had for the rest.
        self.card_set = cards.open_set(None, mode)
        # a rank of a tensor-parallel run is on its card (LOCAL_RANK's), else spyre:0
        self.card = self.card_set.cards[torch.spyre.current_device() if opts.tp > 1 else 0]
        with self.active():
            self._build(opts, mode)

    def active(self):
        """A block in which new spyre tensors go to the session's cards."""
        return cards.using(self.card_set)

    def _build(self, opts: Options, mode: str) -> None:
        from transformers import GraniteForCausalLM, StaticCache

        cfg = self.profile.hf_config(opts.layers)
        self.cfg = cfg
        dtype = self.profile.dtype
        torch.manual_seed(opts.seed)
        if opts.tp > 1:
            from ..distributed.tensor_parallel import sharded_model

            model = sharded_model(GraniteForCausalLM, cfg, dtype, mode, opts.tp)
        elif mode == "timing":
            with torch.device("meta"):
                model = GraniteForCausalLM(cfg).to(dtype).eval()
            model = model.to_empty(device="spyre")  # time only: the card keeps no data
        else:
            model = GraniteForCausalLM(cfg).to(dtype).eval().to("spyre")
        self.model = model
        if opts.regional:
            # the layers are one graph: Dynamo traces it once, Inductor compiles it once and
            # the plan build constructs its kernels once, for a step that still launches as one plan
            compile_layers_once(model)
        self.cache = StaticCache(config=cfg, max_cache_len=opts.seq + opts.decode_steps + 1)
        self.cache.early_initialization(batch_size=opts.batch, num_heads=cfg.num_key_value_heads // opts.tp,
                                        head_dim=cfg.hidden_size // cfg.num_attention_heads, dtype=dtype,
                                        device="spyre")
        cache = self.cache
        # every position of the cache unmasked, as generate() passes a mask: without one, the
        # causal mask asks whether a static cache is empty of a tensor (a data-dependent branch)
        mask = torch.ones(opts.batch, opts.seq + opts.decode_steps + 1, dtype=torch.long).to("spyre")

        def forward(ids, pos):
            # Logits of the last position only, as a serving system asks for: the next token
            # needs no more (a prefill's LM head over all 1,024 positions was 49k-wide work
            # for nothing). The cache goes in as past_key_values: a decode step reads the
            # keys and values of every position before it.
            return model(ids, attention_mask=mask, past_key_values=cache, position_ids=pos, use_cache=True,
                         logits_to_keep=1).logits

        # The greedy loop keeps the next token on the card, as a serving loop would: each
        # step picks it there (argmax) and writes it, with its position, into the tensors
        # the next decode step reads; the host never sees it.
        def prefill(ids, pos, tok, tok_pos):
            logits = forward(ids, pos)
            tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
            tok_pos.copy_(pos[:, -1:] + 1)
            return logits

        def decode(tok, pos):
            logits = forward(tok, pos)
            tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
            pos.add_(1)
            return logits

        compile_ = functools.partial(torch.compile, backend="spyre_rt", fullgraph=True, dynamic=False)
        self.forward = compile_(forward)
        self._prefill, self._decode = compile_(prefill), compile_(decode)
        self.prompt = torch.randint(0, cfg.vocab_size, (opts.batch, opts.seq))
        self.tok = torch.zeros(opts.batch, 1, dtype=torch.long, device="spyre")
        self.tok_pos = torch.zeros(opts.batch, 1, dtype=torch.long, device="spyre")
        self._graphs = None  # (prompt ids, positions, prefill graph, decode graph): replay mode

    def prefill(self):
        """A prefill of the prompt; it leaves the first token on the card."""
        opts = self.opts
        with self.active():
            ids = self.prompt.to("spyre")
            pos = torch.arange(opts.seq).expand(opts.batch, opts.seq).to("spyre")
            return self._prefill(ids, pos, self.tok, self.tok_pos)

    def decode_step(self):
        """One decode step of the token on the card; it leaves the next one there."""
        with self.active():
            return self._decode(self.tok, self.tok_pos)

    def graphs(self):
        """The prefill and a decode step captured (torch.spyre.graph), made once: the
        replay mode's. Its prompt lives in a static tensor that each run fills."""
        if self._graphs is None or self._graphs[2].stale():
            opts = self.opts
            with self.active(), torch.no_grad(), dispatch_mode("prebuilt"):
                ids = self.prompt.to("spyre")
                pos = torch.arange(opts.seq).expand(opts.batch, opts.seq).to("spyre")
                # compiled before the capture; every prefill on an empty cache, as a run's
                self.cache.reset()
                self._prefill(ids, pos, self.tok, self.tok_pos)
                self._decode(self.tok, self.tok_pos)
                self.cache.reset()
                prefill, decode = torch.spyre.SpyreGraph(), torch.spyre.SpyreGraph()
                with torch.spyre.graph(prefill):
                    self._prefill(ids, pos, self.tok, self.tok_pos)
                with torch.spyre.graph(decode):
                    self._decode(self.tok, self.tok_pos)
            self._graphs = (ids, pos, prefill, decode)
        return self._graphs

    def run(self, mode: str, trace: str | None = None, decode_steps: int | None = None) -> dict:
        """One prefill and `decode_steps` decode steps in `mode` (the cache reset first).

        `trace` ("jobs" or "commands") records the card's trace of each phase, with a host
        span around it; :attr:`marks` then holds each phase's range of trace events."""
        decode_steps = self.opts.decode_steps if decode_steps is None else decode_steps
        self.marks: dict[str, tuple[int, int]] = {}
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        replay = self.graphs() if mode == "replay" else None
        with torch.no_grad(), dispatch_mode("prebuilt" if replay else mode), self.active():
            self.cache.reset()
            if replay:
                ids, _, prefill, decode = replay
                with self._phase("prefill", mode, trace) as pre:
                    ids.copy_(self.prompt)  # the prompt's upload, as the other modes' prefill makes
                    prefill.replay()
                with self._phase("decode", mode, trace) as dec:
                    for _ in range(decode_steps):
                        decode.replay()
            else:
                with self._phase("prefill", mode, trace) as pre:
                    self.prefill()
                with self._phase("decode", mode, trace) as dec:
                    for _ in range(decode_steps):
                        self.decode_step()
        steps = max(1, decode_steps)
        d = dec.figures()
        return {
            "prefill_ms": pre.latency,
            "decode_ms_per_token": dec.latency / steps,
            "host_ms": pre.host + dec.host,
            "device_ms": pre.device + dec.device,
            "device_wait_host_ms": pre.wait_host + dec.wait_host,
            "prefill_wall_ms": pre.latency_wall,
            "decode_wall_ms_per_token": dec.latency_wall / steps,
            "host_wall_ms": pre.host_wall + dec.host_wall,
            "phases": {"prefill": pre.figures(), "decode": {**d, "steps": steps}},
        }

    @contextlib.contextmanager
    def _phase(self, name: str, mode: str, trace: str | None):
        card = self.card
        if trace:
            card.trace_enable(True, commands=trace == "commands")
            first = card.trace_count()
        with Phase(card) as phase:
            yield phase
        if trace:
            card.trace_host_span(f"{name} [{mode}]", phase.h0, card.host_clock_ns())
            self.marks[name] = (first, card.trace_count())
            card.trace_enable(False)

    def _events(self, phase: str):
        """The card's trace events of `phase` in the last traced run."""
        first, end = self.marks[phase]
        return self.card.trace_events(first)[: end - first]

    def job_names(self, phase: str) -> list[str]:
        """The names of the jobs the last traced run ran in `phase`, in order."""
        ev = self._events(phase)
        return [self.card.name_of(int(a)) for a in ev["a"][ev["kind"] == cards.EV_JOB].tolist()]

    def job_edges(self, phase: str) -> list[tuple[str, float]]:
        """(name, fill and drain in ns) of each job that computes in `phase` of the last traced
        run: how long it ran before its first compute command started and after its last one
        ended."""
        ev = self._events(phase)
        jobs = ev[ev["kind"] == cards.EV_JOB]
        span = {int(q): (int(a), s, e) for q, a, s, e in zip(jobs["job"].tolist(), jobs["a"].tolist(),
                                                             jobs["start_ns"].tolist(), jobs["end_ns"].tolist(),
                                                             strict=True)}
        out = []
        for c in ev[ev["kind"] == cards.EV_COMPUTE]:
            job = span.get(int(c["job"]))
            if job is not None:
                a, s, e = job
                out.append((self.card.name_of(a), max(0.0, c["start_ns"] - s) + max(0.0, e - c["end_ns"])))
        return out

    def collective_ms(self, phase: str) -> float:
        """The card's time in collectives (jobs on the interconnect) in `phase` of the last
        traced run."""
        ev = self._events(phase)
        jobs = ev[ev["kind"] == cards.EV_JOB]
        total = 0.0
        for a, start, stop in zip(jobs["a"].tolist(), jobs["start_ns"].tolist(), jobs["end_ns"].tolist(), strict=True):
            if (job_facts.lookup(self.card.name_of(int(a))) or {}).get("kind") == "collective":
                total += stop - start
        return total / 1e6


def median_of(samples: list[dict]) -> dict:
    """Figure by figure, the median of several runs' results (nested dicts of numbers)."""
    out: dict = {}
    for key, first in samples[0].items():
        values = [s[key] for s in samples]
        if isinstance(first, dict):
            out[key] = median_of(values)
        elif isinstance(first, int | float):
            out[key] = statistics.median(values)
        else:
            out[key] = first
    return out


# The latency keys of a run's results, per phase: on the host clock, and on its wall twin.
KEYS = {"prefill": "prefill_ms", "decode": "decode_ms_per_token"}
WALL_KEYS = {"prefill": "prefill_wall_ms", "decode": "decode_wall_ms_per_token"}


def round_ratios(samples: dict[str, list[dict]], keys: dict[str, str] = KEYS) -> dict:
    """Per mode and phase, construct's latency over the mode's, round by round (empty
    without construct): what the speedups and their spread are made of."""
    base = samples.get("construct")
    if not base:
        return {}
    return {mode: {phase: [b[key] / r[key] for b, r in zip(base, runs_, strict=True)] for phase, key in keys.items()}
            for mode, runs_ in samples.items()}


def speedups_of(samples: dict[str, list[dict]], keys: dict[str, str] = KEYS) -> dict:
    """Per mode and phase, the median over the rounds of construct's latency over the
    mode's in the same round. The rounds run the modes interleaved, so the two sides of a
    ratio share the host's state of that moment (its load, the speed another process leaves
    it); a ratio of the modes' medians would pair one round's construct with another round's
    mode, and carry the host's drift between rounds into the speedup."""
    return {mode: {phase: statistics.median(r) for phase, r in by_phase.items()}
            for mode, by_phase in round_ratios(samples, keys).items()}


def relative_latencies(speedups: dict) -> dict:
    """Each mode's latencies relative to construct's (1 / speedup), keyed as the results
    are: what the shares of the gain are computed from."""
    return {mode: {key: 1 / sp[phase] for phase, key in KEYS.items()} for mode, sp in speedups.items()}


def compute_share_of(results: dict) -> dict:
    """The share of the whole gain (construct -> prebuilt) made by moving construction off
    the compute path (prebuilt-transfer -> prebuilt)."""
    return _share_of(results, "prebuilt-transfer", "prebuilt")


def path_shares_of(results: dict) -> dict:
    """Per phase, the share of the whole gain (construct -> prebuilt) each path gives on
    its own: ``transfer`` construct -> prebuilt-transfer, ``compute`` construct ->
    prebuilt-compute. Near 1 together when the two gains add up."""
    out: dict = {}
    for path, mode in (("transfer", "prebuilt-transfer"), ("compute", "prebuilt-compute")):
        for phase, share in _share_of(results, "construct", mode).items():
            out.setdefault(phase, {})[path] = share
    return out


def _share_of(results: dict, start: str, end: str) -> dict:
    """Per phase, the share of the whole gain (construct -> prebuilt) made by going from
    mode `start` to mode `end`: (start - end) / (construct - prebuilt), in latencies."""
    if not all(m in results for m in ("construct", "prebuilt", start, end)):
        return {}
    out = {}
    for phase, key in (("prefill", "prefill_ms"), ("decode", "decode_ms_per_token")):
        c, p = results["construct"][key], results["prebuilt"][key]
        out[phase] = (results[start][key] - results[end][key]) / (c - p) if c != p else float("nan")
    return out


@contextlib.contextmanager
def py_spy_recorder(path: str | None, console):
    """Record this process with py-spy into a speedscope file, if it can attach."""
    if not path:
        yield None
        return
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        console.print("[yellow]py-spy is not installed (pip install py-spy); continuing without it[/]")
        yield None
        return
    cmd = [exe, "record", "--pid", str(os.getpid()), "--format", "speedscope", "--output", path,
           "--rate", "200", "--nonblocking"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    if proc.poll() is not None:
        err = (proc.stderr.read() or "").strip().splitlines()
        console.print(f"[yellow]py-spy could not attach ({err[-1] if err else 'exit ' + str(proc.returncode)}); "
                      "continuing without it (it needs ptrace rights, e.g. root or CAP_SYS_PTRACE)[/]")
        yield None
        return
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if Path(path).exists():
            console.print(f"py-spy profile written to {path}")
        else:
            console.print(f"[yellow]py-spy wrote no profile ({(proc.stderr.read() or '').strip()[-200:]})[/]")


def measure(opts: Options, console, progress_factory=None) -> dict:
    """Compile, warm up and measure every mode; the results as plain data."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = progress_factory() if progress_factory else Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
        console=console, transient=False)
    timings: dict[str, float] = {}
    with progress:
        task = progress.add_task("building the model on the card", total=None)
        t0 = time.perf_counter()
        session = Session(opts)
        timings["model_s"] = time.perf_counter() - t0
        progress.update(task, description=f"compiling {session.profile.name} (prefill and decode graphs)")
        t0 = time.perf_counter()
        with torch.no_grad():
            session.prefill()
            session.decode_step()
        timings["compile_s"] = time.perf_counter() - t0
        progress.update(task, total=1, completed=1)
        runs = progress.add_task("measuring", total=(1 + opts.repeats) * len(opts.modes))

        def step(text: str | None = None) -> None:
            """A run begins (named `text`), or the run ends."""
            if text:
                progress.update(runs, description=text)
            else:
                progress.advance(runs)

        with py_spy_recorder(opts.py_spy, console):
            census = _warm_up(session, opts, step)
            first_traced = session.card.trace_count()
            samples = _measure_rounds(session, opts, step)
    out = analyse(session, opts, samples, census, timings)
    if opts.trace:
        from .. import trace

        trace.export(session.card.trace_events(first_traced), session.card.name_of, opts.trace,
                     metadata={k: out[k] for k in ("model", "batch", "seq", "sim_mode", "device_profile", "host", "clock")},
                     card_index=session.card.index, device=session.card.profile)
    return out


def _census_mode(opts: Options) -> str:
    """The mode whose jobs are counted: prebuilt runs the kernels alone (the construct modes
    also upload each kernel's program)."""
    return "prebuilt" if "prebuilt" in opts.modes else opts.modes[-1]


def _warm_up(session: Session, opts: Options, step) -> dict[str, list[str]]:
    """One untimed run per mode: it builds plans and transfer graphs, which are not part of
    the steady state, and first touches what the runs use. The census mode's run is traced
    (jobs only): the names of the kernels of a prefill and of a decode step."""
    census: dict[str, list[str]] = {}
    for mode in opts.modes:
        step(f"warm-up [{mode}]")
        counted = mode == _census_mode(opts)
        figures = session.run(mode, trace="jobs" if counted else None, decode_steps=min(1, opts.decode_steps))
        step()
        if counted:
            census = {phase: session.job_names(phase) for phase in session.marks}
            session.edges = {phase: session.job_edges(phase) for phase in session.marks}
            # the card's time in collectives per prefill and per decode token, and its share of each
            session.collectives = {
                phase: {"ms": (ms := session.collective_ms(phase)),
                        "share": ms / figures["phases"][phase]["latency_ms"] if figures["phases"][phase]["latency_ms"]
                        else 0.0}
                for phase in session.marks}
    return census


def _measure_rounds(session: Session, opts: Options, step) -> dict[str, list[dict]]:
    """`opts.repeats` measured runs per mode; the last round is traced when asked."""
    samples: dict[str, list[dict]] = {mode: [] for mode in opts.modes}
    # As long-running inference servers do: what compiling left on the heap is kept out of
    # later collections. Each run goes without the collector, and the garbage of the one
    # before is collected outside the measurement, so that no collection (hundreds of ms
    # on this heap) lands in one mode's figures by chance.
    gc.collect()
    gc.freeze()
    try:
        # Rounds interleave the modes, so that the machine's drift is shared by all.
        for round_ in range(opts.repeats):
            for mode in opts.modes:
                step(f"measuring [{mode}] {round_ + 1}/{opts.repeats}")
                traced = opts.trace_detail if opts.trace and round_ == opts.repeats - 1 else None
                gc.collect()
                with trace_format.gc_paused():  # no collection inside a measured run
                    samples[mode].append(session.run(mode, trace=traced))
                step()
    finally:
        gc.unfreeze()
    return samples


def analyse(session: Session, opts: Options, samples: dict[str, list[dict]], census: dict[str, list[str]],
            timings: dict[str, float]) -> dict:
    """Every figure of the report from the measured samples and the census of kernels."""
    results = {mode: median_of(runs_) for mode, runs_ in samples.items()}
    speedups = speedups_of(samples)
    relative = relative_latencies(speedups)
    reference = load_reference(session.profile.name, opts.batch, opts.seq)
    kernels = {phase: len(efficiency.kernel_names(names)) for phase, names in census.items()}
    implied = published.implied(results, reference, kernels, speedups=speedups)
    return {
        "format": FORMAT,
        "model": session.profile.name,
        "batch": opts.batch,
        "seq": opts.seq,
        "decode_steps": opts.decode_steps,
        "repeats": opts.repeats,
        "layers": session.cfg.num_hidden_layers,
        "dtype": str(session.profile.dtype).removeprefix("torch."),
        "sim_mode": session.sim_mode,
        "device_profile": session.card.profile.name,
        "device_profile_digest": session.card.profile.digest,
        "host": host.describe(),
        "clock": CLOCK,
        "results": results,
        "speedups": speedups,
        "spread": spread_of(samples),
        "wall": {"speedups": speedups_of(samples, WALL_KEYS), "spread": spread_of(samples, WALL_KEYS)},
        "compute_share": compute_share_of(relative),
        "path_shares": path_shares_of(relative),
        "efficiency": efficiency_of(session, opts, results, census),
        "roofline_assumptions": roofline_assumptions(session.card.profile),
        "reference": reference,
        "kernels": kernels,
        "implied": implied,
        "whatif": published.whatif(results, implied, kernels),
        "timings": timings,
        "tp": opts.tp,
        "collectives": getattr(session, "collectives", {}),
    }


def efficiency_of(session: Session, opts: Options, results: dict, census: dict[str, list[str]]) -> dict:
    """Per phase step (a prefill; one decode token): device time against the roofline."""
    roofline = CostModel.of_figures(session.card.profile)
    mode = _census_mode(opts)
    out = {}
    for phase in PHASES:
        figures = published.phase_figures(results, mode, phase)
        if figures is None or phase not in census:
            continue
        kernels = efficiency.kernels_roofline(efficiency.kernel_names(census[phase]), roofline)
        cost = analytic.granite_step(session.profile.config | {"num_hidden_layers": session.cfg.num_hidden_layers},
                                     opts.batch, opts.seq, phase, str(session.profile.dtype).removeprefix("torch."))
        out[phase] = efficiency.phase_efficiency(figures["device_ms"], kernels, cost, roofline)
        edges = getattr(session, "edges", {}).get(phase)
        if edges:
            out[phase]["edges_ms"] = efficiency.compute_bound_edges_ms(edges, roofline)
    return out


def spread_of(samples: dict[str, list[dict]], keys: dict[str, str] = KEYS) -> dict:
    """Min and max over the repeats: of each mode's latencies, and of each round's speedups
    against the construct run of the same round."""
    latency = {mode: {phase: _min_max([r[key] for r in runs_]) for phase, key in keys.items()}
               for mode, runs_ in samples.items()}
    speedups = {mode: {phase: _min_max(r) for phase, r in by_phase.items()}
                for mode, by_phase in round_ratios(samples, keys).items()}
    return {"latency_ms": latency, "speedups": speedups}


def _min_max(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values), "n": len(values)}


# ---- the report ----------------------------------------------------------------------------


def render(console, out: dict, whatif_plot: str | None = None) -> None:
    """The report: latency per mode and phase, the gains against the published figures with
    their spread, device efficiency, and the published figures placed on our model."""
    console.print(_latency_table(out))
    if out.get("wall") and all("prefill_wall_ms" in r for r in out["results"].values()):
        console.print(_wall_table(out))
    if out["speedups"]:
        console.print(_gains_table(out))
        if out.get("reference"):
            console.print(f"[dim]published: {out['reference']['source']}[/]")
    if out.get("efficiency"):
        console.print(_efficiency_table(out["efficiency"]))
        if note := _assumptions_note(out):
            console.print(f"[yellow]{note}[/]")
    if out.get("implied"):
        console.print(published.implied_table(out["implied"]))
        console.print("[dim]implied: (published speedup - 1) x our device time / our kernels; ours: construct "
                      "latency - prebuilt latency, per kernel[/]")
    published.render_whatif(console, out.get("whatif") or {}, whatif_plot)
    tm = out.get("timings", {})
    if tm:
        console.print(f"[dim]model built in {tm.get('model_s', 0):.1f} s, compiled in {tm.get('compile_s', 0):.1f} s[/]")


def ms_text(v: float) -> str:  # four significant figures are plenty, and the tables fit 80 columns
    if abs(v) < 10:
        return f"{v:.3g}"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:,.1f}"


def _latency_table(out: dict):
    from rich import box
    from rich.table import Table

    title = (f"{out['model']} ({out['layers']} layers, {out['dtype']}), batch {out['batch']}, "
             f"sequence {out['seq']}, {out['decode_steps']} decode steps — {out['device_profile']}, "
             f"{out['sim_mode']} mode; medians of {out.get('repeats', 1)} interleaved rounds "
             "(speedups: of each round's ratio)")
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0),
              caption="\n".join(x for x in (host.label(out["host"]) if out.get("host") else None,
                                             clock_label(out)) if x),
              caption_justify="left",
              caption_style="dim")
    for col in ("mode", "prefill ms", "decode ms/tok", "host ms", "device ms", "device waits for host ms",
                "prefill speedup", "decode speedup"):
        t.add_column(col, justify="left" if col == "mode" else "right", no_wrap=col == "mode")
    sp = out["speedups"]
    for mode, r in out["results"].items():
        s = sp.get(mode, {})
        t.add_row(mode, ms_text(r["prefill_ms"]), ms_text(r["decode_ms_per_token"]), ms_text(r["host_ms"]),
                  ms_text(r["device_ms"]), ms_text(r["device_wait_host_ms"]),
                  *(f"{s[phase]:.2f}x" if phase in s else "—" for phase in ("prefill", "decode")))
    if not sp:
        t.caption = ((t.caption + "\n") if t.caption else "") + "speedups are against construct, which was not run"
    return t


def clock_label(out: dict) -> str:
    """Which clock the host figures are in (a run written before format 3: wall time)."""
    if out.get("clock", {}).get("host") == "thread-cpu":
        return ("host clock: CPU time of the dispatching thread (CLOCK_THREAD_CPUTIME_ID), the card's own "
                "work left out; another process taking a core does not move it")
    return "host clock: wall time (CLOCK_MONOTONIC), the simulator's own time left out"


def _wall_table(out: dict):
    """The latencies, host work and speedups again on the host clock's wall twin (the host
    clock with the host's time off the CPU put back), each speedup with its spread over the
    runs as ± half its range, in % of the median."""
    from rich import box
    from rich.table import Table

    wall = out["wall"]
    t = Table(title="beside it in wall time (CLOCK_MONOTONIC, the card's work left out): the host clock with "
                    "the host's time off the CPU put back", title_justify="left", box=box.SIMPLE_HEAD,
              show_edge=False, padding=(0, 0))
    for col in ("mode", "prefill ms", "decode ms/tok", "host ms", "prefill speedup", "decode speedup"):
        t.add_column(col, justify="left" if col == "mode" else "right", no_wrap=col == "mode")
    sp, spread = wall["speedups"], wall["spread"].get("speedups", {})

    def cell(mode: str, phase: str) -> str:
        if phase not in sp.get(mode, {}):
            return "—"
        v, mm = sp[mode][phase], spread.get(mode, {}).get(phase)
        return f"{v:.2f}x" + (f" ±{(mm['max'] - mm['min']) / 2 / v * 100:.0f} %" if mm and mode != "construct" else "")

    for mode, r in out["results"].items():
        t.add_row(mode, ms_text(r["prefill_wall_ms"]), ms_text(r["decode_wall_ms_per_token"]), ms_text(r["host_wall_ms"]),
                  cell(mode, "prefill"), cell(mode, "decode"))
    return t


def _gains_table(out: dict):
    from rich.table import Table

    sp, share, ref = out["speedups"], out["compute_share"], out.get("reference")
    spread = out.get("spread", {}).get("speedups", {})
    n = out.get("repeats", 1)
    t = Table(title="against the published figures" if ref else "gains", title_justify="left")
    for col in ("figure", "measured", f"spread, {n} runs", "published", "difference"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    rows = []
    for mode in MODES[1:]:
        for phase in PHASES:
            if mode in sp:
                pub = ref["speedups"].get(mode, {}).get(phase) if ref else None
                rows.append((f"{phase} speedup, {mode}", sp[mode][phase], spread.get(mode, {}).get(phase), pub, "x"))
    for phase in PHASES:
        if phase in share:
            pub = ref["compute_share"].get(phase) if ref else None
            rows.append((f"{phase}: share of the gain from the compute path", share[phase], None, pub, "%"))
    for phase, by_path in out.get("path_shares", {}).items():
        for path, value in by_path.items():
            rows.append((f"{phase}: share of the gain, {path} path alone", value, None, None, "%"))
    for name, mine, mm, pub, unit in rows:
        fmt = (lambda v: f"{v * 100:.0f} %") if unit == "%" else (lambda v: f"{v:.2f}x")
        diff = "" if pub is None or not math.isfinite(mine) else f"{(mine - pub) / pub * 100:+.0f} %"
        t.add_row(name, fmt(mine) if math.isfinite(mine) else "n/a",
                  f"{mm['min']:.2f}–{mm['max']:.2f}x" if mm else "", fmt(pub) if pub is not None else "—", diff)
    return t


def _efficiency_table(eff: dict):
    from rich import box
    from rich.table import Table

    t = Table(title="device efficiency: device time against the card's roofline, per prefill and per decode token",
              title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True,
              caption_justify="left", caption_style="dim")
    for col in ("phase", "device ms", "roofline ms", "efficiency", "bound", "roofline of", "analytic ms"):
        t.add_column(col, justify="left" if col in ("phase", "bound", "roofline of") else "right")
    for phase, e in eff.items():
        fraction = f"{e['fraction'] * 100:.0f} %" if e["fraction"] is not None else "—"
        t.add_row(phase, ms_text(e["device_ms"]), ms_text(e["roofline_ms"]),
                  fraction, e["bound"], f"{e['kernels']:,} kernels" if e["source"] == "kernels" else "the model",
                  ms_text(e["analytic"]["roofline_ms"]))
    notes = []
    if any(e["source"] != "kernels" for e in eff.values()):
        notes.append("the kernels carry no info (FLOPs, bytes): the roofline is the analytic model's, matmuls and "
                     "attention against weights, KV cache and activations")
    notes += [f"{phase}: {ms_text(e['edges_ms'])} ms of fill and drain in compute-bound kernels "
              f"({100 * e['edges_ms'] / e['device_ms']:.1f} % of its device time): their arrays and SFUs idle while "
              "their first operands load and their last results store"
              for phase, e in eff.items() if e.get("edges_ms") and e["device_ms"] > 0]
    t.caption = "\n".join(notes) or None
    return t


def _assumptions_note(out: dict) -> str | None:
    names = out.get("roofline_assumptions")
    if not names:
        return None
    return ("the roofline rests on figures that are assumptions, not published (spyre-profile info gives the "
            "reasoning): " + ", ".join(names))


def write_json(out: dict, path: str) -> None:
    """Write the figures atomically (temp file in the same directory, then rename)."""
    import json
    import tempfile

    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".run-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1, sort_keys=True, default=str)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
