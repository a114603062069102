"""Benchmarks of spyre_rt (pytest-benchmark). See the README's "Benchmarks" section.

Every target is a ratio measured side by side in one run, recorded in `extra_info` and
checked by ``targets.check_target`` when the benchmarks are enabled (the default test run only
executes each once, with ``--benchmark-disable``); absolute times are for regression
comparison between runs on one machine only.

One clock on both sides of every comparison (docs/ARCHITECTURE.md, "Host work and the
card's"): host work is CPU time of the calling thread (``time.thread_time_ns``, which is the
card's host clock, CLOCK_THREAD_CPUTIME_ID), the simulated card's work left out, and wall
time is reported beside it. The card's side reads the card's host clock and its wall twin;
the Dynamo floor, which has no card, reads the thread's CPU clock and ``perf_counter``. What
pytest-benchmark's own table shows is the wall time of the whole call, the simulator's work
included.
"""

import os
import tempfile
import time
from typing import NamedTuple

import pytest
import torch

# Every benchmark session starts with an empty plan cache of its own.
os.environ.setdefault("SPYRE_RT_CACHE_DIR", tempfile.mkdtemp(prefix="spyre-rt-bench-plans-"))

from spyre_rt import device_profile  # noqa: E402
from spyre_rt.card import Card  # noqa: E402


@pytest.fixture(scope="session")
def spyre_profile():
    return device_profile.load("spyre")


@pytest.fixture(scope="session")
def timing_card(spyre_profile):
    return Card(spyre_profile, "timing", 0)


@pytest.fixture(scope="session")
def functional_card(spyre_profile):
    return Card(spyre_profile, "functional", 1)


class Cost(NamedTuple):
    """Host work per call: CPU time of the calling thread (the host clock) and wall time."""

    cpu: float
    wall: float

    def scaled(self, k: float) -> "Cost":
        return Cost(self.cpu * k, self.wall * k)


def thread_cost(call, times: int) -> Cost:
    """ns per call of `call` with nothing on the card: the thread's CPU time, and wall time."""
    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    for _ in range(times):
        call()
    c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
    return Cost((c1 - c0) / times, (w1 - w0) / times)


class Decoder:
    """A compiled Granite on the card with its prompt prefilled: ``step()`` is one decode step."""

    def __init__(self, session):
        self.session = session
        self.card = session.card
        with torch.no_grad(), session.active():  # the session's own (timing-mode) cards
            session.prefill()
            self.ids = torch.zeros(session.opts.batch, 1, dtype=torch.long).to("spyre")
            self.pos = torch.full((session.opts.batch, 1), session.opts.seq, dtype=torch.long).to("spyre")

    def step(self):
        with torch.no_grad():
            return self.session.forward(self.ids, self.pos)

    def graph(self):
        """The decode step captured (torch.spyre.graph): replay() runs it again."""
        with torch.no_grad(), self.session.active():
            self.step()
            g = torch.spyre.SpyreGraph()
            with torch.spyre.graph(g):
                self.step()
        return g

    def host_ns_per_step(self, steps: int) -> tuple[Cost, float]:
        """Host work (the card's own work and waits for it left out) and native calls per
        step, from the card's clocks and counters."""
        host, counted = self.card_cost(self.step, steps)
        return host, counted["native_calls"]

    def card_cost(self, call, times: int) -> tuple[Cost, dict[str, float]]:
        """Host ns per call of `call`, on the host clock and its wall twin (the card's own
        work and the waits for it left out), and the card's counters per call."""
        card = self.card
        card.synchronize()
        c0, h0 = card.counters(), card.clock()
        for _ in range(times):
            call()
        card.synchronize()
        c1, h1 = card.counters(), card.clock()
        waited = c1["wait_ns"] - c0["wait_ns"]
        host = Cost(h1.host_ns - h0.host_ns - waited, h1.host_wall_ns - h0.host_wall_ns - waited)
        return host.scaled(1 / times), {k: (c1[k] - c0[k]) / times for k in c1}


@pytest.fixture(scope="session")
def tiny_granite():
    """A factory of compiled Granite decoders in timing mode (the host path is what is
    measured; the simulator keeps no data): ``tiny_granite(layers=None)``."""
    from spyre_rt.profiler.run import Options, Session

    made: dict = {}

    def make(layers: int | None = None) -> Decoder:
        if layers not in made:
            made[layers] = Decoder(Session(Options(model="granite-tiny", seq=8, decode_steps=1,
                                                   sim_mode="timing", layers=layers)))
        return made[layers]

    return make


class CpuFloor:
    """The same Granite on CPU tensors under Dynamo with a do-nothing backend: the compiled
    graph returns outputs it made once, so a step costs Dynamo's frame and guards alone."""

    def __init__(self, layers: int | None):
        from transformers import GraniteForCausalLM, StaticCache

        from spyre_rt.profiler.run import load_model

        model_profile = load_model("granite-tiny")
        cfg = model_profile.hf_config(layers)
        torch.manual_seed(0)
        model = GraniteForCausalLM(cfg).to(model_profile.dtype).eval()
        cache = StaticCache(config=cfg, max_cache_len=16)
        cache.early_initialization(batch_size=1, num_heads=cfg.num_key_value_heads,
                                   head_dim=cfg.hidden_size // cfg.num_attention_heads, dtype=model_profile.dtype,
                                   device="cpu")

        def do_nothing(gm, example_inputs):
            outs = gm(*example_inputs)
            return lambda *args: outs

        mask = torch.ones(1, 16, dtype=torch.long)  # as the card's session passes it (profiler/run.py)

        def forward(ids, pos):
            return model(ids, attention_mask=mask, past_key_values=cache, position_ids=pos, use_cache=True,
                         logits_to_keep=1).logits

        self.forward = torch.compile(forward, backend=do_nothing, fullgraph=True, dynamic=False)
        with torch.no_grad():  # a prefill graph first, as the decoders on the card have
            self.forward(torch.zeros(1, 8, dtype=torch.long), torch.arange(8).view(1, 8))
        self.ids = torch.zeros(1, 1, dtype=torch.long)
        self.pos = torch.full((1, 1), 8, dtype=torch.long)

    def step(self):
        with torch.no_grad():
            return self.forward(self.ids, self.pos)

    def host_ns_per_step(self, steps: int) -> Cost:
        """Host work per step on the same clock as the card's side (no card here)."""
        return thread_cost(self.step, steps)


@pytest.fixture(scope="session")
def cpu_floor():
    """A factory of :class:`CpuFloor` models: ``cpu_floor(layers=None)``."""
    made: dict = {}

    def make(layers: int | None = None) -> CpuFloor:
        if layers not in made:
            made[layers] = CpuFloor(layers)
            made[layers].step()
        return made[layers]

    return make
