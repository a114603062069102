"""``torch.spyre``: the device module, shaped like ``torch.cuda``.

Registered by :func:`spyre_rt.register`. Device indices refer to the cards of the
configured device profile (``spyre:0 .. spyre:count-1``).

``"spyre"`` without an index is the current device (:mod:`spyre_rt.current_device`):
under ``torchrun`` a process starts on the card of its ``LOCAL_RANK``.
"""

from __future__ import annotations

import contextlib
from collections import namedtuple
from collections.abc import Iterator

import torch

from . import card as cards
from . import fallback, tensors
from .graphs import GraphedCallable, SpyreGraph, graph, make_graphed_callables  # noqa: F401
from .streams import Event, Stream, current_stream, default_stream, set_stream, stream  # noqa: F401

_DeviceProperties = namedtuple(
    "_DeviceProperties",
    "name total_memory num_cores multi_processor_count scratchpad_bytes stick_bytes sim_mode profile",
)


def is_available() -> bool:
    return cards.count() > 0


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    cards.card_set()


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return cards.count()


def current_device() -> int:
    return tensors.current_device()


def set_device(device) -> None:
    tensors.set_current_device(tensors.device_index(device))


@contextlib.contextmanager
def device(device) -> Iterator[None]:
    """Make `device` the current spyre device inside the block."""
    previous = current_device()
    set_device(device)
    try:
        yield
    finally:
        set_device(previous)


def _card(device=None) -> cards.Card:
    return cards.get(tensors.device_index(device))


def reset_device(device=None) -> None:
    """Reset a card: the way back from :class:`~spyre_rt.SpyreDeviceLostError`, after which
    every call on the card fails until it is reset. Also ``spyre_rt.reset_device``.

    `device` is a spyre device, index or name (default: the current device). Every
    allocation, program and graph plan on the card is dropped and injected faults are
    cleared. Tensors that lived on the card lose their values: do not use them again
    (their memory may now hold newer tensors; letting them die frees nothing). Compiled
    functions stay usable: their next call makes new arenas and graph plans (plans from
    the plan cache when it has them)."""
    _card(device).reset()


def synchronize(device=None) -> None:
    """Wait for the card: the host clock moves to the end of its last job."""
    _card(device).synchronize()


def get_device_properties(device=None) -> _DeviceProperties:
    c = _card(device)
    p = c.profile
    return _DeviceProperties(
        name=p.name, total_memory=p.dram_bytes, num_cores=p.num_cores, multi_processor_count=p.num_cores,
        scratchpad_bytes=p.scratchpad_bytes, stick_bytes=p.stick_bytes, sim_mode=c.sim_mode, profile=p.path,
    )


def get_device_name(device=None) -> str:
    return get_device_properties(device).name


def memory_allocated(device=None) -> int:
    """Bytes of device memory held by tensors (rounded to whole sticks)."""
    return int(_card(device).mem_stats()["data_allocated"])


def max_memory_allocated(device=None) -> int:
    """The peak of :func:`memory_allocated` since the card opened or the last
    :func:`reset_peak_memory_stats`."""
    return int(_card(device).mem_stats()["data_peak"])


def memory_reserved(device=None) -> int:
    """Bytes the allocator holds: live allocations (tensors and the card's programs) plus
    freed blocks kept for reuse."""
    return int(_card(device).mem_stats()["reserved"])


def max_memory_reserved(device=None) -> int:
    """The peak of :func:`memory_reserved` since the card opened or the last
    :func:`reset_peak_memory_stats`."""
    return int(_card(device).mem_stats()["peak_reserved"])


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the card's DRAM; free leaves out what the allocator reserves."""
    st = _card(device).mem_stats()
    return int(st["free"]), int(st["capacity"])


def reset_peak_memory_stats(device=None) -> None:
    """The peaks (allocated and reserved) start again from the current figures."""
    _card(device).reset_peak()


def reset_accumulated_memory_stats(device=None) -> None:
    """The accumulated counts (allocations, frees, out-of-memory errors) start again at 0."""
    _card(device).reset_accumulated()


def empty_cache() -> None:
    """Give the freed blocks every card's allocator keeps for reuse back to its DRAM."""
    for c in cards.card_set().cards:
        c.empty_cache()


def _allocator_stats(device=None) -> dict:
    """The allocator's figures under torch.cuda's names, nested as the C++ allocators give
    them to ``torch.accelerator.memory_stats``. Only figures that mean what CUDA's do: the
    card's allocator has one pool (so ``all`` only) and no segments or splits."""
    st = _card(device).mem_stats()
    return {
        "allocated_bytes": {"all": {"current": int(st["data_allocated"]), "peak": int(st["data_peak"])}},
        "reserved_bytes": {"all": {"current": int(st["reserved"]), "peak": int(st["peak_reserved"])}},
        "num_ooms": int(st["num_ooms"]),
    }


def _flat(prefix: str, value) -> dict:
    if not isinstance(value, dict):
        return {prefix: value}
    out = {}
    for k, v in value.items():
        out.update(_flat(f"{prefix}.{k}" if prefix else k, v))
    return out


def memory_stats(device=None) -> dict:
    """The allocator's figures under torch.cuda's names (``allocated_bytes.all.current``,
    ``reserved_bytes.all.peak``, ``num_ooms``...), all of the card's allocator figures
    (``memory.*``) and runtime counters (launches, native calls, CPU fallbacks)."""
    c = _card(device)
    st = _flat("", _allocator_stats(device))
    st.update({f"memory.{k}": v for k, v in c.mem_stats().items()})
    st.update({f"runtime.{k}": v for k, v in c.counters().items()})
    st["cpu_fallback.calls"] = sum(fallback.calls.values())
    st.update({f"cpu_fallback.{op}": n for op, n in fallback.calls.items()})
    return st


# torch's random and autocast machinery asks the device module for these. Random ops
# run through the CPU fallback, so the CPU generator is the one that matters.
def manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    """torch.manual_seed calls this after seeding the CPU generator, which is the one
    random ops on spyre use (they run through the CPU fallback): nothing more to do."""


def get_rng_state(device=None) -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device=None) -> None:
    torch.set_rng_state(new_state)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]
