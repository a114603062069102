"""``torch.save`` and ``torch.load`` of spyre tensors.

Saving works as for any device: torch reads each storage's bytes back to the host (a
storage's bytes are a view of other-sized elements, which :mod:`spyre_rt.tensors` copies
whole). Loading a storage onto the card is refused with a clear error instead: torch would
make it with ``torch.UntypedStorage(n, device="spyre")``, which needs an allocator in C++
that a Python-registered device does not have (the process would crash). Load with
``map_location="cpu"`` and move the tensors, as ``model.load_state_dict`` does.
"""

from __future__ import annotations

import re

import torch

from .errors import SpyreError

_LOCATION = re.compile(r"^spyre(:\d+)?$")
_PRIORITY = 19  # before torch's own privateuse1 deserializer (23), which would crash


def _tag(obj):
    return None  # torch's own tagger names spyre storages "spyre:N"


def _deserialize(obj, location: str):
    if isinstance(location, str) and _LOCATION.match(location):
        raise SpyreError(
            f"torch.load cannot put a storage on {location} directly; load with map_location='cpu' "
            "and move the tensors (model.load_state_dict(...), tensor.to('spyre'))")
    return None


def install() -> None:
    torch.serialization.register_package(_PRIORITY, _tag, _deserialize)
