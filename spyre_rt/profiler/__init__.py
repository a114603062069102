"""The profiler: reads traces exported by :mod:`spyre_rt.trace` and reports on them.

``view`` draws one trace in the terminal (timeline, per-op table, idle time, critical path),
``compare`` sets two traces or two ``spyre-profile run`` result files side by side, and
``cli`` is the ``spyre-profile`` command. Each module computes its numbers with pure
functions (testable without a terminal) and renders them with rich separately.
"""
