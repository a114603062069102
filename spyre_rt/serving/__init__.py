"""Serving on the card with vLLM: an out-of-tree platform plugin.

vLLM finds :func:`register` through the ``vllm.platform_plugins`` entry point. The plugin
is active when vLLM is installed and a card is present; ``SPYRE_RT_VLLM=1`` insists on it
(start-up fails without a card) and ``SPYRE_RT_VLLM=0`` leaves vLLM on its own platforms.
"""

from __future__ import annotations

import logging
import os

_log = logging.getLogger("spyre_rt.serving")

PLATFORM = "spyre_rt.serving.platform.SpyrePlatform"


def register() -> str | None:
    choice = os.environ.get("SPYRE_RT_VLLM", "").strip().lower()
    if choice in ("0", "false", "no", "off"):
        return None
    import torch

    import spyre_rt  # noqa: F401  (registers the device)

    if torch.spyre.is_available():
        return PLATFORM
    if choice in ("1", "true", "yes", "on"):
        raise RuntimeError("SPYRE_RT_VLLM=1 asks for the spyre_rt platform, but no card is available")
    _log.debug("spyre_rt: no card, the vLLM platform plugin stays inactive")
    return None
