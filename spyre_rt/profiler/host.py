"""The host a measurement ran on, and how to keep the host's noise out of it.

Construction is real host work, so the speedups of ``spyre-profile run`` follow the host's
speed: the report names the CPU, its cores and its load. :func:`quiet` runs one measured
block without the cyclic garbage collector (a collection is host work the measured code
did not ask for, and lands in whichever run it happens to fall in); the caller collects
between blocks, outside the measurement.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any


def cpu_model() -> str:
    """The CPU's model name ("unknown CPU" where the platform does not say)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe() -> dict[str, Any]:
    """The host: CPU model, usable cores, load average, Python and torch versions."""
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {"cpu": cpu_model(), "cores": cores, "load_1m": load, "python": platform.python_version(),
            "torch": torch.__version__, "platform": sys.platform}


def label(host: dict[str, Any]) -> str:
    """One line naming the host, and what that means for the figures."""
    load = f", load {host['load_1m']:.1f}" if host.get("load_1m") is not None else ""
    return (f"host: {host['cpu']} ({host['cores']} cores{load}). Host work is CPU time and device time "
            f"is simulated, so the speedups follow this host's speed, not its load.")


