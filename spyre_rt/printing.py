"""Printing spyre tensors: format a host copy instead of running a dozen ops on the card.

torch's formatter moves only a few device types to the host before computing its
statistics; for spyre it would run each of them through the CPU fallback. This wraps the
module-level ``torch._tensor_str._tensor_str`` (a private function: re-check on torch
upgrades) so a spyre tensor is formatted from one copy to the host.
"""

from __future__ import annotations

import torch
import torch._tensor_str as _tensor_str_module

_original = None


def install() -> None:
    global _original
    if _original is not None:
        return
    _original = _tensor_str_module._tensor_str

    def _tensor_str(self, indent):
        if isinstance(self, torch.Tensor) and self.device.type == "spyre":
            from .tensors import to_host

            with torch.no_grad():
                self = to_host(self.detach())
        return _original(self, indent)

    _tensor_str_module._tensor_str = _tensor_str
