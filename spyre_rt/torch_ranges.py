"""Host launches as ``torch.profiler`` ranges, beside the aten ops in its trace.

Inside a ``torch.profiler.profile()`` block every launch on a card is a
``record_function`` range named ``spyre:N launch <job> | <ops> | <module>`` (a plan:
``spyre:N launch step``), so a torch.profiler trace shows which launches each aten op made
and how long they held the host. ``spyre-profile merge`` finds these ranges again to put
the card's own tracks on the same timeline.

The dispatch path is hot: outside a profiler a launch pays for one check of a flag, and
nothing is created.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from torch.autograd import profiler as _autograd_profiler

from . import job_facts

if TYPE_CHECKING:
    from .card import Card

# How `spyre-profile merge` recognises a launch range: the card and the job name.
RANGE_NAME = re.compile(r"^spyre:(\d+) launch (\S+)")


def active() -> bool:
    """Whether a torch (autograd or kineto) profiler is recording on this process."""
    return _autograd_profiler._is_profiler_enabled


def range_name(card_index: int, job_name: str) -> str:
    return f"spyre:{card_index} launch {job_facts.describe(job_name or 'job')}"


def launch_range(card: Card, name_id: int) -> _autograd_profiler.record_function:
    """The range of one launch of the job (or plan) interned as `name_id` on `card`."""
    return _autograd_profiler.record_function(range_name(card.index, card.name_of(name_id)))
