"""Compile errors that name the op and the model source line it came from."""

from __future__ import annotations

import os

import torch
from torch._dynamo.exc import ShortenTraceback

from spyre_rt.errors import SpyreCompileError


class CompileFailed(SpyreCompileError, ShortenTraceback):
    """A SpyreCompileError that Dynamo and Inductor hand to the caller unwrapped (they
    pass ShortenTraceback exceptions through instead of wrapping them)."""

    def __init__(self, message: str):
        ShortenTraceback.__init__(self, message, first_useful_frame=None)


class OptionError(CompileFailed, ValueError):
    """A spyre_rt compile option that is unknown, invalid, or the whole process's."""


_TORCH = os.path.dirname(torch.__file__) + os.sep


def source_of(nodes) -> str:
    """'op (file:line of the model code)' for the first origin whose model line is known,
    else the first op (Inductor IR nodes carry the FX nodes they came from; an FX node is
    its own origin)."""
    first = None
    for n in nodes:
        node = getattr(n, "node", n)
        origins = [node] if hasattr(node, "meta") and hasattr(node, "target") else getattr(node, "origins", ())
        for origin in origins or ():
            meta = getattr(origin, "meta", {}) or {}
            trace = meta.get("stack_trace")
            target = getattr(origin, "target", origin)
            if trace:
                lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
                files = [ln for ln in lines if ln.startswith("File ")]
                # the innermost frame of the model: a trace made without Dynamo ends in torch's own
                model = [ln for ln in files if not ln.startswith(f'File "{_TORCH}')]
                where = (model or files or lines or [""])[-1]
                return f"{target} ({where})"
            first = first or str(target)
    return first or "unknown op"


def compile_error(reason: str, nodes) -> CompileFailed:
    return CompileFailed(f"spyre cannot compile {source_of(nodes)}: {reason}")
