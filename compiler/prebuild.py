"""A step's kernels constructed when it compiles, so that what construction refuses is a
compile-time event.

Construction depends on the card's figures and on the stick layouts of the step's
buffers. The layouts of the buffers the step owns come from its memory plan; those of its
inputs are foreseen from what Dynamo saw of them: a tensor gets the layout its sizes and
strides give a new storage (:func:`spyre_rt.layout.layout_for`), a view the layout of the
storage it views as far as its strides tell. With them the executable the first call will
use is made now and prepared in the step's dispatch mode (its plans built and cached, or
every kernel constructed once). A kernel construction refuses makes the compile fail with
the FX nodes it holds, which the backend then compiles again on the CPU (with CPU fallback
off, the error names the op and the model line).

The prepared step is handed to the module the compile generates
(:func:`spyre_rt.executor.step.adopt`), so its first call with the foreseen geometry finds
the work done. A dynamic-shape step is prepared at the sizes Inductor compiled it for (its
hints); a size or geometry the compile did not foresee is prepared at its first call, where
a refused kernel runs on the host instead.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from torch._inductor.virtualized import V

from spyre_rt import card as cards
from spyre_rt import dispatch
from spyre_rt.errors import SpyreError, SpyreRefusedError
from spyre_rt.executor import step as steps
from spyre_rt.ir import StepDesc
from spyre_rt.layout import StickLayout, layout_for, storage_numel

from .errors import CompileFailed

log = logging.getLogger("spyre_rt.compiler.prebuild")


def prebuild(desc: StepDesc, text: str, settings: dict, kernel_nodes: dict[str, set[str]], symbolic: bool,
             kernel_indexing: dict[str, set[str]] | None = None) -> None:
    """Prepare the step the module embeds as `text` with `settings`; a kernel construction refuses is a
    compile error carrying the FX nodes to run on the CPU (``fallback_nodes``): a kernel's
    indexing ops (`kernel_indexing`) when what it refused was an access through an index,
    else all its nodes."""
    if not any(kind == "run" for kind, _ in desc.sequence):
        return
    try:
        card = _card()
        step = _load(text, settings, symbolic)
        concrete = step.step_for(_hints(desc)) if hasattr(step, "step_for") else step
        geometry = tuple(_geometry(concrete.desc, card))
        exe = concrete.executable(card, geometry)
        mode = dispatch.named(dispatch.override() or concrete.default_mode)
    except (SpyreError, TypeError, ValueError, KeyError) as e:  # the first call will tell
        log.debug("no compile-time construction: %s", e)
        return
    try:
        exe.prepare(mode, fallback=False)
    except SpyreRefusedError as e:
        indexing = kernel_indexing or {}
        nodes = set().union(*((name in e.indirect and indexing.get(name)) or kernel_nodes.get(name, set())
                              for name in e.kernels))
        if nodes:
            err = CompileFailed("spyre cannot compile " + "; ".join(
                f"{exe.host_source(name)}: the card's construction refused its kernel {name} ({why})"
                for name, why in e.kernels.items()))
            err.fallback_nodes = nodes
            err.apart_nodes = set().union(*(indexing.get(name, set()) for name in e.kernels if name in e.indirect))
            raise err from None
        raise  # no FX node to run instead (a device copy): nothing the compile can change
    except SpyreError as e:  # not a refusal (a lost card, say): the first call will tell
        log.debug("compile-time construction failed: %s", e)
        return
    steps.adopt(hashlib.sha256(text.encode()).hexdigest(), step)


def _load(text: str, settings: dict, symbolic: bool):
    if symbolic:
        from .specialize import load_step
    else:
        from spyre_rt.executor import load_step
    return load_step(text, settings)


def _card() -> cards.Card:
    device = next((t.device for t in V.graph.example_inputs if isinstance(t, torch.Tensor)
                   and t.device.type == "spyre"), None)
    return cards.get(device.index if device is not None and device.index is not None else 0)


def _hints(desc: StepDesc) -> dict[str, int]:
    """The values Inductor compiled a dynamic-shape step for: its size symbols' hints."""
    sizevars = V.graph.sizevars
    env = sizevars.shape_env
    values = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
    symbols = {str(s): s for s in values}
    return {name: int(sizevars.optimization_hint(symbols[name], fallback=8192)) for name, *_ in desc.symbols}


def _hint(x) -> int:
    if isinstance(x, int):
        return x
    return int(V.graph.sizevars.optimization_hint(x.node.expr if isinstance(x, torch.SymInt) else x, fallback=8192))


def _geometry(desc: StepDesc, card: cards.Card) -> list[tuple[StickLayout, int]]:
    """The (layout, storage offset) the first call's inputs and constants will have."""
    stick = card.profile.stick_bytes
    examples = [t for t in V.graph.example_inputs if isinstance(t, torch.Tensor)]
    if len(examples) != len(desc.inputs):
        raise ValueError(f"{len(examples)} tensor inputs for {len(desc.inputs)} step inputs")
    out = [_foreseen(t, stick) for t in examples]
    for name in desc.constants:
        t = V.graph.constants[name]
        layout = card.layout_of(t.untyped_storage().data_ptr()) if t.device.type == "spyre" else None
        if layout is None:
            raise ValueError(f"constant {name} is not a spyre tensor of this card")
        out.append((layout, t.storage_offset()))
    return out


def _foreseen(t: torch.Tensor, stick: int) -> tuple[StickLayout, int]:
    """The layout and offset a call's tensor like `t` will have on the card."""
    sizes = [_hint(n) for n in t.shape]
    strides = [_hint(s) for s in t.stride()]
    itemsize = t.dtype.itemsize
    if t.device.type != "spyre":  # uploaded by the call into a new storage (tensors.to_card)
        strides = list(torch.empty(sizes, device="meta", dtype=t.dtype).stride()) if t.is_contiguous() else \
            list(torch.empty_like(torch.empty_strided(sizes, strides, device="meta", dtype=t.dtype)).stride())
        return layout_for(sizes, strides, storage_numel(sizes, strides), itemsize, stick), 0
    offset = _hint(t.storage_offset())
    total = _hint(t.untyped_storage().nbytes()) // itemsize
    if offset == 0 and storage_numel(sizes, strides) == total:  # the whole storage: made for it
        return layout_for(sizes, strides, total, itemsize, stick), 0
    # a view: its storage's rows are as long as the stride above its stride-1 dimension
    inner = [st for n, st in zip(sizes, strides, strict=True) if n > 1 and st > 1]
    row = min(inner) if inner else 0
    if row and total % row == 0 and any(st == 1 and n <= row for n, st in zip(sizes, strides, strict=True)):
        return StickLayout(total // row, row, itemsize, stick), offset
    return layout_for(sizes, strides, total, itemsize, stick), offset
