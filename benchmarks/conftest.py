"""Benchmarks of spyre_rt (pytest-benchmark). See the README's "Benchmarks" section.

Every target is a ratio measured side by side in one run, recorded in `extra_info`;
absolute times are for regression comparison between runs on one machine only.
"""

import os
import tempfile
import time

import pytest
import torch

# Every benchmark session starts with an empty plan cache of its own.
os.environ.setdefault("SPYRE_RT_CACHE_DIR", tempfile.mkdtemp(prefix="spyre-rt-bench-plans-"))

from spyre_rt import profile  # noqa: E402
from spyre_rt.card import Card  # noqa: E402


@pytest.fixture(scope="session")
def spyre_profile():
    return profile.load("spyre")


@pytest.fixture(scope="session")
def timing_card(spyre_profile):
    return Card(spyre_profile, "timing", 0)


@pytest.fixture(scope="session")
def functional_card(spyre_profile):
    return Card(spyre_profile, "functional", 1)


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

    def host_ns_per_step(self, steps: int) -> tuple[float, float]:
        """Host time (simulator arithmetic and waits for the card excluded) and native calls
        per step, from the card's clock and counters."""
        host, counted = self.card_cost(self.step, steps)
        return host, counted["native_calls"]

    def card_cost(self, call, times: int) -> tuple[float, dict[str, float]]:
        """Host ns per call of `call` (simulator arithmetic and waits for the card excluded)
        and the card's counters per call."""
        card = self.card
        card.synchronize()
        c0, h0 = card.counters(), card.host_clock_ns()
        for _ in range(times):
            call()
        card.synchronize()
        c1, h1 = card.counters(), card.host_clock_ns()
        host = (h1 - h0) - (c1["wait_ns"] - c0["wait_ns"])
        return host / times, {k: (c1[k] - c0[k]) / times for k in c1}


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

        profile = load_model("granite-tiny")
        cfg = profile.hf_config(layers)
        torch.manual_seed(0)
        model = GraniteForCausalLM(cfg).to(profile.dtype).eval()
        cache = StaticCache(config=cfg, max_cache_len=16)
        cache.early_initialization(batch_size=1, num_heads=cfg.num_key_value_heads,
                                   head_dim=cfg.hidden_size // cfg.num_attention_heads, dtype=profile.dtype,
                                   device="cpu")

        def do_nothing(gm, example_inputs):
            outs = gm(*example_inputs)
            return lambda *args: outs

        def forward(ids, pos):
            return model(ids, cache=cache, position_ids=pos, use_cache=True, logits_to_keep=1).logits

        self.forward = torch.compile(forward, backend=do_nothing, fullgraph=True, dynamic=False)
        with torch.no_grad():  # a prefill graph first, as the decoders on the card have
            self.forward(torch.zeros(1, 8, dtype=torch.long), torch.arange(8).view(1, 8))
        self.ids = torch.zeros(1, 1, dtype=torch.long)
        self.pos = torch.full((1, 1), 8, dtype=torch.long)

    def step(self):
        with torch.no_grad():
            return self.forward(self.ids, self.pos)

    def host_ns_per_step(self, steps: int) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(steps):
            self.step()
        return (time.perf_counter_ns() - t0) / steps


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
