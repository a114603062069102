"""Compile errors that name the op and the model source line it came from."""

from __future__ import annotations

from spyre_rt.errors import SpyreCompileError


def source_of(nodes) -> str:
    """'op at file:line' for the first node with a known origin."""
    for n in nodes:
        node = getattr(n, "node", n)
        for origin in getattr(node, "origins", ()) or ():
            meta = getattr(origin, "meta", {}) or {}
            trace = meta.get("stack_trace")
            target = getattr(origin, "target", origin)
            if trace:
                last = [line.strip() for line in trace.strip().splitlines() if line.strip()]
                where = next((ln for ln in reversed(last) if ln.startswith("File ")), last[-1] if last else "")
                return f"{target} ({where})"
            return str(target)
    return "unknown op"


def compile_error(reason: str, nodes) -> SpyreCompileError:
    return SpyreCompileError(f"spyre cannot compile {source_of(nodes)}: {reason}")
