"""The executor: how a compiled step runs on a card, in any dispatch mode.

A compiled module (the compiler's output) holds its step description as JSON and calls
:func:`load_step` once; the :class:`CompiledStep` it returns is called with the step's
inputs on every call. Per card and input geometry it keeps an :class:`Executable`: the
step's memory, its segments (runs of card kernels, CPU ops) and, in ``prebuilt`` mode, the
graph plans of its device segments.
"""

from .stats import stats
from .step import CompiledStep, live_steps, load_step

__all__ = ["CompiledStep", "live_steps", "load_step", "stats"]
