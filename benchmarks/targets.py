"""The benchmarks' targets: a timed run fails the benchmark whose figure misses its own."""


def check_target(benchmark, met: bool, message: str) -> None:
    """Fail a timed benchmark whose figure misses its target (an untimed run of one round,
    as the default test run makes, measures nothing worth checking)."""
    if not benchmark.disabled:
        assert met, message
