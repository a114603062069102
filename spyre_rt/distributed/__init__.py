"""Several cards: ``spyreccl``, the ``torch.distributed`` backend of the card.

Importing this package registers the backend for the ``"spyre"`` device::

    import torch.distributed as dist
    import spyre_rt.distributed  # noqa: F401
    dist.init_process_group(backend="cpu:gloo,spyre:spyreccl")

One card per process, launched with ``torchrun``: see :func:`spyre_rt.distributed.card_for_rank`.
"""

from __future__ import annotations

import torch.distributed as dist

from .group import BACKEND_NAME, ProcessGroupSpyre, create
from .ring import SpyreCollectiveError

if BACKEND_NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["spyre"])

__all__ = ["BACKEND_NAME", "ProcessGroupSpyre", "SpyreCollectiveError"]
