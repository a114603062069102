"""spyre_rt: a simulated Spyre-like card as a first-class PyTorch device.

``import spyre_rt`` (or just ``import torch``, through the ``torch.backends`` entry
point) registers the ``spyre`` device; ``torch.compile(model, backend="spyre_rt")``
compiles for it.
"""

from __future__ import annotations

import threading

from .version import __version__  # noqa: F401  (the package's version, defined beneath it)

_registered = False
_lock = threading.Lock()


def register() -> None:
    """Register the ``spyre`` device with PyTorch (idempotent)."""
    global _registered
    if _registered:
        return
    # Import torch before taking the lock: a first `import torch` runs the torch.backends
    # entry point, which calls register() again on this thread.
    import torch
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    with _lock:
        if _registered:
            return

        from . import accelerator, aten, current_device, device_module, fallback, printing, serialization

        if torch._C._get_privateuse1_backend_name() != "spyre":
            _setup_privateuseone_for_python_backend("spyre", backend_module=device_module, hook=accelerator.Hooks())
        accelerator.install()
        current_device.install()
        aten.register()
        fallback.register()
        printing.install()
        serialization.install()
        _registered = True


def _autoload() -> None:
    """Entry point of the ``torch.backends`` group, run inside ``import torch``."""
    register()


register()

from .card import configure, configured  # noqa: E402
from .device_module import reset_device  # noqa: E402
from .errors import (  # noqa: E402
    SpyreCompileError,
    SpyreDeviceError,
    SpyreDeviceLostError,
    SpyreDMAError,
    SpyreError,
    SpyreGraphError,
    SpyreIndexError,
    SpyreInvalidCommandError,
    SpyreLayoutError,
    SpyreNoDataError,
    SpyreOutOfMemoryError,
    SpyrePlanCacheError,
    SpyreProfileError,
    SpyreRefusedError,
)
from .fallback import SpyreFallbackWarning  # noqa: E402

__all__ = [
    "register", "configure", "configured", "reset_device", "SpyreError", "SpyreCompileError", "SpyreDeviceError",
    "SpyreDeviceLostError", "SpyreDMAError", "SpyreGraphError", "SpyreIndexError", "SpyreInvalidCommandError",
    "SpyreLayoutError", "SpyreNoDataError", "SpyreOutOfMemoryError", "SpyrePlanCacheError", "SpyreProfileError",
    "SpyreRefusedError", "SpyreFallbackWarning",
]
