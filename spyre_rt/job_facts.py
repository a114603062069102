"""The facts of each job: what its kernel computes and moves, by the job name it runs
under in the trace (construct/facts.py derives them; this is where they are kept).

The compiler registers a kernel's description when it makes the kernel; trace export and
the profiler read it back to name jobs by op and module and to place them against the
card's roofline. The registry is keyed by the interned job name (the name a job event
carries), holds plain data only, and is safe to use from several threads.

The keys an info dict may carry (all optional; unknown keys are kept as they are):

========================  ================================================================
``kind``                  the kernel description's kind: ``matmul``, ``loop``, ...
``op``                    the aten op(s) it came from: a string, or a list of strings
``module``                the ``nn_module_stack`` path, e.g. ``model.layers.3.mlp.up_proj``
``flops``                 floating-point operations (a multiply-add counts as 2)
``dram_bytes_min``        the fewest DRAM bytes it must move (each input and output once)
``dram_bytes``            the DRAM bytes its program moves
``cores``                 the cores it runs on
``scratchpad_peak``       the most scratchpad bytes it holds at once, on any core
``dtype``                 its compute dtype (``float16``, ``float32``): fp32 runs slower
========================  ================================================================
"""

from __future__ import annotations

import threading
from typing import Any

KEYS = ("kind", "op", "module", "flops", "dram_bytes_min", "dram_bytes", "cores", "scratchpad_peak", "dtype")

_registry: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()


def register(job_name: str, info: dict[str, Any]) -> None:
    """Record what the kernel run as `job_name` computes (replacing what was recorded)."""
    if not isinstance(job_name, str) or not job_name:
        raise ValueError(f"a kernel's job name must be a non-empty string, not {job_name!r}")
    if not isinstance(info, dict):
        raise TypeError(f"kernel info must be a dict, not {type(info).__name__}")
    copy = dict(info)  # the caller may go on changing its dict
    with _lock:
        _registry[job_name] = copy


def lookup(job_name: str) -> dict[str, Any] | None:
    """What the kernel run as `job_name` computes, or None when nothing was registered.

    The dict returned is the registry's own: read it, do not change it."""
    return _registry.get(job_name)  # a dict read is atomic; only writers take the lock


def clear() -> None:
    """Forget every kernel (tests; a process that recompiles everything)."""
    with _lock:
        _registry.clear()


# ---- names a user knows ---------------------------------------------------------------------


def op_names(info: dict[str, Any]) -> str | None:
    """The aten ops without their namespace, joined: ``mm``, ``mul+add+rsqrt``."""
    op = info.get("op")
    ops = [op] if isinstance(op, str) else op if isinstance(op, list) else []
    names = [str(o).removeprefix("aten.").removeprefix("aten::") for o in ops if o]
    return "+".join(names) or None


def module_path(info: dict[str, Any]) -> str | None:
    """The module path without the causal-LM wrapper's ``model.`` prefix: ``layers.3.mlp.up_proj``."""
    m = info.get("module")
    return m.removeprefix("model.") if isinstance(m, str) and m else None


def describe(job_name: str) -> str:
    """A kernel by what it computes: ``k12 | mm | layers.3.mlp.up_proj`` (the job name alone
    when nothing was registered). ASCII only: torch.profiler's Kineto export drops a
    record_function range whose name holds anything else."""
    info = lookup(job_name)
    if not info:
        return job_name
    return " | ".join(x for x in (job_name, op_names(info), module_path(info)) if x)

