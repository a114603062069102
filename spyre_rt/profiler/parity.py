"""One model family on the card against CPU eager: the runs the compatibility matrix and the
model-parity tests compare.

A decoder runs a prefill of :data:`PROMPT_LEN` tokens and :data:`DECODE_STEPS` greedy
decode steps with a static cache (one prefill graph, one decode graph that every step
reuses): a static KV layer per layer, or the cache classes the model's config names (a
Mamba layer's conv and SSM states); an encoder runs a batch of two sequences, the second
padded, and gives its hidden states; an encoder-decoder runs ``generate()`` (greedy,
1 + :data:`DECODE_STEPS` new tokens, Hugging Face's default encoder-decoder cache) with a
compiled forward under Dynamo's automatic dynamic shapes: the second step's longer cache
recompiles with symbolic sizes, which every later step reuses. All run on the CPU in eager
mode and on the card through ``torch.compile(backend="spyre_rt")``, compiled once and run
in each dispatch mode.

Every run is fed the tokens the CPU fp32 reference chose greedily, so logits compare step
by step even where a run's own greedy choice would differ (a tie within rounding). The
card's fp32 outputs must be within :data:`FP32_ATOL` of the reference; its fp16 outputs
within :func:`fp16_tolerance`, which is stated against CPU eager's own fp16 error.
"""

from __future__ import annotations

import copy
import inspect
from collections import Counter
from dataclasses import dataclass, field

import torch

from .. import card as cards
from .. import fallback
from ..dispatch import NAMES as MODES  # every dispatch mode: their outputs must be the same bits
from ..dispatch import dispatch_mode
from .efficiency import kernel_names
from .models import DECODER, ENCODER, SEQ2SEQ, Family

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}

PROMPT_LEN = 8
DECODE_STEPS = 16
MAX_CACHE_LEN = 32
ENCODER_BATCH, ENCODER_SEQ, ENCODER_PADDING = 2, 12, 5  # the second sequence ends in 5 pads

FP32_ATOL = 1e-4
FP16_SLACK, FP16_FLOOR = 2.0, 1e-3  # see fp16_tolerance


# ---- one run -------------------------------------------------------------------------------


@dataclass
class Run:
    """What one run of a model produced, on the CPU (as fp32 or the run's dtype)."""

    prefill: torch.Tensor                                      # logits (1, PROMPT_LEN, vocab); encoders: hidden
    #                                                            states; encoder-decoders: the first step's (1, vocab)
    decode: list[torch.Tensor] = field(default_factory=list)   # (vocab,) logits per decode step
    tokens: list[int] = field(default_factory=list)            # the first from prefill, then one per step
    counters: dict[str, dict] = field(default_factory=dict)    # Dynamo's counters after each phase

    def outputs(self) -> torch.Tensor:
        """Every output of the run, prefill and decode, as one flat fp32 tensor."""
        parts = [self.prefill.float().flatten()] + [d.float().flatten() for d in self.decode]
        return torch.cat(parts)


def dynamo_counts() -> dict[str, int]:
    """Graphs Dynamo made, frames it converted and graph breaks, so far."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"],
            "graph_breaks": sum(counters["graph_break"].values())}


def _compiled(fn, fullgraph: bool, dynamic: bool | None = False):
    """`fn` compiled for the card, Dynamo's state, counters and compile times started afresh
    (`dynamic` None: Dynamo's automatic dynamic shapes)."""
    from torch._dynamo.utils import clear_compilation_metrics, counters

    counters.clear()
    clear_compilation_metrics()
    torch._dynamo.reset()
    return torch.compile(fn, backend="spyre_rt", fullgraph=fullgraph, dynamic=dynamic)


def _kv_shape(cfg) -> tuple[list[int], list[int]]:
    """Key/value heads and head size of each layer of a decoder's cache, from its config
    (Gemma 4's global layers have wider heads than its sliding ones; a config without
    attention heads, Mamba's, gives 1: its layers keep no keys and values)."""
    layers = getattr(cfg, "per_layer_config", None) or [cfg] * cfg.num_hidden_layers
    kv, head_dims = [], []
    for c in layers:
        heads = getattr(c, "num_attention_heads", None)
        if heads is None:
            kv.append(1)
            head_dims.append(1)
            continue
        kv.append(getattr(c, "num_key_value_heads", None) or heads)
        head_dims.append(getattr(c, "head_dim", None) or c.hidden_size // heads)
    return kv, head_dims


def model_cache(model, cfg, dtype: torch.dtype, device: str):
    """Transformers' ``StaticCache`` of the model's config: the cache class of each layer
    the config names, at MAX_CACHE_LEN positions, allocated on `device`.

    Its linear-attention layers (Mamba's conv and SSM states) would make their states in
    the first prefill, so that a compiled prefill after :meth:`Cache.reset` (which keeps
    them) is another graph; they are made here instead, of the shapes and dtypes a CPU
    prefill of a model of the same config gives them (the SSM state is fp32 in an fp16
    model)."""
    from transformers.cache_utils import LinearAttentionLayer, StaticCache

    def new_cache():
        return StaticCache(config=cfg, max_cache_len=MAX_CACHE_LEN)

    cache = new_cache()
    kv, head_dim = _kv_shape(cfg)
    cache.early_initialization(batch_size=1, num_heads=kv, head_dim=head_dim, dtype=dtype, device=device)
    linear = [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionLayer)]
    if linear:
        twin = type(model)(cfg).to(dtype).eval()  # on the CPU (the meta device lacks MoE's grouped_mm in fp32)
        shapes = new_cache()
        with torch.no_grad():
            twin(prompt_ids(cfg.vocab_size), position_ids=torch.arange(PROMPT_LEN)[None], use_cache=True,
                 **{cache_argument(twin): shapes})
        for i in linear:
            src, dst = shapes.layers[i], cache.layers[i]
            for k in range(src.number_of_states):
                conv, state = src.conv_states[k], src.recurrent_states[k]
                dst.lazy_initialization(
                    conv_states=None if conv is None else torch.zeros(conv.shape, dtype=conv.dtype, device=device),
                    recurrent_states=None if state is None else torch.zeros(state.shape, dtype=state.dtype, device=device),
                    state_idx=k, conv_kernel_size=src.conv_kernel_size[k])
    return cache


def static_cache(cfg, dtype: torch.dtype, device: str):
    """A static KV cache of MAX_CACHE_LEN positions in every layer, allocated on `device`.

    This is transformers' ``StaticCache`` for models without sliding-window layers. Its
    sliding-window layers (``StaticSlidingWindowLayer``) keep the cache's length in a
    Python int that changes every step, so Dynamo recompiles every decode step (with
    ``dynamic=False``) or returns the int from a dynamic graph, which the backend cannot
    yet do. A full-length layer, with the window applied by the attention mask, computes
    the same attention (Mistral's and Gemma 2's windows run this way)."""
    from transformers.cache_utils import Cache, StaticLayer

    cache = Cache(layers=[StaticLayer(max_cache_len=MAX_CACHE_LEN) for _ in range(cfg.num_hidden_layers)])
    kv, head_dim = _kv_shape(cfg)
    cache.early_initialization(batch_size=1, num_heads=kv, head_dim=head_dim, dtype=dtype, device=device)
    return cache


def prompt_ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def cache_argument(model) -> str:
    """The name the model's forward gives its cache (Mamba's ``cache_params``, else
    ``past_key_values``)."""
    params = inspect.signature(model.forward).parameters
    return "cache_params" if "cache_params" in params and "past_key_values" not in params else "past_key_values"


class Decoder:
    """A causal LM with a static cache on one device, run as prefill + greedy decode."""

    def __init__(self, model, cfg, dtype: torch.dtype, device: str, compiled: bool, fullgraph: bool = True,
                 cache: str = "static"):
        self.device, self.vocab = device, cfg.vocab_size
        self.cache = kv = model_cache(model, cfg, dtype, device) if cache == "model" else static_cache(cfg, dtype, device)
        name = cache_argument(model)
        # every position of the cache unmasked, as generate() passes a mask: without one, the
        # causal mask asks whether a static cache is empty of a tensor (a data-dependent branch)
        mask = torch.ones(1, MAX_CACHE_LEN, dtype=torch.long).to(device)

        def forward(ids, pos):
            return model(ids, attention_mask=mask, position_ids=pos, use_cache=True, **{name: kv}).logits

        self.fn = _compiled(forward, fullgraph) if compiled else forward

    def run(self, steps: int = DECODE_STEPS, feed: list[int] | None = None) -> Run:
        """Prefill the prompt, then `steps` decode steps, each fed the token chosen greedily
        by the step before (or, with `feed`, the tokens of another run)."""
        self.cache.reset()
        device = self.device
        with torch.no_grad():
            logits = self.fn(prompt_ids(self.vocab).to(device), torch.arange(PROMPT_LEN)[None].to(device))
            run = Run(prefill=logits.cpu())
            run.counters["prefill"] = dynamo_counts()
            run.tokens.append(int(run.prefill[0, -1].argmax()))
            for s in range(steps):
                token = feed[s] if feed else run.tokens[-1]
                step = self.fn(torch.tensor([[token]]).to(device), torch.tensor([[PROMPT_LEN + s]]).to(device))
                run.decode.append(step[0, -1].cpu())
                run.tokens.append(int(run.decode[-1].argmax()))
                if s == 0:
                    run.counters["first_decode"] = dynamo_counts()
        run.counters["decode"] = dynamo_counts()
        return run


def encoder_inputs(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and the attention mask of a batch of two, the second sequence padded."""
    ids = torch.randint(3, vocab, (ENCODER_BATCH, ENCODER_SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, ENCODER_SEQ - ENCODER_PADDING:] = 0
    ids[1, ENCODER_SEQ - ENCODER_PADDING:] = 0
    return ids, mask


class Encoder:
    """An encoder on one device: hidden states of a padded batch."""

    def __init__(self, model, cfg, device: str, compiled: bool, fullgraph: bool = True):
        self.device, self.vocab = device, cfg.vocab_size

        def forward(ids, mask):
            return model(input_ids=ids, attention_mask=mask).last_hidden_state

        self.fn = _compiled(forward, fullgraph) if compiled else forward

    def run(self, steps: int = 0, feed: list[int] | None = None) -> Run:
        ids, mask = encoder_inputs(self.vocab)
        with torch.no_grad():
            hidden = self.fn(ids.to(self.device), mask.to(self.device))
        run = Run(prefill=hidden.cpu())
        run.counters["prefill"] = dynamo_counts()
        return run


class _Forced:
    """A logits processor that makes generate() choose `tokens` (one per step, while they
    last), so a run's inputs are another run's; the logits generate() returns are the
    model's own, from before any processor."""

    def __init__(self, tokens: list[int], start: int):
        self.tokens, self.start = tokens, start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.start
        if step >= len(self.tokens):
            return scores
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.tokens[step]] = 0.0
        return forced


class Seq2Seq:
    """An encoder-decoder on one device, run by ``generate()``: greedy, 1 + DECODE_STEPS new
    tokens, with Hugging Face's default cache; on the card its forward is compiled with
    Dynamo's automatic dynamic shapes (each step's cache is one position longer)."""

    def __init__(self, model, cfg, device: str, compiled: bool, fullgraph: bool = True):
        self.model, self.device, self.vocab = model, device, cfg.vocab_size
        self.start = 1  # generate() starts the decoder's sequence with one token
        if compiled:
            model.forward = _compiled(model.forward, fullgraph, dynamic=None)

    def run(self, steps: int = DECODE_STEPS, feed: list[int] | None = None) -> Run:
        """generate() of 1 + `steps` tokens, each step's input the token the step before
        chose greedily (or, with `feed`, the tokens of another run). The tokens recorded are
        each step's greedy choice, as a decoder's are."""
        from transformers import LogitsProcessorList

        ids = prompt_ids(self.vocab)
        processors = LogitsProcessorList([_Forced(feed, self.start)] if feed else [])
        with torch.no_grad():
            out = self.model.generate(
                ids.to(self.device), attention_mask=torch.ones_like(ids).to(self.device), do_sample=False,
                max_new_tokens=steps + 1, min_new_tokens=steps + 1, num_beams=1, logits_processor=processors,
                output_logits=True, return_dict_in_generate=True)
        logits = [lg[0].cpu() for lg in out.logits]
        run = Run(prefill=logits[0][None], decode=logits[1:], tokens=[int(lg.argmax()) for lg in logits])
        run.counters["decode"] = dynamo_counts()
        return run


def runner(fam: Family, model, cfg, dtype: torch.dtype, device: str, compiled: bool, fullgraph: bool = True):
    if fam.kind == DECODER:
        return Decoder(model, cfg, dtype, device, compiled, fullgraph, cache=fam.cache)
    if fam.kind == SEQ2SEQ:
        return Seq2Seq(model, cfg, device, compiled, fullgraph)
    assert fam.kind == ENCODER, fam.kind
    return Encoder(model, cfg, device, compiled, fullgraph)


# ---- one family in one dtype ----------------------------------------------------------------


@dataclass
class Census:
    """What the card did in one prefill and one decode step (an encoder: one forward)."""

    kernels: dict[str, int] = field(default_factory=dict)         # phase -> kernels
    cpu_ops: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> op -> calls on the CPU
    cpu_share: dict[str, float] = field(default_factory=dict)     # phase -> the CPU's share of its time

    def cpu_share_of_decode(self) -> float:
        """The CPU's share of a decode step's time (an encoder: of its forward)."""
        return self.cpu_share.get("decode", self.cpu_share.get("forward", 0.0))


@dataclass
class Compared:
    """A family's runs in one dtype: CPU eager and the card, against the fp32 reference."""

    family: str
    dtype: str
    ref: Run                                         # CPU eager, fp32, greedy
    cpu: Run                                         # CPU eager in `dtype`, fed the reference's tokens
    card: dict[str, Run] = field(default_factory=dict)  # the card in each dispatch mode, likewise fed
    compile_s: float = 0.0                           # Dynamo, AOT and Inductor time of the card's graphs
    census: Census = field(default_factory=Census)

    def error(self) -> float:
        """The largest difference of the card's outputs from the fp32 reference (every
        mode's outputs are the same bits: :meth:`modes_agree`)."""
        return (next(iter(self.card.values())).outputs() - self.ref.outputs()).abs().max().item()

    def cpu_error(self) -> float:
        """The same for CPU eager in this dtype (zero in fp32)."""
        return (self.cpu.outputs() - self.ref.outputs()).abs().max().item()

    def tolerance(self) -> float:
        return FP32_ATOL if self.dtype == "fp32" else fp16_tolerance(self)

    def modes_agree(self) -> bool:
        """Every dispatch mode's outputs are the same bits."""
        outs = [r.outputs() for r in self.card.values()]
        return all(torch.equal(o, outs[0]) for o in outs[1:])


def fp16_tolerance(c: Compared) -> float:
    """The stated fp16 tolerance: the card may be at most FP16_SLACK times as far from the
    fp32 outputs as CPU eager in fp16 is, plus FP16_FLOOR of the largest fp32 output (for
    runs where CPU fp16 happens to be very close). The card accumulates in fp32 and rounds
    when a kernel stores, so it is usually closer than CPU fp16, which rounds every op."""
    return FP16_SLACK * c.cpu_error() + FP16_FLOOR * c.ref.outputs().abs().max().item()


def reference(fam: Family) -> Run:
    """CPU eager in fp32, greedy: what every other run is compared with."""
    cfg, model = fam.build(torch.float32)
    return runner(fam, model, cfg, torch.float32, "cpu", compiled=False).run()


def compare(fam: Family, dname: str, modes: tuple[str, ...] = MODES, ref: Run | None = None,
            fullgraph: bool = True) -> Compared:
    """Run `fam` in dtype `dname` on the CPU and on the card (compiled once, then run in
    each of `modes`), every run fed the fp32 reference's tokens. Errors of the card's
    compile or runs propagate."""
    dtype = DTYPES[dname]
    ref = ref if ref is not None else reference(fam)
    feed = ref.tokens[:-1]
    cfg, model = fam.build(dtype)
    cpu = runner(fam, model, cfg, dtype, "cpu", compiled=False).run(feed=feed)
    out = Compared(fam.name, dname, ref, cpu)
    card = runner(fam, copy.deepcopy(model).to("spyre"), cfg, dtype, "spyre", compiled=True, fullgraph=fullgraph)
    counted = "prebuilt" if "prebuilt" in modes else modes[-1]
    for mode in modes:  # the first mode's run compiles; the others reuse the graphs
        with dispatch_mode(mode):
            out.card[mode] = card.run(feed=feed)
            if mode == counted:
                out.census = census(card)
    out.compile_s = _compile_seconds()
    return out


def _compile_seconds() -> float:
    """Dynamo's, AOT's and Inductor's time on the frames compiled since :func:`_compiled`."""
    from torch._dynamo.utils import get_compilation_metrics

    return sum(m.entire_frame_compile_time_s or 0.0 for m in get_compilation_metrics())


def cpu_share(card, ev) -> float:
    """Of the time a phase's work took, the share the CPU did: its host spans for ops with
    no card kernel (the op and its copies, by the card's host clock) against those plus the
    card's jobs (their run and launch latency, on the card's timeline)."""
    is_job = ev["kind"] == cards.EV_JOB
    job_ns = float((ev["end_ns"][is_job] - ev["start_ns"][is_job]).sum()) + int(is_job.sum()) * card.profile["job_launch_ns"]
    host = ev[ev["kind"] == cards.EV_HOST]
    on_cpu = [card.name_of(int(a)).startswith(cards.CPU_SPAN) for a in host["a"].tolist()]
    cpu_ns = float((host["end_ns"][on_cpu] - host["start_ns"][on_cpu]).sum()) if any(on_cpu) else 0.0
    return cpu_ns / (cpu_ns + job_ns) if cpu_ns + job_ns > 0 else 0.0


def census(r: Decoder | Encoder | Seq2Seq) -> Census:
    """The kernels the card runs, and the ops that run on the CPU, in a prefill and in one
    decode step (an encoder: its forward; an encoder-decoder: generate()'s first step and
    its last, a step of the graph with symbolic sizes), from a traced run of them."""
    card = cards.get(0)
    out = Census()

    def measure(fn) -> tuple[int, dict[str, int], float]:
        first = card.trace_count()
        eager, in_steps = Counter(fallback.calls), Counter(fallback.in_steps)
        with torch.no_grad():
            fn()
        ev = card.trace_events(first)
        jobs = [card.name_of(int(a)) for a in ev["a"][ev["kind"] == cards.EV_JOB].tolist()]
        ops = (Counter(fallback.calls) - eager) + (Counter(fallback.in_steps) - in_steps)
        return len(kernel_names(jobs)), dict(ops), cpu_share(card, ev)

    def phase(name: str, fn) -> None:
        out.kernels[name], out.cpu_ops[name], out.cpu_share[name] = measure(fn)

    card.trace_enable(True, commands=False)
    try:
        if isinstance(r, Decoder):
            r.cache.reset()
            phase("prefill", lambda: r.fn(prompt_ids(r.vocab).to(r.device),
                                          torch.arange(PROMPT_LEN)[None].to(r.device)).cpu())
            phase("decode", lambda: r.fn(torch.tensor([[3]]).to(r.device),
                                         torch.tensor([[PROMPT_LEN]]).to(r.device)).cpu())
        elif isinstance(r, Seq2Seq):
            steps, forward = [], r.model.forward

            def counted(*args, **kwargs):  # each call of the compiled forward, on its own
                result = []
                steps.append(measure(lambda: result.append(forward(*args, **kwargs)) or result[0].logits.cpu()))
                return result[0]

            r.model.forward = counted
            try:
                r.run()
            finally:
                r.model.forward = forward
            for name, step in (("prefill", steps[0]), ("decode", steps[-1])):
                out.kernels[name], out.cpu_ops[name], out.cpu_share[name] = step
        else:
            phase("forward", r.run)
    finally:
        card.trace_enable(False)
    return out
