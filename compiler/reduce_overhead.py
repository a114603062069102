"""``torch.compile(..., mode="reduce-overhead", backend="spyre_rt")``: each compiled graph
captured with ``torch.spyre.graph`` and replayed, per shape, as CUDA graphs are on a GPU.

Per call signature (the tensors' shapes, strides and dtypes, the parameters' identities and
the Python numbers' values) the first call runs the compiled graph as it is (the warm-up:
the card's plans are built), the second captures it on static inputs the wrapper owns, and
every later call copies its tensors into those inputs and replays: one native call, no
binding work. Parameters and tensors marked static (``torch._dynamo.mark_static_address``,
the buffers of compiled modules) are read where they are, as CUDA graphs do. An input the
graph writes is written back after each replay. Outputs are copies of the static ones, so a
later replay never overwrites what an earlier call returned.

A graph that cannot be captured (an op on the CPU, host tensors, an output on the host) runs
as the compiled call it is, with the reason logged once.
"""

from __future__ import annotations

import logging

import torch

import spyre_rt

_log = logging.getLogger("spyre_rt.compiler")

#: modes of torch.compile this backend takes; those in REPLAY capture and replay
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
REPLAY = ("reduce-overhead", "max-autotune")

#: calls by what they did, over every reduce-overhead graph of the process (read by tests)
stats = {"warmups": 0, "captures": 0, "replays": 0, "uncaptured": 0}


def replays(mode: str | None) -> bool:
    """Whether torch.compile's `mode` asks for capture and replay (a ValueError if unknown)."""
    if mode is None:
        return False
    if mode not in MODES:
        raise ValueError(f"torch.compile mode {mode!r} is not one of the spyre_rt backend's: {', '.join(MODES)}")
    return mode in REPLAY


def _static(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or hasattr(t, "_dynamo_static_input_type")


def _signature(args: tuple) -> tuple | None:
    """What a capture is specialized to, or None when the call cannot be captured (a tensor
    not on the card)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.device.type != "spyre":
                return None
            key.append(("static", id(a)) if _static(a) else (a.device, a.shape, a.stride(), a.dtype))
        else:
            key.append((type(a), a))
    return tuple(key)


class _Captured:
    """One signature's capture: static inputs, the graph, its static outputs, and the inputs
    it writes."""

    def __init__(self, compiled, args: tuple, mutated: list[int]) -> None:
        self.owned = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not _static(a)]
        static = list(args)
        for i in self.owned:
            a = args[i]
            static[i] = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a)
        self.static = static
        self.write_back = [i for i in mutated if i in self.owned]
        self.graph = spyre_rt.graphs.SpyreGraph()
        with spyre_rt.graphs.graph(self.graph):
            self.outputs = compiled(*static)

    def run(self, args: tuple, replay: bool):
        static = self.static
        if replay:
            for i in self.owned:
                static[i].copy_(args[i])
            self.graph.replay()
        for i in self.write_back:
            args[i].copy_(static[i])
        return _copies(self.outputs)


def _copies(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_copies(o) for o in out)
    return out


class ReplayPerShape:
    """A compiled graph's callable in reduce-overhead mode (see the module docstring)."""

    def __init__(self, compiled) -> None:
        self.compiled = compiled
        self._warm: dict[tuple, list[int]] = {}      # signature -> inputs the warm-up wrote
        self._captured: dict[tuple, _Captured] = {}
        self._refused: set[tuple] = set()

    def __call__(self, *args):
        key = _signature(args)
        if key is None or key in self._refused:
            stats["uncaptured"] += 1
            return self.compiled(*args)
        done = self._captured.get(key)
        if done is not None:
            stats["replays"] += 1
            return done.run(args, replay=True)
        mutated = self._warm.get(key)
        if mutated is None:
            return self._warm_up(key, args)
        try:
            done = _Captured(self.compiled, args, mutated)
        except spyre_rt.SpyreGraphError as e:
            _log.info("spyre_rt: reduce-overhead runs this graph uncaptured: %s", e)
            self._refused.add(key)
            stats["uncaptured"] += 1
            return self.compiled(*args)
        self._captured[key] = done
        stats["captures"] += 1
        return done.run(args, replay=False)   # the capture ran the step once

    def _warm_up(self, key: tuple, args: tuple):
        versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        out = self.compiled(*args)
        self._warm[key] = [i for i, a in enumerate(args)
                           if isinstance(a, torch.Tensor) and a._version != versions[i]]
        stats["warmups"] += 1
        return out
